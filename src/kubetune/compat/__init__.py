"""Drop-in front ends for other fine-tuning APIs, each translating into one kubetune job spec.

``kubetune.compat.kubeflow.TrainingClient`` runs the Kubeflow Training SDK v1 ``train(...)`` call.
"""
