"""A local HF-layout gpt-oss MXFP4 checkpoint: located, validated, read one tensor at a time."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from gptoss_fp8.checkpoint.format import INDEX_NAME, PICKLE_SUFFIXES, TensorSpec, hf_source_tensors
from gptoss_fp8.checkpoint.st_io import TensorInfo, read_header, read_tensor
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.config import GptOssConfig, read_config_json

# Folders of the hub repos that are not converter inputs (a second copy of the weights in OpenAI's
# layout, and Metal kernels' weights).
IGNORED_DIRS = ("original", "metal")


@dataclass
class SourceCheckpoint:
    root: Path
    config: GptOssConfig
    config_raw: dict
    tensors: dict[str, TensorInfo]
    files: list[Path]

    @classmethod
    def open(cls, root: Path) -> "SourceCheckpoint":
        """Locate and validate everything that can be checked without reading weights."""
        root = Path(root)
        if not root.is_dir():
            raise GptOssFp8Error(f"{root}: no such directory; give a local gpt-oss checkpoint directory")
        raw = read_config_json(root / "config.json")
        cfg = GptOssConfig.from_dict(raw, str(root / "config.json"))
        files = _weight_files(root)
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            infos, _ = read_header(f)
            for name, info in infos.items():
                if name in tensors:
                    raise GptOssFp8Error(f"tensor {name} is in both {tensors[name].file.name} and {f.name}; remove the duplicate file")
                tensors[name] = info
        src = cls(root, cfg, raw, tensors, files)
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
            ok = info.dtype == torch.uint8 if s.dtype == "uint8" else info.dtype.is_floating_point
            if not ok:
                raise GptOssFp8Error(
                    f"{info.file.name}: tensor {s.name} has dtype {info.dtype}, expected {'uint8' if s.dtype == 'uint8' else 'a float type'}"
                )

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        return read_tensor(self.tensors[name], start, stop)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def fingerprint(self) -> list:
        """What identifies this source for --resume: file names, sizes and mtimes."""
        return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in self.files]


def _weight_files(root: Path) -> list[Path]:
    index = root / INDEX_NAME
    st = sorted(root.glob("*.safetensors"))
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            assert isinstance(wm, dict)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AssertionError):
            raise GptOssFp8Error(f"{index}: invalid index (no weight_map object); re-download it") from None
        files = []
        for fname in dict.fromkeys(wm.values()):
            name = str(fname)
            # A plain file name in SRC; not resolved, since HF cache snapshots hold symlinks to ../../blobs/.
            if Path(name).name != name or name in ("", ".", ".."):
                raise GptOssFp8Error(f"{index}: weight_map points at {fname!r}, outside {root}; refusing to read it")
            p = root / name
            if p.suffix in PICKLE_SUFFIXES:
                raise GptOssFp8Error(f"{index}: weight_map points at pickle file {fname!r}; pickle weights are never loaded (unsafe), use safetensors")
            if not p.is_file():
                raise GptOssFp8Error(f"{index}: weight_map points at {fname!r}, which does not exist; re-download the checkpoint")
            files.append(p)
        return files
    if st:
        return st
    pickles = [p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise GptOssFp8Error(
            f"{root}: only pickle-format weights ({pickles[0]}); they are never loaded (unsafe); use the safetensors release"
        )
    raise GptOssFp8Error(f"{root}: no *.safetensors files and no {INDEX_NAME}; is this a checkpoint directory?")
