"""`kubetune render --serve`: the KServe InferenceService (and ServiceAccount) for a job's export.
Golden files; every example's objects admitted whole by KServe v0.20.0's upstream CRD
(tests/data/kserve-crds/, through tests/fakes/crds.py: schema, pruning, CEL) and its webhook rules
(tests/fakes/webhooks.py); refusals of what the schema and webhook refuse; where the export is for
each kind of output; one-line refusals of what cannot be served; no secret anywhere."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml
from fakes import crds, webhooks
from typer.testing import CliRunner

from kubetune.backends.cluster import strict
from kubetune.backends.kserve import manifests as serving
from kubetune.config import load_spec, parse_spec
from kubetune.config.tasks import entries
from kubetune.errors import KubetuneError, SpecError

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
NODE_LOCAL = (
    "output.uri: {uri!r} is in the job's node-local storage, gone with its pods, or outside its workspace claim — "
    "write the output to s3:// or hf://, or to a path under /workspace with kubernetes.storage.mode: pvc"
)
# The examples whose export cannot be served on a cluster, and the one line that says why.
REFUSED = {
    "causal-tiny-chat": NODE_LOCAL.format(uri="runs/causal-tiny-chat"),
    "sentiment-minilm": NODE_LOCAL.format(uri="runs/sentiment-minilm"),
    "sentiment-minilm-tune": NODE_LOCAL.format(uri="runs/sentiment-minilm-tune"),
}
SERVED = [pytest.param(p, id=p.stem) for p in EXAMPLES if p.stem not in REFUSED]


def _render(path: Path, overrides: list[str] | None = None) -> serving.RenderedServe:
    spec = load_spec(path, overrides)
    return serving.render_serve(spec, spec.kubernetes.namespace or "default")


def admit(isvc: dict) -> tuple[list[str], list[str]]:
    """(errors, pruned paths) of creating ``isvc``: the CRD first, then KServe's webhook, as on a cluster."""
    outcome = crds.crd("inferenceservices", "v0.20.0").admit(isvc)
    if outcome.errors:
        return outcome.errors, outcome.pruned
    return webhooks.inferenceservice_errors(outcome.stored), outcome.pruned


@pytest.mark.parametrize("path", SERVED)
def test_examples_match_golden_files(path):
    """Set UPDATE_GOLDEN=1 to rewrite them after an intended change (and review the diff)."""
    golden = GOLDEN / f"{path.stem}.inferenceservice.yaml"
    text = _render(path).to_yaml()
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with UPDATE_GOLDEN=1"
    assert text == golden.read_text()


@pytest.mark.parametrize("path", SERVED)
def test_every_example_is_admitted_whole(path):
    rendered = _render(path)
    assert admit(rendered.inference_service) == ([], [])  # pruned: a real server would drop them silently
    if rendered.service_account is not None:
        assert strict.check_model(rendered.service_account, "V1ServiceAccount", "ServiceAccount") == []


@pytest.mark.parametrize("stem, line", REFUSED.items())
def test_examples_without_a_reachable_export_are_refused_in_one_line(stem, line):
    with pytest.raises(SpecError) as e:
        _render(ROOT / "examples" / f"{stem}.yaml")
    assert e.value.lines() == [line]


def test_every_serving_field_set_is_admitted_whole():
    isvc = _render(
        ROOT / "examples" / "llama-lora.yaml",
        [
            "serving.name=chat",
            "serving.deployment_mode=Knative",
            "serving.min_replicas=0",
            "serving.max_replicas=3",
            "serving.dtype=bfloat16",
            "serving.max_model_len=2048",
            "serving.gpu_resource=amd.com/gpu",
            'kubernetes.labels={"cost": "ml"}',
            'kubernetes.annotations={"team": "a"}',
        ],
    ).inference_service
    predictor = isvc["spec"]["predictor"]
    assert (isvc["metadata"]["name"], predictor["minReplicas"], predictor["maxReplicas"]) == ("chat", 0, 3)
    assert isvc["metadata"]["annotations"] == {"team": "a", "serving.kserve.io/deploymentMode": "Knative"}
    assert predictor["model"]["resources"]["limits"]["amd.com/gpu"] == "1"
    assert "--lora-modules=chat-adapter=/mnt/models/adapter" in predictor["model"]["args"]
    assert admit(isvc) == ([], [])


def test_the_shipped_hugging_face_runtime_serves_what_kubetune_renders():
    runtimes = crds.shipped_serving_runtimes()
    definition = crds.crd("clusterservingruntimes", "v0.20.0")
    hf = next(r for r in runtimes if r["metadata"]["name"] == "kserve-huggingfaceserver")
    for runtime in runtimes:
        assert (definition.admit(runtime).errors, definition.admit(runtime).pruned) == ([], [])
    formats = {(f["name"], f.get("autoSelect")) for f in hf["spec"]["supportedModelFormats"]}
    assert ("huggingface", True) in formats  # modelFormat huggingface selects it without naming it
    # the runtime's own args name the model; kubetune's come after them and never repeat it
    assert hf["spec"]["containers"][0]["args"] == ["--model_name={{.Name}}"]


# -------------------------------------------------------- what the schema and the webhook refuse


@pytest.fixture(scope="module")
def isvc():
    return _render(ROOT / "examples" / "llama-8b-fsdp.yaml").inference_service


def _with(obj: dict, path: str, value) -> dict:
    out = copy.deepcopy(obj)
    node = out
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    node[int(keys[-1]) if isinstance(node, list) else keys[-1]] = value
    return out


@pytest.mark.parametrize(
    "path, value, expected",
    [
        (
            "spec.predictor.minReplicas",
            "1",
            'spec.predictor.minReplicas: Invalid value: "string": spec.predictor.minReplicas in body must be of '
            'type integer: "1"',
        ),
        (
            "spec.predictor.scaleMetric",
            "gpu",
            'spec.predictor.scaleMetric: Unsupported value: "gpu": supported values: "cpu", "memory", '
            '"concurrency", "rps"',
        ),
        (
            "spec.predictor.storageUris",
            [{"uri": "s3://b/base", "mountPath": "mnt/base"}],
            'spec.predictor.storageUris[0].mountPath: Invalid value: "mnt/base": spec.predictor.storageUris[0]'
            ".mountPath in body should match '^/.*'",
        ),
        (
            "spec.predictor.model.resources.limits.cpu",
            "two",
            'spec.predictor.model.resources.limits.cpu: Invalid value: "two": spec.predictor.model.resources.'
            "limits.cpu in body should match",
        ),
    ],
)
def test_the_crd_refuses_what_its_schema_refuses(isvc, path, value, expected):
    errors, _ = admit(_with(isvc, path, value))
    assert any(e.startswith(expected) for e in errors), errors


def test_the_crd_prunes_a_field_it_does_not_know(isvc):
    errors, pruned = admit(_with(isvc, "spec.predictor.model.storageURI", "s3://b/m"))
    assert (errors, pruned) == ([], ["spec.predictor.model.storageURI"])


@pytest.mark.parametrize(
    "path, value, expected",
    [
        ("spec.predictor.model.name", "m", "the 'name' field is not allowed in standard predictor"),
        (
            "spec.predictor.storageUris",
            [{"uri": "s3://b/m", "mountPath": "/mnt/models"}],
            "Setting both StorageURI and StorageURIs is not supported.",
        ),
        ("spec.predictor.minReplicas", 4, "MinReplicas cannot be greater than MaxReplicas"),
        ("spec.predictor.sklearn", {"storageUri": "s3://b/m"}, "exactly one of"),
    ],
)
def test_the_webhook_refuses_what_kserve_refuses(isvc, path, value, expected):
    errors, _ = admit(_with(isvc, path, value))
    assert any(e.startswith(expected) for e in errors), errors


def test_the_webhook_wants_a_common_parent_for_the_storage_paths():
    adapter = _render(ROOT / "examples" / "llama-lora.yaml", ["output.uri=s3://b/runs/x"]).inference_service
    assert admit(adapter) == ([], [])
    apart = _with(adapter, "spec.predictor.storageUris.1.mountPath", "/adapter")
    assert admit(apart)[0] == [
        "storage paths must have a common parent directory. Current paths: ['/mnt/models/base', '/adapter'] have "
        "no common parent beyond root"
    ]


# -------------------------------------------------------------------- what is served, from where

BASE = {
    "name": "j",
    "task": "causal-lm",
    "model": {"uri": "hf://org/base"},
    "data": {"train": "hf://org/d"},
    "output": {"uri": "s3://bucket/runs/j"},
    "kubernetes": {"secrets": {"s3": "s3-keys", "hf_token": {"name": "hf", "key": "HF_TOKEN"}}},
}


def _spec(**sections) -> object:
    raw = copy.deepcopy(BASE)
    for key, value in sections.items():
        raw[key] = value if not isinstance(value, dict) else {**raw.get(key, {}), **value}
    return parse_spec(raw)


@pytest.mark.parametrize(
    "sections, storage",
    [
        ({}, "s3://bucket/runs/j/model"),
        ({"output": {"uri": "hf://org/tuned"}}, "hf://org/tuned"),
        (
            {"output": {"uri": "runs/j"}, "kubernetes": {"storage": {"mode": "pvc"}}},
            "pvc://j-workspace/runs/j/model",
        ),
        (
            {"output": {"uri": "/workspace/out/j/"}, "kubernetes": {"storage": {"mode": "pvc", "existing_claim": "c"}}},
            "pvc://c/out/j/model",
        ),
    ],
)
def test_the_storage_uri_is_the_export_where_the_job_wrote_it(sections, storage):
    isvc = serving.render_serve(_spec(**sections), "ns").inference_service
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == storage
    assert admit(isvc) == ([], [])


def test_an_adapter_is_served_on_its_base_model_through_vllm():
    spec = _spec(
        lora={"r": 24}, serving={"lora": "adapter", "gpu": 1}, model={"uri": "hf://org/base", "revision": "v2"}
    )
    rendered = serving.render_serve(spec, "ns")
    predictor = rendered.inference_service["spec"]["predictor"]
    assert predictor["storageUris"] == [
        {"uri": "hf://org/base:v2", "mountPath": "/mnt/models/base"},
        {"uri": "s3://bucket/runs/j/adapter", "mountPath": "/mnt/models/adapter"},
    ]
    assert "storageUri" not in predictor["model"]
    assert predictor["model"]["args"] == [
        "--task=text_generation",
        "--model_dir=/mnt/models/base",
        "--backend=vllm",
        "--enable-lora",
        "--max-lora-rank=32",  # vLLM's next rank above lora.r
        "--lora-modules=j-adapter=/mnt/models/adapter",
    ]
    # both Secrets by name on the ServiceAccount the predictor runs as: the base from the Hub, the adapter from S3
    assert rendered.service_account["secrets"] == [{"name": "s3-keys"}, {"name": "hf"}]
    assert predictor["serviceAccountName"] == rendered.service_account["metadata"]["name"] == "j-storage"


def test_a_classifier_is_served_as_sequence_classification():
    spec = _spec(task="sequence-classification")
    args = serving.render_serve(spec, "ns").inference_service["spec"]["predictor"]["model"]["args"]
    assert args == ["--task=sequence_classification"]


@pytest.mark.parametrize(
    "sections, line",
    [
        (
            {"serving": {"lora": "adapter", "gpu": 1}},
            "serving.lora: adapter needs a job with a lora section (a full fine-tune exports no adapter) — remove it",
        ),
        (
            {"lora": {}, "serving": {"lora": "adapter"}},
            "serving.lora: adapter is served by the runtime's vLLM backend, which needs a GPU — set serving.gpu: 1, "
            "or serving.lora: merged",
        ),
        (
            {"lora": {}, "task": "sequence-classification", "serving": {"lora": "adapter", "gpu": 1}},
            "serving.lora: adapter — the runtime serves no LoRA adapter of a sequence_classification model (vLLM's "
            "LoRA is for generation) — use serving.lora: merged",
        ),
        (
            {"lora": {}, "output": {"uri": "hf://org/tuned"}, "serving": {"lora": "adapter", "gpu": 1}},
            "serving.lora: adapter — KServe reads an hf:// repository whole, not its adapter/ folder — use "
            "serving.lora: merged, or an s3:// output",
        ),
        (
            {
                "lora": {},
                "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
                "serving": {"lora": "adapter", "gpu": 1},
            },
            "serving.lora: adapter needs the base model where KServe reads it (hf://, s3://, or a path on the "
            "workspace claim), and model.uri is 'pkg://kubetune/assets/tiny-llama' — use serving.lora: merged",
        ),
        (
            {"output": {"uri": "/data/runs/j"}, "kubernetes": {"storage": {"mode": "pvc"}}},
            NODE_LOCAL.format(uri="/data/runs/j"),
        ),
    ],
)
def test_what_cannot_be_served_is_refused_in_one_line(sections, line):
    with pytest.raises(SpecError) as e:
        serving.render_serve(_spec(**sections), "ns")
    assert e.value.lines() == [line]


def test_a_task_whose_export_the_runtime_does_not_serve_is_refused(monkeypatch):
    monkeypatch.setattr(serving, "runtime_of", lambda task: None)  # a task whose entry names no KServe runtime
    with pytest.raises(SpecError) as e:
        serving.render_serve(_spec(), "ns")
    assert e.value.lines() == [
        "task causal-lm names no KServe runtime for its export (TaskEntry.kserve), so kubetune does not serve it "
        "on KServe's Hugging Face runtime — serve it with your own runtime"
    ]


@pytest.mark.parametrize(
    "serving_section, problem",
    [
        ({"min_replicas": 3, "max_replicas": 2}, "serving.min_replicas (3) must be <= serving.max_replicas (2)"),
        ({"name": "Chat"}, "must be 1-52 lowercase letters"),
        ({"min_replicas": 0}, "serving.min_replicas 0 (scale to zero) needs serving.deployment_mode: Knative"),
        ({"cpu": "two"}, "'two' is not a Kubernetes quantity"),
        ({"lora": "both"}, "serving.lora"),
        ({"replicas": 2}, "serving.replicas"),
    ],
)
def test_the_serving_section_is_checked(serving_section, problem):
    with pytest.raises(KubetuneError) as e:
        _spec(serving=serving_section)
    assert problem in str(e.value)


def test_every_task_served_on_kserve_is_served_by_kubetune_serve_over_the_same_kind_of_protocol():
    # the runtime's text_generation speaks OpenAI's API, as `kubetune serve` does for the same export
    from kubetune import tasks
    from kubetune.inference.seam import OPENAI

    for name, entry in entries().items():
        if entry.kserve is not None:
            inference = tasks.get(name).inference
            assert (entry.kserve.task == "text_generation") == (inference.routes is OPENAI), name
            assert entry.kserve.adapters == inference.adapters, name


# ------------------------------------------------------------------------------- secrets, warnings


def test_no_secret_is_rendered_only_referenced(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-1234")
    monkeypatch.setenv("HF_TOKEN", "hf_tokenvalue5678")
    spec = _spec(lora={}, serving={"lora": "adapter", "gpu": 1})
    text = serving.render_serve(spec, "ns").to_yaml()
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "InferenceService"]
    assert "s3cr3t-value-1234" not in text and "hf_tokenvalue5678" not in text
    for doc in docs:
        assert not {"data", "stringData"} & set(doc), doc["kind"]
    assert "AWS_SECRET_ACCESS_KEY" not in text and "env" not in docs[1]["spec"]["predictor"]["model"]


def test_the_s3_endpoint_warning_says_how_to_annotate_the_secret():
    spec = _spec(s3={"endpoint_url": "http://minio.minio.svc.cluster.local:9000"})
    assert serving.serve_warnings(spec, "team-a") == [
        "KServe's storage initializer takes the S3 endpoint from the annotations of Secret s3-keys, not from "
        "AWS_ENDPOINT_URL (AWS S3 needs none): kubectl -n team-a annotate --overwrite secret s3-keys "
        "serving.kserve.io/s3-endpoint=minio.minio.svc.cluster.local:9000 serving.kserve.io/s3-usehttps=0"
    ]
    bare = _spec(kubernetes={"secrets": {}})
    assert serving.render_serve(bare, "ns").service_account is None
    assert serving.serve_warnings(bare, "ns")[0].startswith("kubernetes.secrets.s3 is not set")


def test_render_serve_prints_the_objects_and_the_warnings():
    from kubetune.cli import app

    result = CliRunner().invoke(app, ["render", "--serve", str(ROOT / "examples" / "llama-8b-fsdp.yaml")])
    assert result.exit_code == 0, result.output
    assert [d["kind"] for d in yaml.safe_load_all(result.stdout)] == ["ServiceAccount", "InferenceService"]
    assert "warning: KServe's storage initializer takes the S3 endpoint" in result.stderr
    refused = CliRunner().invoke(app, ["render", "--serve", str(ROOT / "examples" / "sentiment-minilm.yaml")])
    assert refused.exit_code != 0 and "error: output.uri:" in refused.stderr
