"""Hyperparameter search from the job spec's ``tune`` section: ``kubetune tune`` runs a durable Optuna study
whose trials are normal kubetune runs of the spec with the trial's values in."""
