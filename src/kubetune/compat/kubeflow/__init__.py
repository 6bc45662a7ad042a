"""Kubeflow Training SDK v1 drop-in: the SDK's ``TrainingClient().train(...)`` call runs on kubetune::

    from kubetune.compat.kubeflow import TrainingClient      # instead of kubeflow.training's
    client = TrainingClient(backend="local")                 # or "kubeflow" (the default), as the SDK
    client.train(name="fine-tune-bert", model_provider_parameters=HuggingFaceModelParams(...),
                 dataset_provider_parameters=HuggingFaceDatasetParams(...),
                 trainer_parameters=HuggingFaceTrainerParams(...), num_workers=4, num_procs_per_worker=2)
    client.wait_for_job_conditions("fine-tune-bert")
    logs, _ = client.get_job_logs("fine-tune-bert")

The SDK's own parameter objects (``HuggingFaceModelParams``, ``HuggingFaceDatasetParams``,
``S3DatasetParams``, ``HuggingFaceTrainerParams`` holding ``transformers.TrainingArguments`` and
``peft.LoraConfig``) become one kubetune job spec (:func:`spec_from_train`, a pure function), which
:class:`kubetune.client.Client` runs on this machine or submits as a PyTorchJob. An argument the spec
cannot carry is refused by name, all of them in one line (:class:`UnsupportedParameter`), never
dropped; a credential given as a value (an access token, S3 keys, a secret-looking env value) is
refused with the Secret reference to use instead, so no secret ever enters a spec, a ConfigMap or a log.

Return types and exceptions follow the SDK 1.9: ``train`` returns None, ``get_job``/``list_jobs``/
``wait_for_job_conditions`` return ``KubeflowOrgV1PyTorchJob`` objects, ``get_job_logs`` a pair of
dicts, and failures raise RuntimeError / TimeoutError / ValueError subclasses that are also
``KubetuneError`` (one line naming the field and the fix).

The modules: ``translate`` (the train() arguments -> a job spec), ``training_arguments`` (the table
of ``TrainingArguments`` fields), ``client`` (``TrainingClient`` and the SDK-shaped job calls) and
``errors`` (the exceptions and the collector of refused arguments).
"""

from kubetune.compat.kubeflow.client import CONDITIONS, JOB_KIND, TrainingClient
from kubetune.compat.kubeflow.errors import JobError, JobTimeout, UnsupportedParameter
from kubetune.compat.kubeflow.translate import SDK_DEFAULT_STORAGE, spec_from_train

__all__ = [
    "CONDITIONS",
    "JOB_KIND",
    "SDK_DEFAULT_STORAGE",
    "JobError",
    "JobTimeout",
    "TrainingClient",
    "UnsupportedParameter",
    "spec_from_train",
]
