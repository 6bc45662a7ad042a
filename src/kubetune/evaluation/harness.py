"""lm-evaluation-harness on a causal LM export, in this process or as one rank of several.

The harness's own ``HFLM`` scores the model (so the scores are the harness's: the same requests, batching,
log-likelihoods and generation as ``lm_eval --model hf``), handed the model kubetune loaded (its checks, its
one-line errors; a run directory, s3:// or hf:// export). Under several processes each rank scores its share
of the requests and rank 0 gathers them: the harness's data-parallel evaluation, with torch.distributed's
process group (gloo on a CPU, NCCL on a GPU) instead of accelerate's, which ``HFLM`` sets up only for a model
it loads itself.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
from pathlib import Path

from kubetune.errors import KubetuneError


def task_manager(include_path: str | None = None, names: list[str] | None = None, field: str = "--tasks", s3=None):
    """The harness's task registry, with the task YAML under ``include_path`` (a directory, or an s3:// prefix;
    s3:// data files in the YAML are fetched too, through ``s3``: ``suites.stage``) added. When every one of
    ``names`` is a task there, the registry is that directory alone: indexing the harness's own 14,685 task files
    took 5.9 s here, in every process.

    Raises:
        KubetuneError: the harness is not installed, ``include_path`` is not a directory, an s3:// object cannot
            be read.
    """
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise KubetuneError(
            "evaluation with lm-evaluation-harness needs the harness, which is not installed",
            field=field,
            fix="pip install 'kubetune[eval]'",
        ) from None

    from kubetune.evaluation.suites import stage

    where = "--include-path" if field.startswith("--") else "evaluation.include_path"
    include_path = stage(include_path, s3, field=where)
    if include_path is not None and not Path(include_path).is_dir():
        raise KubetuneError(
            f"{include_path} is not a directory",
            field="--include-path" if field.startswith("--") else "evaluation.include_path",
            fix="give a directory of the harness's task YAML files",
        )
    if include_path is not None and names is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)  # the directory alone: fast
        if set(names) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_path)


def check_tasks(names: list[str], manager, field: str = "--tasks") -> None:
    """One line for the first name the registry does not know, with the closest names it does."""
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            raise KubetuneError(
                f"{name!r} is not a task of lm-evaluation-harness {version()}"
                + (f" (closest: {', '.join(close)})" if close else ""),
                field=field,
                fix="give the harness's task names (`lm-eval ls tasks`), or task YAML with "
                + ("--include-path DIR" if field.startswith("--") else "evaluation.include_path"),
            )


def version() -> str:
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
    adapter: bool = False,
) -> dict | None:
    """The harness's results for ``tasks`` on the causal LM at ``model_uri``: its ``simple_evaluate`` dict
    (``results``, ``n-samples``, ``configs``; ``samples`` with ``log_samples``) on rank 0, None on the others.
    ``adapter``: a LoRA export scored as its base model plus ``adapter/``, unmerged (as ``peft=`` in the harness).

    Raises:
        KubetuneError: not a causal LM, an unknown task, a task whose data cannot be had.
    """
    import torch

    from kubetune.inference import causal
    from kubetune.inference import model as M

    manager = task_manager(include_path, tasks, s3=s3)
    check_tasks(tasks, manager)
    path = M.model_path(model_uri, s3)
    adapter_dir = None
    if adapter:
        path, adapter_dir = M.adapter_beside(path)
    M.expect(path, causal.is_causal_lm, "causal LM")
    model, tokenizer = causal.load_causal_lm(path, adapter_dir)  # with ``adapter_dir``: unmerged, as ``peft=``
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    model = model.to(device).eval()
    return run(
        model,
        tokenizer,
        tasks,
        manager,
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=batch_size,
        chat=chat,
        log_samples=log_samples,
        seed=seed,
        rank=rank,
        world_size=world_size,
    )


def run(
    model,
    tokenizer,
    tasks: list[str],
    manager,
    *,
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 1,
    chat: bool = False,
    gen_kwargs: dict | None = None,
    log_samples: bool = False,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    field: str = "--tasks",
    quiet: bool = False,
) -> dict | None:
    """``simple_evaluate`` of ``tasks`` on a loaded causal LM (a model in training too: a PEFT model, in eval
    mode), this process one rank of ``world_size`` (every rank calls it): the results on rank 0, None elsewhere.
    ``quiet``: without the harness's progress bars (in a training job's log, each evaluation is one line).

    Raises:
        KubetuneError: a task's data cannot be had (``field`` names where the tasks were given).
    """
    import lm_eval

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    try:
        with _quiet() if quiet else contextlib.nullcontext(), _no_git():
            return lm_eval.simple_evaluate(
                model=_lm(model, tokenizer, batch_size, rank, world_size),
                tasks=tasks,
                task_manager=manager,
                num_fewshot=num_fewshot,
                limit=limit,
                apply_chat_template=chat,
                gen_kwargs=dict(gen_kwargs) if gen_kwargs else None,
                log_samples=log_samples,
                random_seed=seed,
                numpy_random_seed=seed % 2**32,  # numpy's range, as training seeds it (recipe.seed_everything)
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
    except (ConnectionError, OSError) as e:  # a task's data on the Hub, offline
        raise _no_data(tasks, e, field) from None


@contextlib.contextmanager
def _quiet():
    """The harness's progress bars (tqdm, on stderr) kept out of a training job's log."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


@contextlib.contextmanager
def _no_git():
    """The harness records the git commit of the working directory with ``git describe``, which prints "fatal: not
    a git repository" into the log of any job that does not run in a checkout (a pod, a run directory): the
    record is left empty instead (lm_eval.loggers.utils.get_git_commit_hash; kubetune records the harness's version)."""
    import lm_eval.evaluator as evaluator

    saved = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = saved


def _no_data(tasks: list[str], e: Exception, field: str) -> KubetuneError:
    return KubetuneError(
        f"the data of {', '.join(tasks)} cannot be had here: {' '.join(str(e).split())[:200]}",
        field=field,
        fix="put the task's data in local files and give its task YAML with "
        + ("--include-path" if field.startswith("--") else "evaluation.include_path"),
    )


def check_data(tasks: list[str], manager, field: str) -> dict:
    """Each task loaded with its documents (what the first evaluation would do), so that a task whose data needs an
    unreachable network, or whose data files cannot be read as its YAML says, fails in one line before training
    starts, not after it. Returns the tasks by name, for ``check_fit``."""
    from datasets.exceptions import DatasetGenerationError

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    try:
        with _quiet(), _datasets_quiet():
            return manager.load(tasks)["tasks"]
    except (ConnectionError, OSError) as e:
        raise _no_data(tasks, e, field) from None
    except DatasetGenerationError as e:  # the loader's own error says only "An error occurred": its cause says what
        cause = e.__cause__ or e.__context__ or e
        raise KubetuneError(
            f"the data of {', '.join(tasks)} cannot be read as the task YAML says: "
            f"{type(cause).__name__}: {' '.join(str(cause).split())[:200]}",
            field=field,
            fix="check the data files the task YAML names (dataset_path, dataset_kwargs.data_files: the json loader "
            "reads JSON Lines, one object per line)",
        ) from None
    except (KeyError, ValueError, TypeError) as e:  # the YAML against its data: a split it lacks, say (KeyError)
        raise KubetuneError(
            f"the harness cannot load {', '.join(tasks)}: {type(e).__name__}: {' '.join(str(e).split())[:200]}",
            field=field,
            fix="check the task YAML against its data (test_split, validation_split, fewshot_split, the columns "
            "doc_to_text and doc_to_target name)",
        ) from None


@contextlib.contextmanager
def _datasets_quiet():
    """The datasets library logs a data file it cannot parse on its own (an ERROR line before the exception):
    the one line kubetune says instead is enough."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_fit(
    loaded: dict,
    tokenizer,
    model_path: Path,
    *,
    num_fewshot: int | None = None,
    limit: float | None = None,
    chat: bool = False,
    gen_kwargs: dict | None = None,
    seed: int = 0,
    field: str = "--tasks",
) -> None:
    """Every request of the ``loaded`` tasks (``check_data``'s), as the harness builds them for the model at
    ``model_path`` scored with ``tokenizer`` (as the scoring will hold it: a training run's is prepared as the task
    prepares it), within the model's context: its few-shot examples, the chat template, a generation's token budget.
    Else one line before anything is scored: the harness itself cuts an over-long prompt's start off without a word
    (HFLM keeps the last tokens), so a score would silently be of other prompts than the task's.

    Raises:
        KubetuneError: a chat evaluation with a tokenizer without a template; the first task with requests over
            the context: how many, the longest, the context.
    """
    from lm_eval.evaluator_utils import get_sample_size
    from lm_eval.models.utils import resolve_max_length
    from transformers import AutoConfig

    if chat and not getattr(tokenizer, "chat_template", None):
        raise KubetuneError(
            f"the tokenizer of {model_path} has no chat template, and the tasks are to be formatted with one",
            field=field,
            fix="drop the chat option (--chat, evaluation.chat), or evaluate a model whose tokenizer has a template",
        )
    # HFLM's own notion of the context (its default where neither config nor tokenizer gives one)
    context = resolve_max_length(AutoConfig.from_pretrained(model_path), tokenizer, default=2048)

    def template(history, add_generation_prompt=True):  # HFLM.apply_chat_template's rendering
        return tokenizer.apply_chat_template(
            history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    for task in loaded.values():
        _configure(task, num_fewshot, gen_kwargs, seed)  # as simple_evaluate sets up each task
        try:
            with _quiet():
                task.build_all_requests(
                    limit=get_sample_size(task, limit),
                    apply_chat_template=chat,
                    chat_template=template if chat else None,
                )
        except (ValueError, AssertionError, AttributeError) as e:  # the harness's own words for it: a traceback
            raise _unbuildable(task, e, field, num_fewshot) from None
        lengths = _request_lengths(task.instances, tokenizer)
        over = [n for n in lengths if n > context]
        if over:
            name = task.config.task
            raise KubetuneError(
                f"{len(over)} of {len(lengths)} requests of task {name} need more than the model's context of "
                f"{context} tokens (the longest {max(over)}: prompt"
                + (", few-shot examples" if task.get_config("num_fewshot") else "")
                + " and answer); the harness would cut their start off",
                field=field,
                fix="lower num_fewshot (or a generation's max_gen_toks), shorten the task's prompts, or evaluate a "
                "model with a longer context",
            )


def _unbuildable(task, e: Exception, field: str, num_fewshot: int | None) -> KubetuneError:
    """One line for a task whose requests the harness cannot build: more few-shot examples than the task has
    documents to draw them from (``random.sample``'s "Sample larger than population", or no few-shot documents
    at all), else the harness's own message."""
    name, shots = task.config.task, task.get_config("num_fewshot") or 0
    sampler = getattr(task, "sampler", None)
    pool = len(sampler.fewshot_docs()) if sampler is not None else 0
    # as many as the pool fails too where the few-shot documents are the scored ones: a document is not its own example
    if shots and pool <= shots:
        cli = field.startswith("--")
        given = num_fewshot is not None  # else the task's YAML asks for them
        return KubetuneError(
            f"task {name} cannot draw {shots} few-shot examples per prompt: it has {pool} documents to draw them "
            f"from ({' '.join(str(e).split())[:120]})",
            field=("--num-fewshot" if cli else "evaluation.num_fewshot") if given else field,
            fix="lower num_fewshot"
            if given
            else "lower num_fewshot in the task's YAML, or give the task more few-shot documents (its fewshot_split)",
        )
    return KubetuneError(
        f"the harness cannot build the requests of task {name}: {type(e).__name__}: {' '.join(str(e).split())[:200]}",
        field=field,
        fix="check the task's YAML (doc_to_text, doc_to_target, doc_to_choice) against its data",
    )


def _configure(task, num_fewshot: int | None, gen_kwargs: dict | None, seed: int) -> None:
    """What lm_eval.simple_evaluate sets on each task before building its requests (its own rules: a task whose
    YAML says num_fewshot 0 keeps it)."""
    if task.get_config("output_type") == "generate_until" and gen_kwargs:
        task.set_config(key="generation_kwargs", value=dict(gen_kwargs), update=True)
    if num_fewshot is not None and task.get_config("num_fewshot") != 0:
        task.set_config(key="num_fewshot", value=num_fewshot)
    elif task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=seed)


def _request_lengths(instances, tokenizer) -> list[int]:
    """The tokens each request needs as HFLM runs it: a log-likelihood's context and continuation encoded whole,
    a generation's context plus its max_gen_toks (HFLM's 256 unless the task says); rolling log-likelihoods,
    which HFLM scores in windows, need none."""
    texts, extra = [], []
    for inst in instances:
        if inst.request_type == "loglikelihood":
            texts.append(inst.args[0] + inst.args[1])
            extra.append(0)
        elif inst.request_type == "generate_until":
            texts.append(inst.args[0])
            extra.append(int((inst.args[1] or {}).get("max_gen_toks", 256)))
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [len(i) + e for i, e in zip(ids, extra)]


def scores(results: dict) -> dict[str, dict[str, float]]:
    """The harness's scores per task under its own metric names (``acc,none``, ``exact_match,strict-match``,
    their ``_stderr``), numbers only (its ``alias`` and N/A stderrs dropped)."""
    out = {}
    for task, values in (results.get("results") or {}).items():
        kept = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out[task] = kept
    return out
