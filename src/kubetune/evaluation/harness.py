"""lm-evaluation-harness on a causal LM export, in this process or as one rank of several.

The harness's own ``HFLM`` scores the model (so the scores are the harness's: the same requests, batching,
log-likelihoods and generation as ``lm_eval --model hf``), handed the model kubetune loaded (its checks, its
one-line errors; a run directory, s3:// or hf:// export). Under several processes each rank scores its share
of the requests and rank 0 gathers them: the harness's data-parallel evaluation, with torch.distributed's
process group (gloo on a CPU, NCCL on a GPU) instead of accelerate's, which ``HFLM`` sets up only for a model
it loads itself.
"""

from __future__ import annotations

import difflib
import logging
from pathlib import Path

from kubetune.errors import KubetuneError


def task_manager(include_path: str | None = None, names: list[str] | None = None):
    """The harness's task registry, with the task YAML under ``include_path`` (a directory) added. When every
    one of ``names`` is a task there, the registry is that directory alone: indexing the harness's own 14,685
    task files took 5.9 s here, in every process.

    Raises:
        KubetuneError: the harness is not installed, or ``include_path`` is not a directory.
    """
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise KubetuneError(
            "kubetune eval needs lm-evaluation-harness, which is not installed",
            field="--tasks",
            fix="pip install 'kubetune[eval]'",
        ) from None

    if include_path is not None and not Path(include_path).is_dir():
        raise KubetuneError(
            f"{include_path} is not a directory",
            field="--include-path",
            fix="give a directory of the harness's task YAML files",
        )
    if include_path is not None and names is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)  # the directory alone: fast
        if set(names) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_path)


def check_tasks(names: list[str], manager) -> None:
    """One line for the first name the registry does not know, with the closest names it does."""
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            raise KubetuneError(
                f"{name!r} is not a task of lm-evaluation-harness {_version()}"
                + (f" (closest: {', '.join(close)})" if close else ""),
                field="--tasks",
                fix="give the harness's task names (`lm-eval ls tasks`), or task YAML with --include-path DIR",
            )


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _lm(model, tokenizer, batch_size: int, rank: int, world_size: int):
    """``HFLM`` over the loaded model, one rank of ``world_size``."""
    import torch
    import torch.distributed as dist
    from lm_eval.models.huggingface import HFLM

    class KubetuneLM(HFLM):
        # the harness's distributed primitives (evaluator.evaluate), over torch.distributed's default group
        def all_gather(self, tensor):
            if self.world_size <= 1:
                return tensor
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor)
            return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)  # as accelerate's gather

        def gather_object(self, obj, dst=0):
            if self.world_size <= 1:
                return [obj]
            out = [None] * self.world_size if self.rank == dst else None
            dist.gather_object(obj, out, dst=dst)
            return out

        def barrier(self):
            if self.world_size > 1:
                dist.barrier()

    lm = KubetuneLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    lm._rank, lm._world_size = rank, world_size
    return lm


def evaluate(
    model_uri: str,
    tasks: list[str],
    *,
    include_path: str | None = None,
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 1,
    chat: bool = False,
    log_samples: bool = False,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    s3=None,
) -> dict | None:
    """The harness's results for ``tasks`` on the causal LM at ``model_uri``: its ``simple_evaluate`` dict
    (``results``, ``n-samples``, ``configs``; ``samples`` with ``log_samples``) on rank 0, None on the others.

    Raises:
        KubetuneError: not a causal LM, an unknown task, a task whose data cannot be had.
    """
    import lm_eval
    import torch
    from transformers import AutoModelForCausalLM

    from kubetune.inference import causal
    from kubetune.inference import model as M

    manager = task_manager(include_path, tasks)
    check_tasks(tasks, manager)
    path = M.model_path(model_uri, s3)
    M.expect(path, causal.is_causal_lm, "causal LM")
    tokenizer = M.load_tokenizer(path)
    model = M.load_model(AutoModelForCausalLM, path)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    model = model.to(device).eval()
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    try:
        return lm_eval.simple_evaluate(
            model=_lm(model, tokenizer, batch_size, rank, world_size),
            tasks=tasks,
            task_manager=manager,
            num_fewshot=num_fewshot,
            limit=limit,
            apply_chat_template=chat,
            log_samples=log_samples,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except (ConnectionError, OSError) as e:  # a task's data on the Hub, offline
        raise KubetuneError(
            f"the data of {', '.join(tasks)} cannot be had here: {' '.join(str(e).split())[:200]}",
            field="--tasks",
            fix="put the task's data in local files and give its task YAML with --include-path",
        ) from None
