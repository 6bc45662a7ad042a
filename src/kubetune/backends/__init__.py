"""Job backends: where a job spec runs (local elastic launch now; Kubernetes next)."""
