"""Katib SDK drop-in: the LLM form of Katib's ``KatibClient().tune(...)`` runs on kubetune::

    import kubeflow.katib as katib                    # the SDK's search values and TrainerResources
    from kubetune.compat.katib import KatibClient     # instead of kubeflow.katib's
    client = KatibClient(backend="local")             # or "kubeflow" (the default), as the SDK
    client.tune(name=..., model_provider_parameters=..., dataset_provider_parameters=...,
                trainer_parameters=HuggingFaceTrainerParams(
                    training_parameters=TrainingArguments(learning_rate=katib.search.double(min=1e-5, max=5e-5)),
                    lora_config=LoraConfig(r=katib.search.int(min=8, max=32))),
                objective_metric_name="train_loss", objective_type="minimize", algorithm_name="random",
                max_trial_count=..., parallel_trial_count=...,
                resources_per_trial=katib.TrainerResources(num_workers=1, num_procs_per_worker=2))
    client.wait_for_experiment_condition(name=...)    # then get_experiment, get_optimal_hyperparameters, ...

Locally the call is ``kubetune tune`` on the translated spec (an Optuna study, every trial a kubetune run); on
a cluster it is ``kubetune submit --tune`` (a Katib Experiment whose trials are kubetune's PyTorchJobs). The
search values are read by shape (a ``parameter_type`` and a ``feasible_space``), so kubetune itself does not need
the ``kubeflow-katib`` package, whose pins (protobuf<5, kubeflow-training==1.9.0) conflict with kubetune's.
Modules: ``translate`` (the arguments -> one spec with a tune section) and ``client`` (``KatibClient``).
"""

from kubetune.compat.katib.client import KatibClient
from kubetune.compat.katib.translate import spec_from_tune

__all__ = ["KatibClient", "spec_from_tune"]
