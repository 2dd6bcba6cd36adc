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
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from gptoss_fp8.errors import GptOssFp8Error

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header. Returns ({name: TensorInfo}, metadata)."""

    def corrupt(why: str) -> GptOssFp8Error:
        return GptOssFp8Error(f"{path}: not a valid safetensors file ({why}); re-download or regenerate it")

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise corrupt("shorter than 8 bytes")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or n > size - 8:
            raise corrupt(f"header length {n} does not fit a {size}-byte file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise corrupt("header is not JSON") from None
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, TensorInfo] = {}
    end_max = 0
    for name, e in header.items():
        try:
            dtype = DTYPES[e["dtype"]]
            shape = tuple(int(s) for s in e["shape"])
            b, en = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"bad header entry for tensor {name!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if en - b != nbytes or b < 0:
            raise corrupt(f"tensor {name!r} has {en - b} bytes for shape {list(shape)} {e['dtype']}")
        if en > data_len:
            raise corrupt(f"truncated: tensor {name!r} ends at byte {data_start + en}, file has {size}")
        end_max = max(end_max, en)
        out[name] = TensorInfo(name, path, dtype, shape, data_start + b, nbytes)
    return out, meta


def read_tensor(info: TensorInfo, start: int | None = None, stop: int | None = None) -> torch.Tensor:
    """Read a tensor, or rows [start, stop) of its first dimension, from disk (no mmap held)."""
    shape = list(info.shape)
    row = math.prod(shape[1:]) * info.dtype.itemsize if shape else info.nbytes
    if start is None:
        start, stop = 0, shape[0] if shape else 1
    assert stop is not None and 0 <= start <= stop <= (shape[0] if shape else 1), (info.name, start, stop, shape)
    t = torch.empty((stop - start) * row, dtype=torch.uint8)  # no zero fill: readinto overwrites it
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.begin + start * row)
        got = f.readinto(memoryview(t.numpy())) if t.numel() else 0
    if got != t.numel():
        raise GptOssFp8Error(f"{info.file}: truncated while reading tensor {info.name}; re-download the file")
    if shape:
        shape[0] = stop - start
    return t.view(info.dtype).reshape(shape)


class StreamingWriter:
    """Write one safetensors file header-first, tensors (or row chunks of them) in header order.

    The file is written as ``<path>.tmp`` and renamed to ``path`` by ``commit()`` after fsync,
    so a file under its final name is always complete. Writing and hashing (sha256, for the
    manifest) happen on a background thread, overlapping the caller's compute; at most
    ``QUEUE_CHUNKS`` chunks wait in memory. Callers must not modify a tensor after passing it.
    """

    QUEUE_CHUNKS = 3

    def __init__(self, path: Path, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
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
        self._f = open(self.tmp, "wb")
        self.sha256 = hashlib.sha256()
        self._idx = 0
        self._written_in_tensor = 0
        self._error: OSError | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=self.QUEUE_CHUNKS)
        self._thread = threading.Thread(target=self._drain, name=f"write {path.name}", daemon=True)
        self._thread.start()
        self._write(struct.pack("<Q", len(raw)) + raw)

    def _drain(self) -> None:
        while (data := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._f.write(data)
                    self.sha256.update(data)
                except OSError as e:
                    self._error = e

    def _fail(self, e: OSError) -> GptOssFp8Error:
        self.abort()
        if e.errno == errno.ENOSPC:
            return GptOssFp8Error(
                f"disk full while writing {self.path}; free at least {self.total_bytes / 1e9:.1f} GB and rerun with --resume"
            )
        return GptOssFp8Error(f"cannot write {self.path}: {e.strerror}; fix that and rerun with --resume")

    def _write(self, data) -> None:
        if self._error is not None:
            raise self._fail(self._error)
        self._queue.put(data)

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

    def _stop_thread(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def commit(self) -> None:
        assert self._idx == len(self._order), f"{self.path}: {len(self._order) - self._idx} tensors not written"
        self._stop_thread()
        try:
            if self._error is not None:
                raise self._error
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise self._fail(e) from None
        self._f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self._thread.is_alive():
            self._error = self._error or OSError("aborted")  # the thread drops what is still queued
            self._stop_thread()
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)
