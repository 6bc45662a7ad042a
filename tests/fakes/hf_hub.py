"""A FAKE of the Hugging Face Hub, for tests.

The real Hub cannot be reached from the machines the tests run on, so tests point the real
`huggingface_hub` client at this fake: `HfApi(endpoint=hub.url, token=hub.token)` in-process, or
HF_ENDPOINT / HF_TOKEN for a subprocess. It speaks the HTTP protocol that huggingface_hub 2.4 speaks
to the Hub, over real HTTP on 127.0.0.1, but implements only what pushing and pulling a repo needs:
whoami, repo creation, README metadata validation, preupload, the Git LFS batch API ("basic"
transfers), NDJSON commits on the main branch, repo info, tree listing and /resolve downloads. A
second server on another port stands in for the LFS storage host (S3 and its CDN): it takes
presigned uploads and serves signed downloads, so the client takes its cross-host paths.

No Xet. When hf_xet is installed, huggingface_hub uploads every file that preupload marks "lfs"
through the Xet protocol (chunked, deduplicated CAS storage), and no server answer turns that off.
So a client that uploads LFS files here needs HF_HUB_DISABLE_XET=1 (in-process:
`huggingface_hub.constants.HF_HUB_DISABLE_XET = True`) to use plain LFS; with `lfs_threshold=None`
every file is "regular" and any client works. The Xet token endpoints answer 501, so such a client
fails at once with an error naming xet-write-token. Mind too that huggingface_hub refuses every
request, uploads included, while HF_HUB_OFFLINE is set (tests/conftest.py sets it).

Other simplifications: files go to LFS by size alone (the Hub also looks at content and
.gitattributes); commit ids are made-up SHA-1s; there are no branches, tags, pull requests,
.gitignore rules or multipart LFS uploads. Standard library only, so it imports without pytest.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import socketserver
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qs, unquote, urlsplit

Json = dict[str, Any]

DEFAULT_USER = "kubetune-bot"
LFS_THRESHOLD = 10 * 1000 * 1000  # the Hub refuses regular (non-LFS) files over 10 MB
MAIN = "main"
URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/"}  # repo type -> web URL prefix
_API_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_SHA256 = re.compile(r"[0-9a-f]{64}")
INVALID_TOKEN = "Invalid credentials in Authorization header"  # huggingface_hub matches this exact text
# What the Hub writes in the first commit of every new repo (abridged).
GITATTRIBUTES = b"".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n".encode()
    for pattern in ("*.bin", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.pt", "*.pth", "*.safetensors", "*.zip")
)


class HubError(Exception):
    """An error answer: a JSON {"error": ...} body plus the X-Error-* headers huggingface_hub reads."""

    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        # header values must be latin-1: a path in the message may not be
        header_message = message.encode("ascii", "replace").decode("ascii")
        self.headers = {
            "X-Error-Message": header_message,
            **({"X-Error-Code": code} if code else {}),
            **(headers or {}),
        }


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _git_hash(data: bytes, kind: str = "blob") -> str:
    """The object id git gives `data`."""
    return hashlib.sha1(f"{kind} {len(data)}\0".encode() + data).hexdigest()


# ------------------------------------------------------------------------------------------- state


@dataclass(frozen=True)
class _Blob:
    data: bytes
    lfs: bool  # kept in LFS storage: git holds a pointer file in its place

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @cached_property
    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n".encode()

    @cached_property
    def git_oid(self) -> str:
        return _git_hash(self.pointer if self.lfs else self.data)

    @property
    def content_oid(self) -> str:
        """What preupload reports and the download cache keys on: the sha256 for LFS, else the git id."""
        return self.sha256 if self.lfs else self.git_oid

    def tree_entry(self, path: str) -> Json:
        entry: Json = {"type": "file", "path": path, "size": len(self.data), "oid": self.git_oid}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": len(self.pointer)}
        return entry


@dataclass(frozen=True)
class _Commit:
    oid: str
    message: str
    description: str
    date: str
    tree: dict[str, _Blob]  # the whole snapshot: the fake stores no deltas
    changed: tuple[str, ...]
    deleted: tuple[str, ...]

    def public(self) -> Json:
        return {
            "oid": self.oid,
            "message": self.message,
            "description": self.description,
            "files": list(self.changed),
            "lfs_files": [p for p in self.changed if self.tree[p].lfs],
            "deleted": list(self.deleted),
        }


def _make_commit(
    parent: str, message: str, description: str, tree: dict[str, _Blob], changed: list[str], deleted: list[str]
) -> _Commit:
    listing = json.dumps([parent, message, description, sorted((p, b.git_oid) for p, b in tree.items())])
    return _Commit(
        _git_hash(listing.encode(), "commit"), message, description, _now(), tree, tuple(changed), tuple(deleted)
    )


@dataclass
class _Repo:
    type: str
    id: str
    private: bool
    created_at: str
    commits: list[_Commit]
    lfs_objects: dict[str, bytes] = field(default_factory=dict)  # sha256 -> content, committed or not

    @property
    def head(self) -> _Commit:
        return self.commits[-1]

    @property
    def web_path(self) -> str:
        return f"{URL_PREFIXES[self.type]}{self.id}"

    def at(self, revision: str) -> _Commit:
        if revision == MAIN:
            return self.head
        for commit in self.commits:
            if commit.oid == revision:
                return commit
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def info(self, revision: str, blobs: bool) -> Json:
        commit = self.at(revision)
        siblings = [{"rfilename": p, **(_sibling_blob(b) if blobs else {})} for p, b in sorted(commit.tree.items())]
        return {
            "id": self.id,
            "author": self.id.split("/")[0],
            "sha": commit.oid,
            "lastModified": commit.date,
            "createdAt": self.created_at,
            "private": self.private,
            "gated": False,
            "disabled": False,
            "tags": [],
            "siblings": siblings,
        }


def _sibling_blob(blob: _Blob) -> Json:
    extra: Json = {"size": len(blob.data), "blobId": blob.git_oid}
    if blob.lfs:
        extra["lfs"] = {"sha256": blob.sha256, "size": len(blob.data), "pointerSize": len(blob.pointer)}
    return extra


def _tree(commit: _Commit, path: str, recursive: bool) -> list[Json]:
    """Entries under `path` as /api/.../tree lists them: files and the folders their paths imply."""
    prefix = f"{path}/" if path else ""
    below = {p: b for p, b in commit.tree.items() if p.startswith(prefix)}
    if path and not below:
        raise HubError(404, f"{path} does not exist at {commit.oid}", "EntryNotFound")
    folders: set[str] = set()
    files: list[Json] = []
    for file_path, blob in sorted(below.items()):
        parts = file_path[len(prefix) :].split("/")
        ancestors = range(1, len(parts)) if recursive else range(1, min(len(parts), 2))
        folders.update(prefix + "/".join(parts[:i]) for i in ancestors)
        if recursive or len(parts) == 1:
            files.append(blob.tree_entry(file_path))
    return [_folder_entry(commit, f) for f in sorted(folders)] + files


def _folder_entry(commit: _Commit, folder: str) -> Json:
    listing = sorted((p, b.git_oid) for p, b in commit.tree.items() if p.startswith(f"{folder}/"))
    return {"type": "directory", "path": folder, "oid": _git_hash(json.dumps(listing).encode(), "tree")}


# ------------------------------------------------------------------------------------------ routing


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Json:
        try:
            body = json.loads(self.body or b"null")
        except ValueError as exc:
            raise HubError(400, f"Invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise HubError(400, "The body must be a JSON object")
        return body


@dataclass
class _Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, body: Any, status: int = 200, content_type: str = "application/json") -> _Response:
        return cls(status, json.dumps(body).encode(), {"Content-Type": content_type})


Route = tuple[frozenset[str], re.Pattern[str], Callable[..., _Response]]
_REPO = r"(?P<ns>[^/]+)/(?P<name>[^/]+)"
_WEB_REPO = rf"(?:(?P<prefix>datasets|spaces)/)?{_REPO}"


def _route(method: str, pattern: str, action: Callable[..., _Response]) -> Route:
    return frozenset(method.split("|")), re.compile(pattern), action


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes; Nagle would hold the body ~40 ms
    timeout = 30  # a client that opens a connection and never speaks must not hold stop() forever
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: tests assert on FakeHub.requests instead of reading an access log."""

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        request = _Request(
            self.command,
            url.path,
            {k: v[-1] for k, v in parse_qs(url.query).items()},
            {k.lower(): v for k, v in self.headers.items()},
            self._read_body(),
        )
        try:
            response = self.server.serve(request)
        except HubError as err:
            response = _Response.json({"error": err.message}, err.status)
            response.headers.update(err.headers)
        except Exception as exc:
            traceback.print_exc()
            response = _Response.json({"error": f"fake Hub failed: {exc!r}"}, 500)
        self._send(response)

    do_HEAD = do_POST = do_PUT = do_GET

    def _read_body(self) -> bytes:
        # huggingface_hub sends a Content-Length with every body, file uploads included: no chunked bodies
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, response: _Response) -> None:
        self.send_response(response.status)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))
        # one request per connection: stop() then joins every handler without hanging up idle keep-alives
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins the handler threads, so none outlives the fake

    def __init__(self, routes: list[Route], record: Callable[[_Request], None]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes = routes
        self.record = record

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, which can stall on a machine without DNS
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def serve(self, request: _Request) -> _Response:
        self.record(request)
        for methods, pattern, action in self.routes:
            match = pattern.fullmatch(request.path)
            if match and request.method in methods:
                return action(request, **{k: unquote(v) for k, v in match.groupdict().items() if v is not None})
        raise HubError(404, f"Cannot {request.method} {request.path}")


# ------------------------------------------------------------------------------------------ public API


class FakeHub:
    """A fake Hugging Face Hub on 127.0.0.1, plus thread-safe controls for tests.

    Use as `with FakeHub() as hub: HfApi(endpoint=hub.url, token=hub.token)...`. `token` is the one
    valid token; it belongs to `user`, the namespace of repos created without an organization.
    """

    def __init__(
        self, *, token: str = "hf_test_token", user: str = DEFAULT_USER, lfs_threshold: int | None = LFS_THRESHOLD
    ) -> None:
        self.token = token
        self.user = user
        self.lfs_threshold = lfs_threshold  # preupload answers "lfs" for files larger than this; None: never
        self._secret = secrets.token_bytes(16)  # signs the storage host's URLs
        # re-entrant: a handler holds it across a whole read-modify-write, auth check included
        self._lock = threading.RLock()
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._requests: list[tuple[str, str]] = []
        self._failures: list[int] = []
        self._servers: list[tuple[_Server, threading.Thread]] = []

    # -- lifecycle

    def start(self) -> Self:
        if self._servers:
            raise RuntimeError("FakeHub is already running")
        for routes, name in ((self._hub_routes(), "fake-hf-hub"), (self._storage_routes(), "fake-hf-storage")):
            server = _Server(routes, self._record)
            thread = threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True
            )
            thread.start()
            self._servers.append((server, thread))
        return self

    def stop(self) -> None:
        for server, thread in self._servers:
            server.shutdown()
            server.server_close()
            thread.join()
        self._servers.clear()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The Hub endpoint, for HfApi(endpoint=...) or HF_ENDPOINT."""
        return self._server(0).url

    @property
    def storage_url(self) -> str:
        """The LFS storage host that upload and download URLs point at."""
        return self._server(1).url

    def _server(self, index: int) -> _Server:
        if not self._servers:
            raise RuntimeError("FakeHub is not running")
        return self._servers[index][0]

    # -- controls and inspection

    def files(self, repo_id: str, repo_type: str = "model") -> dict[str, bytes]:
        """Path -> content at the head of main."""
        with self._lock:
            return {p: b.data for p, b in self._get(repo_type, repo_id).head.tree.items()}

    def commits(self, repo_id: str, repo_type: str = "model") -> list[Json]:
        """Oldest first (the first is the repo's creation): oid, message, description, files (added or
        changed paths), lfs_files (those of them stored in LFS), deleted."""
        with self._lock:
            return [c.public() for c in self._get(repo_type, repo_id).commits]

    def repo(self, repo_id: str, repo_type: str = "model") -> Json:
        with self._lock:
            repo = self._get(repo_type, repo_id)
            return {"id": repo.id, "type": repo.type, "private": repo.private, "sha": repo.head.oid}

    @property
    def requests(self) -> list[tuple[str, str]]:
        """(method, path) of every request to either host so far, oldest first; no query strings."""
        with self._lock:
            return list(self._requests)

    def fail_next(self, status: int, times: int = 1) -> None:
        """Answer the next `times` Hub requests (not storage ones), whatever they are, with `status`.
        Note that huggingface_hub retries 429 and 5xx answers on some calls, after sleeping."""
        with self._lock:
            self._failures.extend([status] * times)

    # -- shared by the handlers

    def _record(self, request: _Request) -> None:
        with self._lock:
            self._requests.append((request.method, request.path))

    def _get(self, repo_type: str, repo_id: str) -> _Repo:
        try:
            return self._repos[(repo_type, repo_id)]
        except KeyError:
            raise KeyError(f"no {repo_type} repo {repo_id!r} on the fake Hub") from None

    def _authenticated(self, request: _Request) -> bool:
        """Whether the request carries the token. A wrong token is a 401 everywhere, even for public
        reads, as on the Hub. Failures queued by fail_next are answered here too."""
        authorization = request.headers.get("authorization")
        if authorization is not None and authorization != f"Bearer {self.token}":
            raise HubError(401, INVALID_TOKEN)
        with self._lock:
            failure = self._failures.pop(0) if self._failures else None
        if failure is not None:
            raise HubError(failure, f"injected by FakeHub.fail_next({failure})")
        return authorization is not None

    def _require_token(self, request: _Request) -> None:
        if not self._authenticated(request):
            raise HubError(401, "You must be authenticated to access this resource")

    def _repo_for(self, request: _Request, repo_type: str, repo_id: str, write: bool) -> _Repo:
        """The repo, if this caller may see it (and write to it); the Hub hides what it does not show."""
        authenticated = self._authenticated(request)
        if write and not authenticated:
            raise HubError(401, "You must be authenticated to access this resource")
        repo = self._repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not authenticated):
            raise HubError(404 if authenticated else 401, "Repository not found", "RepoNotFound")
        return repo

    def _sign(self, *parts: str) -> str:
        return hmac.new(self._secret, "\0".join(parts).encode(), hashlib.sha256).hexdigest()

    def _check_signature(self, request: _Request, *parts: str) -> None:
        if not hmac.compare_digest(request.query.get("sig", ""), self._sign(*parts)):
            raise HubError(403, "Request signature does not match")

    # -- Hub API

    def _hub_routes(self) -> list[Route]:
        api = r"/api/(?P<api_type>models|datasets|spaces)/" + _REPO
        lfs = rf"/{_WEB_REPO}\.git/info/lfs/objects"
        return [
            _route("GET", r"/api/whoami-v2", self._whoami),
            _route("POST", r"/api/repos/create", self._create_repo),
            _route("POST", r"/api/validate-yaml", self._validate_yaml),
            _route("GET", rf"{api}(?:/revision/(?P<revision>[^/]+))?", self._repo_info),
            _route("GET", rf"{api}/tree/(?P<revision>[^/]+)(?:/(?P<path>.+))?", self._list_tree),
            _route("GET", rf"{api}/xet-(?:read|write)-token/(?P<revision>[^/]+)", self._no_xet),
            _route("POST", rf"{api}/preupload/(?P<revision>[^/]+)", self._preupload),
            _route("POST", rf"{api}/commit/(?P<revision>[^/]+)", self._commit),
            _route("POST", rf"{lfs}/batch", self._lfs_batch),
            _route("POST", rf"{lfs}/verify", self._lfs_verify),
            _route("GET|HEAD", rf"/{_WEB_REPO}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", self._resolve),
        ]

    def _whoami(self, request: _Request) -> _Response:
        self._require_token(request)
        return _Response.json(
            {
                "type": "user",
                "name": self.user,
                "fullname": self.user,
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "fake", "role": "write"}},
            }
        )

    def _create_repo(self, request: _Request) -> _Response:
        self._require_token(request)
        body = request.json()
        repo_type = body.get("type") or "model"
        if repo_type not in URL_PREFIXES or not isinstance(body.get("name"), str):
            raise HubError(400, f"Invalid repo type or name: {repo_type!r}, {body.get('name')!r}")
        repo_id = f"{body.get('organization') or self.user}/{body['name']}"
        # huggingface_hub 2.x sends visibility; older clients send private
        private = body.get("visibility") == "private" or body.get("private") is True
        url = f"{self.url}/{URL_PREFIXES[repo_type]}{repo_id}"
        with self._lock:
            if (repo_type, repo_id) in self._repos:
                return _Response.json({"error": f"You already created this {repo_type} repo", "url": url}, 409)
            initial = _make_commit(
                "", "initial commit", "", {".gitattributes": _Blob(GITATTRIBUTES, lfs=False)}, [".gitattributes"], []
            )
            self._repos[(repo_type, repo_id)] = _Repo(repo_type, repo_id, private, initial.date, [initial])
        return _Response.json({"url": url, "name": repo_id})

    def _validate_yaml(self, request: _Request) -> _Response:
        self._authenticated(request)  # anyone may ask, but a wrong token is still a 401
        return _Response.json({"errors": [], "warnings": []})  # the metadata itself is not checked

    def _repo_info(self, request: _Request, api_type: str, ns: str, name: str, revision: str = MAIN) -> _Response:
        with self._lock:
            repo = self._repo_for(request, _API_TYPES[api_type], f"{ns}/{name}", write=False)
            return _Response.json(repo.info(revision, blobs=_flag(request, "blobs")))

    def _list_tree(
        self, request: _Request, api_type: str, ns: str, name: str, revision: str, path: str = ""
    ) -> _Response:
        with self._lock:
            commit = self._repo_for(request, _API_TYPES[api_type], f"{ns}/{name}", write=False).at(revision)
        # a single page: no Link header, which tells the client there is no next one
        return _Response.json(_tree(commit, path.strip("/"), recursive=_flag(request, "recursive")))

    def _no_xet(self, request: _Request, **_: str) -> _Response:
        self._authenticated(request)
        raise HubError(
            501,
            "This fake Hub does not implement Xet storage: set HF_HUB_DISABLE_XET=1 on the client "
            "to upload LFS files, or start the FakeHub with lfs_threshold=None",
        )

    def _preupload(self, request: _Request, api_type: str, ns: str, name: str, revision: str) -> _Response:
        _no_pull_requests(request)
        files = request.json().get("files")
        if not isinstance(files, list):
            raise HubError(400, "files must be a list")
        with self._lock:
            head = _writable(self._repo_for(request, _API_TYPES[api_type], f"{ns}/{name}", write=True), revision).head
            answers = [self._upload_mode(head, f) for f in files]
        return _Response.json({"files": answers, "commitOid": head.oid})

    def _upload_mode(self, head: _Commit, file: Json) -> Json:
        path, size = file.get("path"), file.get("size")
        if not isinstance(path, str) or not isinstance(size, int):
            raise HubError(400, f"Each file needs a path and a size, got {file}")
        lfs = self.lfs_threshold is not None and size > self.lfs_threshold
        answer: Json = {"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
        if path in head.tree:
            # lets the client skip files that did not change (compared by sha256 for LFS, git id otherwise)
            answer["oid"] = head.tree[path].content_oid
        return answer

    def _lfs_batch(self, request: _Request, ns: str, name: str, prefix: str = "") -> _Response:
        body = request.json()
        if body.get("operation") != "upload" or "basic" not in body.get("transfers", ["basic"]):
            raise HubError(400, "This fake Hub only takes LFS uploads over the basic transfer")
        repo_type = _web_type(prefix)
        with self._lock:
            repo = self._repo_for(request, repo_type, f"{ns}/{name}", write=True)
            objects = [self._lfs_action(repo, obj) for obj in body.get("objects", [])]
        return _Response.json(
            {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
            content_type="application/vnd.git-lfs+json",
        )

    def _lfs_action(self, repo: _Repo, obj: Json) -> Json:
        oid, size = obj.get("oid"), obj.get("size")
        if not isinstance(oid, str) or not _SHA256.fullmatch(oid) or not isinstance(size, int):
            raise HubError(400, f"Each object needs a sha256 oid and a size, got {obj}")
        if oid in repo.lfs_objects:
            return {"oid": oid, "size": size}  # no actions: the client skips the upload
        target = f"{repo.type}s/{repo.id}/{oid}"
        href = f"{self.storage_url}/upload/{target}?size={size}&sig={self._sign('upload', target, str(size))}"
        verify = f"{self.url}/{repo.web_path}.git/info/lfs/objects/verify"
        return {
            "oid": oid,
            "size": size,
            "authenticated": True,
            "actions": {"upload": {"href": href}, "verify": {"href": verify}},
        }

    def _lfs_verify(self, request: _Request, ns: str, name: str, prefix: str = "") -> _Response:
        body = request.json()
        with self._lock:
            stored = self._repo_for(request, _web_type(prefix), f"{ns}/{name}", write=True).lfs_objects.get(
                body.get("oid")
            )
        if stored is None or len(stored) != body.get("size"):
            raise HubError(404, f"LFS object {body.get('oid')} of size {body.get('size')} was not uploaded")
        return _Response.json({"success": True}, content_type="application/vnd.git-lfs+json")

    def _commit(self, request: _Request, api_type: str, ns: str, name: str, revision: str) -> _Response:
        _no_pull_requests(request)
        try:
            lines = [json.loads(line) for line in request.body.splitlines() if line.strip()]
        except ValueError as exc:
            raise HubError(400, f"The commit payload is not NDJSON: {exc}") from None
        if not lines or not isinstance(lines[0], dict) or lines[0].get("key") != "header":
            raise HubError(400, "The commit payload must start with a header line")
        header = lines[0]["value"]
        with self._lock:
            repo = _writable(self._repo_for(request, _API_TYPES[api_type], f"{ns}/{name}", write=True), revision)
            parent = header.get("parentCommit")
            if parent is not None and not repo.head.oid.startswith(parent):
                raise HubError(412, "A newer commit exists on the branch: parentCommit is not its head")
            tree, changed, deleted = _apply(repo, [(line.get("key"), line.get("value") or {}) for line in lines[1:]])
            commit = _make_commit(
                repo.head.oid, header.get("summary") or "", header.get("description") or "", tree, changed, deleted
            )
            repo.commits.append(commit)
        return _Response.json(
            {
                "success": True,
                "commitOid": commit.oid,
                "hookOutput": "",
                "commitUrl": f"{self.url}/{repo.web_path}/commit/{commit.oid}",
            }
        )

    def _resolve(self, request: _Request, ns: str, name: str, revision: str, path: str, prefix: str = "") -> _Response:
        with self._lock:
            repo = self._repo_for(request, _web_type(prefix), f"{ns}/{name}", write=False)
            commit = repo.at(revision)
            blob = commit.tree.get(path)
            web_path = repo.web_path
        if blob is None:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{blob.git_oid}"'}
        if not blob.lfs:
            return _Response(200, blob.data, {**headers, "Content-Type": "application/octet-stream"})
        # LFS content lives on the storage host: redirect there with a signed URL, as the Hub does to its CDN,
        # carrying the file's own etag and size in X-Linked-* since the client does not follow off-host redirects
        target = f"{web_path}/{blob.sha256}"
        location = f"{self.storage_url}/download/{target}?sig={self._sign('download', target)}"
        return _Response(
            302,
            b"",
            {
                **headers,
                "Location": location,
                "X-Linked-Etag": f'"{blob.sha256}"',
                "X-Linked-Size": str(len(blob.data)),
            },
        )

    # -- storage host: presigned URLs only, no bearer token, as on S3

    def _storage_routes(self) -> list[Route]:
        return [
            _route(
                "PUT",
                rf"/upload/(?P<api_type>models|datasets|spaces)/{_REPO}/(?P<oid>[0-9a-f]{{64}})",
                self._store_object,
            ),
            _route("GET", rf"/download/{_WEB_REPO}/(?P<oid>[0-9a-f]{{64}})", self._serve_object),
        ]

    def _store_object(self, request: _Request, api_type: str, ns: str, name: str, oid: str) -> _Response:
        target = f"{api_type}/{ns}/{name}/{oid}"
        self._check_signature(request, "upload", target, request.query.get("size", ""))
        if hashlib.sha256(request.body).hexdigest() != oid or str(len(request.body)) != request.query.get("size"):
            raise HubError(400, f"Uploaded content does not match sha256 {oid} and size {request.query.get('size')}")
        with self._lock:
            self._get(_API_TYPES[api_type], f"{ns}/{name}").lfs_objects[oid] = request.body
        # S3 answers with the part's ETag, which multipart completion would need
        return _Response(200, headers={"ETag": f'"{hashlib.md5(request.body, usedforsecurity=False).hexdigest()}"'})

    def _serve_object(self, request: _Request, ns: str, name: str, oid: str, prefix: str = "") -> _Response:
        self._check_signature(request, "download", f"{URL_PREFIXES[_web_type(prefix)]}{ns}/{name}/{oid}")
        with self._lock:
            data = self._get(_web_type(prefix), f"{ns}/{name}").lfs_objects[oid]
        return _Response(200, data, {"Content-Type": "application/octet-stream"})


def _flag(request: _Request, name: str) -> bool:
    return request.query.get(name, "").lower() in ("1", "true")  # httpx writes True as "true"


def _web_type(prefix: str) -> str:
    return {"datasets": "dataset", "spaces": "space"}.get(prefix, "model")


def _writable(repo: _Repo, revision: str) -> _Repo:
    if revision != MAIN:
        raise HubError(404, f"This fake Hub only writes to {MAIN}, not {revision}", "RevisionNotFound")
    return repo


def _no_pull_requests(request: _Request) -> None:
    if request.query.get("create_pr"):
        raise HubError(501, "This fake Hub does not implement pull requests")


def _apply(repo: _Repo, operations: list[tuple[str | None, Json]]) -> tuple[dict[str, _Blob], list[str], list[str]]:
    """The head tree with the commit's operations applied, checked in full before anything is stored."""
    tree = dict(repo.head.tree)
    changed: list[str] = []
    deleted: list[str] = []
    for key, value in operations:
        path = value.get("path")
        if not isinstance(path, str) or not path:
            raise HubError(400, f"Operation {key} needs a path")
        if key == "file":
            tree[path] = _Blob(_decode(value), lfs=False)
            changed.append(path)
        elif key == "lfsFile":
            tree[path] = _lfs_blob(repo, value)
            changed.append(path)
        elif key in ("deletedFile", "deletedFolder"):
            gone = (
                [p for p in tree if p == path]
                if key == "deletedFile"
                else [p for p in tree if p.startswith(f"{path.rstrip('/')}/")]
            )
            if not gone:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            deleted.extend(gone)
            for p in gone:
                del tree[p]
        else:
            raise HubError(400, f"Unknown commit operation {key!r}")
    return tree, changed, deleted


def _decode(value: Json) -> bytes:
    try:
        if value.get("encoding") == "base64" and isinstance(value.get("content"), str):
            return base64.b64decode(value["content"], validate=True)
    except ValueError:
        pass
    raise HubError(400, f"Regular file {value.get('path')} must come as base64 content")


def _lfs_blob(repo: _Repo, value: Json) -> _Blob:
    oid, size = value.get("oid"), value.get("size")
    data = repo.lfs_objects.get(oid) if value.get("algo") == "sha256" else None
    if data is None or (size is not None and size != len(data)):
        raise HubError(422, f"LFS file {value.get('path')}: no uploaded object with sha256 {oid} and size {size}")
    return _Blob(data, lfs=True)


__all__ = ["DEFAULT_USER", "LFS_THRESHOLD", "FakeHub", "HubError"]
