"""Synthetic gpt-oss MXFP4 checkpoints with realistic statistics, streamed to disk.

No hub is reachable where tests and CI run, so every test and benchmark starts from these. They are
deterministic: each tensor (and each expert chunk of it) draws from its own generator seeded by
(seed, tensor name, chunk), so a checkpoint regenerates bit-identically from its seed.

Statistics, chosen to resemble the released weights where it matters:
* MXFP4 experts: e2m1 codes from a rounded Gaussian (most mass on 0.5..2, tails to 6); e8m0
  exponents = per-tensor base + per-row offset + per-group offset, so exponents vary across rows
  and groups as in trained weights (a few binades within a 128x128 block).
* bf16 projections ~ N(0, 1/fan_in); norms ~ 1 + small noise; sinks ~ N(0, 1).
* lm_head scaled so that logits are peaked: std = 1.6 * sqrt(2 ln V), above the point where the
  largest logit dominates the softmax, so top-1 probabilities sit far above 1/V.
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from gptoss_fp8.checkpoint.format import TensorSpec, assign_shards, hf_source_tensors, shard_file_names
from gptoss_fp8.checkpoint.st_io import StreamingWriter, format_gb
from gptoss_fp8.config import GptOssConfig, hf_config_dict, original_config_dict, preset_config, special_token_ids
from gptoss_fp8.convert.writer import write_text_atomic
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.quant.mxfp4 import E2M1_VALUES

LAYOUTS = ("hf", "original", "both")
SHARD_BYTES = 4 * 1024**3
CHUNK_BYTES = 64 * 1024**2
# synth has no --resume: after a write error the way on is to run it again over the same DST.
RETRY = "run synth again with --overwrite"


def _generation_config(cfg: GptOssConfig) -> dict:
    ids = special_token_ids(cfg.vocab_size)
    return {"bos_token_id": ids["bos"], "do_sample": True, "eos_token_id": [ids["eos"], ids["pad"], ids["call"]],
            "pad_token_id": ids["pad"], "transformers_version": "4.55.0"}


_EXTRA_FILES = {
    "special_tokens_map.json": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
    "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072,
                              "note": "synthetic checkpoint: no tokenizer.json; use token ids"},
}
_CHAT_TEMPLATE = "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}\n"


def _gen(seed: int, name: str, chunk: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + chunk) % 2**63)


# A byte table for sampling e2m1 pairs: 65536 equiprobable entries, each a byte whose two nibbles
# are independent draws of a Gaussian (std 1.3) rounded to the nearest e2m1 value.
def _nibble_table() -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64)
    edges = (mags[1:] + mags[:-1]) / 2
    x = torch.distributions.Normal(0.0, 1.3)
    cdf = x.cdf(edges)  # P(|z| < edge) pieces
    p_mag = torch.cat([2 * cdf[:1] - 1, 2 * (cdf[1:] - cdf[:-1]), 2 * (1 - cdf[-1:])])
    p = torch.cat([p_mag / 2, p_mag / 2])  # codes 0..7 positive, 8..15 negative
    counts = torch.round(p * 256).long()
    counts[1] += 256 - int(counts.sum())
    nib = torch.repeat_interleave(torch.arange(16), counts)  # 256 nibble draws
    return (nib[:, None] | (nib[None, :] << 4)).reshape(-1).to(torch.uint8)  # [65536]


_NIBBLES = _nibble_table()


FLOAT_ROWS_PER_DRAW = 1024


def _float_rows(spec: TensorSpec, cfg: GptOssConfig, seed: int, draw: int) -> torch.Tensor:
    """Rows [draw * 1024, ...) of a float tensor, from a generator of their own."""
    name = spec.name
    rows = spec.shape[0] if spec.shape else 1
    a = draw * FLOAT_ROWS_PER_DRAW
    shape = (min(rows, a + FLOAT_ROWS_PER_DRAW) - a, *spec.shape[1:])
    g = _gen(seed, name, draw)
    h, v = cfg.hidden_size, cfg.vocab_size
    if name.endswith(("layernorm.weight", "norm.weight")):
        t = 1.0 + 0.05 * torch.randn(shape, generator=g)
    elif name.endswith("sinks"):
        t = torch.randn(shape, generator=g)
    elif name == "lm_head.weight":
        t = torch.randn(shape, generator=g) * (1.6 * math.sqrt(2 * math.log(v)) / math.sqrt(h))
    elif name == "model.embed_tokens.weight":
        t = torch.randn(shape, generator=g)
    elif name.endswith(".bias"):
        t = 0.02 * torch.randn(shape, generator=g)
    elif name.endswith("_bias"):  # expert biases
        t = 0.05 * torch.randn(shape, generator=g)
    else:  # projections and router: N(0, 1/fan_in)
        t = torch.randn(shape, generator=g) / math.sqrt(spec.shape[-1])
    return t.to(torch.bfloat16)


def _expert_mxfp4(spec: TensorSpec, seed: int, expert: int) -> torch.Tensor:
    """One expert's blocks [N, G, 16] or scales [N, G] of an MXFP4 expert tensor."""
    g = _gen(seed, spec.name, expert)
    if spec.name.endswith("_blocks"):
        n, groups = spec.shape[1], spec.shape[2]
        idx = torch.randint(0, 65536, (n * groups * 16,), generator=g, dtype=torch.int32)
        return _NIBBLES.index_select(0, idx).reshape(n, groups, 16)
    n, groups = spec.shape[1], spec.shape[2]
    # exponent = base + row offset + group offset: values around 2^-6..2^-3, varying across rows/groups
    base = 127 - 6
    row = torch.round(torch.randn(n, 1, generator=g) * 1.0)
    grp = torch.round(torch.randn(n, groups, generator=g) * 0.8)
    return (base + row + grp).clamp(1, 254).to(torch.uint8)


def _producer(spec: TensorSpec, cfg: GptOssConfig, seed: int) -> Callable[[int, int], torch.Tensor]:
    """rows [a, b) of dim 0 of a synthetic tensor; the same bytes whatever the chunking."""
    if spec.dtype == "uint8":
        return lambda a, b: torch.stack([_expert_mxfp4(spec, seed, e) for e in range(a, b)])

    def rows(a: int, b: int) -> torch.Tensor:
        d0, d1 = a // FLOAT_ROWS_PER_DRAW, (b - 1) // FLOAT_ROWS_PER_DRAW
        t = torch.cat([_float_rows(spec, cfg, seed, d) for d in range(d0, d1 + 1)])
        off = d0 * FLOAT_ROWS_PER_DRAW
        return t[a - off : b - off]

    return rows


def _row_chunks(spec: TensorSpec, chunk_bytes: int, align: int = 1) -> Iterator[tuple[int, int]]:
    """Row ranges [a, b) of dim 0 holding about chunk_bytes each (bf16 / uint8 sized)."""
    rows = spec.shape[0] if spec.shape else 1
    row_bytes = math.prod(spec.shape[1:]) * (1 if spec.dtype == "uint8" else 2)
    step = max(1, chunk_bytes // max(row_bytes, 1))
    if align > 1:
        step = max(align, step - step % align)
    for a in range(0, rows, step):
        yield a, min(rows, a + step)


def spec_bytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * (1 if spec.dtype == "uint8" else 2)


def _write_files(root: Path, names: list[str], specs_per_file: list[list[TensorSpec]],
                 make: Callable[[TensorSpec], tuple[str, Callable[[int, int], torch.Tensor], int]],
                 metadata: dict[str, str], progress: Callable[[int], None]) -> None:
    for fname, specs in zip(names, specs_per_file, strict=True):
        entries = []
        for s in specs:
            out_name, _, _ = make(s)
            entries.append((out_name, torch.uint8 if s.dtype == "uint8" else torch.bfloat16, s.shape))
        w = None
        try:
            w = StreamingWriter(root / fname, entries, metadata, retry=RETRY)
            for s in specs:
                out_name, produce, align = make(s)
                for a, b in _row_chunks(s, CHUNK_BYTES, align):
                    w.write(out_name, produce(a, b))
                    progress(spec_bytes(s) * (b - a) // max(s.shape[0], 1))
            w.commit()
        except BaseException:
            if w is not None:  # (the constructor cleans up after itself)
                w.abort()
            raise


def write_synthetic(dst: Path, preset: str = "tiny", *, layers: int | None = None, seed: int = 0,
                    layout: str = "both", shard_bytes: int | None = None, overwrite: bool = False,
                    progress: Callable[[int], None] | None = None, **overrides) -> GptOssConfig:
    """Write a synthetic gpt-oss MXFP4 checkpoint (HF layout, and/or OpenAI's ``original/``).

    ``overrides`` replace config fields (hidden_size=..., num_local_experts=...), so tests can
    build shapes no preset has. Returns the config written.
    """
    if layout not in LAYOUTS:
        raise GptOssFp8Error(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    cfg = preset_config(preset, layers, **overrides)
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise GptOssFp8Error(f"{dst}: exists and is not a directory; choose a new directory for the synthetic checkpoint")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise GptOssFp8Error(f"{dst}: directory is not empty; choose an empty or new directory (or --overwrite)")
    specs = hf_source_tensors(cfg)
    need = sum(map(spec_bytes, specs)) * (2 if layout == "both" else 1)
    probe = dst
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise GptOssFp8Error(f"{dst}: the {preset} checkpoint needs {format_gb(need)}, {format_gb(free)} free; "
                             "free space or choose another disk (nothing was written)")
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GptOssFp8Error(f"{dst}: cannot create directory ({e.strerror})") from None
    progress = progress or (lambda n: None)
    meta = {"format": "pt", "producer": "gptoss-fp8 synth", "preset": preset, "seed": str(seed)}
    if shard_bytes is None:
        shard_bytes = SHARD_BYTES if preset != "tiny" else max(1, sum(map(spec_bytes, specs)) // 3)

    if layout in ("hf", "both"):
        shard_of = assign_shards([spec_bytes(s) for s in specs], shard_bytes)
        n = shard_of[-1] + 1
        names = shard_file_names(n)
        per_file = [[s for s, k in zip(specs, shard_of, strict=True) if k == f] for f in range(n)]
        _write_files(dst, names, per_file, lambda s: (s.name, _producer(s, cfg, seed), 1), meta, progress)
        index = {"metadata": {"total_size": sum(map(spec_bytes, specs))},
                 "weight_map": {s.name: names[k] for s, k in zip(specs, shard_of, strict=True)}}
        write_text_atomic(dst / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n", RETRY)
        for fname, content in {"generation_config.json": _generation_config(cfg), **_EXTRA_FILES}.items():
            write_text_atomic(dst / fname, json.dumps(content, indent=2) + "\n", RETRY)
        write_text_atomic(dst / "chat_template.jinja", _CHAT_TEMPLATE, RETRY)
        write_text_atomic(dst / "config.json", json.dumps(hf_config_dict(cfg), indent=2) + "\n", RETRY)

    if layout in ("original", "both"):
        _write_original(dst / "original", cfg, seed, meta, progress)
    return cfg


def _original_tensors(cfg: GptOssConfig, seed: int) -> list[tuple[TensorSpec, Callable[[int, int], torch.Tensor], int]]:
    """OpenAI-layout tensors built from the same draws as the HF layout (qkv = cat(q, k, v))."""
    hf = {s.name: s for s in hf_source_tensors(cfg)}

    def same(hf_name: str, new_name: str):
        s = hf[hf_name]
        return replace(s, name=new_name), _producer(s, cfg, seed), 1

    def cat_qkv(n: int, what: str):
        parts = [hf[f"model.layers.{n}.self_attn.{p}_proj.{what}"] for p in "qkv"]
        rows = sum(p.shape[0] for p in parts)
        spec = TensorSpec(f"block.{n}.attn.qkv.{what}", (rows, *parts[0].shape[1:]), "float")
        full = lambda: torch.cat([_producer(p, cfg, seed)(0, p.shape[0]) for p in parts])  # noqa: E731
        return spec, (lambda a, b: full()[a:b]), rows  # one chunk: attention tensors are small

    out = [same("model.embed_tokens.weight", "embedding.weight")]
    for n in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{n}.", f"block.{n}."
        out += [
            same(p + "input_layernorm.weight", q + "attn.norm.scale"),
            cat_qkv(n, "weight"), cat_qkv(n, "bias"),
            same(p + "self_attn.sinks", q + "attn.sinks"),
            same(p + "self_attn.o_proj.weight", q + "attn.out.weight"),
            same(p + "self_attn.o_proj.bias", q + "attn.out.bias"),
            same(p + "post_attention_layernorm.weight", q + "mlp.norm.scale"),
            same(p + "mlp.router.weight", q + "mlp.gate.weight"),
            same(p + "mlp.router.bias", q + "mlp.gate.bias"),
            same(p + "mlp.experts.gate_up_proj_blocks", q + "mlp.mlp1_weight.blocks"),
            same(p + "mlp.experts.gate_up_proj_scales", q + "mlp.mlp1_weight.scales"),
            same(p + "mlp.experts.gate_up_proj_bias", q + "mlp.mlp1_bias"),
            same(p + "mlp.experts.down_proj_blocks", q + "mlp.mlp2_weight.blocks"),
            same(p + "mlp.experts.down_proj_scales", q + "mlp.mlp2_weight.scales"),
            same(p + "mlp.experts.down_proj_bias", q + "mlp.mlp2_bias"),
        ]
    out += [same("model.norm.weight", "norm.scale"), same("lm_head.weight", "unembedding.weight")]
    return out


def _write_original(root: Path, cfg: GptOssConfig, seed: int, meta: dict[str, str], progress) -> None:
    root.mkdir(parents=True, exist_ok=True)
    items = _original_tensors(cfg, seed)
    by_name = {s.name: (s, prod, align) for s, prod, align in items}
    specs = [s for s, _, _ in items]
    _write_files(root, ["model.safetensors"], [specs], lambda s: (s.name, by_name[s.name][1], by_name[s.name][2]),
                 meta, progress)
    write_text_atomic(root / "config.json", json.dumps(original_config_dict(cfg), indent=2) + "\n", RETRY)
