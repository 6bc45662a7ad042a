"""Inference on an exported model through the transformers pipeline."""

from __future__ import annotations

from pathlib import Path

from kubetune import providers
from kubetune.errors import KubetuneError


def pull(uri: str, dest: Path | None = None) -> Path:
    """Download and verify an exported artifact (s3:// needs its complete manifest; hf:// a repo).

    Returns:
        The local directory.
    """
    scheme = providers.parse_uri(uri).scheme
    if scheme == "s3":
        from kubetune.data.tokenize import cache_root
        from kubetune.providers import s3

        loc = s3.Location.parse(uri, "MODEL")
        dest = dest or cache_root() / "pulled" / loc.bucket / loc.key.strip("/")
        return s3.download(uri.rstrip("/") + "/", dest, field="MODEL", require_manifest=True)
    if scheme == "hf" and dest is not None:
        from kubetune.artifacts import hub

        return hub.pull(uri, dest)
    if dest is not None:
        raise KubetuneError(f"{uri!r} is already local", field="URI", fix="pull takes s3:// or hf:// URIs")
    return providers.resolve(uri, kind="model", field="MODEL")


def model_path(uri: str) -> Path:
    """Accept a job's output (uses its ``model/``) or a model directory itself; s3:// and hf://
    artifacts are downloaded (and verified) first."""
    path = pull(uri)
    if (path / "model" / "config.json").exists():
        return path / "model"
    if (path / "config.json").exists():
        return path
    raise KubetuneError(f"{uri!r} holds no exported model (no config.json, no model/config.json)", field="MODEL", fix="pass a job's output.uri or its model/ directory")


def is_causal_lm(path: Path) -> bool:
    """True when the exported model at ``path`` is a causal LM (generates text)."""
    import json

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or [])


def generate(uri: str, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.0, chat: bool | None = None, seed: int = 0) -> list[dict]:
    """Continue each prompt with a causal LM; returns ``[{prompt, completion}]`` in input order.

    Args:
        chat: render each prompt as a user turn with the tokenizer's chat template (the template the
            model was trained with, saved beside it); default: when the tokenizer has one.
        temperature: 0 = greedy decoding; above 0 samples (seeded by ``seed``).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    path = model_path(uri)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat and not getattr(tokenizer, "chat_template", None):
        raise KubetuneError(f"the tokenizer in {path} has no chat template", field="--chat", fix="drop --chat to complete the raw prompt")
    results = []
    for prompt in prompts:
        if use_chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
            enc = tokenizer(text, add_special_tokens=False, return_tensors="pt")  # the template holds BOS
        else:
            enc = tokenizer(prompt, return_tensors="pt")
        enc = {k: v.to(device) for k, v in enc.items()}
        torch.manual_seed(seed)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling)
        completion = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        results.append({"prompt": prompt, "completion": completion})
    return results


def predict(uri: str, texts: list[str], batch_size: int = 32) -> list[dict]:
    """Classify ``texts``; returns ``[{text, label, score}]`` in input order."""
    import torch
    import transformers
    from transformers import pipeline

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    path = model_path(uri)
    clf = pipeline("text-classification", model=str(path), tokenizer=str(path), device=0 if torch.cuda.is_available() else -1)
    results = clf(texts, batch_size=batch_size, truncation=True)
    return [{"text": t, "label": r["label"], "score": float(r["score"])} for t, r in zip(texts, results)]
