"""Get gpt-oss checkpoints from the Hugging Face hub, and turn a "source" (path or repo id) into a directory.

Everything goes through ``huggingface_hub``, so its conventions hold: files land in its cache
(``HF_HOME`` / ``HF_HUB_CACHE``, layout ``models--ORG--NAME/{refs,blobs,snapshots/SHA}``) or in
``local_dir``; ``HF_TOKEN`` (or the token saved by ``hf auth login``) authenticates; ``HF_ENDPOINT``
picks the hub; ``HF_HUB_OFFLINE=1`` resolves from the cache only. ``HF_HOME``/``HF_HUB_CACHE``,
``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are read at call time (``huggingface_hub`` reads them once, at
import), so a process that changes them after import, such as a test, gets what it asked for.

Only what the converter needs is fetched (:data:`CONVERTER_PATTERNS`: top-level safetensors shards
and index, config, tokenizer, chat template, generation config, license). The gpt-oss repos also
hold ``original/`` (a second copy of the weights in OpenAI's layout) and ``metal/``; they are skipped
unless ``include_original=True``.

Integrity: ``huggingface_hub`` (1.33 and 2.x; not 1.0 or 0.24) resumes a transfer dropped mid-file
with an HTTP range request, from the last 10 MiB write chunk, and rejects a file whose length differs
from the announced size. A file still incomplete after its retries is discarded; files already
complete stay in the cache, so running the command again continues from there. After the transfer, :func:`download` checks every
selected file against the hub's listing: size always, and for files fetched by this call the content
hash (sha256 for LFS files, the git blob sha1 for the others). A file that fails is removed from the
cache or ``local_dir`` (so the next run fetches it again) and the call raises ``GptOssFp8Error``.

Every failure a user can fix (unknown repo or revision, gated repo, bad token, offline with a cold
cache, corrupt transfer, full disk) raises ``GptOssFp8Error`` with one line saying what happened,
which repo or file, and what to do. Tokens never appear in messages.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import re
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote

import huggingface_hub
from huggingface_hub import constants as hf_constants
from huggingface_hub import utils as hf_errors  # the error types live here in every version >= 0.24
from huggingface_hub.utils import filter_repo_objects

from gptoss_fp8.errors import GptOssFp8Error

T = TypeVar("T")

# What the converter reads, as huggingface_hub allow-patterns (fnmatch, matched against repo paths).
CONVERTER_PATTERNS: tuple[str, ...] = (
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "LICENSE",
    "USAGE_POLICY",
)
# The folders of the gpt-oss repos that the converter does not read; fetched with include_original.
ORIGINAL_PATTERNS: tuple[str, ...] = ("original/*", "metal/*")
# fnmatch's "*" crosses "/": without this, "*.safetensors" would also take original/model.safetensors.
TOP_LEVEL_ONLY: tuple[str, ...] = ("*/*",)

_REPO_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_SPEC = re.compile(rf"^(?P<repo>{_REPO_NAME}/{_REPO_NAME})(?:@(?P<rev>[^\s@]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_HASH_WORKERS = 4


@dataclass(frozen=True)
class HubFile:
    """One repo file selected for download."""

    path: str  # repo path, "/"-separated
    size: int  # bytes (the real size for LFS files, not the pointer's)
    sha256: str | None  # announced by the hub for LFS files
    git_oid: str | None  # git blob sha1 (announced for every file; checked for non-LFS files)
    cached: bool  # already present at the destination before this call


@dataclass(frozen=True)
class DownloadResult:
    """What :func:`download` fetched (or, for a dry run, would fetch)."""

    path: Path  # snapshot folder in the HF cache, or local_dir
    repo_id: str
    revision: str  # resolved commit sha
    files: tuple[HubFile, ...]
    total_bytes: int  # sum of the selected files' sizes
    dry_run: bool = False
    offline: bool = False  # resolved from the local cache without contacting the hub

    @property
    def bytes_to_fetch(self) -> int:
        """Bytes of the selected files not already present (what a real run transfers)."""
        return sum(f.size for f in self.files if not f.cached)


@dataclass(frozen=True)
class ResolvedSource:
    """A checkpoint directory, and the hub coordinates it came from (None for a local path)."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None  # resolved commit sha

    def provenance(self) -> dict | None:
        """``{"repo_id": ..., "revision": sha}`` for a hub source, None for a local path."""
        return None if self.repo_id is None else {"repo_id": self.repo_id, "revision": self.revision}


def parse_repo_spec(spec: str) -> tuple[str, str | None]:
    """Split ``ORG/NAME`` or ``ORG/NAME@REVISION`` into (repo id, revision or None).

    REVISION is a branch, tag or commit sha (it may contain "/", e.g. ``refs/pr/1``).
    Raises GptOssFp8Error when ``spec`` is not of that form.
    """
    m = _REPO_SPEC.match(spec)
    if m is None or "--" in m["repo"] or ".." in m["repo"]:
        raise GptOssFp8Error(
            f"{spec!r} is not a Hugging Face repo id; write ORG/NAME or ORG/NAME@REVISION (e.g. openai/gpt-oss-20b)"
        )
    return m["repo"], m["rev"]


def hub_patterns(include_original: bool = False) -> tuple[list[str], list[str] | None]:
    """The (allow, ignore) patterns handed to ``huggingface_hub`` for a converter download.

    Without ``include_original`` nothing below the top level is taken. With it, ``original/`` and
    ``metal/`` are added (and a ``*.safetensors`` in any other folder would match too).
    """
    if include_original:
        return [*CONVERTER_PATTERNS, *ORIGINAL_PATTERNS], None
    return list(CONVERTER_PATTERNS), list(TOP_LEVEL_ONLY)


def select_files(paths: list[str], include_original: bool = False) -> list[str]:
    """The repo paths a converter download takes, in the given order."""
    allow, ignore = hub_patterns(include_original)
    return list(filter_repo_objects(paths, allow_patterns=allow, ignore_patterns=ignore))


def download(
    repo_id: str,
    *,
    revision: str | None = None,
    local_dir: Path | None = None,
    include_original: bool = False,
    token: str | None = None,
    dry_run: bool = False,
) -> DownloadResult:
    """Fetch the files the converter needs from a hub model repo; return where they are.

    ``revision`` is a branch, tag or commit (default: main). Files go to the HF cache (the returned
    path is ``.../snapshots/SHA``) unless ``local_dir`` is given. ``token`` overrides ``HF_TOKEN``.
    With ``dry_run`` nothing is written: the result lists the files, their sizes and which are cached.
    With ``HF_HUB_OFFLINE=1`` (or when the hub cannot be reached at all) the cached snapshot is used.
    Raises GptOssFp8Error for anything the user can fix; see the module docstring for the checks.
    """
    hub = _Hub.from_env(repo_id, revision, token)
    if hub.offline:
        if dry_run:
            raise GptOssFp8Error(
                f"--dry-run must ask the hub what {hub.spec} holds, but HF_HUB_OFFLINE is set; unset it and run again"
            )
        return hub.from_cache(local_dir, include_original, reason=None)

    try:
        sha, listing = hub.listing()
    except hub.transport_errors as e:
        # Like huggingface_hub: no network at all is not fatal when the cache already holds the files.
        if dry_run:
            raise GptOssFp8Error(
                f"cannot reach the hub at {hub.endpoint} ({type(e).__name__}) to list {hub.spec}; "
                "check the network or HF_ENDPOINT"
            ) from None
        return hub.from_cache(local_dir, include_original, reason=e)

    selected = select_files(list(listing), include_original)
    if not selected:
        raise GptOssFp8Error(
            f"{hub.spec} (commit {sha[:12]}) has none of the files the converter needs "
            f"({', '.join(CONVERTER_PATTERNS[:3])}, ...); is it a gpt-oss checkpoint repo?"
        )
    dest = local_dir.expanduser().resolve() if local_dir is not None else hub.snapshot_dir(sha)
    files = tuple(
        HubFile(
            path=p,
            size=listing[p].lfs.size if listing[p].lfs is not None else listing[p].size,
            sha256=listing[p].lfs.sha256 if listing[p].lfs is not None else None,
            git_oid=listing[p].blob_id,
            cached=_present(dest, p, sha, local_dir is not None),
        )
        for p in selected
    )
    result = DownloadResult(dest, repo_id, sha, files, sum(f.size for f in files), dry_run=dry_run)
    if dry_run:
        # Listings of gated repos are public: ask for one file so a missing grant shows now, not after the plan.
        hub.check_access(sha, files[0].path)
        return result

    allow, ignore = hub_patterns(include_original)
    path = hub.snapshot_download(sha, allow, ignore, local_dir, files)
    _verify(result, path, local_dir is not None)
    if local_dir is None:
        hub.record_ref(sha)
    return DownloadResult(path, repo_id, sha, files, result.total_bytes)


def resolve_source(spec: str | Path, *, revision: str | None = None, token: str | None = None) -> ResolvedSource:
    """Turn a checkpoint source into a local directory.

    An existing directory is used as is (``repo_id``/``revision`` None). Otherwise a string of the
    form ``ORG/NAME[@REVISION]`` is downloaded (converter files only, into the HF cache) and its
    snapshot folder returned with the resolved commit sha. A ``Path`` is always a path. ``revision``
    is the same as ``@REVISION`` (giving two different ones is an error).
    Raises GptOssFp8Error when the source is neither.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return ResolvedSource(path)
    if path.exists():
        raise GptOssFp8Error(f"{spec} is a file; give the checkpoint directory (the folder holding config.json)")
    text = str(spec)
    repo_part = text.split("@", 1)[0]  # a revision may hold "/" (refs/pr/1)
    looks_like_path = isinstance(spec, Path) or text.startswith((".", "/", "~")) or repo_part.count("/") != 1
    if looks_like_path or _REPO_SPEC.match(text) is None:
        raise GptOssFp8Error(
            f"{text}: no such directory, and not a Hugging Face repo id (ORG/NAME or ORG/NAME@REVISION)"
        )
    repo_id, rev = parse_repo_spec(text)
    if rev is not None and revision is not None and rev != revision:
        raise GptOssFp8Error(f"{text} names revision {rev!r} but --revision says {revision!r}; give one of them")
    try:
        result = download(repo_id, revision=rev or revision, token=token)
    except GptOssFp8Error as e:
        # Say both readings were tried: a mistyped local path also looks like ORG/NAME.
        raise GptOssFp8Error(f"{text} is not a local directory; as a hub repo id: {e}") from None
    _check_checkpoint(result.path, f"{repo_id}@{result.revision[:12]}")
    return ResolvedSource(result.path, repo_id, result.revision)


# --- internals -------------------------------------------------------------------------------------------


def _env_true(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value is None else value.strip().upper() in hf_constants.ENV_VARS_TRUE_VALUES


def _hub_cache_dir() -> Path:
    """HF_HUB_CACHE, else HF_HOME/hub, else what huggingface_hub computed at import."""
    for name, suffix in (("HF_HUB_CACHE", ""), ("HUGGINGFACE_HUB_CACHE", ""), ("HF_HOME", "hub")):
        if value := os.environ.get(name):
            return Path(os.path.expandvars(value)).expanduser() / suffix
    return Path(hf_constants.HF_HUB_CACHE)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Network-level errors of whichever HTTP library this huggingface_hub uses (httpx2, httpx or requests)."""
    found: list[type[BaseException]] = [hf_errors.OfflineModeIsEnabled]
    candidates = (
        ("httpx2", "TransportError"),
        ("httpx", "TransportError"),
        ("requests", "RequestException"),  # huggingface_hub < 1.0
    )
    for module, name in candidates:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


@dataclass
class _Hub:
    """One repo on one hub, with the settings of this call and the error translation."""

    repo_id: str
    revision: str | None
    token: str | None
    endpoint: str
    cache_dir: Path
    offline: bool
    transport_errors: tuple[type[BaseException], ...]

    @classmethod
    def from_env(cls, repo_id: str, revision: str | None, token: str | None) -> _Hub:
        parse_repo_spec(repo_id if revision is None else f"{repo_id}@{revision}")  # validate early
        offline = _env_true("HF_HUB_OFFLINE")
        return cls(
            repo_id=repo_id,
            revision=revision,
            token=token or None,
            endpoint=(os.environ.get("HF_ENDPOINT") or hf_constants.ENDPOINT).rstrip("/"),
            cache_dir=_hub_cache_dir(),
            offline=bool(getattr(hf_constants, "HF_HUB_OFFLINE", False)) if offline is None else offline,
            transport_errors=_transport_errors(),
        )

    @property
    def spec(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"

    def snapshot_dir(self, sha: str) -> Path:
        return self.cache_dir / f"models--{self.repo_id.replace('/', '--')}" / "snapshots" / sha

    def listing(self) -> tuple[str, dict]:
        """(commit sha, repo path -> RepoFile) at the requested revision."""
        api = huggingface_hub.HfApi(endpoint=self.endpoint, token=self.token)
        try:
            sha = api.model_info(self.repo_id, revision=self.revision).sha
            assert sha is not None and _COMMIT.match(sha), f"hub returned no commit sha for {self.repo_id}: {sha!r}"
            tree = api.list_repo_tree(self.repo_id, recursive=True, revision=sha)
            return sha, {f.path: f for f in tree if isinstance(f, huggingface_hub.hf_api.RepoFile)}
        except hf_errors.HfHubHTTPError as e:
            raise self.http_error(e) from None

    def check_access(self, sha: str, path: str) -> None:
        """HEAD one file of the repo (what every download starts with): raises on 401/403/404."""
        url = huggingface_hub.hf_hub_url(self.repo_id, path, revision=sha, endpoint=self.endpoint)
        try:
            huggingface_hub.get_hf_file_metadata(url, token=self.token)
        except hf_errors.HfHubHTTPError as e:
            raise self.http_error(e) from None

    def snapshot_download(
        self, sha: str, allow: list[str], ignore: list[str] | None, local_dir: Path | None, files: tuple[HubFile, ...]
    ) -> Path:
        """The transfer itself (tqdm progress bars from huggingface_hub); returns the folder."""
        try:
            path = _interruptible(_drop_partial_files, lambda: huggingface_hub.snapshot_download(
                self.repo_id,
                revision=sha,
                cache_dir=self.cache_dir,
                local_dir=local_dir,
                allow_patterns=allow,
                ignore_patterns=ignore,
                token=self.token,
                endpoint=self.endpoint,
            ))
        except hf_errors.HfHubHTTPError as e:
            raise self.http_error(e) from None
        except self.transport_errors as e:
            raise GptOssFp8Error(
                f"download of {self.spec} from {self.endpoint} failed ({type(e).__name__}) after retries; "
                "check the network and run the same command again (completed files are kept)"
            ) from None
        except OSError as e:
            raise self.os_error(e, local_dir, files) from None
        return Path(path)

    def record_ref(self, sha: str) -> None:
        """Point ``refs/REVISION`` at ``sha`` in the cache, so offline runs find the snapshot by branch/tag name.

        (The transfer was asked for by commit sha, to pin all files to one commit; huggingface_hub only
        writes the ref when it resolves a branch itself.)
        """
        name = self.revision or hf_constants.DEFAULT_REVISION
        if _COMMIT.match(name):
            return
        ref = self.snapshot_dir(sha).parent.parent / "refs" / name
        if ref.is_file() and ref.read_text() == sha:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f"{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(sha)
        os.replace(tmp, ref)

    def from_cache(self, local_dir: Path | None, include_original: bool, reason: BaseException | None) -> DownloadResult:
        """Resolve from the cache (or local_dir) only: offline mode, or the hub is unreachable."""
        allow, ignore = hub_patterns(include_original)
        try:
            path = Path(
                huggingface_hub.snapshot_download(
                    self.repo_id,
                    revision=self.revision,
                    cache_dir=self.cache_dir,
                    local_dir=local_dir,
                    allow_patterns=allow,
                    ignore_patterns=ignore,
                    local_files_only=True,
                )
            )
        except hf_errors.LocalEntryNotFoundError as e:
            where = local_dir if local_dir is not None else self.cache_dir
            incomplete = type(e).__name__ == "IncompleteSnapshotError"
            what = "only partly in" if incomplete else "not in"
            if reason is None:
                raise GptOssFp8Error(
                    f"{self.spec} is {what} the Hugging Face cache ({where}) and HF_HUB_OFFLINE=1 forbids downloading; "
                    f"run `gptoss-fp8 download {self.spec}` with network access first, or unset HF_HUB_OFFLINE"
                ) from None
            raise GptOssFp8Error(
                f"cannot reach the hub at {self.endpoint} ({type(reason).__name__}) and {self.spec} is {what} "
                f"the cache ({where}); check the network or HF_ENDPOINT and run again"
            ) from None
        # huggingface_hub returns local_dir if it merely exists: make sure the converter's files are there.
        _check_checkpoint(path, self.spec, hint=f"run `gptoss-fp8 download {self.spec}` with network access")
        sha = path.name if local_dir is None else _local_dir_commit(path)
        on_disk = sorted(
            q.relative_to(path).as_posix()
            for q in path.rglob("*")
            if q.is_file() and ".cache" not in q.relative_to(path).parts  # local_dir bookkeeping
        )
        files = tuple(
            HubFile(p, (path / p).stat().st_size, None, None, cached=True)
            for p in select_files(on_disk, include_original)
        )
        return DownloadResult(path, self.repo_id, sha, files, sum(f.size for f in files), offline=True)

    def http_error(self, e: hf_errors.HfHubHTTPError) -> GptOssFp8Error:
        """One line for an HTTP error from the hub (never the token, never the raw response)."""
        status = e.response.status_code if e.response is not None else None
        sent = "no token was sent" if not self._has_token() else "the token sent has no access"
        login = "pass --token or set HF_TOKEN (or run `hf auth login`)"
        page = f"{self.endpoint}/{self.repo_id}"
        server_says = e.response.headers.get("X-Error-Message", "") if e.response is not None else ""
        if isinstance(e, hf_errors.GatedRepoError):
            if status == 401:
                msg = f"{self.repo_id} is gated and {sent}: accept its terms at {page} while logged in, then {login}"
            else:
                msg = (
                    f"{self.repo_id} is gated and the token's account has not been granted access (403): "
                    f"accept its terms at {page} with that account, or use a token of an account that has"
                )
        elif isinstance(e, hf_errors.RevisionNotFoundError):
            msg = (
                f"revision {self.revision!r} not found in {self.repo_id}; "
                "check the branch, tag or commit (leave it out for main)"
            )
        elif isinstance(e, hf_errors.RepositoryNotFoundError):
            msg = (
                f"repo {self.repo_id} not found on {self.endpoint} ({status}; or it is private and {sent}); "
                f"check the repo id, or {login} with access to it"
            )
        elif status == 401:
            reason = "invalid token" if "credentials" in server_says.lower() else "unauthorized"
            msg = (
                f"the hub at {self.endpoint} rejected the token for {self.repo_id} (401, {reason}); "
                "check HF_TOKEN / --token, or run `hf auth login` again"
            )
        elif status == 403:
            msg = f"access to {self.repo_id} denied (403); use a token with read access to it"
        else:
            msg = (
                f"the hub at {self.endpoint} answered HTTP {status} for {self.spec}; "
                "try again later, or check HF_ENDPOINT"
            )
        return GptOssFp8Error(_scrub(msg, self.token))

    def os_error(self, e: OSError, local_dir: Path | None, files: tuple[HubFile, ...]) -> GptOssFp8Error:
        where = local_dir if local_dir is not None else self.cache_dir
        if e.errno == errno.ENOSPC:
            return GptOssFp8Error(f"no space left in {where} while downloading {self.spec}; free space or pass --local-dir")
        m = re.search(r"should be of size (\d+) but has size (\d+) \((?:\(…\))?(.*?)\)", str(e))
        if m is not None:
            # huggingface_hub names the file by the (possibly cut) tail of its URL: map it back to a repo path.
            tail = unquote(m[3])
            names = [f.path for f in files if f"/{f.path}".endswith(tail) or tail.endswith(f"/{f.path}")]
            name = names[0] if len(names) == 1 else tail
            return GptOssFp8Error(
                f"{self.spec}: {name} arrived with {m[2]} bytes but the hub announced {m[1]}; nothing was kept, "
                f"run again (if it repeats, {self.endpoint} serves a bad copy)"
            )
        return GptOssFp8Error(_scrub(f"download of {self.spec} into {where} failed: {e}", self.token).splitlines()[0])

    def _has_token(self) -> bool:
        return bool(self.token) or huggingface_hub.get_token() is not None


def _interruptible(on_interrupt: Callable[[], None], fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own, its result or exception handed back; a Ctrl-C ends the wait
    (``on_interrupt()`` first).

    huggingface_hub moves files on a thread pool whose shutdown waits for every transfer in flight,
    so a Ctrl-C inside its snapshot_download was answered only once those files were done (20 s in
    a hand-run on tests/test_download.py's slow link; minutes for a few 4 GB shards). Here the
    KeyboardInterrupt comes at once; the transfers, left on their (daemon) threads, end with the
    process (the CLI then exits without waiting for threads)."""
    box: queue.SimpleQueue = queue.SimpleQueue()

    def run() -> None:
        try:
            box.put((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box.put((False, e))

    threading.Thread(target=run, name="hub transfer", daemon=True).start()
    try:
        ok, got = box.get()
    except KeyboardInterrupt:
        on_interrupt()
        raise
    if not ok:
        raise got
    return got


def _drop_partial_files() -> None:
    """Remove the partial files (``*.incomplete``) this process has open. huggingface_hub downloads
    each file into a name of its own (a new one each run: nothing resumes across runs) and removes
    it when the transfer fails, but a transfer a Ctrl-C leaves running ends with the process, not
    in that clean-up. Linux (/proc/self/fd); elsewhere they stay, as after a crash."""
    try:
        fds = list(Path("/proc/self/fd").iterdir())
    except OSError:
        return
    for fd in fds:
        try:
            target = Path(os.readlink(fd))
        except OSError:
            continue
        if target.name.endswith(".incomplete"):  # (an unlinked one reads "... (deleted)")
            target.unlink(missing_ok=True)  # (the thread writes on into the unlinked file till the exit)


def _scrub(text: str, token: str | None) -> str:
    """Belt and braces: never let a token reach a message."""
    text = re.sub(r"hf_[A-Za-z0-9]{8,}", "hf_***", text)
    return text.replace(token, "***") if token else text


def _present(dest: Path, path: str, sha: str, is_local_dir: bool) -> bool:
    """Whether ``path`` at commit ``sha`` is already at ``dest`` (what huggingface_hub would skip)."""
    target = dest / path
    if not target.is_file():
        return False
    if not is_local_dir:
        return True  # snapshot folders are per commit
    meta = dest / ".cache" / "huggingface" / "download" / f"{path}.metadata"
    return meta.is_file() and meta.read_text().split("\n", 1)[0].strip() == sha


def _local_dir_commit(local_dir: Path) -> str:
    """Commit sha recorded by huggingface_hub for a local_dir download ('unknown' if none)."""
    for meta in sorted((local_dir / ".cache" / "huggingface" / "download").rglob("*.metadata")):
        first = meta.read_text().split("\n", 1)[0].strip()
        if _COMMIT.match(first):
            return first
    return "unknown"


def _file_hashes(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file, reading it once."""
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            sha256.update(chunk)
            git.update(chunk)
    return sha256.hexdigest(), git.hexdigest()


def _mismatch(f: HubFile, local: Path, check_hash: bool) -> str | None:
    """Why ``local`` is not the announced file, or None when it is."""
    if not local.is_file():
        return "is missing after the download"
    size = local.stat().st_size
    if size != f.size:
        return f"has {size} bytes but the hub announced {f.size}"
    if not check_hash:
        return None
    sha256, git_oid = _file_hashes(local)
    if f.sha256 is not None and sha256 != f.sha256:
        return f"does not match its announced sha256 (got {sha256[:12]}..., expected {f.sha256[:12]}...)"
    if f.sha256 is None and f.git_oid is not None and git_oid != f.git_oid:
        return f"does not match its announced git blob id (got {git_oid[:12]}..., expected {f.git_oid[:12]}...)"
    return None


def _verify(result: DownloadResult, path: Path, is_local_dir: bool) -> None:
    """Check sizes of all files and hashes of the ones fetched now; remove and raise on a mismatch."""
    with ThreadPoolExecutor(_HASH_WORKERS) as pool:  # hashlib releases the GIL
        problems = list(pool.map(lambda f: (f, _mismatch(f, path / f.path, not f.cached)), result.files))
    bad = [(f, why) for f, why in problems if why is not None]
    if not bad:
        return
    for f, _ in bad:
        _remove(path, f.path, is_local_dir)
    f, why = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise GptOssFp8Error(
        f"{result.repo_id}@{result.revision[:12]}: {f.path} {why}{more}; removed the bad copy, run the download again"
    )


def _remove(root: Path, path: str, is_local_dir: bool) -> None:
    """Delete a downloaded file so huggingface_hub fetches it again (cache blob + link, or local_dir file + metadata)."""
    target = root / path
    if is_local_dir:
        (root / ".cache" / "huggingface" / "download" / f"{path}.metadata").unlink(missing_ok=True)
    elif target.is_symlink():
        target.resolve().unlink(missing_ok=True)  # the blob
    target.unlink(missing_ok=True)


def _check_checkpoint(path: Path, label: str, hint: str = "is it a gpt-oss checkpoint repo?") -> None:
    """The converter's minimum: config.json, and every shard the index names (or some *.safetensors)."""
    if not (path / "config.json").is_file():
        raise GptOssFp8Error(f"{label}: no config.json in {path}; {hint}")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise GptOssFp8Error(f"{label}: {len(missing)} shard(s) missing in {path} (first: {missing[0]}); {hint}")
    elif not any(path.glob("*.safetensors")):
        raise GptOssFp8Error(f"{label}: no *.safetensors in {path}; {hint}")
