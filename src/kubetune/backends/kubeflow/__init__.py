"""The Kubeflow family: the ``pytorchjob`` and ``trainjob`` backends (``backend``: submit and delete;
``read``: status, logs, wait, list), the pure builders of what they create (``manifests``: ConfigMap, PVC,
PyTorchJob, TrainJob and ``render``; ``tensorboard``) and ``checks``, the problems that refuse a render."""
