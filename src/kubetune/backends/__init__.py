"""Job backends: where a job spec runs. ``local`` (PyTorch's elastic launcher on this machine),
``kubeflow`` (a Kubeflow PyTorchJob or Trainer v2 TrainJob, built by the pure ``manifests``
builders and checked by ``strict``); ``status`` holds what every backend answers (JobStatus)."""
