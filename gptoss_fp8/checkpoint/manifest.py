"""Loading a converted checkpoint by its manifest (``layout.json``), one rank at a time.

Every loader goes through ``load_rank``: it checks that the manifest is ours, that the rank's
files exist with the recorded sizes (and sha256, unless ``verify=False``), and that their
headers hold exactly the tensors, dtypes and shapes the manifest lists, so a corrupt or missing
rank file, or a manifest that does not match the files, stops with one clear line.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from gptoss_fp8.checkpoint.format import LAYOUT_FORMAT, LAYOUT_NAME
from gptoss_fp8.checkpoint.st_io import DTYPES, read_header, read_tensor
from gptoss_fp8.config import load_json
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.quant.fp8 import dequantize_weight_blocks


def read_manifest(ckpt: Path) -> dict:
    path = Path(ckpt) / LAYOUT_NAME
    if not path.is_file():
        raise GptOssFp8Error(f"{ckpt}: no {LAYOUT_NAME}; is this a checkpoint written by gptoss-fp8 convert (complete)?")
    def bad() -> GptOssFp8Error:
        return GptOssFp8Error(f"{path}: not a valid {LAYOUT_FORMAT} manifest; reconvert or restore the file")

    try:
        m = load_json(path.read_bytes(), str(path), "layout manifest")
    except GptOssFp8Error:
        raise bad() from None
    try:
        assert m["format"] == LAYOUT_FORMAT and len(m["ranks"]) == m["world_size"] == m["tp"]
        for r in m["ranks"]:
            assert isinstance(r["files"], dict) and isinstance(r["tensors"], dict)
            assert all(isinstance(k, str) and isinstance(v["bytes"], int) and isinstance(v["sha256"], str)
                       for k, v in r["files"].items())
    except (KeyError, TypeError, AssertionError):
        raise bad() from None
    return m


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def check_rank_files(ckpt: Path, manifest: dict, rank: int, verify: bool = True) -> dict:
    """Validate a rank's files against the manifest; returns {tensor name: TensorInfo}."""
    ckpt = Path(ckpt)
    if not 0 <= rank < manifest["world_size"]:
        raise GptOssFp8Error(f"{ckpt}: rank {rank} does not exist (world size {manifest['world_size']})")
    r = manifest["ranks"][rank]
    infos = {}
    for rel, meta in r["files"].items():
        f = ckpt / rel
        if not f.is_file():
            raise GptOssFp8Error(f"{f}: rank {rank} file is missing; re-copy it or reconvert "
                                 "(convert --resume finishes a partial one)")
        if f.stat().st_size != meta["bytes"]:
            raise GptOssFp8Error(f"{f}: {f.stat().st_size} bytes, the manifest says {meta['bytes']}; "
                                 "the file is truncated or from another conversion")
        if verify and file_sha256(f) != meta["sha256"]:
            raise GptOssFp8Error(f"{f}: sha256 does not match {LAYOUT_NAME}; the file is corrupt or from another conversion: "
                                 "re-copy it")
        hdr, _ = read_header(f)
        infos.update(hdr)
    listed = r["tensors"]
    for name, t in listed.items():
        info = infos.get(name)
        if info is None or str(info.file) != str(ckpt / t["file"]):
            raise GptOssFp8Error(f"{ckpt / t['file']}: tensor {name} listed in {LAYOUT_NAME} is not in that file; "
                                 "the manifest does not match the files")
        if info.dtype != DTYPES[t["dtype"]] or list(info.shape) != t["shape"]:
            raise GptOssFp8Error(
                f"{info.file}: tensor {name} is {info.dtype} {list(info.shape)}, {LAYOUT_NAME} says {t['dtype']} {t['shape']}; "
                "the manifest does not match the files"
            )
    extra = sorted(set(infos) - set(listed))
    if extra:
        raise GptOssFp8Error(f"{infos[extra[0]].file}: tensor {extra[0]} is not in {LAYOUT_NAME}; "
                             "the manifest does not match the files")
    return infos


def load_rank(ckpt: Path, rank: int, *, verify: bool = True, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of one rank (HF names holding that rank's slices), checked against the manifest."""
    manifest = read_manifest(ckpt)
    infos = check_rank_files(ckpt, manifest, rank, verify)
    return {name: read_tensor(info).to(device) for name, info in infos.items()}


def reassemble(ckpt: Path, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every full tensor, dequantized to float32, rebuilt from all ranks by the manifest alone.

    Replicated tensors must be identical on every rank that holds them; every element of every
    full tensor must be covered exactly once (replicas aside).
    """
    manifest = read_manifest(ckpt)
    full: dict[str, torch.Tensor] = {}
    cover: dict[str, torch.Tensor] = {}
    for r in range(manifest["world_size"]):
        tensors = load_rank(ckpt, r, verify=verify)
        listed = manifest["ranks"][r]["tensors"]
        for name, t in tensors.items():
            meta = listed[name]
            if meta["slices"] is None:
                continue  # a scale: used with its weight
            v = t.float()
            if t.dtype == torch.float8_e4m3fn:
                v = dequantize_weight_blocks(t, tensors[name + "_scale_inv"])
            if name not in full:
                full[name] = torch.full(meta["full_shape"], float("nan"))
                cover[name] = torch.zeros(meta["full_shape"], dtype=torch.int8)
            idx = [slice(None)] * len(meta["full_shape"])
            for d, a, b in meta["slices"]:
                idx[d] = slice(a, b)
            idx = tuple(idx)
            if bool(cover[name][idx].all()):  # a replica (whole tensor, or kv heads beyond their count)
                assert torch.equal(full[name][idx], v), f"replicated slice of {name} differs on rank {r}"
                continue
            assert not cover[name][idx].any(), f"{name}: rank {r} partly overlaps another rank's slice"
            full[name][idx] = v
            cover[name][idx] = 1
    for name, c in cover.items():
        assert bool(c.all()), f"{name}: {int((c == 0).sum())} elements held by no rank"
    return full
