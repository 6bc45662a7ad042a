"""The KServe family: `kubetune submit|status|delete --serve` (``backend``) and the pure builder of the
InferenceService and ServiceAccount that serve a finished job's export (``manifests``)."""
