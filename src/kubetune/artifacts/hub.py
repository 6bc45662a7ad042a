"""hf://org/repo as an output: push the model, tokenizer and a generated model card to the Hub.

The token comes from HF_TOKEN (or huggingface_hub's login cache, or a Kubernetes Secret exposed
as HF_TOKEN); it is passed to huggingface_hub and never logged or written anywhere.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from kubetune.artifacts.presentation import Presentation
from kubetune.config import JobSpec, dump_spec
from kubetune.errors import KubetuneError
from kubetune.paths import check_tree_inside

log = logging.getLogger(__name__)


def repo_id(uri: str) -> str:
    """``ORG/REPO`` from an hf:// output URI.

    Raises:
        KubetuneError: not ORG/REPO, or a name the Hub refuses (checked here, before training).
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    rid = uri.split("://", 1)[1].strip("/")
    if rid.count("/") != 1:
        raise KubetuneError(f"{_short(uri)!r} is not a Hub repo", field="output.uri", fix="write hf://ORG/REPO")
    try:
        validate_repo_id(rid)
    except HFValidationError:
        raise KubetuneError(
            f"{_short(uri)!r} is not a valid Hub repo name",
            field="output.uri",
            fix="use letters, digits, '-', '_' and '.' (no '--' or '..', not first or last), at most 96 characters",
        ) from None
    return rid


def check_can_push(spec: JobSpec, repo: str) -> None:
    """Fail before training when a push cannot work: a bad repo name, offline mode, no token, a
    token the Hub rejects, or a Hub that cannot be reached.

    Raises:
        KubetuneError: one line naming the endpoint (never the token) and the fix.
    """
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise KubetuneError(
            "HF_HUB_OFFLINE=1 is set, so nothing can be pushed to the Hub",
            field="output.uri",
            fix="unset HF_HUB_OFFLINE for a job with an hf:// output",
        )
    if not get_token():
        raise KubetuneError(
            f"pushing to {spec.output.uri} needs a Hugging Face token",
            field="output.uri",
            fix="set HF_TOKEN (or kubernetes.secrets.hf_token)",
        )
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf_errors

    try:
        HfApi().whoami()  # a rejected token fails now, not after training
    except (hf_errors.HfHubHTTPError, OSError) + _network_errors() as e:  # no local file is written here
        rejected = (f"the Hub at {_endpoint()} rejected the token ({{status}})", "check HF_TOKEN")
        raise _hub_error(
            e,
            "output.uri",
            {401: rejected, 403: rejected},
            (f"the Hub at {_endpoint()} answered {{status}} to a token check", "check HF_ENDPOINT, or try again later"),
            ("", "check HF_ENDPOINT and the network"),
        ) from None


def model_card(spec: JobSpec, repo: str, metrics: dict, present: Presentation) -> str:
    pipeline_tag = present.pipeline_tag
    usage = present.card_usage(repo)
    about = present.card_about(metrics)
    lines = [
        "---",
        "library_name: transformers",
        f"pipeline_tag: {pipeline_tag}",
        f"base_model: {spec.model.uri.removeprefix('hf://')}"
        if spec.model.uri.startswith("hf://")
        else f"# base model: {spec.model.uri}",
        f"tags: [kubetune, {pipeline_tag}]",
        "---",
        "",
        f"# {spec.name}",
        "",
        f"Fine-tuned from `{spec.model.uri}` on `{spec.data.train}` ({metrics.get('train_rows')} training rows, "
        f"{metrics.get('eval_rows')} evaluation rows) with kubetune, "
        f"{'LoRA r=' + str(spec.lora.r) + ' (merged)' if spec.lora else 'full fine-tune'}, "
        f"world size {metrics.get('world_size')}.",
        "",
        "| metric | value |",
        "| --- | --- |",
        *[f"| {k} | {metrics[k]:.4f} |" for k in present.card_metrics if isinstance(metrics.get(k), float)],
        *present.reference_card(metrics),
        "",
        *about,
        "",
        "```python",
        "from transformers import pipeline",
        *usage,
        "```",
        "",
        "## Job spec",
        "",
        "```yaml",
        dump_spec(spec).rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def push(spec: JobSpec, repo: str, out: Path, metrics: dict, present: Presentation) -> str:
    """Create the repo (private unless output.hf_private is false) and upload one commit.

    Returns:
        The commit URL.
    """
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf_errors

    rid = repo
    api = HfApi()
    folder = Path(tempfile.mkdtemp(prefix="kubetune-hub-"))
    try:
        for path in (out / "model").iterdir():
            _link(path, folder / path.name)
        if (out / "adapter").exists():
            shutil.copytree(out / "adapter", folder / "adapter")
        (folder / "kubetune").mkdir()
        for name in ("metrics.json", "job.yaml", "report.html", "history.jsonl"):
            if (out / name).exists():
                _link(out / name, folder / "kubetune" / name)
        (folder / "README.md").write_text(model_card(spec, repo, metrics, present))
        message = spec.output.commit_message or f"kubetune {spec.name}: {present.headline(metrics)}"
        api.create_repo(rid, private=spec.output.hf_private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(folder), repo_id=rid, repo_type="model", commit_message=message)
    except (hf_errors.HfHubHTTPError,) + _network_errors() as e:
        # httpx errors (huggingface_hub >= 1) are not OSErrors; requests' (older versions) are
        kept = "check HF_ENDPOINT and the network; the local artifacts are kept"
        raise _hub_error(
            e,
            "output.uri",
            {
                401: (f"the Hub rejected the token while pushing to {spec.output.uri} (401)", "check HF_TOKEN"),
                403: (
                    f"the token may not write to {spec.output.uri} (403)",
                    "use a token with write access to that org",
                ),
            },
            (f"Hub push to {spec.output.uri} failed ({{status}})", kept),
            (f" to push {spec.output.uri}", kept),
        ) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    url = getattr(info, "commit_url", None) or str(info)
    log.info("pushed to %s (%s)", spec.output.uri, url)
    return url


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # no copy of multi-GB weights when the filesystem allows it
    except OSError:
        shutil.copy2(src, dst)


def pull(uri: str, dest: Path) -> Path:
    """Download an hf:// model repo into ``dest``.

    Raises:
        KubetuneError: no such repo (or the token may not read it), offline mode without the repo
            in the cache, or a Hub that cannot be reached. An OSError writing ``dest`` propagates.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf_errors

    rid = uri.split("://", 1)[1].strip("/")
    shown = _short(uri)
    try:
        path = Path(snapshot_download(rid, local_dir=str(dest)))
    except hf_errors.HFValidationError:
        raise KubetuneError(f"{shown!r} is not a valid Hub repo name", field="URI", fix="write hf://ORG/REPO") from None
    except ValueError as e:  # huggingface_hub refuses a repo file name that would write outside dest
        raise KubetuneError(
            f"{shown}: {_short(str(e).splitlines()[0])}",
            field="URI",
            fix="refusing the repo; nothing outside DEST was written",
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise KubetuneError(
            f"the Hub at {_endpoint()} has no model repo {shown}, or the token may not read it",
            field="URI",
            fix="check the name and HF_TOKEN",
        ) from None
    except hf_errors.HfHubHTTPError as e:
        answered = (
            f"the Hub at {_endpoint()} answered {{status}} for {shown}",
            "check HF_TOKEN and HF_ENDPOINT, or try again later",
        )
        raise _hub_error(e, "URI", {}, answered, ("", "")) from None
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled):
        if constants.HF_HUB_OFFLINE:
            raise KubetuneError(
                f"HF_HUB_OFFLINE=1 is set and {shown} is not in the local cache",
                field="URI",
                fix="unset HF_HUB_OFFLINE to download it",
            ) from None
        raise KubetuneError(
            f"cannot reach the Hub at {_endpoint()} to download {shown}",
            field="URI",
            fix="check HF_ENDPOINT and the network",
        ) from None
    except _network_errors() as e:
        raise _hub_error(
            e, "URI", {}, ("", ""), (f" to download {shown}", "check HF_ENDPOINT and the network")
        ) from None
    check_tree_inside(path, what=f"URI: {shown}")
    return path


def _hub_error(
    e: BaseException,
    field: str,
    statuses: dict[int, tuple[str, str]],
    other: tuple[str, str],
    unreachable: tuple[str, str],
) -> KubetuneError:
    """The one line for a Hub call that failed: an HTTP answer (``statuses``' (message, fix) by status
    code, else ``other``; ``{status}`` in a message is the code), or no answer at all (``unreachable``:
    what the call was doing, e.g. " to push hf://ORG/REPO", and the fix)."""
    from huggingface_hub import errors as hf_errors

    if isinstance(e, hf_errors.HfHubHTTPError):
        status = getattr(e.response, "status_code", None)
        message, fix = statuses.get(status, other) if isinstance(status, int) else other
        return KubetuneError(message.replace("{status}", str(status)), field=field, fix=fix)
    doing, fix = unreachable
    return KubetuneError(f"cannot reach the Hub at {_endpoint()}{doing} ({type(e).__name__})", field=field, fix=fix)


def _network_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the Hub cannot be reached: httpx's HTTPError (transport
    errors included, and not OSErrors) from huggingface_hub 1.0 on, requests' errors before that.
    Not every OSError: one from writing a local file must not read as a network problem."""
    from huggingface_hub import errors as hf_errors

    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    http = getattr(hf_errors, "HTTPError", None)
    if isinstance(http, type):
        found.append(http)
    try:
        from requests.exceptions import RequestException
    except ImportError:
        pass
    else:
        found.append(RequestException)
    return tuple(found)


def _endpoint() -> str:
    from huggingface_hub import constants

    return _short(constants.ENDPOINT, 120)


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


__all__ = ["check_can_push", "model_card", "pull", "push", "repo_id"]
