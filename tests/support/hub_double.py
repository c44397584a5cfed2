"""A local stand-in for the Hugging Face hub: the requests huggingface_hub's ``snapshot_download``
makes, answered over real HTTP from files held in memory. Reached through ``HF_ENDPOINT``.

Answered (read from huggingface_hub 2.4's ``hf_api.py``, ``file_download.py``, ``_snapshot_download.py``):

* ``GET /api/models/ORG/NAME/revision/REV``: the model info (``id``, ``sha``, ``siblings``; with
  ``?blobs=true`` each sibling's ``size``, ``blobId`` and ``lfs``);
* ``GET /api/models/ORG/NAME/tree/REV``: the recursive file listing (``type``, ``path``, ``size``,
  ``oid``, and ``lfs`` for weight files);
* ``HEAD`` and ``GET /ORG/NAME/resolve/REV/FILE``: ``X-Repo-Commit``, ``ETag`` (``X-Linked-Etag`` and
  ``X-Linked-Size`` for LFS files), ``Content-Length``, and ``Range: bytes=N-`` answered with 206.

Errors carry the ``X-Error-Code`` the library maps to its exceptions (``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``). Every request is recorded, and a file can
be made to break its next transfer halfway (the connection is cut after half the body), or to send
other bytes than the listing describes.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    refs: dict[str, str] = field(default_factory=dict)
    #: A token the requests must carry (a gated repository), or None.
    token: str | None = None
    #: Files whose transfer sends these bytes instead of the ones the listing and headers describe.
    altered: dict[str, bytes] = field(default_factory=dict)

    def commit_for(self, revision: str) -> str | None:
        if revision == self.commit:
            return revision
        if revision == "main":
            return self.commit
        if revision in self.refs.values():  # the commit a tag or branch points at
            return revision
        return self.refs.get(revision)


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    #: The first byte a ``Range: bytes=N-`` header asked for (None: no Range header).
    range_start: int | None
    authorization: str | None
    #: The query string (``blobs=True`` when huggingface_hub asks for the files' hashes).
    query: str = ""


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by its path relative to it."""
    return {path.relative_to(directory).as_posix(): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


class HubDouble:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Seen] = []
        self._cut: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- set-up ---------------------------------------------------------------------------------

    def publish(self, repo: str, files: Mapping[str, bytes], *, commit: str | None = None,
                refs: Mapping[str, str] | None = None, token: str | None = None) -> str:
        """Serve ``files`` as ``repo`` at one commit (derived from the content unless given)."""
        if commit is None:
            digest = hashlib.sha1()
            for name in sorted(files):
                digest.update(name.encode() + b"\0" + files[name])
            commit = digest.hexdigest()
        self.repos[repo] = Repo(dict(files), commit, dict(refs or {}), token)
        return commit

    def alter_transfers(self, repo: str, filename: str, data: bytes) -> None:
        """Every later transfer of this file sends ``data``, while the listing, the API and the headers
        still describe the published file (a mirror or proxy that changes what it passes on)."""
        with self._lock:
            self.repos[repo].altered[filename] = data

    def cut_next_transfer(self, repo: str, filename: str) -> None:
        """The next GET of this file sends half its bytes, then the connection drops."""
        with self._lock:
            self._cut.add((repo, filename))

    def downloads(self, method: str = "GET") -> list[Seen]:
        """The file transfers seen so far (``/resolve/`` requests of ``method``)."""
        with self._lock:
            return [seen for seen in self.requests if seen.method == method and "/resolve/" in seen.path]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    # --- server ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubDouble:
        double = self

        class Handler(_Handler):
            hub = double

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-double", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> HubDouble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    hub: HubDouble
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    # --- helpers --------------------------------------------------------------------------------

    def _record(self, path: str) -> None:
        header = self.headers.get("Range")
        start = None
        if header and header.startswith("bytes="):
            start = int(header[len("bytes="):].split("-", 1)[0] or 0)
        with self.hub._lock:
            self.hub.requests.append(Seen(self.command, path, start, self.headers.get("Authorization"),
                                          urlsplit(self.path).query))

    def _send(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, extra: Mapping[str, str] | None = None) -> None:
        body = json.dumps({"error": code}).encode()
        self._send(status, body, {"X-Error-Code": code, "X-Error-Message": code, **(extra or {})})

    def _repo(self, name: str) -> Repo | None:
        repo = self.hub.repos.get(name)
        if repo is None:
            self._error(401, "RepoNotFound")
            return None
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            self._error(401, "GatedRepo")
            return None
        return repo

    # --- routes ---------------------------------------------------------------------------------

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        path = urlsplit(self.path).path
        self._record(path)
        parts = [unquote(part) for part in path.strip("/").split("/")]
        if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] in ("revision", "tree"):
            blobs = "blobs=true" in urlsplit(self.path).query.lower()
            self._api("/".join(parts[2:4]), parts[4], parts[5], blobs)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        else:
            self._error(404, "NotFound")

    def _api(self, name: str, what: str, revision: str, blobs: bool = False) -> None:
        repo = self._repo(name)
        if repo is None:
            return
        commit = repo.commit_for(revision)
        if commit is None:
            self._error(404, "RevisionNotFound")
            return
        if what == "revision":
            body = {"id": name, "modelId": name, "sha": commit, "private": False,
                    "gated": repo.token is not None and "manual",
                    "siblings": [self._sibling(filename, data, blobs) for filename, data in sorted(repo.files.items())]}
        else:
            body = [self._tree_entry(filename, data) for filename, data in sorted(repo.files.items())]
        self._send(200, json.dumps(body).encode())

    @staticmethod
    def _sibling(filename: str, data: bytes, blobs: bool) -> dict[str, object]:
        """A file of the model info; with ``?blobs=true`` (``files_metadata``) its size, Git blob id and LFS sha256."""
        if not blobs:
            return {"rfilename": filename}
        entry: dict[str, object] = {"rfilename": filename, "size": len(data), "blobId": git_oid(data)}
        if filename.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    @staticmethod
    def _tree_entry(filename: str, data: bytes) -> dict[str, object]:
        entry: dict[str, object] = {"type": "file", "path": filename, "size": len(data), "oid": git_oid(data)}
        if filename.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _resolve(self, name: str, revision: str, filename: str) -> None:
        repo = self._repo(name)
        if repo is None:
            return
        commit = repo.commit_for(revision)
        if commit is None:
            self._error(404, "RevisionNotFound")
            return
        data = repo.files.get(filename)
        if data is None:
            self._error(404, "EntryNotFound", {"X-Repo-Commit": commit})
            return
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes", "ETag": f'"{git_oid(data)}"'}
        if filename.endswith(LFS_SUFFIXES):
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(data))
        if self.command == "HEAD":
            self._send(200, data, headers, "application/octet-stream")
            return
        start = 0
        header = self.headers.get("Range")
        if header and header.startswith("bytes="):
            start = int(header[len("bytes="):].split("-", 1)[0] or 0)
        body = repo.altered.get(filename, data)[start:]
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        with self.hub._lock:
            cut = (name, filename) in self.hub._cut
            self.hub._cut.discard((name, filename))
        if not cut:
            self._send(status, body, headers, "application/octet-stream")
            return
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body[: len(body) // 2])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)


# --- the tiny model as a hub repository -----------------------------------------------------------

#: The repository the fetch tests publish the tiny model under, and its test recipe's key.
FETCH_REPO = "carbonforge-test/tiny-fetch"
FETCH_KEY = "cf-tiny-fetch:bf16:chat:cpu"
FETCH_SERVED_NAME = "carbonforge/tiny-fetch"
#: Files of the repository that serving does not read: fetch must leave them on the hub.
NOT_FETCHED = {
    "README.md": b"# tiny-fetch\nA random-weight model for tests.\n",
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    "pytorch_model.bin": b"\0" * 4096,  # a duplicate checkpoint: vLLM loads the safetensors
    "original/params.bin": b"\1" * 512,
}


def tiny_repo_files(model_dir: Path) -> dict[str, bytes]:
    """The tiny model's files as a hub repository (without the runtime's build marker), plus files
    serving does not need."""
    files = {name: data for name, data in files_of(model_dir).items() if not name.startswith("carbonforge-")}
    return {**files, **NOT_FETCHED}


def write_fetch_recipe(directory: Path, *, key: str = FETCH_KEY, repo: str = FETCH_REPO,
                       served_name: str = FETCH_SERVED_NAME, revision: str | None = None,
                       plan: str = "free") -> Path:
    """A CPU recipe that serves ``repo`` from the hub cache (not the built-in model)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        f"key: {key}",
        f"plan: {plan}",
        "description: The tiny CPU model published on a hub double, for the fetch tests.",
        "model:",
        f"  repo: {repo}",
        f"  served_name: {served_name}",
        *([f"  revision: '{revision}'"] if revision else []),
        "vllm:",
        "  dtype: bfloat16",
        "  max_model_len: 2048",
        "  max_num_seqs: 4",
        "drain_timeout_s: 10",
        "env:",
        "  VLLM_CPU_KVCACHE_SPACE: '1'",
        "scheduler:",
        "  family: fcfs",
        "  params: {}",
        "controller:",
        "  policy: none",
        "benchmark:",
        "  measured_on: null",
        "  date: null",
        "  figures: {}",
    ]
    path = directory / (key.replace(":", "--") + ".yaml")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def fetch_env(hub_url: str | None, recipes_dir: Path, hf_home: Path, **extra: str) -> dict[str, str]:
    """The environment of a runtime command against the double: the hub at ``hub_url`` (None: no
    HF_ENDPOINT), ``hf_home`` as HF_HOME, no proxy, no licence, no Hugging Face variable of the caller."""
    env = {name: value for name, value in os.environ.items()
           if not name.lower().endswith("_proxy") and not name.startswith(("HF_", "HUGGINGFACE_"))
           and name not in ("CF_CONTEXT_KEY", "CARBONFORGE_LICENSE_KEY", "TRANSFORMERS_OFFLINE")}
    env.update({"CF_RECIPES_DIR": str(recipes_dir), "HF_HOME": str(hf_home), "HF_HUB_DISABLE_TELEMETRY": "1",
                "CF_LICENSE_FILE": str(hf_home / "no-licence.key"), "PYTHONUNBUFFERED": "1"})
    if hub_url:
        env["HF_ENDPOINT"] = hub_url
    env.update(extra)
    return env


def run_runtime(args: list[str], env: Mapping[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m carbonforge_runtime ARGS`` to completion, its output captured (stdout, stderr)."""
    return subprocess.run([sys.executable, "-m", "carbonforge_runtime", *args], env=dict(env), capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)


def snapshot_dir(cache: Path, repo: str, commit: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--")) / "snapshots" / commit
