"""Pure builders: a finished job's spec → the KServe objects that serve its export (no cluster access
here): an ``InferenceService`` (serving.kserve.io/v1beta1) on KServe's Hugging Face runtime, and, for
an export on S3, the ``ServiceAccount`` through which KServe's storage initializer reads the job's S3
Secret (by reference: the Secret itself is never rendered).

What the runtime serves is what the task's entry says (``TaskEntry.kserve``: the runtime's ``--task``, and
whether it serves the task's LoRA adapter), never the task's name. Where the export is follows the
job's output: ``s3://…/model``, ``hf://org/repo``, or ``pvc://CLAIM/path`` for an output on the job's
workspace claim. A LoRA export is served merged (``model/``) or as the base model plus ``adapter/``
(``serving.lora``), the latter through the runtime's vLLM backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from kubetune import providers
from kubetune.artifacts.output import Output
from kubetune.backends.cluster.objects import WORKSPACE, pvc_name, to_yaml
from kubetune.config import JobSpec
from kubetune.config.tasks import KServeRuntime, entries
from kubetune.errors import SpecError

ISVC_API = ("serving.kserve.io", "v1beta1", "inferenceservices")
MODELS = "/mnt/models"  # where KServe's storage initializer puts what storageUri(s) name
DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"
SERVES_LABEL = "kubetune.io/serves"  # not kubetune.io/job: KServe copies the labels onto its pods
# vLLM's --max-lora-rank takes one of these; the adapter's rank is rounded up to the next.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
HF_TOKEN_KEY = "HF_TOKEN"  # the only key of a Secret that KServe's storage initializer reads a Hub token from


@dataclass(frozen=True)
class RenderedServe:
    """What serving a job's export needs, in creation order."""

    service_account: dict | None
    inference_service: dict

    def objects(self) -> list[dict]:
        return [*([self.service_account] if self.service_account else []), self.inference_service]

    def to_yaml(self) -> str:
        return to_yaml(self.objects())


def runtime_of(task: str) -> KServeRuntime | None:
    """How KServe's Hugging Face runtime serves what task ``task`` exports (its entry's, light: no torch)."""
    return entries()[task].kserve


def serve_name(spec: JobSpec) -> str:
    """The InferenceService's name: ``serving.name``, else the job's."""
    return spec.serving.name or spec.name


def service_account_name(spec: JobSpec) -> str:
    return f"{serve_name(spec)}-storage"


def _adapter(spec: JobSpec) -> bool:
    return spec.lora is not None and spec.serving.lora == "adapter"


def _claim_uri(spec: JobSpec, pod_path: str) -> str | None:
    """``pvc://CLAIM/path`` for a path the job's pods see on their workspace claim, else None."""
    if spec.kubernetes.storage.mode != "pvc" or not pod_path.startswith(WORKSPACE + "/"):
        return None
    return f"pvc://{pvc_name(spec)}/{pod_path[len(WORKSPACE) + 1 :].strip('/')}"


def export_uri(spec: JobSpec, entry: str) -> str | None:
    """Where the job's export ``entry`` (``model`` or ``adapter``) is, as a KServe storage URI; None
    where KServe cannot reach it (see ``serving_problems``). An hf:// output holds the model at the
    repository's root."""
    out = Output.for_spec(spec)
    if out.scheme == "s3":
        return f"{out.prefix}/{entry}"
    if out.scheme == "hf":
        return out.prefix if entry == "model" else None
    path = out.pod_path(WORKSPACE)
    assert path is not None  # a local output: the remote ones (s3, hf) returned above
    return _claim_uri(spec, f"{path.rstrip('/')}/{entry}")


def base_uri(spec: JobSpec) -> str | None:
    """Where the base model (``model.uri``) is, as a KServe storage URI; None where KServe cannot reach it."""
    parsed = providers.parse_uri(spec.model.uri)
    if parsed.scheme == "hf":
        return f"hf://{parsed.body}" + (f":{spec.model.revision}" if spec.model.revision else "")
    if parsed.scheme == "s3":
        return spec.model.uri
    if parsed.scheme == "file":
        body = parsed.body
        return _claim_uri(spec, body if body.startswith("/") else f"{WORKSPACE}/{body}")
    return None


def serving_problems(spec: JobSpec, runtime: KServeRuntime | None) -> list[str]:
    """Why the export of ``spec`` (served by ``runtime``, its task's) cannot be served, one line each."""
    out = []
    if runtime is None:
        out.append(
            f"task {spec.task} names no KServe runtime for its export (TaskEntry.kserve), so kubetune does not "
            "serve it on KServe's Hugging Face runtime — serve it with your own runtime"
        )
    if spec.serving.lora == "adapter" and spec.lora is None:
        out.append(
            "serving.lora: adapter needs a job with a lora section (a full fine-tune exports no adapter) — remove it"
        )
    out_scheme = Output.for_spec(spec).scheme
    if export_uri(spec, "model") is None and out_scheme == "file":
        out.append(
            f"output.uri: {spec.output.uri!r} is in the job's node-local storage, gone with its pods, or outside its "
            f"workspace claim — write the output to s3:// or hf://, or to a path under {WORKSPACE} with "
            "kubernetes.storage.mode: pvc"
        )
    if not _adapter(spec):
        return out
    assert spec.lora is not None  # _adapter: the job has a lora section
    if runtime is not None and not runtime.adapters:
        out.append(
            f"serving.lora: adapter — the runtime serves no LoRA adapter of a {runtime.task} model (vLLM's LoRA is "
            "for generation) — use serving.lora: merged"
        )
    if out_scheme == "hf":
        out.append(
            "serving.lora: adapter — KServe reads an hf:// repository whole, not its adapter/ folder — use "
            "serving.lora: merged, or an s3:// output"
        )
    if base_uri(spec) is None:
        out.append(
            f"serving.lora: adapter needs the base model where KServe reads it (hf://, s3://, or a path on the "
            f"workspace claim), and model.uri is {spec.model.uri!r} — use serving.lora: merged"
        )
    if not spec.serving.gpu:
        out.append(
            "serving.lora: adapter is served by the runtime's vLLM backend, which needs a GPU — set serving.gpu: 1, "
            "or serving.lora: merged"
        )
    if spec.lora.r > VLLM_LORA_RANKS[-1]:
        out.append(
            f"serving.lora: adapter — vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, and lora.r is "
            f"{spec.lora.r} — use serving.lora: merged"
        )
    return out


def serve_warnings(spec: JobSpec, namespace: str) -> list[str]:
    """What a user must do on the cluster that the render cannot do: S3 credentials and the S3
    endpoint for KServe's storage initializer (it reads the Secret's annotations, not AWS_ENDPOINT_URL),
    and the key it reads a Hugging Face token from."""
    uris, secrets, out = _storage_uris(spec), spec.kubernetes.secrets, []
    if any(u.startswith("s3://") for u in uris) and secrets.s3 is None:
        out.append(
            "kubernetes.secrets.s3 is not set: KServe's storage initializer reads the export from S3 with the "
            "namespace's default ServiceAccount — set kubernetes.secrets.s3 to the Secret of S3 keys the job used"
        )
    elif any(u.startswith("s3://") for u in uris):
        endpoint = urlsplit(spec.s3.endpoint_url or "")
        where = (
            f"serving.kserve.io/s3-endpoint={endpoint.netloc} "
            f"serving.kserve.io/s3-usehttps={1 if endpoint.scheme == 'https' else 0}"
            if endpoint.netloc
            else "serving.kserve.io/s3-endpoint=HOST:PORT serving.kserve.io/s3-usehttps=0|1"
        )
        out.append(
            f"KServe's storage initializer takes the S3 endpoint from the annotations of Secret {secrets.s3}, not "
            f"from AWS_ENDPOINT_URL (AWS S3 needs none): kubectl -n {namespace} annotate --overwrite secret "
            f"{secrets.s3} {where}"
        )
    if any(u.startswith("hf://") for u in uris) and secrets.hf_token and secrets.hf_token.key != HF_TOKEN_KEY:
        out.append(
            f"kubernetes.secrets.hf_token: KServe's storage initializer reads the key {HF_TOKEN_KEY} of Secret "
            f"{secrets.hf_token.name}, not {secrets.hf_token.key!r} — add the token under {HF_TOKEN_KEY}"
        )
    return out


def _storage_uris(spec: JobSpec) -> list[str]:
    if _adapter(spec):
        return [u for u in (base_uri(spec), export_uri(spec, "adapter")) if u]
    return [u for u in (export_uri(spec, "model"),) if u]


def _labels(spec: JobSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kubetune",
        "app.kubernetes.io/instance": serve_name(spec),
        "app.kubernetes.io/component": "serving",
        SERVES_LABEL: spec.name,
        **spec.kubernetes.labels,
    }


def _metadata(spec: JobSpec, name: str, namespace: str, **annotations: str) -> dict:
    meta = {"name": name, "namespace": namespace, "labels": _labels(spec)}
    annotations = {**spec.kubernetes.annotations, **annotations}
    return {**meta, "annotations": annotations} if annotations else meta


def _storage_secrets(spec: JobSpec) -> list[str]:
    """The job's Secrets that KServe's storage initializer needs for the export: the S3 keys
    (``kubernetes.secrets.s3``) for s3://, the Hugging Face token's Secret for hf://."""
    uris, secrets = _storage_uris(spec), spec.kubernetes.secrets
    names = [secrets.s3] if secrets.s3 and any(u.startswith("s3://") for u in uris) else []
    if secrets.hf_token and any(u.startswith("hf://") for u in uris):
        names.append(secrets.hf_token.name)
    return list(dict.fromkeys(names))


def build_service_account(spec: JobSpec, namespace: str) -> dict | None:
    """The ServiceAccount listing the job's Secrets that the export needs (``_storage_secrets``): KServe's
    storage initializer finds credentials in the Secrets of the predictor's ServiceAccount. None when
    it needs none."""
    names = _storage_secrets(spec)
    if not names:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(spec, service_account_name(spec), namespace),
        # the model server never calls the Kubernetes API
        "automountServiceAccountToken": False,
        "secrets": [{"name": n} for n in names],
    }


def runtime_args(spec: JobSpec, runtime: KServeRuntime) -> list[str]:
    """The Hugging Face runtime's arguments after its own ``--model_name={{.Name}}``
    (kserve python/huggingfaceserver ``__main__.py``; vLLM's engine arguments pass through it)."""
    s = spec.serving
    args = [f"--task={runtime.task}"]
    if s.max_model_len is not None:
        args.append(f"--max_model_len={s.max_model_len}")
    if s.dtype is not None:
        args.append(f"--dtype={s.dtype}")
    if _adapter(spec):
        assert spec.lora is not None  # _adapter: the job has a lora section
        rank = next(r for r in VLLM_LORA_RANKS if r >= spec.lora.r)
        args += [
            f"--model_dir={MODELS}/base",
            # vLLM alone serves adapters: without it the runtime would ignore --enable-lora and serve the base.
            "--backend=vllm",
            "--enable-lora",
            f"--max-lora-rank={rank}",
            f"--lora-modules={serve_name(spec)}-adapter={MODELS}/adapter",
        ]
    return args


def build_inference_service(spec: JobSpec, namespace: str, runtime: KServeRuntime) -> dict:
    """The InferenceService serving the export of ``spec`` on ``runtime`` (its task's)."""
    s = spec.serving
    amounts = {k: v for k, v in {"cpu": s.cpu, "memory": s.memory}.items() if v}
    limits = {**amounts, **({s.gpu_resource: str(s.gpu)} if s.gpu else {})}
    model = {
        "modelFormat": {"name": "huggingface"},
        "args": runtime_args(spec, runtime),
        **({} if _adapter(spec) else {"storageUri": export_uri(spec, "model")}),
        "resources": {k: v for k, v in {"requests": amounts, "limits": limits}.items() if v},
    }
    predictor = {
        "minReplicas": s.min_replicas,
        "maxReplicas": s.max_replicas,
        "model": model,
    }
    if _adapter(spec):
        # one storage initializer fetches both, each to its own directory under /mnt/models
        predictor["storageUris"] = [
            {"uri": base_uri(spec), "mountPath": f"{MODELS}/base"},
            {"uri": export_uri(spec, "adapter"), "mountPath": f"{MODELS}/adapter"},
        ]
    if _storage_secrets(spec):
        predictor["serviceAccountName"] = service_account_name(spec)
    return {
        "apiVersion": f"{ISVC_API[0]}/{ISVC_API[1]}",
        "kind": "InferenceService",
        "metadata": _metadata(spec, serve_name(spec), namespace, **{DEPLOYMENT_MODE: s.deployment_mode}),
        "spec": {"predictor": predictor},
    }


def render_serve(spec: JobSpec, namespace: str) -> RenderedServe:
    """The objects that serve the export of ``spec`` in ``namespace``, on its task's runtime (``runtime_of``).

    Raises:
        SpecError: the export cannot be served this way (every problem, one line each).
    """
    runtime = runtime_of(spec.task)
    problems = serving_problems(spec, runtime)
    if problems:
        raise SpecError(problems, "spec")
    assert runtime is not None  # serving_problems names a task without one
    return RenderedServe(build_service_account(spec, namespace), build_inference_service(spec, namespace, runtime))
