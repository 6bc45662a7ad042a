"""Pydantic schema of the job spec.

The key names are a public contract (docs, tools and the Kubernetes ConfigMap rely on them).
Unknown keys are errors; every field carries help text in ``description``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Literal, TypeVar, Union

from pydantic import Field, create_model, field_validator, model_validator

from kubetune.config.base import DataCommon, Section, Uri
from kubetune.config.cluster import KubernetesSpec, ResourcesSpec
from kubetune.config.serving import ServingSpec
from kubetune.config.tasks import default_task, entries
from kubetune.config.tune import TuneSpec


class ModelSpec(Section):
    uri: Uri = Field(
        description="Base model: hf://org/name (Hugging Face Hub or its local cache), s3://bucket/prefix, "
        "file:///path or a plain local path to a save_pretrained directory.",
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit) for hf:// models; default: main."
    )


class LoraSpec(Section):
    r: int = Field(8, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(16, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA branch.")
    target_modules: list[str] | Literal["all-linear"] | None = Field(
        None,
        description="Module names to adapt (e.g. [query, value]) or 'all-linear'. Absent: peft's default for "
        "the architecture. The classification head always trains in full.",
    )
    quantization: Literal["4bit", "8bit"] | None = Field(
        None,
        description="QLoRA: load the frozen base model quantized with bitsandbytes, 4bit (NF4, double quantization) "
        "or 8bit (LLM.int8); needs CUDA GPUs. Absent: the base model keeps its precision.",
    )


class TrainSpec(Section):
    epochs: int = Field(1, ge=1, description="Passes over the training data.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many optimizer steps (overrides epochs when reached first)."
    )
    batch_size: int = Field(16, ge=1, description="Examples per micro-batch per process.")
    grad_accum: int = Field(
        1, ge=1, description="Micro-batches per optimizer step; global batch = batch_size × grad_accum × world size."
    )
    learning_rate: float = Field(5e-5, gt=0, le=1, description="Peak learning rate (reached after the warmup).")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Fraction of optimizer steps with linear warmup.")
    weight_decay: float = Field(
        0.01,
        ge=0,
        description="Weight decay, not applied to biases and norms (AdamW's decoupled decay; sgd's L2 on the "
        "gradient).",
    )
    optimizer: Literal["adamw", "adamw_foreach", "sgd", "adamw_8bit"] = Field(
        "adamw",
        description="adamw: torch's fused AdamW (one kernel over all parameters; on a non-finite gradient the step is "
        "skipped on the device); adamw_foreach: the same AdamW with its multi-tensor kernels; sgd: fused SGD with "
        "training.momentum; adamw_8bit: bitsandbytes' 8-bit AdamW (optimizer state in 8 bits, about a quarter of "
        "adamw's memory; needs bitsandbytes and a CUDA GPU).",
    )
    momentum: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="Momentum of training.optimizer sgd (0: plain SGD); the other optimizers ignore it.",
    )
    lr_scheduler: Literal["linear", "cosine", "constant", "wsd"] = Field(
        "linear",
        description="The learning rate after training.warmup_ratio's linear warmup (transformers' schedules): linear: "
        "down to 0 at the last step; cosine: along half a cosine down to 0; constant: stays at "
        "training.learning_rate; wsd (warmup-stable-decay): constant, then along half a cosine down to 0 over the "
        "last training.decay_ratio of the steps.",
    )
    decay_ratio: float = Field(
        0.1,
        gt=0,
        le=1,
        description="With training.lr_scheduler wsd: the fraction of optimizer steps, at the end, over which the "
        "learning rate decays to 0 (warmup_ratio + decay_ratio at most 1); the other schedules ignore it.",
    )
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm; null disables clipping.")
    seed: int = Field(42, ge=0, description="Seed for data order, initialization and dropout.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Compute precision: auto = bf16 autocast on a GPU that supports it or a CPU with AMX or "
        "AVX512-BF16 (native bf16), else fp32.",
    )
    eval_batch_size: int | None = Field(None, ge=1, description="Eval micro-batch per process; default 2 × batch_size.")
    group_by_length: bool = Field(
        True, description="Batch examples of similar length together (seeded, distributed-correct) to cut padding."
    )
    log_every: int = Field(10, ge=1, description="Optimizer steps between training-loss log lines.")
    eval_every: int | None = Field(
        None,
        ge=1,
        description="Also evaluate every N optimizer steps "
        "(the eval set is always evaluated at the end of each epoch).",
    )
    eval_on_start: bool = Field(
        False, description="Also evaluate before the first step (the baseline the curves start from; not on resume)."
    )
    checkpoint_every: int | None = Field(
        None,
        ge=1,
        description="Write a checkpoint every N optimizer steps (under <output>/checkpoints/); "
        "one is always written on SIGTERM/SIGINT.",
    )
    checkpoint_minutes: float | None = Field(
        None, gt=0, description="Also write a checkpoint every N minutes of training."
    )
    keep_checkpoints: int = Field(2, ge=1, description="How many of the newest complete checkpoints to keep.")
    resume: Literal["auto", "never"] = Field(
        "auto",
        description="auto: continue from the newest complete checkpoint under output.uri; "
        "never: start over (`kubetune run --no-resume`).",
    )
    dataloader_workers: int | None = Field(
        None,
        ge=0,
        le=64,
        description="DataLoader worker processes per training process (they build and pin batches ahead); "
        "default: 2 on a GPU, 0 on CPU, as measured in benchmarks/README.md.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass: less memory for long sequences, "
        "about 30% more compute.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each transformer block (dynamic shapes). Pays a compile time up front "
        "(about 40 s on a CPU) for faster steps after it; see benchmarks/README.md for when it pays back.",
    )


class FSDPSpec(Section):
    reshard_after_forward: bool = Field(
        True,
        description="Free each block's gathered weights after its forward pass and gather them again for the "
        "backward (less memory); false keeps them until the backward (less communication).",
    )
    cpu_offload: bool = Field(
        False,
        description="Keep the sharded weights, gradients and optimizer state in host memory and run the optimizer "
        "step on the CPU (GPU only): fits larger models, slower steps.",
    )


class DistributedSpec(Section):
    strategy: Literal["auto", "ddp", "fsdp"] = Field(
        "auto",
        description="ddp: every process holds the whole model; fsdp: weights, gradients and optimizer state are "
        "sharded over the processes (FSDP2, one unit per transformer block). auto: fsdp when the job has more than "
        "one process and its full-precision training state (weights, gradients, AdamW moments) would take more "
        "than half of one device's memory (a GPU's, or on CPU the host memory per process), else ddp.",
    )
    fsdp: FSDPSpec = Field(default_factory=FSDPSpec, description="Settings of the fsdp strategy.")
    nodes: int = Field(1, ge=1, description="Number of nodes (Kubernetes pods, or hosts running `kubetune run`).")
    procs_per_node: int = Field(1, ge=1, description="Worker processes per node (one per GPU on GPU nodes).")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend: auto = nccl when CUDA is available, else gloo."
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="host:port of the c10d rendezvous for multi-node local runs (the first node's address). "
        "Single node: a free local port is chosen.",
    )
    max_restarts: int = Field(0, ge=0, description="Times the elastic launcher restarts all workers after a failure.")
    timeout_minutes: int = Field(
        60,
        ge=1,
        description="How long ranks wait for each other in a collective "
        "(rank 0 alone tokenizes, saves and uploads meanwhile).",
    )
    threads_per_proc: int | None = Field(
        None, ge=1, description="CPU threads per worker process; default: CPU cores / procs_per_node."
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class S3Spec(Section):
    endpoint_url: Uri | None = Field(
        None,
        description="S3 endpoint, e.g. http://minio.minio.svc:9000 for MinIO; "
        "default: $S3_ENDPOINT_URL, then $AWS_ENDPOINT_URL, then AWS.",
    )
    region: str | None = Field(None, description="S3 region; default: $AWS_REGION, then us-east-1.")
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        "auto", description="Bucket addressing: auto = path-style when an endpoint is set (MinIO), else virtual-hosted."
    )


class MLflowSpec(Section):
    uri: Uri | None = Field(
        None,
        description="The MLflow tracking server (http(s)://HOST:PORT); absent: MLFLOW_TRACKING_URI. Credentials come "
        "from MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN in the environment (on Kubernetes: "
        "kubernetes.secrets.mlflow), never from the spec.",
    )
    experiment: str = Field("kubetune", min_length=1, description="The MLflow experiment (created if missing).")
    run_name: str | None = Field(None, description="The MLflow run's name; absent: the job's name.")
    tags: dict[str, str] = Field(default_factory=dict, description="Extra tags on the MLflow run.")
    register_model: str | None = Field(
        None,
        description="Register the exported model (by its output.uri) under this name in the model registry.",
    )

    @field_validator("uri")
    @classmethod
    def _http(cls, v):
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL of an MLflow tracking server, e.g. http://mlflow:5000")
        return v


class EvaluationSpec(Section):
    """lm-evaluation-harness tasks scored on the model being trained (a causal-LM task): after training on the
    final weights, and optionally every N steps and before the first step (the base model's score)."""

    tasks: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        min_length=1,
        description="The harness's task names (its registry: hellaswag, arc_easy, gsm8k, ... where their data can "
        "be had) or tasks defined in include_path.",
    )
    include_path: str | None = Field(
        None,
        description="A directory of the harness's task YAML (offline and private suites), relative to the spec "
        "file or absolute (on Kubernetes a path the pods see: a PVC or the image), or an s3:// prefix. Data files "
        "the YAML names by s3:// URI are fetched with the job's S3 settings.",
    )
    num_fewshot: int | None = Field(None, ge=0, le=1000, description="Few-shot examples; default: each task's own.")
    limit: float | None = Field(
        None,
        gt=0,
        le=1_000_000_000,
        allow_inf_nan=False,
        description="Documents per task: a count (1 to 1e9) or a fraction (below 1); default: all.",
    )
    batch_size: int = Field(8, ge=1, le=4096, description="Requests per forward, per process.")
    chat: bool = Field(False, description="Format the prompts with the tokenizer's chat template.")
    gen_kwargs: dict[str, int | float | bool | str] | None = Field(
        None,
        description="Generation settings for generation tasks, over the tasks' own (the harness's gen_kwargs: "
        "max_gen_toks, temperature, do_sample, ...).",
    )
    every: int | None = Field(
        None,
        ge=1,
        description="Also evaluate every N optimizer steps (a curve per task). A stop signal during one is answered "
        "when it ends: keep one evaluation well below the grace period a stopped pod gets (30 s by default; "
        "kubernetes.termination_grace_period_seconds).",
    )
    on_start: bool = Field(
        False, description="Also evaluate before the first step: the base model's score the curves start from."
    )
    after: bool = Field(True, description="Evaluate after training on the final weights (metrics.json's lm_eval).")
    log_samples: bool = Field(
        False,
        description="Keep the final evaluation's per-sample log (lm_eval_samples/<task>.jsonl in the output; a task "
        "name that is not a plain file name is %-encoded, so the samples stay inside the run).",
    )


class TrackingSpec(Section):
    mlflow: MLflowSpec | None = Field(
        None,
        description="Log params, metrics, system facts and artifacts to an MLflow tracking server (rank 0 only); "
        "a resumed run continues the same MLflow run.",
    )


class OutputSpec(Section):
    uri: Uri = Field(
        description="Where artifacts go: a local directory (plain path or file://), "
        "s3://bucket/prefix (uploaded with a "
        "completion manifest), or hf://org/repo (model, tokenizer and model card pushed to the Hub)."
    )
    hf_private: bool = Field(True, description="Create the hf:// output repo as private.")
    commit_message: str | None = Field(
        None, description="Commit message for an hf:// push; default names the job and its accuracy."
    )
    report_baseline: bool = Field(
        True, description="Fit a TF-IDF + logistic-regression baseline on the same split and show it in the report."
    )
    overwrite: bool = Field(
        False,
        description="Allow writing into a non-empty directory (or s3:// prefix) that kubetune did not create, "
        "and replacing "
        "a finished run there once this run finishes (`kubetune run --overwrite`). "
        "kubetune still replaces only its own "
        "entries (model/, metrics.json, ...), never other files.",
    )

    @field_validator("uri")
    @classmethod
    def _not_special(cls, v: str) -> str:
        problem = output_uri_problem(v)
        if problem:
            raise ValueError(problem)
        return v


def output_uri_problem(uri: str) -> str | None:
    """Why ``uri`` can only be a mistake as an output (the empty string, the filesystem root, a
    home directory itself, a bucket's root), or None. Textual: paths are resolved at run time."""
    import re

    body = uri.strip()
    scheme, sep, rest = body.partition("://")
    if not sep:
        scheme, rest = "file", body
    if not body:
        return "is empty, which would write into the current directory; name a directory of its own, e.g. runs/NAME"
    if scheme == "file" and (rest.strip("/") == "" or re.fullmatch(r"~[^/]*/*", rest)):
        return (
            f"{uri!r} is the filesystem root or a home directory itself; kubetune writes model/, checkpoints/ and more "
            "into its output — name a directory of its own, e.g. runs/NAME"
        )
    if scheme == "s3" and not rest.partition("/")[2].strip("/"):
        return (
            f"{uri!r} is a whole bucket — "
            f"name a prefix inside it, e.g. s3://{rest.partition('/')[0] or 'BUCKET'}/runs/NAME"
        )
    return None


S = TypeVar("S", bound=Section)


class _JobSpecBase(Section):
    """The job spec's checks; ``JobSpec`` adds the fields, which depend on the registered tasks."""

    def section(self, kind: type[S]) -> S | None:
        """This spec's task section of model ``kind`` (a task's own section, ``TaskEntry.section``), None where
        the spec has none: the typed way to a task's section (its field exists per registered task).

        Raises:
            KeyError: no registered task has a section of model ``kind``.
        """
        for name, model in TASK_SECTIONS.items():
            if model is kind:
                value = getattr(self, name)
                assert value is None or isinstance(value, kind)
                return value
        raise KeyError(f"no registered task has a section of model {kind.__name__}")

    @field_validator("name", check_fields=False)
    @classmethod
    def _dns_name(cls, v: str) -> str:
        import re

        # DNS-1035: the PyTorchJob webhook and the TrainJob CRD both require a letter first.
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?", v):
            raise ValueError(
                "must be 1-52 lowercase letters, digits or '-', starting with a letter "
                "and ending with a letter or digit "
                "(it names Kubernetes objects, and the Training Operator and Trainer require a DNS-1035 name), "
                "e.g. 'sentiment-minilm'"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _data_for_task(cls, raw):
        # The data section's model is the task's (DATA_SPECS): its hidden `task` tag selects it.
        if isinstance(raw, dict) and isinstance(raw.get("data"), dict):
            task = raw.get("task", default_task())
            known = isinstance(task, str) and task in DATA_SPECS  # a list or a mapping: the task field's own error
            raw = {**raw, "data": {**raw["data"], "task": task if known else ""}}
        return raw

    @model_validator(mode="after")
    def _cross_checks(self):
        own = {name: getattr(self, name) for name in TASK_SECTIONS}
        problems = cross_problems(
            self.data,
            self.distributed,
            self.kubernetes,
            self.output,
            self.tracking,
            own,
            self.training,
            self.lora,
            self.evaluation,
        )
        if problems:
            raise ValueError(CROSS_SEPARATOR.join(problems))  # parse_spec reports each on its own line
        return self


TASKS = entries()
if not TASKS:
    raise ImportError(
        "no kubetune task is registered (entry points of kubetune.tasks): kubetune is not installed — "
        "pip install -e . (or pip install kubetune)"
    )
# The data section's model per task: the `task` field's values, and the union the spec's `data` is validated as.
DATA_SPECS: Mapping[str, type[DataCommon]] = MappingProxyType({name: entry.data for name, entry in TASKS.items()})
_DATA_MODELS = tuple(DATA_SPECS.values())
DataSpec = Annotated[Union[_DATA_MODELS], Field(discriminator="task")] if len(_DATA_MODELS) > 1 else _DATA_MODELS[0]  # noqa: UP007
# The tasks that have a top-level section of their own, keyed by the task's name.
TASK_SECTIONS: Mapping[str, type[Section]] = MappingProxyType(
    {name: entry.section for name, entry in TASKS.items() if entry.section is not None}
)

# The fields in the order a dumped spec lists them (job.yaml, the ConfigMap): the tasks' own sections after lora.
JobSpec = create_model(
    "JobSpec",
    __base__=_JobSpecBase,
    __module__=__name__,
    __doc__="A job spec: the model, the data, the task, the training recipe, where it runs and what it writes.",
    name=(
        str,
        Field(
            description="Job name: lowercase letters, digits and '-', a letter first, at most 52 characters "
            "(used for Kubernetes objects).",
        ),
    ),
    task=(
        Literal[tuple(DATA_SPECS)],  # type: ignore[valid-type]
        Field(
            default_task(),
            description="What to fine-tune for: "
            + "; ".join(f"{name} ({entry.summary})" for name, entry in TASKS.items())
            + ".",
        ),
    ),
    model=(ModelSpec, Field(description="The base model.")),
    data=(DataSpec, Field(description="Training and evaluation data.")),
    lora=(LoraSpec | None, Field(None, description="LoRA settings; absent = full fine-tune.")),
    **{
        name: (model | None, Field(None, description=f"task {name}: {model.__doc__ or ''} Absent: its defaults."))
        for name, model in TASK_SECTIONS.items()
    },
    training=(TrainSpec, Field(default_factory=TrainSpec, description="The training recipe.")),
    distributed=(DistributedSpec, Field(default_factory=DistributedSpec, description="Nodes × processes per node.")),
    output=(OutputSpec, Field(description="Where the exported model, metrics and report are written.")),
    evaluation=(
        EvaluationSpec | None,
        Field(None, description="lm-evaluation-harness tasks on the model being trained; absent: none."),
    ),
    tune=(
        TuneSpec | None,
        Field(None, description="A hyperparameter search over this spec's fields (`kubetune tune`); absent: none."),
    ),
    tracking=(TrackingSpec, Field(default_factory=TrackingSpec, description="Experiment trackers (MLflow).")),
    s3=(
        S3Spec,
        Field(
            default_factory=S3Spec,
            description="S3 / MinIO connection settings (credentials come from the environment, never the spec).",
        ),
    ),
    resources=(
        ResourcesSpec,
        Field(default_factory=ResourcesSpec, description="Per-node (pod) resources on Kubernetes."),
    ),
    kubernetes=(KubernetesSpec, Field(default_factory=KubernetesSpec, description="How the job runs on Kubernetes.")),
    serving=(
        ServingSpec,
        Field(
            default_factory=ServingSpec,
            description="How `kubetune render --serve` serves the finished job's export on KServe.",
        ),
    ),
)


CROSS_SEPARATOR = "\n"


# A task's own section that is present but does not validate (``cross_problems``' ``own``): its task's checks
# are skipped rather than told the section is missing.
INVALID = object()


def cross_problems(
    data,
    distributed: DistributedSpec | None,
    kubernetes: KubernetesSpec | None,
    output: OutputSpec | None = None,
    tracking: TrackingSpec | None = None,
    own: Mapping[str, Section | None] | None = None,
    training: TrainSpec | None = None,
    lora: LoraSpec | None = None,
    evaluation: EvaluationSpec | None = None,
) -> list[str]:
    """The problems between fields of different sections (each section valid on its own); ``None``
    for a section that is not valid (its checks are skipped); ``own``: the tasks' own sections by
    task name (None: absent; ``INVALID``: present but not valid, its own errors already reported). Also
    run by ``load.parse_spec`` when other fields fail, so that every problem of a spec is reported at once."""
    out = []
    own = own or {}
    if data is not None:
        if own.get(data.task) is not INVALID:  # an invalid section's own errors say it all (not "needs a section")
            out += TASKS[data.task].checks(data, own.get(data.task))
        out += [
            f"{name}: applies to task {name}, and this job's task is {data.task} — remove the {name} section, "
            f"or set task: {name}"
            for name, section in own.items()
            if section is not None and section is not INVALID and name != data.task
        ]
    if data is not None and getattr(data, "streaming", False) and training is not None and not training.max_steps:
        out.append(
            "data.streaming needs training.max_steps: the stream's length is not known before it is read — set "
            "training.max_steps (training.epochs then bounds how often the stream is read)"
        )
    if training is not None and training.lr_scheduler == "wsd" and training.warmup_ratio + training.decay_ratio > 1:
        out.append(
            f"training.decay_ratio {training.decay_ratio} and training.warmup_ratio {training.warmup_ratio} add up to "
            "more than the whole run: lr_scheduler wsd warms up, holds, then decays — lower one of them so that they "
            "add up to at most 1"
        )
    if data is not None and getattr(data, "streaming", False) and TASKS[data.task].streaming_needs_lora and not lora:
        out.append(
            f"data.streaming with task {data.task} needs lora: its full fine-tune computes a reference over the "
            "whole training set before the first step, which a stream does not have — add a lora section, or set "
            "data.streaming: false"
        )
    mlflow = tracking.mlflow if tracking is not None else None
    if mlflow and mlflow.register_model and output is not None and not output.uri.startswith("s3://"):
        out.append(
            f"tracking.mlflow.register_model needs output.uri on s3:// (the registry references the model where it "
            f"is, and refuses a local path such as {output.uri!r}) — write the output to s3://, or drop register_model"
        )
    if distributed is not None and distributed.strategy == "fsdp":
        # refused here rather than by every worker after start-up (strategy.for_job says the same)
        if training is not None and training.compile:
            out.append(
                "training.compile under distributed.strategy fsdp is not supported yet — set training.compile: false, "
                "or distributed.strategy: ddp"
            )
        if lora is not None and lora.quantization:
            out.append(
                "lora.quantization (QLoRA) under distributed.strategy fsdp is not supported yet — use "
                "distributed.strategy: ddp (every GPU holds the quantized base, which is what QLoRA saves)"
            )
        if data is not None and TASKS[data.task].fsdp_needs_lora and lora is None:
            out.append(
                f"task {data.task} under distributed.strategy fsdp needs lora: its full fine-tune keeps a frozen copy "
                "of the base model as the reference, which a sharded model cannot be copied into — add a lora section "
                "(the reference is then the base with the adapter off), or use distributed.strategy: ddp"
            )
    if evaluation is not None and data is not None and not TASKS[data.task].language_model:
        language = [name for name, entry in TASKS.items() if entry.language_model]
        out.append(
            f"evaluation: lm-evaluation-harness scores causal language models, and task {data.task} trains "
            f"something else — remove the evaluation section, or use one of the tasks {', '.join(language)}"
        )
    if evaluation is not None and evaluation.every and distributed is not None and distributed.strategy == "fsdp":
        out.append(
            "evaluation.every under distributed.strategy fsdp is not supported yet (each rank holds a shard of the "
            "model) — drop evaluation.every (the evaluation after training still runs), or use "
            "distributed.strategy: ddp"
        )
    elastic = kubernetes.elastic if kubernetes is not None else None
    if elastic and distributed is not None and not elastic.min_nodes <= distributed.nodes <= elastic.max_nodes:
        out.append("distributed.nodes must lie between kubernetes.elastic.min_nodes and max_nodes")
    return out
