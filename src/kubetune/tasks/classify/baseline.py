"""A TF-IDF + logistic-regression baseline on exactly the same train/eval split."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from kubetune.paths import cache_root, write_atomic

log = logging.getLogger(__name__)

METHOD = "TF-IDF (1-2 grams, sublinear tf) + logistic regression (C=10)"
CACHE_VERSION = "1"


def tfidf_baseline(frames) -> dict | None:
    """Fit on ``frames.train``, score on ``frames.eval``; the result is cached under the split's
    content (a rerun on the same split, a resumed run, reads it instead of fitting again).

    Returns:
        accuracy, macro-F1 and the method; None (with one warning line saying why) when the fit
        cannot fit in memory: estimated from the vocabulary and the classes before fitting, or a
        MemoryError while fitting.
    """
    from importlib.metadata import version

    path = cache_root() / "baseline" / f"{_split_key(frames, version('scikit-learn'))}.json"
    try:
        cached = json.loads(path.read_text())
        if isinstance(cached, dict) and cached.get("method") == METHOD:
            return {"accuracy": float(cached["accuracy"]), "f1_macro": float(cached["f1_macro"]), "method": METHOD}
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: fit again
        pass
    result = _fit(frames)
    if result is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(result))
        except OSError:  # a read-only or full cache: the result stands, the next run fits again
            pass
    return result


def _split_key(frames, version: str) -> str:
    import pandas as pd

    h = hashlib.sha256(f"v{CACHE_VERSION}:{METHOD}:sklearn {version}".encode())
    for part in (frames.train, frames.eval):
        cols = [c for c in ("text", "text_pair", "label") if c in part]
        h.update(f"{cols}:{len(part)}".encode())
        h.update(pd.util.hash_pandas_object(part[cols], index=False).to_numpy().tobytes())
    return h.hexdigest()[:32]


def _fit(frames) -> dict | None:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, f1_score
    from threadpoolctl import threadpool_limits

    def texts(df):
        return (df["text"] + " [SEP] " + df["text_pair"]) if "text_pair" in df else df["text"]

    n_classes = int(frames.train["label"].nunique())
    try:
        vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1)
        x_train = vec.fit_transform(texts(frames.train))
        need = fit_bytes(x_train.shape[0], x_train.shape[1], n_classes)
        available = available_memory()
        # Half of what is free: the estimate is rough, and the fine-tuned model is still in memory.
        if available is not None and need > available / 2:
            log.warning(
                "baseline skipped: logistic regression over %d classes x %d TF-IDF features needs about %.1f GiB, "
                "and %.1f GiB of memory is available",
                n_classes,
                x_train.shape[1],
                need / 2**30,
                available / 2**30,
            )
            return None
        # One BLAS thread: the fit is faster on one than on two (benchmarks/README.md, a short run's fixed
        # cost), and the solver's path, so the accuracy's last digits, no longer depends on the core count.
        with threadpool_limits(1):
            clf = LogisticRegression(max_iter=1000, C=10.0).fit(x_train, frames.train["label"])
        pred = clf.predict(vec.transform(texts(frames.eval)))
    except MemoryError:
        log.warning("baseline skipped: out of memory fitting TF-IDF + logistic regression over %d classes", n_classes)
        return None
    return {
        "accuracy": float(accuracy_score(frames.eval["label"], pred)),
        "f1_macro": float(f1_score(frames.eval["label"], pred, average="macro")),
        "method": METHOD,
    }


def fit_bytes(n_samples: int, n_features: int, n_classes: int) -> int:
    """Estimated peak memory of the lbfgs logistic-regression fit, in bytes.

    The coefficients are classes x (features + 1) float64 (one row for two classes); L-BFGS keeps
    10 pairs of correction vectors of that size plus a few gradients and copies (about 30 in all),
    and each iteration holds the scores and probabilities of every training row for every class.
    """
    rows = n_classes if n_classes > 2 else 1
    return 8 * (30 * rows * (n_features + 1) + 3 * n_samples * n_classes)


def available_memory() -> int | None:
    """Bytes this process can still allocate: MemAvailable, or less under a cgroup memory limit
    (a Kubernetes pod); None where neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            cap = Path(limit).read_text().strip()
            if cap != "max" and int(cap) < 2**60:
                found.append(max(0, int(cap) - int(Path(usage).read_text().strip())))
            break
        except (OSError, ValueError):
            continue
    return min(found) if found else None
