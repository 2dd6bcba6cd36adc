"""A local HF-layout gpt-oss MXFP4 checkpoint: located, validated, read one tensor at a time."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptoss_fp8.checkpoint.format import INDEX_NAME, PICKLE_SUFFIXES, TensorSpec, hf_source_tensors
from gptoss_fp8.checkpoint.st_io import TensorInfo, open_regular, read_header_full, read_tensor
from gptoss_fp8.config import GptOssConfig, load_json, read_config_json
from gptoss_fp8.errors import GptOssFp8Error

# Folders of the hub repos that are not converter inputs (a second copy of the weights in OpenAI's
# layout, and Metal kernels' weights).
IGNORED_DIRS = ("original", "metal")
MAX_INDEX_BYTES = 64 * 1024**2
# Float tensors of an MXFP4 release are bf16; f16/f32 are accepted as copies. FP8 (or any other
# float) there means this is not an MXFP4 source (an already converted checkpoint, say).
SOURCE_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class SourceCheckpoint:
    root: Path
    config: GptOssConfig
    config_raw: dict
    tensors: dict[str, TensorInfo]
    files: list[Path]
    digests: dict[str, str] = field(default_factory=dict)  # file name -> sha256 (config, index, headers)

    @classmethod
    def open(cls, root: Path) -> SourceCheckpoint:
        """Locate and validate everything that can be checked without reading weights."""
        root = Path(root)
        if not root.is_dir():
            raise GptOssFp8Error(f"{root}: no such directory; give a local gpt-oss checkpoint directory")
        raw = read_config_json(root / "config.json")
        cfg = GptOssConfig.from_dict(raw, str(root / "config.json"))
        digests = {"config.json": hashlib.sha256((root / "config.json").read_bytes()).hexdigest()}
        files, weight_map, index_digest = _weight_files(root)
        if index_digest is not None:
            digests[INDEX_NAME] = index_digest
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            h = read_header_full(f)
            digests[f.name] = f"{h.file_bytes}:{h.sha256}"
            for name, info in h.tensors.items():
                if name in tensors:
                    raise GptOssFp8Error(f"tensor {name} is in both {tensors[name].file.name} and {f.name}; "
                                         "remove the duplicate file")
                tensors[name] = info
        if weight_map is not None:
            _check_index(root / INDEX_NAME, weight_map, tensors)
        src = cls(root, cfg, raw, tensors, files, digests)
        src._check_tensors(hf_source_tensors(cfg))
        return src

    def _check_tensors(self, expected: list[TensorSpec]) -> None:
        names = {s.name for s in expected}
        missing = [s.name for s in expected if s.name not in self.tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise GptOssFp8Error(
                f"{self.root}: tensor {missing[0]} is missing{more}; the checkpoint is incomplete or does not match config.json"
            )
        extra = sorted(set(self.tensors) - names)
        if extra:
            raise GptOssFp8Error(
                f"{self.tensors[extra[0]].file}: unexpected tensor {extra[0]} ({len(extra)} in all) for a gpt-oss "
                "config with these sizes; check that config.json belongs to these weights"
            )
        for s in expected:
            info = self.tensors[s.name]
            if info.shape != s.shape:
                raise GptOssFp8Error(
                    f"{info.file.name}: tensor {s.name} has shape {list(info.shape)}, config.json implies {list(s.shape)}; "
                    "the weights and config.json disagree"
                )
            ok = info.dtype == torch.uint8 if s.dtype == "uint8" else info.dtype in SOURCE_FLOATS
            if ok:
                continue
            if s.dtype == "uint8":
                raise GptOssFp8Error(f"{info.file.name}: tensor {s.name} has dtype {info.dtype}, expected uint8 (MXFP4 data)")
            hint = "; is this already an FP8 checkpoint? convert takes the MXFP4 release" if info.dtype.itemsize == 1 else ""
            raise GptOssFp8Error(
                f"{info.file.name}: tensor {s.name} has dtype {str(info.dtype).removeprefix('torch.')}, expected bfloat16 "
                f"(or float16/float32) in an MXFP4 source{hint}"
            )

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        return read_tensor(self.tensors[name], start, stop)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def fingerprint(self) -> dict[str, str]:
        """What identifies this source for --resume: sha256 of config.json, of the index, and of
        every weight file's header (with the file's size). Content, not mtimes: a copied source
        resumes, an edited one does not."""
        return dict(self.digests)


def _check_index(index: Path, weight_map: dict[str, str], tensors: dict[str, TensorInfo]) -> None:
    """Every weight_map entry names a tensor of the file it points at, and every tensor is listed."""
    for name, fname in weight_map.items():
        info = tensors.get(name)
        if info is None:
            raise GptOssFp8Error(f"{index}: weight_map lists tensor {name} in {fname}, which does not hold it; "
                                 "re-download the checkpoint")
        if info.file.name != fname:
            raise GptOssFp8Error(
                f"{index}: weight_map puts tensor {name} in {fname}, but it is in {info.file.name}; re-download the checkpoint"
            )
    unlisted = [n for n in tensors if n not in weight_map]
    if unlisted:
        raise GptOssFp8Error(
            f"{tensors[unlisted[0]].file}: tensor {unlisted[0]} is not in {INDEX_NAME} ({len(unlisted)} in all); "
            "re-download the checkpoint"
        )


def _read_index(index: Path) -> tuple[dict[str, str], str]:
    fd = open_regular(index, "index file")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_INDEX_BYTES + 1)
    if len(raw) > MAX_INDEX_BYTES:
        raise GptOssFp8Error(f"{index}: larger than {MAX_INDEX_BYTES} bytes, not a safetensors index; re-download it")
    d = load_json(raw, str(index), "index JSON")
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict):
        raise GptOssFp8Error(f"{index}: invalid index (no weight_map object); re-download it")
    for name, fname in wm.items():
        if not isinstance(fname, str):
            shown = repr(fname) if len(repr(fname)) < 60 else repr(fname)[:57] + "..."
            raise GptOssFp8Error(
                f"{index}: weight_map value for tensor {name} is {type(fname).__name__} {shown}, not a file name; "
                "re-download the index"
            )
    return wm, hashlib.sha256(raw).hexdigest()


def _weight_files(root: Path) -> tuple[list[Path], dict[str, str] | None, str | None]:
    """(weight files, the index's weight_map or None, the index's sha256 or None)."""
    index = root / INDEX_NAME
    st = sorted(root.glob("*.safetensors"))
    if index.exists() or index.is_symlink():
        wm, digest = _read_index(index)
        files = []
        for name in dict.fromkeys(wm.values()):
            # A plain file name in SRC; not resolved, since HF cache snapshots hold symlinks to ../../blobs/.
            if Path(name).name != name or name in ("", ".", ".."):
                raise GptOssFp8Error(f"{index}: weight_map points at {name!r}, outside {root}; refusing to read it")
            p = root / name
            if p.suffix in PICKLE_SUFFIXES:
                raise GptOssFp8Error(f"{index}: weight_map points at pickle file {name!r}; pickle weights are never loaded "
                                     "(unsafe), use safetensors")
            if not p.exists():
                raise GptOssFp8Error(f"{index}: weight_map points at {name!r}, which does not exist; re-download the checkpoint")
            files.append(p)
        if not files:
            raise GptOssFp8Error(f"{index}: weight_map is empty; re-download the index")
        return files, wm, digest
    if st:
        return st, None, None
    pickles = [p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise GptOssFp8Error(
            f"{root}: only pickle-format weights ({pickles[0]}); they are never loaded (unsafe); use the safetensors release"
        )
    raise GptOssFp8Error(f"{root}: no *.safetensors files and no {INDEX_NAME}; is this a checkpoint directory?")
