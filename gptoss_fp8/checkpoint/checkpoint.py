"""A converted (FP8) checkpoint directory, opened once: config, layout, conversion record, tensors.

``Checkpoint.open(path)`` reads ``config.json``, ``layout.json`` (the shard-plan manifest, absent
for an unsharded FP8 checkpoint written by another tool) and ``conversion.json`` (our conversion
record, optional) once, validates them, and is passed on: the model loader, verify and bench take
the object; nothing above this module re-reads those files.

Tensors come out per rank: through the manifest (sizes, sha256 and every header checked against
``layout.json`` first, checkpoint/manifest.py), or, for an unsharded checkpoint without one,
through its safetensors index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptoss_fp8.checkpoint.format import INDEX_NAME, LAYOUT_NAME, REPORT_NAME, attention_is_fp8
from gptoss_fp8.config import GptOssConfig, read_config_json
from gptoss_fp8.errors import GptOssFp8Error


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    raw_config: dict[str, Any]  # config.json as written (quantization_config included)
    config: GptOssConfig
    tp: int  # the layout it was converted for ((1, 1) without layout.json)
    ep: int
    manifest: dict | None  # layout.json, None for an FP8 checkpoint not written by gptoss-fp8
    conversion: dict | None  # conversion.json, None when absent
    # embedding and lm_head split by vocabulary rows over the tp ranks (layout.json's
    # "vocab_parallel"; False for a manifest without the field, written before the option existed)
    vocab_parallel: bool = False

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        """Open a converted checkpoint directory; one-line errors for what is missing or invalid."""
        from gptoss_fp8.checkpoint.manifest import read_manifest

        root = Path(path)
        cfg_path = root / "config.json"
        if not root.is_dir():
            raise GptOssFp8Error(f"{root}: not a directory; point at a converted checkpoint directory")
        if not cfg_path.is_file():
            raise GptOssFp8Error(f"{root}: no config.json; point at a converted checkpoint directory")
        raw = read_config_json(cfg_path)
        check_converted(root, raw)
        cfg = GptOssConfig.from_dict(raw, str(cfg_path))
        manifest = read_manifest(root) if (root / LAYOUT_NAME).is_file() else None
        tp, ep, vocab_parallel = (1, 1, False)
        if manifest is not None:
            try:
                tp, ep = int(manifest["tp"]), int(manifest["ep"])
            except (KeyError, TypeError, ValueError):
                raise GptOssFp8Error(f"{root / LAYOUT_NAME}: not a valid layout manifest (no tp/ep); "
                                     "re-run the conversion") from None
            vocab_parallel = manifest.get("vocab_parallel", False)
            if not isinstance(vocab_parallel, bool):
                raise GptOssFp8Error(f"{root / LAYOUT_NAME}: not a valid layout manifest (vocab_parallel is "
                                     f"{vocab_parallel!r}, not true or false); re-run the conversion")
        conversion = None
        if (root / REPORT_NAME).is_file():
            try:
                conversion = json.loads((root / REPORT_NAME).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                conversion = None  # a record only: unreadable means unknown, not fatal
            if not isinstance(conversion, dict):
                conversion = None
        return cls(root, raw, cfg, tp, ep, manifest, conversion, vocab_parallel and tp > 1)

    @classmethod
    def of(cls, ckpt: Checkpoint | str | Path) -> Checkpoint:
        """``ckpt`` itself when already open, else ``Checkpoint.open(ckpt)`` (library entry points
        take either; inside, the one object is passed on)."""
        return ckpt if isinstance(ckpt, Checkpoint) else cls.open(ckpt)

    # --- what the conversion did --------------------------------------------------------------
    @property
    def attention_fp8(self) -> bool:
        """Whether the attention projections are FP8 (quantization_config in config.json)."""
        return attention_is_fp8(self.raw_config)

    @property
    def scale_mode(self) -> str:
        """The weight scale mode of the conversion (conversion.json, else layout.json; pow2 by default)."""
        for rec, keys in ((self.conversion, ("options", "scale_mode")), (self.manifest, ("scale_mode",))):
            v: Any = rec
            for k in keys:
                v = v.get(k) if isinstance(v, dict) else None
            if v in ("pow2", "amax"):
                return v
        return "pow2"

    @property
    def exact_conversion(self) -> bool:
        """Whether conversion.json says every converted weight came out exact."""
        try:
            return float(self.conversion["exactness"]["overall"]["exact_fraction"]) == 1.0
        except (KeyError, TypeError, ValueError):
            return False

    # --- layout ---------------------------------------------------------------------------------
    def resolve_layout(self, tp: int | None = None, ep: int | None = None) -> tuple[int, int]:
        """The (tp, ep) to run: the checkpoint's, which explicit --tp/--ep must match."""
        if (tp is not None and tp != self.tp) or (ep is not None and ep != self.ep):
            raise GptOssFp8Error(
                f"{self.path}: converted for --tp {self.tp} --ep {self.ep}, asked to run --tp {tp or self.tp} "
                f"--ep {ep or self.ep}; pass --tp {self.tp} --ep {self.ep}, or convert again with the layout you want"
            )
        return self.tp, self.ep

    # --- tensors --------------------------------------------------------------------------------
    def rank_tensors(self, rank: int = 0, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s tensors (checkpoint names). Through layout.json (every file checked
        against it first) when there is one; else the unsharded index (``names``: only those)."""
        if self.manifest is None:
            if rank != 0:
                raise GptOssFp8Error(f"{self.path}: unsharded (no {LAYOUT_NAME}), there is no rank {rank}")
            return read_tensors(self.path, names)
        from gptoss_fp8.checkpoint.manifest import check_rank_files
        from gptoss_fp8.checkpoint.st_io import read_tensor

        infos = check_rank_files(self.path, self.manifest, rank)
        return {name: read_tensor(info) for name, info in infos.items()}


def check_converted(root: Path, raw_config: dict) -> None:
    """A source checkpoint given where a converted one is needed (generate, verify-logits' DST,
    bench --checkpoint: everything that opens one for the model) is one line saying so and what to
    run, before any tensor is looked for."""
    q = raw_config.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "mxfp4":
        raise GptOssFp8Error(f"{root} is an MXFP4 source checkpoint, not a converted FP8 one; "
                             f"convert it first: gptoss-fp8 convert {root} DST")
    if "num_experts" in raw_config and "model_type" not in raw_config:  # OpenAI's original/ config.json
        raise GptOssFp8Error(f"{root} is a source checkpoint in OpenAI's original/ layout, not a converted FP8 one; "
                             "convert the Hugging Face layout beside it first: gptoss-fp8 convert SRC DST")


def read_tensors(ckpt: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of an unsharded checkpoint directory (index json, or one model.safetensors)."""
    from safetensors import safe_open

    index = ckpt / INDEX_NAME
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError, AssertionError):
            raise GptOssFp8Error(f"{index}: not a valid safetensors index (no weight_map of file names); "
                                 "re-run the conversion") from None
    elif (ckpt / "model.safetensors").is_file():
        with safe_open(ckpt / "model.safetensors", framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118  (a safe_open handle is not iterable)
    else:
        raise GptOssFp8Error(f"{ckpt}: no {INDEX_NAME} or model.safetensors; point at a converted checkpoint directory")
    wanted = list(weight_map) if names is None else [n for n in names if n in weight_map]
    by_file: dict[str, list[str]] = {}
    for n in wanted:
        by_file.setdefault(weight_map[n], []).append(n)
    out = {}
    for fname, keys in by_file.items():
        path = ckpt / fname
        if not path.is_file():
            raise GptOssFp8Error(f"{index}: points at missing file {fname}; re-run the conversion")
        try:
            with safe_open(path, framework="pt") as f:
                for k in keys:
                    out[k] = f.get_tensor(k)
        except Exception as e:  # safetensors raises its own types for truncated/corrupt files
            raise GptOssFp8Error(f"{path}: cannot read ({e}); the file is truncated or corrupt, re-run the conversion") from None
    return out
