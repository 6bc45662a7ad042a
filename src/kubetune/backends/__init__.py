"""Job backends: where a job spec runs, behind one protocol and a name registry (``base``), by family:
``local/`` (`kubetune run` in the foreground or the background and its records, ``runs``; torch's elastic
launcher, ``launcher``), ``kubeflow/`` (PyTorchJob and TrainJob: ``backend`` submits and deletes, ``read``
gives status, logs, wait and list; the pure builders ``manifests`` and ``tensorboard``; ``checks``, what
makes a spec unfit for a cluster) and ``kserve/`` (the InferenceService of an export: ``backend`` and the
pure builder ``manifests``). ``cluster/`` is what the cluster families share: the connection and its errors
translated (``api``), the names, labels and paths of the objects (``objects``), the typed-model check
(``strict``). ``status`` holds what every backend answers (JobStatus), without a Kubernetes client."""
