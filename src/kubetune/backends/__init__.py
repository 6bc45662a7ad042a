"""Job backends: where a job spec runs, behind one protocol and a name registry (``base``):
``local`` (a background `kubetune run`, ``local_runs``; its launcher is ``local``), ``pytorchjob``
and ``trainjob`` (``kubeflow``: objects built by the pure ``manifests`` builders and checked by
``strict``); ``status`` holds what every backend answers (JobStatus), without a Kubernetes client."""
