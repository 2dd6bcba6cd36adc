"""The conversion's jobs: which source tensor makes which output tensors, and making them.

``plan_jobs`` lists every output tensor in source order with its transform (the rule table of
checkpoint/format.py decides it); ``run_job`` produces one job's outputs, chunk by chunk, for every
rank that holds a piece, in bounded memory. Pure tensor work: the output directory is writer.py,
the orchestration (resume, records) convert.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from gptoss_fp8.checkpoint.format import ATTENTION_MODULES, NOT_CONVERTED, Kind, fp8_names, rule_for, scales_name
from gptoss_fp8.checkpoint.plan import Slice
from gptoss_fp8.checkpoint.source import SourceCheckpoint
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.quant.fp8 import (
    BLOCK,
    FP8_DTYPE,
    ScaleMode,
    block_amax,
    dequantize_weight_blocks,
    expand_blocks,
    fp8_exact_fraction,
    quantize_weight_blocks,
    quantize_weight_blocks_banded,
    round_trip_sq,
    scale_grid,
    to_fp8_saturating,
)
from gptoss_fp8.quant.mxfp4 import ExactStats, decode_mxfp4, mxfp4_to_fp8, nan_scale_count

DEFAULT_SHARD_BYTES = 5 * 1000**3
DEFAULT_CHUNK_BYTES = 96 * 1024**2


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Job:
    """One source tensor (with its MXFP4 scales) -> one or two output tensors."""

    source: str
    kind: Kind
    outputs: list[OutTensor]
    in_bytes: int

    @property
    def out_bytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


@dataclass(frozen=True)
class ConvertOptions:
    scale_mode: ScaleMode = ScaleMode.pow2
    keep_attention_bf16: bool = False
    device: str = "cpu"
    shard_bytes: int = DEFAULT_SHARD_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def identity(self) -> dict:
        """Options that change the output bytes (recorded, and compared on resume)."""
        return {"scale_mode": ScaleMode(self.scale_mode).value, "keep_attention_bf16": self.keep_attention_bf16,
                "shard_bytes": self.shard_bytes, "weight_block_size": [BLOCK, BLOCK]}


@dataclass
class Report:
    tensors: dict[str, dict] = field(default_factory=dict)

    def add(self, name: str, st: ExactStats) -> None:
        self.tensors[name] = {"total": st.total, "exact": st.exact, "exact_fraction": st.exact_fraction,
                              "max_rel_err": st.max_rel_err, "err_sq": st.err_sq, "ref_sq": st.ref_sq}

    def overall(self) -> dict:
        tot = sum(t["total"] for t in self.tensors.values())
        ex = sum(t["exact"] for t in self.tensors.values())
        mre = max((t["max_rel_err"] for t in self.tensors.values()), default=0.0)
        return {"total": tot, "exact": ex, "exact_fraction": ex / tot if tot else 1.0, "max_rel_err": mre}


def plan_jobs(src: SourceCheckpoint, opts: ConvertOptions) -> list[Job]:
    """Every output tensor, in source order, with the transform that makes it."""
    jobs: list[Job] = []
    for name, info in src.tensors.items():
        kind = rule_for(name).kind
        if name.endswith("_scales") and kind is Kind.copy and name[: -len("_scales")] + "_blocks" in src.tensors:
            continue  # consumed by its *_blocks job
        if kind is Kind.linear_fp8 and opts.keep_attention_bf16:
            kind = Kind.copy
        if kind is Kind.copy:
            jobs.append(Job(name, kind, [OutTensor(name, info.dtype, info.shape)], info.nbytes))
            continue
        wname, sname = fp8_names(name, kind)
        if kind is Kind.experts_mxfp4:
            e, n, g, _ = info.shape
            shape = (e, n, g * 32)
            in_bytes = info.nbytes + src.tensors[scales_name(name)].nbytes
        else:
            shape = info.shape
            in_bytes = info.nbytes
        grid = scale_grid(shape[-2], shape[-1])
        jobs.append(Job(name, kind, [OutTensor(wname, FP8_DTYPE, shape),
                                     OutTensor(sname, torch.float32, (*shape[:-2], *grid))], in_bytes))
    # Output files follow the source order; order within the file list is deterministic.
    return jobs


def output_config(raw: dict, opts: ConvertOptions) -> dict:
    cfg = dict(raw)
    not_converted = list(NOT_CONVERTED) + ([ATTENTION_MODULES] if opts.keep_attention_bf16 else [])
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": not_converted,
    }
    return cfg


# ----------------------------------------------------------------------------------------------
# Producing output tensors, chunk by chunk, for every rank that holds a piece


Write = Callable[[int, str, torch.Tensor], None]


def reslice_blocks(q: torch.Tensor, s: torch.Tensor, index: tuple[slice, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A slice of a block-quantized weight as FP8 block data on its own grid.

    Each own block takes the largest whole-tensor block scale it touches; where it lies inside one
    whole-tensor block the bytes equal the unsharded ones (division by the same power of two).
    """
    n, k = q.shape[-2:]
    deq = dequantize_weight_blocks(q, s)[index]
    per_elem = expand_blocks(s, n, k)[index]
    own = block_amax(per_elem)
    return to_fp8_saturating(deq / expand_blocks(own, *deq.shape[-2:])), own


def _exactness(q: torch.Tensor, s: torch.Tensor, ref: torch.Tensor) -> ExactStats:
    st = ExactStats(total=ref.numel())
    deq = dequantize_weight_blocks(q, s)
    st.exact, st.max_rel_err = fp8_exact_fraction(deq, ref)
    st.err_sq, st.ref_sq = round_trip_sq(deq, ref)
    return st


def _experts_fp8(blocks: torch.Tensor, scales: torch.Tensor, rows: tuple[int, int] | None,
                 cols: tuple[int, int] | None, mode: ScaleMode) -> tuple[torch.Tensor, torch.Tensor, ExactStats]:
    """FP8 of (a row or column range of) MXFP4 experts, on the slice's own block grid."""
    if rows is not None:
        blocks, scales = blocks[:, rows[0]:rows[1]], scales[:, rows[0]:rows[1]]
    if cols is not None and cols[0] % 32 == 0 and cols[1] % 32 == 0:
        g0, g1 = cols[0] // 32, cols[1] // 32
        blocks, scales, cols = blocks[:, :, g0:g1], scales[:, :, g0:g1], None
    if mode is ScaleMode.pow2 and cols is None:
        return mxfp4_to_fp8(blocks.contiguous(), scales.contiguous())
    # Slices that cut MXFP4 groups, and amax mode: exact float decode, then block quantization.
    # In pow2 mode this gives the same bytes as the table path (tests check it).
    g0 = cols[0] // 32 if cols is not None else 0
    g1 = -(-cols[1] // 32) if cols is not None else blocks.shape[2]
    ref = decode_mxfp4(blocks[:, :, g0:g1], scales[:, :, g0:g1], torch.float32)
    if cols is not None:
        ref = ref[..., cols[0] - 32 * g0 : cols[1] - 32 * g0]
    q, s = quantize_weight_blocks(ref, mode)
    return q, s, _exactness(q, s, ref)


def run_job(src: SourceCheckpoint, job: Job, holders: list[tuple[int, Slice]], opts: ConvertOptions,
             write: Write, stats: dict[int, Report], progress: Callable[[int], None]) -> None:
    """Make job's outputs for every (rank, slice of its first output) in holders; bounded memory."""
    dev = torch.device(opts.device)
    info = src.tensors[job.source]
    wname = job.outputs[0].name
    if job.kind is Kind.copy:
        if all(d == 0 for _, sl in holders for d, _, _ in sl.ranges):
            # whole, or cut along rows only (vocab-parallel embedding / lm_head): stream row chunks,
            # each holder getting the rows of the chunk inside its own range
            rows = info.shape[0] if info.shape else 1
            row_bytes = max(1, info.nbytes // max(rows, 1))
            step = max(1, opts.chunk_bytes // row_bytes)
            ranges = [(a, min(rows, a + step)) for a in range(0, rows, step)]
            reads = (lambda a=a, b=b: src.read(job.source, a, b) if info.shape else src.read(job.source) for a, b in ranges)
            own = [(r, _dim_range(sl, 0, rows)) for r, sl in holders]
            with _read_ahead(reads) as got:
                for (a, b), t in zip(ranges, got, strict=True):
                    for r, (r0, r1) in own:
                        lo, hi = max(a, r0), min(b, r1)
                        if lo < hi:
                            write(r, wname, t if (lo, hi) == (a, b) else t[lo - a : hi - a])
                    progress(row_bytes * (b - a))
            return
        full = src.read(job.source)  # sliced copies are small (biases, sinks)
        for r, sl in holders:
            write(r, wname, full[sl.index()])
        progress(job.in_bytes)
        return
    sname = job.outputs[1].name
    mode = ScaleMode(opts.scale_mode)
    if job.kind is Kind.linear_fp8:
        w = src.read(job.source).to(dev)
        q, s, exact, max_rel = quantize_weight_blocks_banded(w, mode)
        for r, sl in holders:
            if sl.ranges:
                qs, ss = reslice_blocks(q, s, sl.index())
                stats[r].add(wname, _exactness(qs, ss, w[sl.index()]))
            else:
                qs, ss = q, s
                stats[r].add(wname, ExactStats(total=w.numel(), exact=exact, max_rel_err=max_rel))
            write(r, wname, qs)
            write(r, sname, ss)
        progress(job.in_bytes)
        return
    # MXFP4 experts: a few experts at a time, each chunk cut into every holder's piece.
    sinfo = src.tensors[scales_name(job.source)]
    e = info.shape[0]
    per_expert = job.in_bytes // e
    step = max(1, opts.chunk_bytes // per_expert)
    acc = {r: ExactStats() for r, _ in holders}
    scale_chunks: dict[int, list[torch.Tensor]] = {r: [] for r, _ in holders}
    chunks = []
    for a in range(0, e, step):
        b = min(e, a + step)
        need = [(r, sl) for r, sl in holders if _dim_range(sl, 0, e)[0] < b and _dim_range(sl, 0, e)[1] > a]
        if need:
            chunks.append((a, b, need))
    reads = (lambda a=a, b=b: (src.read(job.source, a, b), src.read(sinfo.name, a, b)) for a, b, _ in chunks)
    with _read_ahead(reads) as got:
        for (a, b, need), (blocks, scales) in zip(chunks, got, strict=True):
            blocks, scales = blocks.to(dev), scales.to(dev)
            bad = nan_scale_count(scales)
            if bad:
                raise GptOssFp8Error(
                    f"{sinfo.file.name}: tensor {sinfo.name} has {bad} e8m0 scale(s) equal to 255 (NaN) in experts {a}..{b - 1}; "
                    "the checkpoint is corrupt: re-download it"
                )
            for r, sl in need:
                e0, e1 = _dim_range(sl, 0, e)
                lo, hi = max(a, e0), min(b, e1)
                rows = _dim_range(sl, 1, None)
                cols = _dim_range(sl, 2, None)
                q, s, st = _experts_fp8(blocks[lo - a : hi - a], scales[lo - a : hi - a], rows, cols, mode)
                acc[r].add(st)
                scale_chunks[r].append(s.cpu())
                write(r, wname, q)
            del blocks, scales
            progress(per_expert * (b - a))
    for r, _ in holders:
        stats[r].add(wname, acc[r])
        write(r, sname, torch.cat(scale_chunks[r]))


@contextmanager
def _read_ahead(reads: Iterator[Callable[[], object]]) -> Iterator[Iterator[object]]:
    """Results of the read callables in order, the next one running on a thread meanwhile.

    Disk reads then overlap the conversion and the writer thread; at most two chunks are held. A
    context: leaving it (a Ctrl-C, an error) waits for the read in flight, so no thread runs
    torch code once the caller has moved on.
    """
    with ThreadPoolExecutor(1) as ex:

        def results() -> Iterator[object]:
            pending = None
            for fn in reads:
                nxt = ex.submit(fn)
                if pending is not None:
                    yield pending.result()
                pending = nxt
            if pending is not None:
                yield pending.result()

        yield results()


def _dim_range(sl: Slice, dim: int, full: int | None) -> tuple[int, int] | None:
    for d, a, b in sl.ranges:
        if d == dim:
            return a, b
    return (0, full) if full is not None else None
