"""Pydantic schema of the job spec.

The key names are a public contract (docs, tools and the Kubernetes ConfigMap rely on them).
Unknown keys are errors; every field carries help text in ``description``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from kubetune.config.base import Section, Uri
from kubetune.config.cluster import KubernetesSpec, ResourcesSpec


class ModelSpec(Section):
    uri: Uri = Field(
        description="Base model: hf://org/name (Hugging Face Hub or its local cache), s3://bucket/prefix, "
        "file:///path or a plain local path to a save_pretrained directory.",
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit) for hf:// models; default: main."
    )


class DataCommon(Section):
    """The ``data`` fields every task has; each task's section adds its own (``DATA_SPECS``)."""

    task: str = Field("", exclude=True, description="(internal) the job's task, which selects the data section's model")

    train: Uri = Field(
        description="Training data: a CSV/TSV/JSONL/Parquet file (plain path or file://), a directory of "
        "such files, hf://org/dataset (Hugging Face dataset), or pkg://package/path (a file shipped "
        "inside an installed Python package).",
    )
    eval: Uri | None = Field(
        None,
        description="Evaluation data, same forms as data.train. Absent: carve data.eval_fraction out of data.train.",
    )
    eval_fraction: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="Fraction of data.train held out (stratified by label, fixed seed) when data.eval is absent.",
    )
    train_split: str = Field(
        "train", description="Split (with optional slice, e.g. 'train[:3000]') for hf:// and directory datasets."
    )
    eval_split: str = Field(
        "validation", description="Split (with optional slice) of data.eval for hf:// and directory datasets."
    )
    text_column: str = Field("text", description="Column holding the input text.")
    max_length: int = Field(
        128,
        ge=8,
        le=32768,
        description="Token limit per example; longer texts are truncated. Batches are padded dynamically.",
    )
    max_train_samples: int | None = Field(
        None,
        ge=1,
        description="Use at most this many training rows (a seeded random subset), after the eval carve-out.",
    )
    max_eval_samples: int | None = Field(
        None, ge=1, description="Use at most this many evaluation rows (a seeded random subset)."
    )
    encoding: str = Field(
        "auto",
        description="Text encoding of CSV/TSV/JSON(L) files. 'auto': UTF-8; "
        "a byte-order mark selects UTF-8/16/32; bytes that "
        "are not valid UTF-8 are decoded as cp1252 with a warning "
        "(valid UTF-8 around them stays UTF-8). Any other value "
        "(latin-1, cp1252, utf-16, ...) is used as given.",
    )
    max_input_mb: int = Field(
        1024,
        ge=1,
        description="Largest data file (or directory, or dataset) read into memory, in MiB; pandas holds several times "
        "the file size. Raise it for bigger data.",
    )
    # ---- causal-lm only ----


class ClassificationData(DataCommon):
    """``data`` for task: sequence-classification."""

    task: Literal["sequence-classification"] = Field(
        "sequence-classification", exclude=True, description="(internal) the job's task, set from `task`"
    )
    text_pair_column: str | None = Field(
        None, description="Optional second text column (sentence pairs, e.g. NLI); encoded as [CLS] a [SEP] b [SEP]."
    )
    label_column: str = Field(
        "label",
        description="Column holding the class label: strings or numbers; mapped to ids in sorted order (numerically "
        "when every label is a number). None/NA/null are labels, not missing.",
    )
    max_classes: int = Field(
        1000,
        ge=2,
        le=100_000,
        description="Most distinct labels a classification dataset may have; "
        "more is almost always the wrong label column.",
    )


class CausalLMData(DataCommon):
    """``data`` for task: causal-lm."""

    task: Literal["causal-lm"] = Field(
        "causal-lm", exclude=True, description="(internal) the job's task, set from `task`"
    )
    format: Literal["auto", "text", "instruction", "chat"] = Field(
        "auto",
        description="causal-lm data layout: text = one document per row (data.text_column); instruction = alpaca-style "
        "records (data.instruction_column, data.input_column, data.output_column); chat = a list of {role, content} "
        "messages per row (data.messages_column). auto: chat if the messages column exists, else instruction if the "
        "instruction and output columns exist, else text.",
    )
    instruction_column: str = Field("instruction", description="causal-lm instruction format: the instruction column.")
    input_column: str | None = Field(
        "input",
        description="causal-lm instruction format: optional extra input "
        "appended to the instruction (absent or empty = none).",
    )
    output_column: str = Field(
        "output", description="causal-lm instruction format: the response the model learns to produce."
    )
    messages_column: str = Field(
        "messages", description="causal-lm chat format: column holding the list of {role, content} messages."
    )
    system_prompt: str | None = Field(
        None,
        description="causal-lm instruction/chat formats: a system message "
        "put first in every conversation that has none.",
    )
    train_on_prompt: bool = Field(
        False,
        description="causal-lm: also compute the loss on prompt tokens (instruction, user and system turns). Default: "
        "loss on response (assistant) tokens only; text-format rows are all response.",
    )
    packing: bool = Field(
        False,
        description="causal-lm: padding-free packing: each micro-batch is one row of concatenated examples with "
        "per-example position ids, so examples cannot attend to each other and no compute goes to padding.",
    )
    max_tokens_per_batch: int | None = Field(
        None,
        ge=8,
        description="causal-lm with packing: fill each micro-batch with whole examples up to this many tokens "
        "instead of taking training.batch_size examples, so every micro-batch does similar work; a global step is "
        "then world size × training.grad_accum micro-batches. At least data.max_length. Absent: batch_size examples.",
    )


class PreferenceData(DataCommon):
    """``data`` for task: dpo (preference pairs, TRL's conventions)."""

    task: Literal["dpo"] = Field("dpo", exclude=True, description="(internal) the job's task, set from `task`")
    format: Literal["auto", "text", "chat"] = Field(
        "auto",
        description="dpo data layout. text: prompt, chosen and rejected are strings, joined as they are (the "
        "chosen and rejected answers end with the EOS token), as TRL's standard format. chat: rendered with the chat "
        "template; the columns hold {role, content} message lists (TRL's conversational format: answers that start "
        "with the prompt's turns need no prompt column, the prompt is the turns they share), or strings, which "
        "become a user turn and an "
        "assistant turn. auto: chat when the chosen column holds message lists, else text.",
    )
    prompt_column: str = Field("prompt", description="dpo: the prompt column (string or message list).")
    chosen_column: str = Field("chosen", description="dpo: the preferred answer (string or message list).")
    rejected_column: str = Field("rejected", description="dpo: the dispreferred answer (string or message list).")
    system_prompt: str | None = Field(
        None, description="dpo chat format: a system message put first in every prompt that has none."
    )
    chat_template: str | None = Field(
        None,
        description="dpo chat format: a Jinja chat template used instead of the tokenizer's (saved with the exported "
        "tokenizer). Absent: the tokenizer's, else kubetune's fallback template (as for causal-lm).",
    )
    max_length: int = Field(
        512,
        ge=8,
        le=32768,
        description="Token limit of prompt + answer; longer sequences lose their end (TRL's keep_start), and pairs "
        "whose prompt alone fills it are dropped (counted).",
    )


# The data section's model per task: the `task` field's values, and the union the spec's `data` is
# validated as. A new task adds its data model here and its module to kubetune.tasks.
DATA_SPECS: dict[str, type[DataCommon]] = {
    "sequence-classification": ClassificationData,
    "causal-lm": CausalLMData,
    "dpo": PreferenceData,
}
DataSpec = Annotated[ClassificationData | CausalLMData | PreferenceData, Field(discriminator="task")]


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


class DPOSpec(Section):
    """The preference loss of task: dpo (the names of TRL's DPOConfig)."""

    beta: float = Field(
        0.1,
        gt=0,
        description="How far the policy may move from the reference model: the reward of an answer is beta × (its "
        "log-probability under the policy − under the reference). Lower: further.",
    )
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid",
        description="sigmoid: the DPO loss −log σ(beta × (chosen reward margin)); ipo: the IPO squared loss on "
        "per-token log-ratios, (margin − 1/(2·beta))².",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="sigmoid only: the assumed fraction of pairs whose preference is flipped (conservative DPO): "
        "−(1−ε) log σ(βΔ) − ε log σ(−βΔ).",
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
    learning_rate: float = Field(5e-5, gt=0, le=1, description="Peak AdamW learning rate.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Fraction of optimizer steps with linear warmup.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (not applied to biases and LayerNorm).")
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


class JobSpec(Section):
    name: str = Field(
        description="Job name: lowercase letters, digits and '-', a letter first, at most 52 characters "
        "(used for Kubernetes objects).",
    )
    task: Literal[tuple(DATA_SPECS)] = Field(  # type: ignore[valid-type]
        "sequence-classification",
        description="What to fine-tune for: sequence-classification (a label per text; BERT-class encoders), "
        "causal-lm (next-token prediction on text, instruction or chat data; Llama-class decoders) or dpo "
        "(preference tuning of a causal LM on chosen/rejected answer pairs, Direct Preference Optimization).",
    )
    model: ModelSpec = Field(description="The base model.")
    data: DataSpec = Field(description="Training and evaluation data.")
    lora: LoraSpec | None = Field(None, description="LoRA settings; absent = full fine-tune.")
    dpo: DPOSpec | None = Field(None, description="task dpo: the preference loss; absent = its defaults.")
    training: TrainSpec = Field(default_factory=TrainSpec, description="The training recipe.")
    distributed: DistributedSpec = Field(default_factory=DistributedSpec, description="Nodes × processes per node.")
    output: OutputSpec = Field(description="Where the exported model, metrics and report are written.")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="Experiment trackers (MLflow).")
    s3: S3Spec = Field(
        default_factory=S3Spec,
        description="S3 / MinIO connection settings (credentials come from the environment, never the spec).",
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Per-node (pod) resources on Kubernetes."
    )
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec, description="How the job runs on Kubernetes.")

    @field_validator("name")
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
            task = raw.get("task", "sequence-classification")
            known = isinstance(task, str) and task in DATA_SPECS  # a list or a mapping: the task field's own error
            raw = {**raw, "data": {**raw["data"], "task": task if known else ""}}
        return raw

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        problems = cross_problems(
            self.data, self.distributed, self.kubernetes, self.output, self.tracking, self.dpo, self.training, self.lora
        )
        if problems:
            raise ValueError(CROSS_SEPARATOR.join(problems))  # parse_spec reports each on its own line
        return self


CROSS_SEPARATOR = "\n"


def cross_problems(
    data,
    distributed: DistributedSpec | None,
    kubernetes: KubernetesSpec | None,
    output: OutputSpec | None = None,
    tracking: TrackingSpec | None = None,
    dpo: DPOSpec | None = None,
    training: TrainSpec | None = None,
    lora: LoraSpec | None = None,
) -> list[str]:
    """The problems between fields of different sections (each section valid on its own); ``None``
    for a section that is not valid (its checks are skipped). Also run by ``load.parse_spec`` when
    other fields fail, so that every problem of a spec is reported at once."""
    out = []
    if isinstance(data, ClassificationData):
        if data.text_pair_column and data.text_pair_column == data.text_column:
            out.append("data.text_pair_column must differ from data.text_column")
        if data.label_column in (data.text_column, data.text_pair_column):
            out.append("data.label_column must differ from the text columns")
    if isinstance(data, CausalLMData) and data.max_tokens_per_batch is not None:
        if not data.packing:
            out.append("data.max_tokens_per_batch needs data.packing: true (micro-batches of packed tokens)")
        if data.max_tokens_per_batch < data.max_length:
            out.append(
                f"data.max_tokens_per_batch {data.max_tokens_per_batch} is below data.max_length "
                f"{data.max_length}: raise it to at least data.max_length, so the longest example fits"
            )
    if dpo is not None and data is not None and data.task != "dpo":
        out.append(
            f"dpo: applies to task dpo, and this job's task is {data.task} — remove the dpo section, or set task: dpo"
        )
    if dpo is not None and dpo.label_smoothing and dpo.loss_type != "sigmoid":
        out.append(f"dpo.label_smoothing applies to dpo.loss_type sigmoid, not {dpo.loss_type} — remove it")
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
    elastic = kubernetes.elastic if kubernetes is not None else None
    if elastic and distributed is not None and not elastic.min_nodes <= distributed.nodes <= elastic.max_nodes:
        out.append("distributed.nodes must lie between kubernetes.elastic.min_nodes and max_nodes")
    return out
