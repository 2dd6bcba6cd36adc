"""A small Hugging Face hub on 127.0.0.1, for download tests (a real HTTP server, not a mock).

It speaks the part of the hub's HTTP API that ``huggingface_hub`` (1.x and 2.x) uses to look up a
model repo and fetch files from it:

- ``GET /api/models/{repo}`` and ``GET /api/models/{repo}/revision/{rev}``: repo info (``id``, ``sha``,
  ``private``, ``gated``, ``siblings``; with ``?blobs=true`` the siblings carry size, blob id, LFS info);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=..``: the file listing (size, git blob oid,
  ``lfs: {oid: sha256, size, pointerSize}``), paginated with a ``Link: <...>; rel="next"`` header;
- ``POST /api/models/{repo}/paths-info/{rev}`` (form ``paths=...``): the same entries for given paths;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: the file, with ``ETag`` (git blob sha1, or sha256 for
  LFS files), ``X-Repo-Commit``, ``X-Linked-Etag`` / ``X-Linked-Size`` (LFS files), ``Content-Length``,
  ``Accept-Ranges``; ``Range: bytes=N-`` / ``bytes=N-M`` gives 206 with ``Content-Range`` (416 past the end).

Errors carry the headers ``huggingface_hub`` turns into typed exceptions: ``X-Error-Code``
(``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``) and ``X-Error-Message``
(``Invalid credentials in Authorization header`` for an unknown token, 401 on every endpoint, as the
real hub does). Private repos answer like missing ones (401 without a token, 404 with one). Gated
repos show their metadata to anyone; their files need a token on the repo's allow list (401 without a
token, 403 with a valid token that has not been granted access).

Fault injection:
- :meth:`HubServer.drop_after`: the next GET of a file (once) sends its headers and ``nbytes`` bytes of
  the body, then closes the connection (a network drop mid-file);
- :meth:`HubServer.tamper`: GETs of a file serve other bytes than the metadata announces, until
  :meth:`HubServer.clear_faults`: ``"truncate"`` (fewer bytes, with a consistent ``Content-Length``,
  like a bad mirror) or ``"flip"`` (same length, one byte changed).

Every request is recorded in :attr:`HubServer.requests` (method, repo, file, Range header, Authorization
header, status), so tests can assert what the client sent.

Serve a directory as a repo with :meth:`HubServer.add_repo`; start and stop the server with ``with``.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
LFS_MIN_SIZE = 10 * 1024 * 1024  # bigger files are LFS whatever their name (the hub's default .gitattributes)
LFS_POINTER_SIZE = 134
CHUNK = 1 << 20

TamperMode = Literal["truncate", "flip"]


@dataclass(frozen=True)
class HubFile:
    """One file of a served commit: where its bytes are, and the metadata the hub announces."""

    path: str  # repo path, "/"-separated
    source: Path  # file on disk holding its bytes
    size: int
    git_oid: str  # sha1 of b"blob {size}\0" + content (what git and the hub call the blob id)
    sha256: str
    lfs: bool

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid

    def tree_entry(self) -> dict:
        entry: dict = {"type": "file", "oid": self.git_oid, "size": self.size, "path": self.path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": LFS_POINTER_SIZE}
        return entry


@dataclass
class HubRepo:
    repo_id: str
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)  # sha -> path -> file
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> sha
    private: bool = False
    gated: bool = False
    allowed_tokens: set[str] = field(default_factory=set)  # who may read files of a private/gated repo

    def resolve(self, rev: str) -> str | None:
        """Commit sha of a branch, tag or full commit sha; None when unknown."""
        if rev in self.refs:
            return self.refs[rev]
        return rev if rev in self.commits else None


@dataclass
class Request:
    method: str
    path: str  # URL path as received
    repo_id: str | None
    filename: str | None  # for resolve requests
    range: str | None  # the Range header
    authorization: str | None  # the Authorization header
    status: int = 0
    body_bytes: int = 0  # body bytes actually sent


_DESCRIBED: dict[tuple[str, str, int, int], HubFile] = {}  # hashing is the slow part of add_repo: do it once


def _describe_file(path: str, source: Path) -> HubFile:
    st = source.stat()
    key = (path, str(source.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DESCRIBED:
        _DESCRIBED[key] = _hash_file(path, source)
    return _DESCRIBED[key]


def _hash_file(path: str, source: Path) -> HubFile:
    sha1 = hashlib.sha1()
    sha256 = hashlib.sha256()
    size = source.stat().st_size
    sha1.update(f"blob {size}\0".encode())
    with source.open("rb") as f:
        while chunk := f.read(CHUNK):
            sha1.update(chunk)
            sha256.update(chunk)
    lfs = path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE
    return HubFile(path, source, size, sha1.hexdigest(), sha256.hexdigest(), lfs)


def _commit_sha(files: dict[str, HubFile], salt: str) -> str:
    h = hashlib.sha1(salt.encode())
    for p in sorted(files):
        h.update(f"{p}\0{files[p].git_oid}\n".encode())
    return h.hexdigest()


class HubServer:
    """A threaded HTTP hub on 127.0.0.1 (random free port). Use as a context manager."""

    def __init__(self, *, tokens: tuple[str, ...] = (), page_size: int = 1000) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.tokens: set[str] = set(tokens)  # every token the hub knows; others get 401
        self.page_size = page_size  # tree entries per page
        self._requests: list[Request] = []
        self._inflight = 0  # requests being handled right now
        self._drops: dict[tuple[str, str], int] = {}
        self._tampers: dict[tuple[str, str], TamperMode] = {}
        self.chunk_delay = 0.0  # seconds before each 1 MiB of a file's body (a slow link; set it any time)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # --- content -----------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        root: Path,
        *,
        refs: tuple[str, ...] = ("main",),
        private: bool = False,
        gated: bool = False,
        allowed_tokens: tuple[str, ...] = (),
    ) -> str:
        """Serve every file under ``root`` as one commit of ``repo_id``; return the commit sha.

        Calling it again for the same repo adds another commit (``refs`` then move to it). The files
        are read from ``root`` on each request, so do not change them while serving.
        """
        files = {
            p.relative_to(root).as_posix(): p
            for p in sorted(root.rglob("*"))
            if p.is_file() and ".cache" not in p.relative_to(root).parts
        }
        described = {rel: _describe_file(rel, src) for rel, src in files.items()}
        with self._lock:
            repo = self.repos.setdefault(repo_id, HubRepo(repo_id))
            sha = _commit_sha(described, f"{repo_id}:{len(repo.commits)}")
            repo.commits[sha] = described
            for ref in refs:
                repo.refs[ref] = sha
            repo.private = private
            repo.gated = gated
            repo.allowed_tokens |= set(allowed_tokens)
            self.tokens |= set(allowed_tokens)
        return sha

    def file(self, repo_id: str, path: str, revision: str = "main") -> HubFile:
        repo = self.repos[repo_id]
        return repo.commits[repo.resolve(revision)][path]  # type: ignore[index]

    # --- faults ------------------------------------------------------------------------------

    def drop_after(self, repo_id: str, path: str, nbytes: int) -> None:
        """Make the next GET of ``path`` send ``nbytes`` body bytes, then drop the connection."""
        with self._lock:
            self._drops[(repo_id, path)] = nbytes

    def tamper(self, repo_id: str, path: str, mode: TamperMode) -> None:
        """Serve wrong bytes for ``path`` on GET (metadata keeps announcing the true size/hash)."""
        with self._lock:
            self._tampers[(repo_id, path)] = mode

    def clear_faults(self) -> None:
        with self._lock:
            self._drops.clear()
            self._tampers.clear()

    @property
    def requests(self) -> list[Request]:
        """Every request so far, in arrival order, once the handlers in flight have finished.

        (A client can hold a whole response before the server thread that sent it is done with it.)
        """
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0, timeout=10)
            return list(self._requests)

    def requests_for(self, filename: str, method: str = "GET") -> list[Request]:
        return [r for r in self.requests if r.filename == filename and r.method == method]

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        assert self._httpd is None, "already started"
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.hub = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()  # joins the request threads (block_on_close)
        assert self._thread is not None
        self._thread.join(timeout=5)
        self._httpd = None
        self._thread = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- request handling (called from handler threads) -------------------------------------

    def _take_fault(self, repo_id: str, path: str) -> tuple[int | None, TamperMode | None]:
        with self._lock:
            return self._drops.pop((repo_id, path), None), self._tampers.get((repo_id, path))

    def _begin(self) -> None:
        with self._idle:
            self._inflight += 1

    def _end(self, req: Request) -> None:
        with self._idle:
            self._requests.append(req)
            self._inflight -= 1
            self._idle.notify_all()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = False  # server_close() waits for in-flight requests: nothing outlives stop()
    block_on_close = True
    request_queue_size = 128  # the default 5 drops SYNs of parallel downloads (1 s retransmit stalls)
    hub: HubServer


class _HttpError(Exception):
    def __init__(self, status: int, code: str | None = None, message: str | None = None, commit: str | None = None):
        super().__init__(message or code or str(status))
        self.status, self.code, self.message, self.commit = status, code, message, commit


class _Handler(http.server.BaseHTTPRequestHandler):
    # HTTP/1.0: one request per connection, so no keep-alive socket outlives the server.
    protocol_version = "HTTP/1.0"
    timeout = 10
    server: _Server

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet
        pass

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # --- plumbing ----------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        hub = self.server.hub
        url = urlsplit(self.path)
        req = Request(method, url.path, None, None, self.headers.get("Range"), self.headers.get("Authorization"))
        self._req = req
        hub._begin()
        try:
            token = self._token()
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if len(parts) >= 3 and parts[0] == "api" and parts[1] == "models":
                self._api(method, parts[2:], query, token)
            elif len(parts) >= 5 and parts[2] == "resolve" and method in ("HEAD", "GET"):
                # /{org}/{name}/resolve/{rev}/{path...}; rev arrives %-quoted as one segment
                raw = url.path.split("/")[1:]
                req.repo_id = f"{parts[0]}/{parts[1]}"
                req.filename = "/".join(unquote(p) for p in raw[4:])
                self._resolve(method, req.repo_id, parts[3], req.filename, token)
            else:
                raise _HttpError(404, message="Not Found")
        except _HttpError as e:
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away
        finally:
            hub._end(req)

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization")
        if auth is None:
            return None
        token = auth.removeprefix("Bearer ").strip()
        if token not in self.server.hub.tokens:
            raise _HttpError(401, message="Invalid credentials in Authorization header")
        return token

    def _send_error(self, e: _HttpError) -> None:
        body = json.dumps({"error": e.message or e.code or "error"}).encode()
        self.send_response(e.status)
        if e.code:
            self.send_header("X-Error-Code", e.code)
        if e.message:
            self.send_header("X-Error-Message", e.message)
        if e.commit:
            self.send_header("X-Repo-Commit", e.commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self._req.status = e.status
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, data: object, extra_headers: dict[str, str] | None = None) -> None:
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self._req.status = 200
        self.wfile.write(body)
        self._req.body_bytes = len(body)

    def _repo(self, repo_id: str, token: str | None) -> HubRepo:
        repo = self.server.hub.repos.get(repo_id)
        if repo is None or (repo.private and token not in repo.allowed_tokens):
            # Like the hub: without a token, "missing" and "private" both answer 401.
            raise _HttpError(
                401 if token is None else 404, "RepoNotFound", "Repository not found"
            )
        return repo

    def _commit(self, repo: HubRepo, rev: str) -> tuple[str, dict[str, HubFile]]:
        sha = repo.resolve(rev)
        if sha is None:
            raise _HttpError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return sha, repo.commits[sha]

    # --- /api/models/... ---------------------------------------------------------------------

    def _api(self, method: str, parts: list[str], query: dict[str, str], token: str | None) -> None:
        if len(parts) < 2:
            raise _HttpError(404, message="Not Found")
        repo_id = f"{parts[0]}/{parts[1]}"
        self._req.repo_id = repo_id
        rest = parts[2:]
        repo = self._repo(repo_id, token)
        if method == "GET" and (not rest or (rest[0] == "revision" and len(rest) == 2)):
            sha, files = self._commit(repo, rest[1] if rest else "main")
            self._send_json(self._info(repo, sha, files, blobs=query.get("blobs", "").lower() in ("1", "true")))
        elif method == "GET" and len(rest) >= 2 and rest[0] == "tree":
            sha, files = self._commit(repo, rest[1])
            self._tree(repo_id, rest[1], sha, files, "/".join(rest[2:]), query)
        elif method == "POST" and len(rest) == 2 and rest[0] == "paths-info":
            sha, files = self._commit(repo, rest[1])
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode())
            wanted = form.get("paths", [])
            self._send_json([e for e in _entries(files, "", recursive=True) if e["path"] in wanted])
        else:
            raise _HttpError(404, message="Not Found")

    @staticmethod
    def _info(repo: HubRepo, sha: str, files: dict[str, HubFile], *, blobs: bool) -> dict:
        siblings = []
        for f in files.values():
            s: dict = {"rfilename": f.path}
            if blobs:
                s |= {"size": f.size, "blobId": f.git_oid}
                if f.lfs:
                    s["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": LFS_POINTER_SIZE}
            siblings.append(s)
        return {
            "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": sha,
            "lastModified": "2026-01-01T00:00:00.000Z",
            "createdAt": "2026-01-01T00:00:00.000Z",
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": ["safetensors", "gpt_oss"],
            "library_name": "transformers",
            "siblings": siblings,
            "usedStorage": sum(f.size for f in files.values()),
        }

    def _tree(self, repo_id: str, rev: str, sha: str, files: dict[str, HubFile], path: str, query: dict) -> None:
        recursive = query.get("recursive", "").lower() in ("1", "true")
        if path and path not in files and not any(p.startswith(path + "/") for p in files):
            raise _HttpError(404, "EntryNotFound", f"{path} does not exist on {rev}", commit=sha)
        entries = _entries(files, path, recursive=recursive)
        start = int(query.get("cursor", "0"))
        page = entries[start : start + self.server.hub.page_size]
        headers = {}
        if start + len(page) < len(entries):
            host, port = self.server.server_address[:2]
            tail = "/" + quote(path, safe="") if path else ""
            nxt = (
                f"http://{host}:{port}/api/models/{repo_id}/tree/{quote(rev, safe='')}{tail}"
                f"?recursive={str(recursive).lower()}&expand=false&cursor={start + len(page)}"
            )
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._send_json(page, headers)

    # --- /{repo}/resolve/{rev}/{path} -------------------------------------------------------

    def _resolve(self, method: str, repo_id: str, rev: str, filename: str, token: str | None) -> None:
        hub = self.server.hub
        repo = self._repo(repo_id, token)
        sha, files = self._commit(repo, rev)
        if repo.gated and token not in repo.allowed_tokens:
            message = (
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it."
                if token is None
                else f"Access to model {repo_id} is restricted and you are not in the authorized list."
            )
            raise _HttpError(401 if token is None else 403, "GatedRepo", message)
        f = files.get(filename)
        if f is None:
            raise _HttpError(404, "EntryNotFound", f"{filename} does not exist on {rev}", commit=sha)

        drop, tamper = hub._take_fault(repo_id, filename) if method == "GET" else (None, None)
        served_size = f.size - max(1, f.size // 3) if tamper == "truncate" else f.size
        start, stop = 0, served_size  # [start, stop)
        status = 200
        rng = self.headers.get("Range")
        if rng is not None and method == "GET":
            first, _, last = rng.removeprefix("bytes=").partition("-")
            start = int(first)
            stop = min(int(last) + 1, served_size) if last else served_size
            if start >= served_size:
                raise _HttpError(416, message=f"Range {rng} not satisfiable")
            status = 206

        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{f.etag}"')
        if f.lfs:
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(f.size))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{served_size}")
        self.send_header("Content-Length", str(stop - start if method == "GET" else f.size))
        self.end_headers()
        self._req.status = status
        if method == "HEAD":
            return
        self._send_body(f, start, stop, drop, tamper)

    def _send_body(self, f: HubFile, start: int, stop: int, drop: int | None, tamper: TamperMode | None) -> None:
        limit = stop if drop is None else min(stop, start + drop)
        flip_at = f.size // 2 if tamper == "flip" else -1
        with f.source.open("rb") as src:
            src.seek(start)
            pos = start
            while pos < limit:
                chunk = bytearray(src.read(min(CHUNK, limit - pos)))
                if not chunk:
                    break
                if pos <= flip_at < pos + len(chunk):
                    chunk[flip_at - pos] ^= 0xFF
                if self.server.hub.chunk_delay:
                    time.sleep(self.server.hub.chunk_delay)
                self.wfile.write(chunk)
                pos += len(chunk)
                self._req.body_bytes += len(chunk)
        if drop is not None:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True


def _entries(files: dict[str, HubFile], path: str, *, recursive: bool) -> list[dict]:
    """Tree entries under ``path`` (directories first, like the hub), one level or all levels."""
    prefix = path + "/" if path else ""
    dirs: dict[str, None] = {}
    out_files = []
    for p in sorted(files):
        if not p.startswith(prefix):
            continue
        rest = p[len(prefix) :].split("/")
        for depth in range(1, len(rest)):
            if depth == 1 or recursive:
                dirs[prefix + "/".join(rest[:depth])] = None
        if len(rest) == 1 or recursive:
            out_files.append(files[p].tree_entry())
    dir_entries = [
        {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d} for d in dirs
    ]
    return dir_entries + out_files
