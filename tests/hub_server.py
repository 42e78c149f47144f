"""A small local Hugging Face Hub server for tests, so Hub code paths run without a network.

It speaks the subset of the Hub HTTP API that ``huggingface_hub`` 2.x and ``transformers`` use to push and
pull a repo: whoami, repo create / delete, README YAML validation, preupload (every file is "regular",
so contents travel base64 inside the NDJSON commit and no LFS / Xet path is used), commit, repo info,
tree listing and ``HEAD`` / ``GET`` on ``/{repo}/resolve/{rev}/{path}``. Repos live in a folder on disk;
each commit gets its own sha and branches are refs to commits.

``serve_local_hub(tmp_dir)`` points ``huggingface_hub`` (and transformers' shared ``HfApi``) at the
process-wide server, online, with a fresh repo store, cache and dummy token, and restores everything on
exit. ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are read once at import by ``huggingface_hub.constants``,
so the module attributes are patched, not only the environment.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["HubStore", "LocalHub", "get_local_hub", "serve_local_hub"]

USER = "user"
TOKEN = "hf_local_hub_dummy_token"
_REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}


class HubHTTPError(Exception):
    """An error answered to the client as ``status`` with ``X-Error-Code: code``."""

    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


def git_blob_sha1(data: bytes) -> str:
    """Git object id of a blob, which the Hub uses as oid and ETag of regular files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# ----------------------------------------------------------------------------------------------------------
# Storage: blobs/<oid>, repos/<type>/<owner>/<name>/{refs.json, commits/<sha>.json}
# ----------------------------------------------------------------------------------------------------------
class HubStore:
    """Repos, commits and blobs kept in ``root``; every method is safe to call from several threads."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()

    def _repo_dir(self, repo_type: str, repo_id: str) -> Path:
        return self.root / "repos" / repo_type / repo_id

    def exists(self, repo_type: str, repo_id: str) -> bool:
        return (self._repo_dir(repo_type, repo_id) / "refs.json").is_file()

    def _check_exists(self, repo_type: str, repo_id: str) -> None:
        if not self.exists(repo_type, repo_id):
            raise HubHTTPError(404, f"Repository {repo_id} ({repo_type}) not found", "RepoNotFound")

    def _refs(self, repo_type: str, repo_id: str) -> dict[str, str]:
        return json.loads((self._repo_dir(repo_type, repo_id) / "refs.json").read_text())

    def _commit(self, repo_type: str, repo_id: str, sha: str) -> dict[str, Any]:
        return json.loads((self._repo_dir(repo_type, repo_id) / "commits" / f"{sha}.json").read_text())

    def _write_commit(self, repo_type: str, repo_id: str, branch: str, commit: dict[str, Any]) -> str:
        sha = hashlib.sha1(
            json.dumps(commit, sort_keys=True).encode() + str(time.time_ns()).encode()
        ).hexdigest()
        repo_dir = self._repo_dir(repo_type, repo_id)
        (repo_dir / "commits").mkdir(parents=True, exist_ok=True)
        (repo_dir / "commits" / f"{sha}.json").write_text(json.dumps(commit))
        refs = self._refs(repo_type, repo_id) if self.exists(repo_type, repo_id) else {}
        refs[branch] = sha
        (repo_dir / "refs.json").write_text(json.dumps(refs))
        return sha

    def create(self, repo_type: str, repo_id: str) -> bool:
        """Create an empty repo with one initial commit on ``main``; False if it already exists."""
        with self._lock:
            if self.exists(repo_type, repo_id):
                return False
            commit = {"parent": None, "summary": "initial commit", "description": "", "files": {}}
            commit["date"] = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
            self._write_commit(repo_type, repo_id, "main", commit)
            return True

    def delete(self, repo_type: str, repo_id: str) -> None:
        import shutil

        with self._lock:
            self._check_exists(repo_type, repo_id)
            shutil.rmtree(self._repo_dir(repo_type, repo_id))

    def resolve(self, repo_type: str, repo_id: str, revision: str) -> str:
        """Commit sha of a branch name or a full commit sha."""
        with self._lock:
            self._check_exists(repo_type, repo_id)
            refs = self._refs(repo_type, repo_id)
            if revision in refs:
                return refs[revision]
            if (
                re.fullmatch(r"[0-9a-f]{40}", revision)
                and (self._repo_dir(repo_type, repo_id) / "commits" / f"{revision}.json").is_file()
            ):
                return revision
            raise HubHTTPError(404, f"Revision {revision!r} not found in {repo_id}", "RevisionNotFound")

    def commit_info(self, repo_type: str, repo_id: str, sha: str) -> dict[str, Any]:
        """The commit record: ``parent``, ``summary``, ``description``, ``date``, ``files`` {path: [oid, size]}."""
        with self._lock:
            return self._commit(repo_type, repo_id, sha)

    def files(self, repo_type: str, repo_id: str, revision: str) -> dict[str, tuple[str, int]]:
        """``{path: (oid, size)}`` at ``revision``."""
        with self._lock:
            sha = self.resolve(repo_type, repo_id, revision)
            return {
                p: (oid, size) for p, (oid, size) in self._commit(repo_type, repo_id, sha)["files"].items()
            }

    def read_blob(self, oid: str) -> bytes:
        return (self.root / "blobs" / oid).read_bytes()

    def commit(
        self,
        repo_type: str,
        repo_id: str,
        branch: str,
        summary: str,
        description: str,
        operations: list[tuple[str, str, bytes | None]],
        parent: str | None = None,
    ) -> str:
        """Apply ``(kind, path, content)`` operations (kind: file, deletedFile, deletedFolder) on ``branch``."""
        with self._lock:
            self._check_exists(repo_type, repo_id)
            if branch not in self._refs(repo_type, repo_id):
                raise HubHTTPError(404, f"Branch {branch!r} not found in {repo_id}", "RevisionNotFound")
            head = self._refs(repo_type, repo_id)[branch]
            if parent is not None and parent != head:
                raise HubHTTPError(412, f"parentCommit {parent} is not the head of {branch} ({head})")
            files = dict(self._commit(repo_type, repo_id, head)["files"])
            for kind, path, content in operations:
                if kind == "file":
                    assert content is not None
                    oid = git_blob_sha1(content)
                    blob = self.root / "blobs" / oid
                    if not blob.is_file():
                        blob.write_bytes(content)
                    files[path] = [oid, len(content)]
                elif kind == "deletedFile":
                    if files.pop(path, None) is None:
                        raise HubHTTPError(404, f"File {path} not found in {repo_id}", "EntryNotFound")
                else:  # deletedFolder
                    prefix = path.rstrip("/") + "/"
                    doomed = [p for p in files if p.startswith(prefix)]
                    if not doomed:
                        raise HubHTTPError(404, f"Folder {path} not found in {repo_id}", "EntryNotFound")
                    for p in doomed:
                        del files[p]
            date = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
            record = {
                "parent": head,
                "summary": summary,
                "description": description,
                "files": files,
                "date": date,
            }
            return self._write_commit(repo_type, repo_id, branch, record)


# ----------------------------------------------------------------------------------------------------------
# HTTP layer
# ----------------------------------------------------------------------------------------------------------
_REPO = r"(?P<repo>[^/]+/[^/]+)"
_TYPES = r"(?P<type>models|datasets|spaces)"
_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"/api/whoami-v2"), "whoami"),
    ("POST", re.compile(r"/api/repos/create"), "create_repo"),
    ("DELETE", re.compile(r"/api/repos/delete"), "delete_repo"),
    ("POST", re.compile(r"/api/validate-yaml"), "validate_yaml"),
    ("POST", re.compile(rf"/api/{_TYPES}/{_REPO}/preupload/(?P<rev>[^/]+)"), "preupload"),
    ("POST", re.compile(rf"/api/{_TYPES}/{_REPO}/commit/(?P<rev>[^/]+)"), "commit"),
    ("GET", re.compile(rf"/api/{_TYPES}/{_REPO}(?:/revision/(?P<rev>[^/]+))?"), "repo_info"),
    ("GET", re.compile(rf"/api/{_TYPES}/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?"), "tree"),
    (
        "HEAD",
        re.compile(rf"/(?:(?P<prefix>datasets|spaces)/)?{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"),
        "resolve",
    ),
    (
        "GET",
        re.compile(rf"/(?:(?P<prefix>datasets|spaces)/)?{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"),
        "resolve",
    ),
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: httpx reuses the connection
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence the stderr access log
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # ---- plumbing ------------------------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes, headers: dict[str, str], content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers or {}, "application/json")

    def _dispatch(self, method: str) -> None:
        hub = self.server.hub
        url = urlsplit(self.path)
        body = self._body() if method in ("POST", "DELETE") else b""
        hub.requests.append((method, url.path))
        try:
            for route_method, pattern, name in _ROUTES:
                match = pattern.fullmatch(url.path)
                if route_method == method and match:
                    params = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                    getattr(self, f"_{name}")(params, query, body)
                    return
            raise HubHTTPError(404, f"local hub: no route for {method} {url.path}")
        except HubHTTPError as e:
            headers = {"X-Error-Message": e.message, **e.headers}
            if e.code is not None:
                headers["X-Error-Code"] = e.code
            self._json({"error": e.message}, e.status, headers)

    def _require_token(self) -> None:
        if not self.headers.get("Authorization", "").startswith("Bearer "):
            raise HubHTTPError(401, "Invalid credentials in Authorization header")

    @property
    def _store(self) -> HubStore:
        return self.server.hub.store

    # ---- routes --------------------------------------------------------------------------------------------
    def _whoami(self, params: dict, query: dict, body: bytes) -> None:
        self._require_token()
        auth = {"type": "access_token", "accessToken": {"displayName": "local", "role": "write"}}
        self._json({"type": "user", "name": USER, "fullname": "Local Test User", "orgs": [], "auth": auth})

    def _repo_from_payload(self, body: bytes) -> tuple[str, str]:
        payload = json.loads(body or b"{}")
        name, namespace = payload.get("name"), payload.get("organization") or USER
        if not name or "/" in name:
            raise HubHTTPError(400, f"Invalid repo name {name!r}")
        return payload.get("type") or "model", f"{namespace}/{name}"

    def _create_repo(self, params: dict, query: dict, body: bytes) -> None:
        self._require_token()
        repo_type, repo_id = self._repo_from_payload(body)
        url = f"{self.server.hub.endpoint}/{_URL_PREFIX[repo_type]}{repo_id}"
        if not self._store.create(repo_type, repo_id):
            self._json({"error": f"You already created this {repo_type} repo", "url": url}, 409)
            return
        self._json({"url": url, "name": repo_id, "id": repo_id})

    def _delete_repo(self, params: dict, query: dict, body: bytes) -> None:
        self._require_token()
        self._store.delete(*self._repo_from_payload(body))
        self._json({})

    def _validate_yaml(self, params: dict, query: dict, body: bytes) -> None:
        self._json({"errors": [], "warnings": []})

    def _preupload(self, params: dict, query: dict, body: bytes) -> None:
        self._require_token()
        repo_type = _REPO_TYPES[params["type"]]
        current = self._store.files(repo_type, params["repo"], params["rev"])
        files = [
            {
                "path": f["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": current[f["path"]][0] if f["path"] in current else None,
            }
            for f in json.loads(body)["files"]
        ]
        self._json(
            {"files": files, "commitOid": self._store.resolve(repo_type, params["repo"], params["rev"])}
        )

    def _commit(self, params: dict, query: dict, body: bytes) -> None:
        self._require_token()
        if query.get("create_pr") == "1":
            raise HubHTTPError(400, "local hub does not support pull requests (create_pr=True)")
        repo_type, repo_id = _REPO_TYPES[params["type"]], params["repo"]
        header: dict[str, Any] = {}
        operations: list[tuple[str, str, bytes | None]] = []
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                raw = value["content"]
                content = base64.b64decode(raw) if value.get("encoding") == "base64" else raw.encode()
                operations.append(("file", value["path"], content))
            elif key in ("deletedFile", "deletedFolder"):
                operations.append((key, value["path"], None))
            else:
                raise HubHTTPError(400, f"local hub only takes regular files in commits, got {key!r}")
        sha = self._store.commit(
            repo_type,
            repo_id,
            params["rev"],
            header.get("summary", ""),
            header.get("description", ""),
            operations,
            parent=header.get("parentCommit"),
        )
        url = f"{self.server.hub.endpoint}/{_URL_PREFIX[repo_type]}{repo_id}/commit/{sha}"
        self._json({"success": True, "commitUrl": url, "commitOid": sha, "pullRequestUrl": None})

    def _repo_info(self, params: dict, query: dict, body: bytes) -> None:
        repo_type, repo_id = _REPO_TYPES[params["type"]], params["repo"]
        sha = self._store.resolve(repo_type, repo_id, params.get("rev", "main"))
        commit = self._store.commit_info(repo_type, repo_id, sha)
        siblings = [
            {"rfilename": p, "size": size, "blobId": oid}
            for p, (oid, size) in sorted(commit["files"].items())
        ]
        info = {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "author": repo_id.split("/")[0],
            "sha": sha,
            "lastModified": commit["date"],
            "createdAt": commit["date"],
            "private": False,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        if repo_type == "model":
            info["modelId"] = repo_id
        self._json(info)

    def _tree(self, params: dict, query: dict, body: bytes) -> None:
        repo_type, repo_id = _REPO_TYPES[params["type"]], params["repo"]
        files = self._store.files(repo_type, repo_id, params["rev"])
        base = params.get("path", "").strip("/")
        prefix = base + "/" if base else ""
        recursive = query.get("recursive", "false").lower() == "true"
        entries: dict[str, dict[str, Any]] = {}
        for path, (oid, size) in files.items():
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix) :].split("/")
            for depth in range(1, len(parts)):  # folders on the way
                folder = prefix + "/".join(parts[:depth])
                if recursive or depth == 1:
                    entries[folder] = {
                        "type": "directory",
                        "oid": git_blob_sha1(folder.encode()),
                        "size": 0,
                        "path": folder,
                    }
            if recursive or len(parts) == 1:
                entries[path] = {"type": "file", "oid": oid, "size": size, "path": path}
        if base and not entries:
            raise HubHTTPError(404, f"Folder {base} not found in {repo_id}", "EntryNotFound")
        self._json([entries[p] for p in sorted(entries)])

    def _resolve(self, params: dict, query: dict, body: bytes) -> None:
        repo_type = {"datasets": "dataset", "spaces": "space"}.get(params.get("prefix", ""), "model")
        repo_id, path = params["repo"], params["path"]
        sha = self._store.resolve(repo_type, repo_id, params["rev"])
        files = self._store.files(repo_type, repo_id, sha)
        if path not in files:
            raise HubHTTPError(
                404, f"Entry {path} not found in {repo_id}", "EntryNotFound", {"X-Repo-Commit": sha}
            )
        oid, _ = files[path]
        headers = {"X-Repo-Commit": sha, "ETag": f'"{oid}"', "Accept-Ranges": "none"}
        self._send(200, self._store.read_blob(oid), headers, "application/octet-stream")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: LocalHub


# ----------------------------------------------------------------------------------------------------------
# The server object and the activation context
# ----------------------------------------------------------------------------------------------------------
@dataclass
class LocalHub:
    """A running local Hub on ``127.0.0.1``; ``store`` can be swapped for a fresh one between tests."""

    store: HubStore
    endpoint: str = ""
    token: str = TOKEN
    cache_dir: Path | None = None  # HF_HUB_CACHE while activated
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path) of every request served
    _server: _Server | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> LocalHub:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-hub", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def reset(self, root: str | os.PathLike) -> None:
        """Serve an empty repo store kept in ``root`` from now on."""
        self.store = HubStore(root)
        self.requests = []

    def create_repo(self, repo_id: str, repo_type: str = "model") -> None:
        """Create a repo directly in the store (no HTTP)."""
        self.store.create(repo_type, repo_id)

    def repo_exists(self, repo_id: str, repo_type: str = "model") -> bool:
        return self.store.exists(repo_type, repo_id)

    def repo_files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, bytes]:
        """``{path: bytes}`` of every file in the repo at ``revision``."""
        return {
            p: self.store.read_blob(oid)
            for p, (oid, _) in self.store.files(repo_type, repo_id, revision).items()
        }

    def commits(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> list[str]:
        """Commit shas from ``revision`` back to the initial commit, newest first."""
        sha: str | None = self.store.resolve(repo_type, repo_id, revision)
        out = []
        while sha is not None:
            out.append(sha)
            sha = self.store.commit_info(repo_type, repo_id, sha)["parent"]
        return out


_shared_hub: LocalHub | None = None


def get_local_hub(root: str | os.PathLike) -> LocalHub:
    """The process-wide server (started on first use, stopped at exit), serving a fresh store in ``root``."""
    global _shared_hub
    if _shared_hub is None:
        _shared_hub = LocalHub(store=HubStore(root)).start()
        atexit.register(_shared_hub.close)
    else:
        _shared_hub.reset(root)
    return _shared_hub


class _Patches:
    """Set attributes and environment variables, remembering the old values to restore them in reverse."""

    def __init__(self) -> None:
        self._undo: list[Any] = []

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        self._undo.append((setattr, obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def setenv(self, name: str, value: str) -> None:
        self._undo.append((os.environ, name, os.environ.get(name)))
        os.environ[name] = value

    def undo(self) -> None:
        for item in reversed(self._undo):
            if len(item) == 4:
                item[0](item[1], item[2], item[3])
            elif item[2] is None:
                item[0].pop(item[1], None)
            else:
                item[0][item[1]] = item[2]
        self._undo.clear()


def _drop_cached_clients() -> None:
    """Forget Hub clients that captured an endpoint when they were built."""
    if (hub_utils := sys.modules.get("transformers.utils.hub")) is not None:
        hub_utils._hf_api = None
    if (hf_fs := sys.modules.get("huggingface_hub.hf_file_system")) is not None:
        hf_fs.HfFileSystem.clear_instance_cache()


@contextlib.contextmanager
def serve_local_hub(tmp_dir: str | os.PathLike) -> Iterator[LocalHub]:
    """Point ``huggingface_hub`` / ``transformers`` at a fresh local Hub, online, until the block exits.

    ``tmp_dir`` holds the repo store (``hub-repos``) and ``HF_HOME`` (``hf-home``, cache in ``hf-home/hub``).
    """
    import huggingface_hub.hf_api
    from huggingface_hub import constants
    from huggingface_hub.utils import _cache_manager

    tmp_dir = Path(tmp_dir)
    hub = get_local_hub(tmp_dir / "hub-repos")
    home = tmp_dir / "hf-home"
    cache = home / "hub"
    cache.mkdir(parents=True, exist_ok=True)
    hub.cache_dir = cache

    patches = _Patches()
    try:
        for name, value in {
            "HF_ENDPOINT": hub.endpoint,
            "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0",
            "HF_TOKEN": hub.token,
            "HF_HOME": str(home),
            "HF_HUB_CACHE": str(cache),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "DISABLE_SAFETENSORS_CONVERSION": "1",
        }.items():
            patches.setenv(name, value)
        for name, value in {
            "ENDPOINT": hub.endpoint,
            "HUGGINGFACE_CO_URL_TEMPLATE": hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
            "HF_URL_HOSTS": constants.HF_URL_HOSTS | {"127.0.0.1"},
            "HF_HUB_OFFLINE": False,
            "HF_HUB_DISABLE_TELEMETRY": True,
            "HF_HOME": str(home),
            "HF_HUB_CACHE": str(cache),
            "HUGGINGFACE_HUB_CACHE": str(cache),
            "HF_ASSETS_CACHE": str(home / "assets"),
            "HF_XET_CACHE": str(home / "xet"),
            "HF_TOKEN_PATH": str(home / "token"),
            "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
            "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
        }.items():
            if hasattr(constants, name):
                patches.setattr(constants, name, value)
        patches.setattr(_cache_manager, "HF_HUB_CACHE", str(cache))
        patches.setattr(
            huggingface_hub.hf_api.api, "endpoint", hub.endpoint
        )  # behind create_repo(), upload_folder()...
        _drop_cached_clients()
        yield hub
    finally:
        patches.undo()
        _drop_cached_clients()
        hub.cache_dir = None
