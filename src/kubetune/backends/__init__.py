"""Job backends: where a job spec runs, behind one protocol and a name registry (``base``):
``local`` (``local_runs``: `kubetune run` in the foreground or in the background, and its records;
its launcher is ``local``), ``pytorchjob`` and ``trainjob`` (``kubeflow``: objects built by the
pure ``manifests`` builders and checked by ``strict``); ``status`` holds what every backend answers
(JobStatus), without a Kubernetes client."""
