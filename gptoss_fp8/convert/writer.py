"""The output directory of a conversion: lock, resume records, atomic writes, metadata files.

What lives in DST while a conversion runs or after it:
* ``.gptoss-fp8.lock``: flock'ed by the one convert writing here; removed when it ends (finished,
  refused or interrupted), so a user never finds it behind;
* ``.gptoss-fp8-partial/plan.json``: what the run is (tool version, options, layout, the source's
  fingerprint: sha256 of its config, index and every header), and one record per finished output
  file (bytes, sha256, exactness stats). ``--resume`` continues only when plan.json equals what the
  new run would do, and trusts a finished file only after re-checking its size and sha256;
* the outputs (rank folders, shards, indexes, ``layout.json``, ``conversion.json``, and
  ``config.json`` last). ``conversion.json`` keeps the plan under ``resume_state``, so ``--resume``
  on a finished DST can tell "already complete" from "made with something else".
Every file is written under a unique temporary name created exclusively in its own directory, then
renamed: a planted file or symlink is never written through.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gptoss_fp8.checkpoint.format import (
    INDEX_NAME,
    LAYOUT_FORMAT,
    LAYOUT_NAME,
    PICKLE_SUFFIXES,
    REPORT_NAME,
    assign_shards,
    shard_file_names,
)
from gptoss_fp8.checkpoint.manifest import check_rank_files, file_sha256, read_manifest
from gptoss_fp8.checkpoint.st_io import DTYPE_NAMES, TMP_SUFFIX, create_temp, format_gb
from gptoss_fp8.config import load_json
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.parallel import Parallel

PARTIAL_DIR = ".gptoss-fp8-partial"
LOCK_NAME = ".gptoss-fp8.lock"
PLAN_NAME = "plan.json"
RESUME_KEY = "resume_state"
FILE_OVERHEAD = 64 * 1024  # header and records per output file, for the free-space estimate


# ----------------------------------------------------------------------------------------------
# Which files a rank writes


@dataclass
class RankFile:
    """One output file of one rank: its path relative to DST and the jobs whose outputs it holds."""

    rank: int
    rel: str
    jobs: list[int]
    tensors: list  # PlannedTensor, in file order

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def rank_dir(rank: int, tp: int) -> str:
    return "." if tp == 1 else f"rank-{rank:05d}"


def layout_files(job_outputs: list[list[str]], plans: list[dict], tp: int, shard_bytes: int) -> list[list[RankFile]]:
    """Per rank, its files: each job's outputs stay in one file; names model-0000k-of-0000N."""
    out = []
    for r, held in enumerate(plans):
        mine = [(i, [held[o] for o in outs if o in held]) for i, outs in enumerate(job_outputs)]
        mine = [(i, ts) for i, ts in mine if ts]
        shard_of = assign_shards([sum(t.nbytes for t in ts) for _, ts in mine], shard_bytes)
        names = shard_file_names(shard_of[-1] + 1)
        d = rank_dir(r, tp)
        files = [RankFile(r, names[f] if d == "." else f"{d}/{names[f]}", [], []) for f in range(len(names))]
        for (i, ts), f in zip(mine, shard_of, strict=True):
            files[f].jobs.append(i)
            files[f].tensors += ts
        out.append(files)
    return out


# ----------------------------------------------------------------------------------------------
# Atomic writes


def _replace_atomic(path: Path, fill: Callable[[int], None], failure: Callable[[OSError], str]) -> None:
    """``fill(fd)`` writes (and closes) a unique, exclusively created temporary file beside ``path``,
    then it is renamed to ``path``. On any failure, a Ctrl-C included, the temporary file is removed;
    an OSError is one line (``failure(e)``)."""
    tmp = None
    try:
        fd, tmp = create_temp(path)
        fill(fd)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise GptOssFp8Error(failure(e)) from None
        raise


def write_text_atomic(path: Path, text: str, retry: str = "rerun with --resume") -> None:
    """Write text to path through a unique, exclusively created temporary file and a rename."""

    def fill(fd: int) -> None:
        with os.fdopen(fd, "w") as f:
            f.write(text)

    _replace_atomic(path, fill, lambda e: f"cannot write {path}: {e.strerror}; free space or fix permissions and {retry}")


def copy_atomic(a: Path, b: Path) -> None:
    def fill(fd: int) -> None:
        with open(a, "rb") as fa, os.fdopen(fd, "wb") as fb:
            shutil.copyfileobj(fa, fb)

    _replace_atomic(b, fill, lambda e: f"cannot copy {a.name} to {b}: {e.strerror}")


def side_files(src_root: Path) -> list[Path]:
    """Top-level non-weight files to carry over (tokenizer, chat template, generation config...)."""
    out = []
    for p in sorted(src_root.iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        if p.name in ("config.json", INDEX_NAME) or p.suffix in (".safetensors", *PICKLE_SUFFIXES):
            continue
        out.append(p)
    return out


def check_free_space(where: Path, need: int, reclaim: int = 0) -> None:
    """Refuse, before anything is created, when the disk holding ``where`` cannot take ``need`` bytes."""
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free + reclaim:
        also = f" (plus {format_gb(reclaim)} that --overwrite would free)" if reclaim else ""
        raise GptOssFp8Error(
            f"{where}: the conversion needs {format_gb(need)} more, {format_gb(free)} free{also}; "
            "free space and rerun (nothing was written)"
        )


# ----------------------------------------------------------------------------------------------
# What differs between two plans


def describe_difference(recorded: object, now: dict) -> tuple[str, str]:
    """(what kind: 'other options' / 'another source' / ..., the details) of the first differences."""
    if not isinstance(recorded, dict):
        return "an unreadable record", "its plan cannot be read"
    out: list[str] = []
    kind = ""
    if recorded.get("version") != now["version"]:
        kind = kind or "another gptoss-fp8 version"
        out.append(f"version {recorded.get('version')!r} there, {now['version']!r} now")
    ro, no = recorded.get("options") if isinstance(recorded.get("options"), dict) else {}, now["options"]
    for k in no:
        if ro.get(k) != no[k]:
            kind = kind or "other options"
            out.append(f"{k} {ro.get(k)!r} there, {no[k]!r} now")
    for k in ("tp", "ep"):
        if recorded.get(k) != now[k]:
            kind = kind or "other options"
            out.append(f"{k} {recorded.get(k)!r} there, {now[k]!r} now")
    if recorded.get("vocab_parallel", False) != now.get("vocab_parallel", False):  # absent: replicated
        kind = kind or "other options"
        out.append(f"vocab_parallel {recorded.get('vocab_parallel', False)!r} there, "
                   f"{now.get('vocab_parallel', False)!r} now")
    rs, ns = recorded.get("source") if isinstance(recorded.get("source"), dict) else {}, now["source"]
    headers = []
    for name in sorted(set(rs) | set(ns)):
        if rs.get(name) == ns.get(name):
            continue
        kind = kind or "another source"
        if name not in ns:
            out.append(f"source file {name} is gone")
        elif name not in rs:
            out.append(f"source file {name} is new")
        elif not isinstance(rs[name], str) or ":" not in ns[name]:
            out.append(f"source {name} differs")
        elif ns[name].split(":")[0] != rs[name].split(":")[0]:
            out.append(f"source {name} has {ns[name].split(':')[0]} bytes, {rs[name].split(':')[0]} recorded")
        else:
            headers.append(name)
    if headers:
        out.append(f"the header of source {headers[0]} differs" if len(headers) == 1 else
                   f"the headers of {len(headers)} source files differ (first: {headers[0]})")
    if not out and recorded.get("files") != now["files"]:
        kind, out = "another output layout", ["the output files differ"]
    if not out and recorded != now:
        kind, out = "another record format", ["the record differs"]
    more = f", and {len(out) - 3} more" if len(out) > 3 else ""
    return kind, "; ".join(out[:3]) + more


# ----------------------------------------------------------------------------------------------
# The directory


class OutputDir:
    """DST of one conversion. ``session()`` creates it if needed and holds its lock; every exit
    removes the lock, and a refusal before any work also removes a DST that it created."""

    def __init__(self, root: Path):
        self.root = root
        self.partial = root / PARTIAL_DIR
        self.plan_file = self.partial / PLAN_NAME
        self._created: Path | None = None
        self._made_dirs: list[Path] = []
        self.started = False  # set once work that --resume can continue has begun

    # --- before the lock: read-only checks --------------------------------------------------
    def check_target(self) -> None:
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return
        except OSError as e:
            raise GptOssFp8Error(f"{self.root}: cannot use as DST ({e.strerror})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise GptOssFp8Error(f"{self.root}: exists and is not a directory; choose a directory for the FP8 checkpoint")

    def entries(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if p.name not in (LOCK_NAME, PARTIAL_DIR) and not p.name.endswith(TMP_SUFFIX)]

    def _outputs(self) -> list[Path]:
        """What --overwrite removes: what loaders read (weights, indexes, config) and our records."""
        out = []
        for p in self.entries():
            if p.name in (INDEX_NAME, "config.json", REPORT_NAME, LAYOUT_NAME) or p.name.endswith(".safetensors"):
                out.append(p)
            elif p.name.startswith("rank-") and (p.is_dir() or p.is_symlink()):
                out.append(p)
        return out

    def reclaimable(self) -> int:
        total = 0
        for p in self._outputs():
            if p.is_symlink():
                continue
            if p.is_dir():
                total += sum(f.lstat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
            elif p.is_file():
                total += p.lstat().st_size
        return total

    def done_estimate(self, files: list[RankFile]) -> set[str]:
        """Files that look finished (record present, size as recorded); verified later under the lock."""
        done = set()
        for f in files:
            rec = self.read_record(f)
            p = self.root / f.rel
            if rec is not None and p.is_file() and not p.is_symlink() and p.stat().st_size == rec["bytes"]:
                done.add(f.rel)
        return done

    # --- the session ------------------------------------------------------------------------
    @contextmanager
    def session(self) -> Iterator[OutputDir]:
        self._mkdir()
        lock = self.root / LOCK_NAME
        fd = self._lock(lock)
        refused = False
        try:
            yield self
        except GptOssFp8Error:
            refused = not self.started
            raise
        finally:
            lock.unlink(missing_ok=True)  # while we hold it: nobody else can be using this file
            os.close(fd)
            if refused:
                self._undo_prepare()

    def _mkdir(self) -> None:
        top = self.root
        while not top.parent.exists() and top.parent != top:
            top = top.parent
        try:
            existed = self.root.exists()
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise GptOssFp8Error(f"{self.root}: cannot create directory ({e.strerror})") from None
        self._created = None if existed else top

    def _undo_prepare(self) -> None:
        """A refusal before any work: remove what this run made (an empty partial dir, rank
        folders it created, DST itself when it created it), never a finished file."""
        if self.partial.is_dir() and not self.partial.is_symlink() and not self.plan_file.exists():
            shutil.rmtree(self.partial, ignore_errors=True)
        for d in self._made_dirs:
            try:
                d.rmdir()
            except OSError:
                pass
        self._remove_created()

    def _remove_created(self) -> None:
        """Undo our mkdir (only directories we made, and only while empty)."""
        if self._created is None:
            return
        d = self.root
        while True:
            try:
                d.rmdir()
            except OSError:
                return
            if d == self._created:
                return
            d = d.parent

    def _lock(self, lock: Path) -> int:
        for _ in range(5):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                self._remove_created()
                raise GptOssFp8Error(f"{self.root}: cannot create the lock file {LOCK_NAME} ({e.strerror}); "
                                     "choose a DST you can write") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise GptOssFp8Error(
                    f"{self.root}: another gptoss-fp8 convert is writing here (lock {LOCK_NAME} is held); "
                    "wait for it or choose another DST"
                ) from None
            try:  # the holder before us may have unlinked the file we opened: lock the one on disk
                if os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)
        raise GptOssFp8Error(f"{self.root}: the lock {LOCK_NAME} keeps changing; is another convert starting here?")

    # --- records ----------------------------------------------------------------------------
    def record_path(self, f: RankFile) -> Path:
        return self.partial / (f.rel.replace("/", "__") + ".json")

    def read_record(self, f: RankFile) -> dict | None:
        """A finished file's record, or None when absent or unreadable (the file is then redone)."""
        p = self.record_path(f)
        try:
            rec = json.loads(p.read_bytes()) if p.is_file() and p.stat().st_size < 64 * 1024**2 else None
        except (OSError, ValueError, RecursionError):
            return None
        ok = isinstance(rec, dict) and isinstance(rec.get("bytes"), int) and isinstance(rec.get("sha256"), str) \
            and isinstance(rec.get("stats"), dict)
        return rec if ok else None

    def write_record(self, f: RankFile, rec: dict) -> None:
        write_text_atomic(self.record_path(f), json.dumps(rec))

    def read_plan(self) -> object:
        try:
            return load_json(self.plan_file.read_bytes(), str(self.plan_file), "resume record")
        except (OSError, GptOssFp8Error):
            return None

    def finished_state(self) -> tuple[object, dict | None]:
        """(the plan recorded in a finished DST's conversion.json, the conversion record)."""
        try:
            rec = load_json((self.root / REPORT_NAME).read_bytes(), str(self.root / REPORT_NAME), "conversion record")
        except (OSError, GptOssFp8Error):
            return None, None
        if not isinstance(rec, dict):
            return None, None
        return rec.get(RESUME_KEY), rec

    def verify_finished(self, files: list[RankFile]) -> None:
        """A finished DST: config, indexes and every file of layout.json, by size and sha256."""
        try:
            manifest = read_manifest(self.root)
            listed = {rel for r in manifest["ranks"] for rel in r["files"]}
            if listed != {f.rel for f in files}:
                raise GptOssFp8Error(f"{self.root / LAYOUT_NAME}: lists other files than this conversion writes")
            for r in range(manifest["world_size"]):
                check_rank_files(self.root, manifest, r, verify=True)
                idx = self.root / rank_dir(r, manifest["tp"]) / INDEX_NAME
                if not idx.is_file():
                    raise GptOssFp8Error(f"{idx}: missing")
        except GptOssFp8Error as e:
            raise GptOssFp8Error(f"{e} (--resume: the finished conversion in {self.root} is damaged; "
                                 "use --overwrite to convert again)") from None

    def verify_done(self, files: list[RankFile]) -> dict[str, dict]:
        """Records of the files that really are finished: size and sha256 re-checked. A file that
        fails (truncated, changed) loses its record and is converted again."""
        done = {}
        for f in files:
            rec = self.read_record(f)
            if rec is None:
                continue
            p = self.root / f.rel
            if p.is_file() and not p.is_symlink() and p.stat().st_size == rec["bytes"] and file_sha256(p) == rec["sha256"]:
                done[f.rel] = rec
            else:
                self.record_path(f).unlink(missing_ok=True)
        return done

    # --- preparing the tree -----------------------------------------------------------------
    def clear_outputs(self) -> None:
        """--overwrite: remove what loaders read (weights, index, config) and our own state."""
        for p in self._outputs():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        self.remove_partial()

    def remove_partial(self) -> None:
        if self.partial.is_symlink() or (self.partial.exists() and not self.partial.is_dir()):
            self.partial.unlink()
        elif self.partial.exists():
            shutil.rmtree(self.partial)

    def prepare_dirs(self, files: list[RankFile]) -> None:
        """The partial dir and rank folders, real directories (never a symlink into elsewhere),
        and no stale temporary files of ours. DST itself may be a symlink to a directory (the
        user's choice of where the checkpoint goes, checked by ``check_target``): the output is
        written inside it, and --overwrite removes only our outputs there."""
        for d in [self.partial, *sorted({(self.root / f.rel).parent for f in files})]:
            if d == self.root:
                continue
            if d.is_symlink() or (d.exists() and not d.is_dir()):
                raise GptOssFp8Error(f"{d}: is a symlink or a file, not a directory; remove it (or use --overwrite)")
            if not d.exists():
                d.mkdir()
                self._made_dirs.append(d)
            for p in d.iterdir():
                if p.name.endswith(TMP_SUFFIX) or p.name.endswith(".safetensors.tmp"):
                    p.unlink()  # ours, from a killed run (unlink never follows a symlink)

    def write_plan(self, state: dict) -> None:
        write_text_atomic(self.plan_file, json.dumps(state))


# ----------------------------------------------------------------------------------------------
# Indexes, layout.json, side files, conversion.json, config.json


def write_metadata_files(dst: Path, files: list[list[RankFile]], full_shapes: dict[str, tuple[int, ...]],
                         finished: dict[str, dict], tp: int, ep: int, layout_extra: dict, src_root: Path,
                         conversion: dict, config: dict) -> None:
    """Indexes, layout.json, side files, conversion.json, and config.json last of all."""
    ranks = []
    for r, fs in enumerate(files):
        weight_map = {t.name: f.rel.split("/")[-1] for f in fs for t in f.tensors}
        index = {"metadata": {"total_size": sum(f.nbytes for f in fs)}, "weight_map": weight_map}
        write_text_atomic(dst / rank_dir(r, tp) / INDEX_NAME, json.dumps(index, indent=2) + "\n")
        par = Parallel(r, tp, ep)
        tensors = {}
        for f in fs:
            for t in f.tensors:
                tensors[t.name] = {
                    "file": f.rel, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                    "full_shape": list(full_shapes[t.name]),
                    "slices": [list(x) for x in t.slice.ranges] if t.slice is not None else None,
                }
        ranks.append({
            "rank": r, "dir": rank_dir(r, tp), "expert_group": par.expert_group, "intermediate_part": par.expert_part,
            "files": {f.rel: {"bytes": finished[f.rel]["bytes"], "sha256": finished[f.rel]["sha256"]} for f in fs},
            "tensors": tensors,
        })
    layout = {"format": LAYOUT_FORMAT, "world_size": tp, "tp": tp, "ep": ep, **layout_extra, "ranks": ranks}
    write_text_atomic(dst / LAYOUT_NAME, json.dumps(layout, indent=1) + "\n")
    for p in side_files(src_root):
        copy_atomic(p, dst / p.name)
    write_text_atomic(dst / REPORT_NAME, json.dumps(conversion, indent=1) + "\n")
    write_text_atomic(dst / "config.json", json.dumps(config, indent=2) + "\n")
