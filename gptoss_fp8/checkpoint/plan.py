"""The shard plan: which slice of which tensor lives on which rank, for tp in {1, 2, 4, ...}, ep | tp.

One rule table (``SHARD_RULES``) and one pure function (``plan``) serve three users: ``convert``
writes rank files with it, ``gptoss-fp8 plan`` prints it, and the model loads by it (through the
manifest ``layout.json`` that records it). Nothing else decides what lives on which rank.

Parallel layout (world size = tp; ranks r = 0 .. tp-1):
* attention over tp ranks: q heads and sinks split contiguously; k/v heads split when
  tp <= kv heads, otherwise replicated (rank r holds kv head r // (tp / kv_heads)), never a
  head split; o_proj split along its input (head) dimension, its bias held by rank 0 only
  (a partial sum needs the bias once, before the all-reduce);
* MoE: experts split over ep groups (rank r is in group r // (tp/ep)), and each expert's
  intermediate dimension over the tp/ep ranks of a group (part r % (tp/ep)): gate_up rows
  contiguous (rows 2j, 2j+1 are gate/up j, so pairs stay together), gate_up bias alike,
  down_proj columns; down_proj bias only on the part-0 rank of each group (applied once);
* router and norms replicated; embeddings and lm_head replicated by default, or, with the
  ``vocab_parallel`` layout option (``convert --vocab-parallel``, recorded in ``layout.json``;
  older manifests without it are replicated), split by vocabulary rows over the tp ranks:
  rank r holds rows ``[V * r // tp, V * (r + 1) // tp)`` of both (``Parallel.vocab_rows``;
  contiguous, sizes differing by at most one when tp does not divide V). At tp 8 that saves
  (7/8) x 2 x 1.16 GB = 2.03 GB per rank at the released shapes (see ``plan`` totals), for an
  all-reduce of the embedding rows and an all-gather of the logits.

128x128 blocks: shards get their own block grid with partial edge blocks, not padding. Expert
shards are requantized from the MXFP4 source itself, so pow2 exactness is the same as unsharded.
Attention shards take, per own block, the largest whole-tensor block scale they touch: where a
shard block lies inside one whole-tensor block (every gpt-oss-20b/120b layout: q/o slices are
multiples of 128, k/v slices of 64 rows sit inside one block) the bytes are exactly those of the
unsharded conversion.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

import torch

from gptoss_fp8.config import GptOssConfig
from gptoss_fp8.parallel import Parallel, check_layout
from gptoss_fp8.quant.fp8 import FP8_DTYPE, scale_grid


class Split(str, enum.Enum):
    replicate = "replicate"
    q_heads = "q_heads"  # dim 0 by q heads (q_proj weight/bias, sinks)
    kv_heads = "kv_heads"  # dim 0 by kv heads, replicated beyond the kv head count
    o_in = "o_in"  # dim 1 by q heads (o_proj weight)
    rank0 = "rank0"  # replicated content, held by rank 0 only (o_proj bias)
    experts_rows = "experts_rows"  # dim 0 experts by ep group, dim 1 by intermediate part (gate_up)
    experts_cols = "experts_cols"  # dim 0 experts by ep group, dim 2 by intermediate part (down_proj)
    experts_once = "experts_once"  # dim 0 experts by ep group, on part 0 only (down_proj bias)
    vocab = "vocab"  # dim 0 by vocabulary rows with the vocab_parallel layout, else replicated


_L = r"model\.layers\.\d+\."
SHARD_RULES: tuple[tuple[re.Pattern, Split], ...] = tuple((re.compile(p), s) for p, s in (
    (_L + r"self_attn\.q_proj\.(weight|bias)", Split.q_heads),
    (_L + r"self_attn\.sinks", Split.q_heads),
    (_L + r"self_attn\.[kv]_proj\.(weight|bias)", Split.kv_heads),
    (_L + r"self_attn\.o_proj\.weight", Split.o_in),
    (_L + r"self_attn\.o_proj\.bias", Split.rank0),
    (_L + r"mlp\.experts\.gate_up_proj(_bias)?", Split.experts_rows),
    (_L + r"mlp\.experts\.down_proj", Split.experts_cols),
    (_L + r"mlp\.experts\.down_proj_bias", Split.experts_once),
    (r"model\.embed_tokens\.weight|lm_head\.weight", Split.vocab),
    (r".*", Split.replicate),
))


def split_for(name: str) -> Split:
    """The shard rule of a tensor of the FP8 checkpoint (scale tensors follow their weight)."""
    base = name[: -len("_scale_inv")] if name.endswith("_scale_inv") else name
    for pat, s in SHARD_RULES:
        if pat.fullmatch(base):
            return s
    raise AssertionError(name)


@dataclass(frozen=True)
class Slice:
    """A rank's piece of a full tensor: ranges [start, stop) per dimension (None = whole dim)."""

    name: str
    full_shape: tuple[int, ...]
    ranges: tuple[tuple[int, int, int], ...]  # (dim, start, stop)

    @property
    def shape(self) -> tuple[int, ...]:
        s = list(self.full_shape)
        for d, a, b in self.ranges:
            s[d] = b - a
        return tuple(s)

    def index(self) -> tuple[slice, ...]:
        idx = [slice(None)] * len(self.full_shape)
        for d, a, b in self.ranges:
            idx[d] = slice(a, b)
        return tuple(idx)


def _even(n: int, k: int, i: int) -> tuple[int, int]:
    return n * i // k, n * (i + 1) // k


def rank_slice(name: str, full_shape: tuple[int, ...], cfg: GptOssConfig, par: Parallel) -> Slice | None:
    """The slice of ``name`` held by ``par.rank``, or None if that rank holds none of it.

    Scale tensors (``*_scale_inv``) are not sliced: each shard has its own grid; ask for the
    weight's slice and use ``shard_scale_shape``.
    """
    s = split_for(name)
    tp, hd = par.tp, cfg.head_dim
    if s is Split.replicate:
        return Slice(name, full_shape, ())
    if s is Split.rank0:
        return Slice(name, full_shape, ()) if par.rank == 0 else None
    if s is Split.vocab:
        if not par.vocab_parallel:
            return Slice(name, full_shape, ())
        return Slice(name, full_shape, ((0, *par.vocab_rows(full_shape[0])),))
    if s is Split.q_heads:
        per = full_shape[0] // cfg.num_attention_heads  # head_dim rows per head, or 1 for sinks
        h0, h1 = _even(cfg.num_attention_heads, tp, par.rank)
        return Slice(name, full_shape, ((0, h0 * per, h1 * per),))
    if s is Split.kv_heads:
        kv = cfg.num_key_value_heads
        if tp <= kv:
            h0, h1 = _even(kv, tp, par.rank)
        else:
            h0 = par.rank // (tp // kv)
            h1 = h0 + 1
        return Slice(name, full_shape, ((0, h0 * hd, h1 * hd),))
    if s is Split.o_in:
        h0, h1 = _even(cfg.num_attention_heads, tp, par.rank)
        return Slice(name, full_shape, ((1, h0 * hd, h1 * hd),))
    e0, e1 = _even(cfg.num_local_experts, par.ep, par.expert_group)
    i0, i1 = _even(cfg.intermediate_size, par.parts, par.expert_part)
    if s is Split.experts_rows:
        return Slice(name, full_shape, ((0, e0, e1), (1, 2 * i0, 2 * i1)))
    if s is Split.experts_cols:
        return Slice(name, full_shape, ((0, e0, e1), (2, i0, i1)))
    assert s is Split.experts_once, s
    return Slice(name, full_shape, ((0, e0, e1),)) if par.expert_part == 0 else None


def shard_scale_shape(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*weight_shape[:-2], *scale_grid(weight_shape[-2], weight_shape[-1]))


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    slice: Slice | None  # None for scale tensors (own grid)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def fp8_checkpoint_tensors(cfg: GptOssConfig, keep_attention_bf16: bool = False,
                           float_dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, full shape) of every tensor of the converted checkpoint, in file order."""
    from gptoss_fp8.checkpoint.format import Kind, fp8_names, hf_source_tensors, rule_for

    out = []
    for spec in hf_source_tensors(cfg):
        if spec.name.endswith("_scales"):
            continue
        kind = rule_for(spec.name).kind
        if kind is Kind.linear_fp8 and keep_attention_bf16:
            kind = Kind.copy
        if kind is Kind.copy:
            out.append((spec.name, float_dtype, spec.shape))
            continue
        shape = spec.shape if kind is Kind.linear_fp8 else (*spec.shape[:2], spec.shape[2] * 32)
        w, s = fp8_names(spec.name, kind)
        out += [(w, FP8_DTYPE, shape), (s, torch.float32, shard_scale_shape(shape))]
    return out


def plan_rank(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], cfg: GptOssConfig,
              par: Parallel) -> list[PlannedTensor]:
    """What rank ``par.rank`` holds of the given full tensors (scales follow their weights)."""
    out: list[PlannedTensor] = []
    held: dict[str, Slice] = {}
    for name, dtype, shape in tensors:
        if name.endswith("_scale_inv"):
            w = name[: -len("_scale_inv")]
            if w in held:
                out.append(PlannedTensor(name, dtype, shard_scale_shape(held[w].shape), None))
            continue
        sl = rank_slice(name, shape, cfg, par)
        if sl is not None:
            held[name] = sl
            out.append(PlannedTensor(name, dtype, sl.shape, sl))
    return out


def plan(cfg: GptOssConfig, tp: int, ep: int, keep_attention_bf16: bool = False,
         vocab_parallel: bool = False) -> list[list[PlannedTensor]]:
    """Per rank, the tensors it holds, in file order. Pure: reads no weights."""
    check_layout(cfg, tp, ep, vocab_parallel)
    full = fp8_checkpoint_tensors(cfg, keep_attention_bf16)
    return [plan_rank(full, cfg, Parallel(r, tp, ep, vocab_parallel=vocab_parallel)) for r in range(tp)]
