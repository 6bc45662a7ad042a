"""The local family: jobs on this machine (``runs``: the ``local`` backend, `kubetune run` in the
foreground or the background, and the records other shells read) and torch's elastic launcher that
starts their workers (``launcher``)."""
