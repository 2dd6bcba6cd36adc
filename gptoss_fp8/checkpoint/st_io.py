"""safetensors reading with validation, and a streaming writer with bounded memory.

File format (https://github.com/huggingface/safetensors): 8-byte little-endian header length n,
n bytes of JSON header ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}``,
then the data; offsets are relative to the end of the header. We validate the header ourselves so
a truncated or corrupt file gives one clear line instead of a Rust panic, and we write files
header-first so a tensor never has to be held in memory as a whole.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import queue
import stat
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from gptoss_fp8.config import MAX_JSON_DEPTH, json_depth_exceeds
from gptoss_fp8.errors import GptOssFp8Error

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024
MAX_RANK = 16  # dimensions of one tensor
TMP_SUFFIX = ".gptoss-fp8.tmp"  # temporary files we create (unique names, O_EXCL): cleaned on resume/overwrite


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    sha256: str  # of the 8-byte length and the header bytes: identifies the file's layout cheaply
    file_bytes: int


def open_regular(path: Path, what: str = "file") -> int:
    """An O_RDONLY fd of path, which must be a regular file (never blocks on a FIFO or device)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise GptOssFp8Error(f"{path}: no such {what}; re-download the checkpoint") from None
    except OSError as e:
        raise GptOssFp8Error(f"{path}: cannot stat ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
        raise GptOssFp8Error(f"{path}: is {kind}, not a regular {what}; remove or replace it")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise GptOssFp8Error(f"{path}: cannot open ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between stat and open
        os.close(fd)
        raise GptOssFp8Error(f"{path}: not a regular {what}; remove or replace it")
    return fd


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    d = {}
    for k, v in pairs:
        if k in d:
            raise _Duplicate(k)
        d[k] = v
    return d


class _Duplicate(ValueError):
    pass


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header_full(path: Path) -> Header:
    """Parse and validate a safetensors header: everything the format promises.

    Regular file; header length within bounds and within the file; JSON of bounded nesting with no
    duplicate names; every entry a {dtype, shape, data_offsets} with a known dtype, non-negative
    integer shape and offsets; dtype x shape = bytes; tensors in order, not overlapping, covering
    the data region exactly (no holes, nothing after the last tensor).
    """
    def corrupt(why: str) -> GptOssFp8Error:
        return GptOssFp8Error(f"{path}: not a valid safetensors file ({why}); re-download or regenerate it")

    fd = open_regular(path, "safetensors file")
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise corrupt("shorter than 8 bytes")
        (n,) = struct.unpack("<Q", head)
        if n < 2 or n > MAX_HEADER or n > size - 8:
            raise corrupt(f"header length {n} does not fit a {size}-byte file")
        raw = f.read(n)
    if len(raw) != n:
        raise corrupt(f"header length {n}, only {len(raw)} bytes readable")
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise corrupt("header is not JSON") from None
    except RecursionError:
        raise corrupt(f"header JSON nested more than {MAX_JSON_DEPTH} levels deep") from None
    except _Duplicate as e:
        raise corrupt(f"name {e.args[0]!r} appears twice in the header") from None
    if json_depth_exceeds(header):
        raise corrupt(f"header JSON nested more than {MAX_JSON_DEPTH} levels deep")
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise corrupt("__metadata__ is not an object of strings")
    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, e in header.items():
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
            raise corrupt(f"bad header entry for tensor {name!r} (needs dtype, shape, data_offsets)")
        dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dt, str) or dt not in DTYPES:
            raise corrupt(f"tensor {name!r} has unknown dtype {dt!r}")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_int(x) and x >= 0 for x in shape):
            raise corrupt(f"tensor {name!r} has bad shape {shape!r}")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_int(x) and x >= 0 for x in offs) or offs[1] < offs[0]:
            raise corrupt(f"tensor {name!r} has bad data_offsets {offs!r}")
        dtype, b, en = DTYPES[dt], offs[0], offs[1]
        nbytes = math.prod(shape) * dtype.itemsize
        if en - b != nbytes:
            raise corrupt(f"tensor {name!r} has {en - b} bytes for shape {list(shape)} {dt} ({nbytes} bytes)")
        if en > data_len:
            raise corrupt(f"truncated: tensor {name!r} ends at byte {data_start + en}, file has {size}")
        spans.append((b, en, name))
        out[name] = TensorInfo(name, path, dtype, tuple(shape), data_start + b, nbytes)
    pos, prev, hole = 0, None, None
    for b, en, name in sorted(spans):  # overlaps first: they are what silently aliases two tensors
        if b < pos:
            raise corrupt(f"tensor {name!r} (data bytes {b}..{en}) overlaps tensor {prev!r} (ending at {pos})")
        if b > pos and hole is None:
            hole = f"{b - pos} data bytes before tensor {name!r} belong to no tensor (a hole at {pos}..{b})"
        pos, prev = max(pos, en), name
    if hole is not None:
        raise corrupt(hole)
    if pos != data_len:
        raise corrupt(f"{data_len - pos} bytes after the last tensor belong to no tensor")
    digest = hashlib.sha256(head + raw).hexdigest()
    return Header(out, meta, digest, size)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header. Returns ({name: TensorInfo}, metadata)."""
    h = read_header_full(path)
    return h.tensors, h.metadata


def format_gb(n: int) -> str:
    """Bytes as GB with enough digits to be non-zero (0.000312 GB, not 0.00 GB)."""
    gb = n / 1e9
    if gb >= 0.1 or n == 0:
        return f"{gb:.2f} GB"
    return f"{gb:.{min(9, 2 - math.floor(math.log10(gb)))}f}".rstrip("0") + " GB"


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m


_UMASK = _umask()


def create_temp(path: Path) -> tuple[int, Path]:
    """A new temporary file beside path for an atomic write: (fd, tmp path).

    The name is unique and created exclusively (O_EXCL, so a planted file or symlink is never
    followed or reused); rename it onto path with os.replace, which replaces a symlink itself,
    not its target. Permissions are the usual 0666 & ~umask (mkstemp would give 0600).
    """
    tmp = None
    try:  # (a Ctrl-C once the file exists: removed)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
        os.fchmod(fd, 0o666 & ~_UMASK)
        return fd, Path(tmp)
    except BaseException:
        if tmp is not None:
            os.close(fd)
            os.unlink(tmp)
        raise


def read_tensor(info: TensorInfo, start: int | None = None, stop: int | None = None) -> torch.Tensor:
    """Read a tensor, or rows [start, stop) of its first dimension, from disk (no mmap held)."""
    shape = list(info.shape)
    row = math.prod(shape[1:]) * info.dtype.itemsize if shape else info.nbytes
    if start is None:
        start, stop = 0, shape[0] if shape else 1
    assert stop is not None and 0 <= start <= stop <= (shape[0] if shape else 1), (info.name, start, stop, shape)
    t = torch.empty((stop - start) * row, dtype=torch.uint8)  # no zero fill: readinto overwrites it
    with os.fdopen(open_regular(info.file, "safetensors file"), "rb", buffering=0) as f:
        f.seek(info.begin + start * row)
        got = f.readinto(memoryview(t.numpy())) if t.numel() else 0
    if got != t.numel():
        raise GptOssFp8Error(f"{info.file}: truncated while reading tensor {info.name}; re-download the file")
    if shape:
        shape[0] = stop - start
    return t.view(info.dtype).reshape(shape)


class StreamingWriter:
    """Write one safetensors file header-first, tensors (or row chunks of them) in header order.

    The file is written under a unique temporary name beside it (``create_temp``) and renamed to
    ``path`` by ``commit()`` after fsync, so a file under its final name is always complete.
    ``retry`` ends the message of a write error (what the user runs after freeing space). Writing and hashing (sha256, for the
    manifest) happen on a background thread, overlapping the caller's compute; at most
    ``QUEUE_CHUNKS`` chunks wait in memory. Callers must not modify a tensor after passing it.
    """

    QUEUE_CHUNKS = 3

    def __init__(self, path: Path, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str],
                 retry: str = "rerun with --resume"):
        self.path = path
        self.retry = retry
        header: dict = {"__metadata__": metadata}
        off = 0
        self._order: list[tuple[str, int]] = []
        for name, dtype, shape in tensors:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
            self._order.append((name, nbytes))
            off += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.total_bytes = 8 + len(raw) + off
        self._error: OSError | None = None
        self._starting = self._launched = self._stopped = self._thread_done = False
        self.tmp: Path | None = None
        self._f = None
        try:  # from the temporary file's creation on, whatever stops us (a Ctrl-C too) removes it
            try:
                fd, self.tmp = create_temp(path)
            except OSError as e:
                raise GptOssFp8Error(f"cannot create a file in {path.parent}: {e.strerror}; fix that and {retry}") from None
            self._f = os.fdopen(fd, "wb")
            self.sha256 = hashlib.sha256()
            self._idx = 0
            self._written_in_tensor = 0
            # The thread is fed and waited for through SimpleQueues (C, reentrant: a get() a Ctrl-C
            # interrupts loses nothing), never queue.Queue or Thread.join, which a KeyboardInterrupt
            # raised inside them breaks (3.11): Queue.put's condition variable could lose the
            # thread's wake-up, and abort() then waited for ever (1 run in ~150 with Ctrl-C 0.2-3.5 s
            # into a tiny convert); an interrupted join() or is_alive() marks the thread stopped
            # while it still runs (bpo-45274's handling releases the lock the running thread holds).
            # The bound: a chunk is queued once a slot is free; the thread frees its slot as it
            # takes the chunk (QUEUE_CHUNKS waiting, one being written).
            self._items: queue.SimpleQueue = queue.SimpleQueue()
            self._slots: queue.SimpleQueue = queue.SimpleQueue()
            for _ in range(self.QUEUE_CHUNKS):
                self._slots.put(True)
            self._ended: queue.SimpleQueue = queue.SimpleQueue()  # the thread's last act: a put here
            self._thread = threading.Thread(target=self._drain, name=f"write {path.name}", daemon=True)
            self._starting = True
            self._thread.start()
            self._launched = True
            self._write(struct.pack("<Q", len(raw)) + raw)
        except BaseException:  # (the caller holds no writer to abort yet)
            self.abort()
            raise

    def _drain(self) -> None:
        try:
            while (data := self._items.get()) is not None:
                self._slots.put(True)
                if self._error is None:
                    try:
                        self._f.write(data)
                        self.sha256.update(data)
                    except OSError as e:
                        self._error = e
        finally:
            self._thread_done = True
            self._ended.put(True)

    def _fail(self, e: OSError) -> GptOssFp8Error:
        self.abort()
        if e.errno == errno.ENOSPC:
            return GptOssFp8Error(
                f"disk full while writing {self.path}; free at least {format_gb(self.total_bytes)} and {self.retry}"
            )
        return GptOssFp8Error(f"cannot write {self.path}: {e.strerror}; fix that and {self.retry}")

    def _write(self, data) -> None:
        if self._error is not None:
            raise self._fail(self._error)
        self._slots.get()
        self._items.put(data)

    def write(self, name: str, t: torch.Tensor) -> None:
        """Append a tensor, or the next row chunk of it, in header order."""
        exp_name, nbytes = self._order[self._idx]
        assert name == exp_name, f"writing {name} but {exp_name} comes next in {self.path}"
        data = t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy()
        assert self._written_in_tensor + data.nbytes <= nbytes, (name, self._written_in_tensor, data.nbytes, nbytes)
        self._write(memoryview(data))
        self._written_in_tensor += data.nbytes
        if self._written_in_tensor == nbytes:
            self._idx += 1
            self._written_in_tensor = 0

    def _stop_thread(self) -> bool:
        """Let the thread write what is queued and end; wait for it. A Ctrl-C meanwhile is held until
        it has ended (returns True then): the thread must not outlive the file, nor run at
        interpreter exit, where torch code on a daemon thread aborts the process ("terminate called
        without an active exception", pytorch/pytorch#38228)."""
        if self._stopped or not self._starting:
            return False
        self._items.put(None)
        interrupted = False
        while not self._thread_done:  # (the flag, not the item: a Ctrl-C just after get() returned)
            # (a start() a Ctrl-C cut short may not have made the thread; if it did, the thread has no work
            # but the None and touches no file once _error is set: a short wait, then it may end on its own)
            try:
                self._ended.get(timeout=None if self._launched else 0.25)
            except queue.Empty:
                break
            except KeyboardInterrupt:
                interrupted = True
        self._stopped = True
        return interrupted

    def commit(self) -> None:
        """Write what is queued, fsync, and rename the file to its name; on any failure, a Ctrl-C
        included, nothing is left (``abort``)."""
        try:
            assert self._idx == len(self._order), f"{self.path}: {len(self._order) - self._idx} tensors not written"
            if self._stop_thread():
                raise KeyboardInterrupt
            if self._error is not None:
                raise self._error
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise self._fail(e) from None
        except BaseException:  # a Ctrl-C: no temporary file left behind
            self.abort()
            raise

    def abort(self) -> None:
        """Stop the thread (what is still queued dropped), close and remove the temporary file."""
        self._error = self._error or OSError("aborted")  # the thread drops what is still queued
        self._stop_thread()  # (a Ctrl-C meanwhile: the caller is already on its way out)
        if self._f is not None and not self._f.closed:
            self._f.close()
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
