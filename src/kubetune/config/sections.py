"""The spec's common sections: model, lora, training, distributed, s3, tracking, evaluation, output.

The base model, LoRA, the training recipe, the distribution (DDP | FSDP), S3, the experiment trackers,
lm-evaluation-harness during training, and the output: each a model of its own, which ``schema.JobSpec``
puts together with the data section and the tasks' own sections.

The key names are a public contract (docs, tools and the Kubernetes ConfigMap rely on them).
Unknown keys are errors; every field carries help text in ``description``.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from kubetune.config.base import Section, Uri


class ModelSpec(Section):
    uri: Uri = Field(
        description="Base model: hf://org/name (Hugging Face Hub or its local cache), s3://bucket/prefix, "
        "file:///path or a plain local path to a save_pretrained directory.",
    )
    revision: str | None = Field(
        default=None, description="Hub revision (branch, tag or commit) for hf:// models; default: main."
    )


class LoraSpec(Section):
    r: int = Field(default=8, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(default=16, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(default=0.05, ge=0, lt=1, description="Dropout on the LoRA branch.")
    target_modules: list[str] | Literal["all-linear"] | None = Field(
        default=None,
        description="Module names to adapt (e.g. [query, value]) or 'all-linear'. Absent: peft's default for "
        "the architecture. The classification head always trains in full.",
    )
    quantization: Literal["4bit", "8bit"] | None = Field(
        default=None,
        description="QLoRA: load the frozen base model quantized with bitsandbytes, 4bit (NF4, double quantization) "
        "or 8bit (LLM.int8); needs CUDA GPUs. Absent: the base model keeps its precision.",
    )


class FastPathSpec(Section):
    """The GPU's fast path, each piece on by default where it applies (the trainer picks it; the spec stays the
    same on a CPU, which always runs the plain PyTorch path). Set a piece to false to turn it off."""

    flash_attention: bool = Field(
        default=True,
        description="Packed rows on a CUDA GPU run torch's flash variable-length attention "
        "(torch.nn.attention.varlen) over the documents' boundaries built on the host; false: the "
        "gather-and-SDPA path the CPU runs.",
    )
    liger: bool = Field(
        default=True,
        description="On a CUDA GPU with liger-kernel installed: its fused RMSNorm, SwiGLU and RoPE in "
        "Llama-class models and its fused linear cross-entropy for the loss (the vocabulary's logits never "
        "exist); false: the plain modules and the chunked loss.",
    )
    bf16_weights: bool = Field(
        default=True,
        description="With bf16 precision on one CUDA GPU and distributed.strategy auto: the model computes with bf16 "
        "weights while the optimizer keeps fp32 master weights (the fsdp strategy on a world of one: FSDP2's mixed "
        "precision, as under fsdp on several GPUs; its checkpoints are fsdp's). Not for QLoRA, evaluation.every or "
        "a full fine-tune that keeps a frozen copy of the model as its reference; false: fp32 weights under bf16 "
        "autocast (ddp).",
    )


class TrainSpec(Section):
    epochs: int = Field(default=1, ge=1, description="Passes over the training data.")
    max_steps: int | None = Field(
        default=None, ge=1, description="Stop after this many optimizer steps (overrides epochs when reached first)."
    )
    batch_size: int = Field(default=16, ge=1, description="Examples per micro-batch per process.")
    grad_accum: int = Field(
        default=1,
        ge=1,
        description="Micro-batches per optimizer step; global batch = batch_size × grad_accum × world size.",
    )
    learning_rate: float = Field(default=5e-5, gt=0, le=1, description="Peak learning rate (reached after the warmup).")
    warmup_ratio: float = Field(default=0.0, ge=0, lt=1, description="Fraction of optimizer steps with linear warmup.")
    weight_decay: float = Field(
        default=0.01,
        ge=0,
        description="Weight decay, not applied to biases and norms (AdamW's decoupled decay; sgd's L2 on the "
        "gradient).",
    )
    optimizer: Literal["adamw", "adamw_foreach", "sgd", "adamw_8bit"] = Field(
        default="adamw",
        description="adamw: torch's fused AdamW (one kernel over all parameters; on a non-finite gradient the step is "
        "skipped on the device); adamw_foreach: the same AdamW with its multi-tensor kernels; sgd: fused SGD with "
        "training.momentum; adamw_8bit: bitsandbytes' 8-bit AdamW (optimizer state in 8 bits, about a quarter of "
        "adamw's memory; needs bitsandbytes and a CUDA GPU).",
    )
    momentum: float = Field(
        default=0.9,
        ge=0,
        lt=1,
        description="Momentum of training.optimizer sgd (0: plain SGD); the other optimizers ignore it.",
    )
    lr_scheduler: Literal["linear", "cosine", "constant", "wsd"] = Field(
        default="linear",
        description="The learning rate after training.warmup_ratio's linear warmup (transformers' schedules): linear: "
        "down to 0 at the last step; cosine: along half a cosine down to 0; constant: stays at "
        "training.learning_rate; wsd (warmup-stable-decay): constant, then along half a cosine down to 0 over the "
        "last training.decay_ratio of the steps.",
    )
    decay_ratio: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="With training.lr_scheduler wsd: the fraction of optimizer steps, at the end, over which the "
        "learning rate decays to 0 (warmup_ratio + decay_ratio at most 1); the other schedules ignore it.",
    )
    max_grad_norm: float | None = Field(
        default=1.0, gt=0, description="Gradient clipping norm; null disables clipping."
    )
    seed: int = Field(default=42, ge=0, description="Seed for data order, initialization and dropout.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        default="auto",
        description="Compute precision: auto = bf16 autocast on a GPU that supports it or a CPU with AMX or "
        "AVX512-BF16 (native bf16), else fp32.",
    )
    eval_batch_size: int | None = Field(
        default=None, ge=1, description="Eval micro-batch per process; default 2 × batch_size."
    )
    group_by_length: bool = Field(
        default=True,
        description="Batch examples of similar length together (seeded, distributed-correct) to cut padding.",
    )
    log_every: int = Field(default=10, ge=1, description="Optimizer steps between training-loss log lines.")
    eval_every: int | None = Field(
        default=None,
        ge=1,
        description="Also evaluate every N optimizer steps "
        "(the eval set is always evaluated at the end of each epoch).",
    )
    eval_on_start: bool = Field(
        default=False,
        description="Also evaluate before the first step (the baseline the curves start from; not on resume).",
    )
    checkpoint_every: int | None = Field(
        default=None,
        ge=1,
        description="Write a checkpoint every N optimizer steps (under <output>/checkpoints/); "
        "one is always written on SIGTERM/SIGINT.",
    )
    checkpoint_minutes: float | None = Field(
        default=None, gt=0, description="Also write a checkpoint every N minutes of training."
    )
    keep_checkpoints: int = Field(default=2, ge=1, description="How many of the newest complete checkpoints to keep.")
    checkpoint_async: bool = Field(
        default=True,
        description="Write checkpoints in the background: the step waits only while the state is copied off "
        "the device (into host memory), and the next checkpoint, a stop signal or the end of the run waits for the "
        "one in flight; a checkpoint is still complete or absent. false: every checkpoint blocks the step until "
        "it is written.",
    )
    resume: Literal["auto", "never"] = Field(
        default="auto",
        description="auto: continue from the newest complete checkpoint under output.uri; "
        "never: start over (`kubetune run --no-resume`).",
    )
    dataloader_workers: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description="DataLoader worker processes per training process (they build and pin batches ahead); "
        "default: 2 on a GPU, 0 on CPU, as measured in benchmarks/README.md.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute activations in the backward pass: less memory for long sequences, "
        "about 30% more compute.",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile each transformer block (dynamic shapes; under fsdp too, each sharded block). "
        "Pays a compile time up front "
        "(about 40 s on a CPU) for faster steps after it; see benchmarks/README.md for when it pays back.",
    )
    fast_path: FastPathSpec = Field(
        default_factory=FastPathSpec,
        description="The GPU's fast path (flash attention for packed rows, Liger-Kernel's fused ops, bf16 "
        "compute weights): each piece on where it applies, each can be turned off.",
    )


class FSDPSpec(Section):
    reshard_after_forward: bool = Field(
        default=True,
        description="Free each block's gathered weights after its forward pass and gather them again for the "
        "backward (less memory); false keeps them until the backward (less communication).",
    )
    cpu_offload: bool = Field(
        default=False,
        description="Keep the sharded weights, gradients and optimizer state in host memory and run the optimizer "
        "step on the CPU (GPU only): fits larger models, slower steps.",
    )


class DistributedSpec(Section):
    strategy: Literal["auto", "ddp", "fsdp"] = Field(
        default="auto",
        description="ddp: every process holds the whole model; fsdp: weights, gradients and optimizer state are "
        "sharded over the processes (FSDP2, one unit per transformer block). auto: fsdp when the job has more than "
        "one process and its full-precision training state (weights, gradients, AdamW moments) would take more "
        "than half of one device's memory (a GPU's, or on CPU the host memory per process); on one process, fsdp "
        "for bf16 on a CUDA GPU (training.fast_path.bf16_weights); else ddp. A resumed run keeps the strategy of "
        "its checkpoint.",
    )
    fsdp: FSDPSpec = Field(default_factory=FSDPSpec, description="Settings of the fsdp strategy.")
    nodes: int = Field(
        default=1, ge=1, description="Number of nodes (Kubernetes pods, or hosts running `kubetune run`)."
    )
    procs_per_node: int = Field(default=1, ge=1, description="Worker processes per node (one per GPU on GPU nodes).")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="torch.distributed backend: auto = nccl when CUDA is available, else gloo."
    )
    rdzv_endpoint: str | None = Field(
        default=None,
        description="host:port of the c10d rendezvous for multi-node local runs (the first node's address). "
        "Single node: a free local port is chosen.",
    )
    max_restarts: int = Field(
        default=0, ge=0, description="Times the elastic launcher restarts all workers after a failure."
    )
    timeout_minutes: int = Field(
        default=60,
        ge=1,
        description="How long ranks wait for each other in a collective "
        "(rank 0 alone tokenizes, saves and uploads meanwhile).",
    )
    threads_per_proc: int | None = Field(
        default=None, ge=1, description="CPU threads per worker process; default: CPU cores / procs_per_node."
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class S3Spec(Section):
    endpoint_url: Uri | None = Field(
        default=None,
        description="S3 endpoint, e.g. http://minio.minio.svc:9000 for MinIO; "
        "default: $S3_ENDPOINT_URL, then $AWS_ENDPOINT_URL, then AWS.",
    )
    region: str | None = Field(default=None, description="S3 region; default: $AWS_REGION, then us-east-1.")
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="auto",
        description="Bucket addressing: auto = path-style when an endpoint is set (MinIO), else virtual-hosted.",
    )


class MLflowSpec(Section):
    uri: Uri | None = Field(
        default=None,
        description="The MLflow tracking server (http(s)://HOST:PORT); absent: MLFLOW_TRACKING_URI. Credentials come "
        "from MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN in the environment (on Kubernetes: "
        "kubernetes.secrets.mlflow), never from the spec.",
    )
    experiment: str = Field(default="kubetune", min_length=1, description="The MLflow experiment (created if missing).")
    run_name: str | None = Field(default=None, description="The MLflow run's name; absent: the job's name.")
    tags: dict[str, str] = Field(default_factory=dict, description="Extra tags on the MLflow run.")
    register_model: str | None = Field(
        default=None,
        description="Register the exported model (by its output.uri) under this name in the model registry.",
    )

    @field_validator("uri")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
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
        default=None,
        description="A directory of the harness's task YAML (offline and private suites), relative to the spec "
        "file or absolute (on Kubernetes a path the pods see: a PVC or the image), or an s3:// prefix. Data files "
        "the YAML names by s3:// URI are fetched with the job's S3 settings.",
    )
    num_fewshot: int | None = Field(
        default=None, ge=0, le=1000, description="Few-shot examples; default: each task's own."
    )
    limit: float | None = Field(
        default=None,
        gt=0,
        le=1_000_000_000,
        allow_inf_nan=False,
        description="Documents per task: a count (1 to 1e9) or a fraction (below 1); default: all.",
    )
    batch_size: int = Field(default=8, ge=1, le=4096, description="Requests per forward, per process.")
    chat: bool = Field(default=False, description="Format the prompts with the tokenizer's chat template.")
    gen_kwargs: dict[str, int | float | bool | str] | None = Field(
        default=None,
        description="Generation settings for generation tasks, over the tasks' own (the harness's gen_kwargs: "
        "max_gen_toks, temperature, do_sample, ...).",
    )
    every: int | None = Field(
        default=None,
        ge=1,
        description="Also evaluate every N optimizer steps (a curve per task). A stop signal during one is answered "
        "when it ends: keep one evaluation well below the grace period a stopped pod gets (30 s by default; "
        "kubernetes.termination_grace_period_seconds).",
    )
    on_start: bool = Field(
        default=False, description="Also evaluate before the first step: the base model's score the curves start from."
    )
    after: bool = Field(
        default=True, description="Evaluate after training on the final weights (metrics.json's lm_eval)."
    )
    log_samples: bool = Field(
        default=False,
        description="Keep the final evaluation's per-sample log (lm_eval_samples/<task>.jsonl in the output; a task "
        "name that is not a plain file name is %-encoded, so the samples stay inside the run).",
    )


class TrackingSpec(Section):
    mlflow: MLflowSpec | None = Field(
        default=None,
        description="Log params, metrics, system facts and artifacts to an MLflow tracking server (rank 0 only); "
        "a resumed run continues the same MLflow run.",
    )


class OutputSpec(Section):
    uri: Uri = Field(
        description="Where artifacts go: a local directory (plain path or file://), "
        "s3://bucket/prefix (uploaded with a "
        "completion manifest), or hf://org/repo (model, tokenizer and model card pushed to the Hub)."
    )
    hf_private: bool = Field(default=True, description="Create the hf:// output repo as private.")
    commit_message: str | None = Field(
        default=None, description="Commit message for an hf:// push; default names the job and its accuracy."
    )
    report_baseline: bool = Field(
        default=True,
        description="Fit a TF-IDF + logistic-regression baseline on the same split and show it in the report.",
    )
    overwrite: bool = Field(
        default=False,
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
