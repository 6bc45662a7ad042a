"""Hostile and careless job specs: bounded time and memory, one short line per problem."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import pytest
import yaml

from kubetune.config import load_spec, parse_spec
from kubetune.errors import SpecError

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
GOOD = "name: t\nmodel: {uri: hf://org/m}\ndata: {train: t.csv}\noutput: {uri: out}\n"


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The 350-byte "billion laughs": each level is `width` aliases of the one below."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return GOOD + "\n".join(lines) + "\n"


def _problems(tmp_path, text: str) -> list[str]:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_spec(path)
    lines = e.value.lines()
    assert all("\n" not in line and len(line) < 400 for line in lines), lines
    return lines


CASES = [
    # (what, spec text, expected fragment of the first problem)
    ("alias bomb", alias_bomb(), "aliases expand to more than 100,000 values"),
    ("recursive alias", GOOD + "x: &x [*x]\n", "recursive structure"),
    (
        "duplicate key",
        GOOD + "training:\n  epochs: 1\n  epochs: 3\n",
        "duplicate key 'epochs' (first on line 6); YAML keys must be unique",
    ),
    ("duplicate section", GOOD + "name: u\n", "duplicate key 'name' (first on line 1)"),
    (
        "weight_decay .inf",
        GOOD + "training: {weight_decay: .inf}\n",
        "training.weight_decay: Input should be a finite number",
    ),
    (
        "learning_rate .nan",
        GOOD + "training: {learning_rate: .nan}\n",
        "training.learning_rate: Input should be a finite number",
    ),
    ("lora alpha -.inf", GOOD + "lora: {alpha: -.inf}\n", "lora.alpha: Input should be a finite number"),
    (
        "checkpoint_minutes .inf",
        GOOD + "training: {checkpoint_minutes: .inf}\n",
        "training.checkpoint_minutes: Input should be a finite number",
    ),
    ("epochs 1e9", GOOD + "training: {epochs: 1e9}\n", "YAML reads this as a string (write 1000000000, or 1.0e+9"),
    (
        "a huge number",
        GOOD + "training: {epochs: " + "9" * 200_000 + "}\n",
        "a value cannot be read: Exceeds the limit",
    ),
    ("a huge value", GOOD + "training: {epochs: " + "x" * 200_000 + "}\n", "training.epochs"),
    ("a huge key", GOOD + "training:\n  ? " + "k" * 100_000 + "\n  : 1\n", "unknown key"),
    (
        "empty output",
        GOOD.replace("uri: out", "uri: ''"),
        "output.uri: is empty, which would write into the current directory",
    ),
    ("root output", GOOD.replace("uri: out", "uri: /"), "is the filesystem root or a home directory itself"),
    ("home output", GOOD.replace("uri: out", "uri: '~'"), "is the filesystem root or a home directory itself"),
    (
        "other home output",
        GOOD.replace("uri: out", "uri: '~alice/'"),
        "is the filesystem root or a home directory itself",
    ),
    (
        "bucket root output",
        GOOD.replace("uri: out", "uri: s3://bucket/"),
        "is a whole bucket — name a prefix inside it",
    ),
    ("label key", GOOD + "kubernetes: {labels: {'team name': x}}\n", "key 'team name' is not a valid Kubernetes key"),
    ("label value", GOOD + "kubernetes: {labels: {team: 'a b'}}\n", "label value 'a b' (key 'team')"),
    ("label prefix", GOOD + "kubernetes: {labels: {'Example.COM/x': y}}\n", "its prefix must be a DNS subdomain"),
    ("annotation key", GOOD + "kubernetes: {annotations: {'-bad': y}}\n", "key '-bad' is not a valid Kubernetes key"),
    ("node selector", GOOD + "kubernetes: {node_selector: {'gpu/': y}}\n", "key 'gpu/' is not a valid Kubernetes key"),
    (
        "service account",
        GOOD + "kubernetes: {service_account: Runner_1}\n",
        "'Runner_1' is not a valid ServiceAccount name",
    ),
    (
        "secret name",
        GOOD + "kubernetes: {secrets: {hf_token: {name: 'HF Secret', key: t}}}\n",
        "'HF Secret' is not a valid Secret name",
    ),
    # issue 30: integers that size memory or loops, nesting, checks the workers made 20 s later
    (
        "epochs 10^30",
        GOOD + "training: {epochs: " + "1" + "0" * 30 + "}\n",
        "training.epochs: must be at most 2,147,483,647",
    ),
    ("batch 2^63", GOOD + "training: {batch_size: 9223372036854775808}\n", "training.batch_size: must be at most"),
    ("nested 1000 deep", GOOD + "x: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n", "nested deeper than 32 levels"),
    ("nested list 1000 deep", GOOD + "x: " + "[" * 1000 + "]" * 1000 + "\n", "nested deeper than 32 levels"),
    (
        "fsdp with QLoRA",
        GOOD + "distributed: {strategy: fsdp}\nlora: {quantization: 4bit}\n",
        "spec: lora.quantization (QLoRA) under distributed.strategy fsdp is not supported yet",
    ),
]

# Every field that holds a URL (tests below check that each refuses credentials).
URL_FIELDS = {
    "model.uri": "model: {{uri: '{}'}}",
    "data.train": "data: {{train: '{}'}}",
    "data.eval": "data: {{train: t.csv, eval: '{}'}}",
    "output.uri": "output: {{uri: '{}'}}",
    "s3.endpoint_url": "s3: {{endpoint_url: '{}'}}",
    "tracking.mlflow.uri": "tracking: {{mlflow: {{uri: '{}'}}}}",
}


@pytest.mark.parametrize("what, text, expected", CASES, ids=[c[0] for c in CASES])
def test_hostile_spec_is_one_short_line(tmp_path, what, text, expected):
    t0 = time.monotonic()
    lines = _problems(tmp_path, text)
    assert time.monotonic() - t0 < 5  # (today's main took minutes, or never finished, on the alias bomb)
    assert expected in lines[0], lines


def test_alias_bomb_stays_small_through_the_real_cli(tmp_path):
    """`kubetune validate` on the bomb under a 1.5 GiB address-space limit (it grew past 2.7 GB)."""
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(path.read_bytes()) < 600  # the bomb itself is about 350 bytes

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))

    proc = subprocess.run(
        [sys.executable, "-m", "kubetune", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: spec: ") and "aliases expand" in proc.stderr


def test_an_oversized_or_special_spec_file(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(GOOD + "# " + "x" * (1 << 20) + "\n")
    assert "larger than 1024 KiB" in _problems(tmp_path, big.read_text())[0]
    import os

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(SpecError, match="is not a regular file"):
        load_spec(fifo)
    (tmp_path / "latin.yaml").write_bytes(GOOD.encode() + b"# caf\xe9\n")
    with pytest.raises(SpecError, match=r"is not UTF-8 \(byte \d+\)"):
        load_spec(tmp_path / "latin.yaml")


def test_many_problems_are_capped():
    raw = yaml.safe_load(GOOD)
    raw["training"] = {f"k{i}": i for i in range(5000)}
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    lines = e.value.lines()
    assert len(lines) == 21 and lines[-1] == "spec: ... and 4980 more problems — fix the ones above first"


def test_legitimate_aliases_and_set_values_still_work(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(GOOD.replace("output: {uri: out}", "output: {uri: &o out}") + "kubernetes: {labels: {run: *o}}\n")
    assert load_spec(path, ["training.learning_rate=1e-4", "training.epochs=2"]).kubernetes.labels == {"run": "out"}
    with pytest.raises(SpecError, match="aliases expand"):
        load_spec(
            path,
            [
                "kubernetes.annotations="
                + "{a: &a ["
                + ",".join(["x"] * 400)
                + "], b: ["
                + ",".join(["*a"] * 400)
                + "]}"
            ],
        )


def test_render_refuses_an_invalid_namespace(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(GOOD)
    proc = subprocess.run(
        [sys.executable, "-m", "kubetune", "render", str(path), "-n", "Team_A"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "error: --namespace: 'Team_A' is not a valid namespace: a DNS label of lowercase letters, digits and '-', "
        "at most 63 characters — pass a valid namespace, e.g. -n kubeflow"
    )


@pytest.mark.parametrize("key", list(URL_FIELDS))
@pytest.mark.parametrize(
    "url", ["http://alice:PASSWORD@host:5000/x", "s3://AKIAKEY:PASSWORD@bucket/p", "hf://PASSWORD@o/m"]
)
def test_credentials_in_a_url_field_are_refused_without_being_shown(tmp_path, key, url):
    section = key.split(".")[0]
    base = "\n".join(line for line in GOOD.splitlines() if not line.startswith(section + ":"))
    lines = _problems(tmp_path, base + "\n" + URL_FIELDS[key].format(url) + "\n")
    assert len(lines) == 1 and lines[0].startswith(f"{key}: holds a user name or password"), lines
    assert "credentials never go in the spec" in lines[0] and "S3CRETpw" not in lines[0]
    assert "***@" in lines[0]  # the value is shown, its credentials are not


def test_every_url_field_of_the_spec_refuses_credentials():
    """The mechanism, not the cases: every field named like a URL, in every section and every
    task's data section, has the Uri type (a new URL field without it fails here)."""
    from pydantic import BaseModel

    from kubetune.config import spec_model
    from kubetune.config.base import _no_userinfo
    from kubetune.config.load import _submodels

    found = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            subs = _submodels(field.annotation)
            for sub in subs:
                walk(sub, f"{prefix}{name}.")
            if not subs and (name in ("uri", "train", "eval") or name.endswith(("_url", "_uri"))):
                found[prefix + name] = any(getattr(m, "func", None) is _no_userinfo for m in field.metadata) or any(
                    getattr(m, "func", None) is _no_userinfo
                    for a in getattr(field.annotation, "__args__", ())
                    for m in getattr(a, "__metadata__", ())
                )

    walk(spec_model(), "")  # the registered model: every task's data section and own section too
    assert set(URL_FIELDS) <= set(found), found
    assert all(found.values()), [k for k, ok in found.items() if not ok]


def test_validate_refuses_what_needs_a_gpu_on_a_machine_without_one(tmp_path):
    import torch
    from typer.testing import CliRunner

    from kubetune.cli import app

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: the job can run here")
    for extra, field in [
        ("distributed: {strategy: fsdp, fsdp: {cpu_offload: true}}\n", "distributed.fsdp.cpu_offload"),
        ("lora: {quantization: 4bit}\n", "lora.quantization"),
    ]:
        spec = tmp_path / "job.yaml"
        spec.write_text(GOOD + extra)
        r = CliRunner().invoke(app, ["validate", str(spec)])
        assert r.exit_code == 2 and r.stderr.splitlines() == [
            f"error: {field}: {r.stderr.split(': ', 2)[2].strip()}"
        ], r.stderr
        assert "needs a CUDA GPU and this machine has none" in r.stderr
        # GPU pods (resources.gpu) can run it: validate says ok on any machine
        spec.write_text(GOOD + extra + "resources: {gpu: 1}\n")
        r = CliRunner().invoke(app, ["validate", str(spec)])
        assert r.exit_code == 0 and r.stdout == "ok\n", r.stderr


@pytest.mark.parametrize(
    "text, expected",
    [
        ("https://u:p@ss@h.example/x?a=b@c", "https://***@h.example/x?a=b@c"),  # the tail 'ss@' leaked
        ("see http://a:b@h and mail x@y.z", "see http://***@h and mail x@y.z"),
    ],
)
def test_redact_masks_a_password_holding_at_signs_whole(text, expected):
    from kubetune.errors import redact

    assert redact(text) == expected
