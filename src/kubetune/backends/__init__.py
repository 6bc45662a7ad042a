"""Job backends: where a job spec runs, behind one protocol and a name registry (``base``):
``local`` (``local_runs``: `kubetune run` in the foreground or in the background, and its records;
its launcher is ``local``), ``pytorchjob`` and ``trainjob`` (``kubeflow``: submit and delete, over
``kubeflow_read``: status, logs, wait and list, over ``kubeflow_api``: the cluster connection and
its errors translated). The objects they create are built by pure builders: ``manifests`` (the
ConfigMap, PVC, pods, PyTorchJob and TrainJob, and ``render``), ``tensorboard``, and ``objects``
(the names, labels and paths they share); ``checks`` finds what makes a spec unfit for a cluster
before it renders, and ``strict`` checks objects against the typed models. ``status`` holds what
every backend answers (JobStatus), without a Kubernetes client."""
