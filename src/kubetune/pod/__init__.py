"""What runs inside a pod or a local worker: ``launch`` (the pod's main process: torch's elastic launcher
with exit codes the operator acts on), ``stage`` (`kubetune fetch`, the init container's download) and
``worker`` (each training process's entry point)."""
