"""MXFP4 (HF layout) -> FP8 e4m3 with 128x128 block scales, streamed, resumable, lossless in pow2 mode.

Output (an HF-style FP8 checkpoint in DST):
* ``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json``;
* experts ``...mlp.experts.gate_up_proj`` float8_e4m3fn [E, 2I, H] + ``gate_up_proj_scale_inv``
  float32 [E, ceil(2I/128), ceil(H/128)] (gate/up rows stay interleaved), same for ``down_proj``;
  expert biases unchanged;
* attention q/k/v/o ``weight`` FP8 + ``weight_scale_inv`` (unless keep_attention_bf16);
* everything else (embeddings, lm_head, router, norms, sinks, biases) copied unchanged;
* ``conversion.json``: provenance (source, tool version, options) and the exactness report;
* ``config.json`` = source config with an fp8 ``quantization_config``, written LAST, so a directory
  with a config.json is a complete conversion. Everything is written under a temporary name and
  renamed; ``.gptoss-fp8-partial/`` records finished shards so ``resume`` can finish the job with
  byte-identical files (the output is a pure function of source bytes and options).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from gptoss_fp8 import __version__
from gptoss_fp8.checkpoint.format import (
    ATTENTION_MODULES, NOT_CONVERTED, Kind, assign_shards, fp8_names, rule_for, scales_name, shard_file_names,
)
from gptoss_fp8.checkpoint.format import INDEX_NAME, LAYOUT_FORMAT, LAYOUT_NAME, PICKLE_SUFFIXES, REPORT_NAME
from gptoss_fp8.checkpoint.source import SourceCheckpoint
from gptoss_fp8.checkpoint.st_io import DTYPE_NAMES, StreamingWriter
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.checkpoint.plan import Slice, plan_rank
from gptoss_fp8.parallel import Parallel, check_layout
from gptoss_fp8.quant.fp8 import (
    BLOCK, FP8_DTYPE, ScaleMode, block_amax, dequantize_weight_blocks, expand_blocks, fp8_exact_fraction,
    quantize_weight_blocks, quantize_weight_blocks_banded, scale_grid, to_fp8_saturating,
)
from gptoss_fp8.quant.mxfp4 import ExactStats, decode_mxfp4, mxfp4_to_fp8, nan_scale_count

PARTIAL_DIR = ".gptoss-fp8-partial"
LOCK_NAME = ".gptoss-fp8.lock"
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
                              "max_rel_err": st.max_rel_err}

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
    st.exact, st.max_rel_err = fp8_exact_fraction(dequantize_weight_blocks(q, s), ref)
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


def _run_job(src: SourceCheckpoint, job: Job, holders: list[tuple[int, Slice]], opts: ConvertOptions,
             write: Write, stats: dict[int, Report], progress: Callable[[int], None]) -> None:
    """Make job's outputs for every (rank, slice of its first output) in holders; bounded memory."""
    dev = torch.device(opts.device)
    info = src.tensors[job.source]
    wname = job.outputs[0].name
    if job.kind is Kind.copy:
        if all(not sl.ranges for _, sl in holders):  # replicated: stream row chunks to every holder
            rows = info.shape[0] if info.shape else 1
            row_bytes = max(1, info.nbytes // max(rows, 1))
            step = max(1, opts.chunk_bytes // row_bytes)
            ranges = [(a, min(rows, a + step)) for a in range(0, rows, step)]
            reads = (lambda a=a, b=b: src.read(job.source, a, b) if info.shape else src.read(job.source) for a, b in ranges)
            for (a, b), t in zip(ranges, _read_ahead(reads)):
                for r, _ in holders:
                    write(r, wname, t)
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
    for (a, b, need), (blocks, scales) in zip(chunks, _read_ahead(reads)):
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


def _read_ahead(reads: Iterator[Callable[[], object]]) -> Iterator[object]:
    """Results of the read callables in order, the next one running on a thread meanwhile.

    Disk reads then overlap the conversion and the writer thread; at most two chunks are held.
    """
    with ThreadPoolExecutor(1) as ex:
        pending = None
        for fn in reads:
            nxt = ex.submit(fn)
            if pending is not None:
                yield pending.result()
            pending = nxt
        if pending is not None:
            yield pending.result()


def _dim_range(sl: Slice, dim: int, full: int | None) -> tuple[int, int] | None:
    for d, a, b in sl.ranges:
        if d == dim:
            return a, b
    return (0, full) if full is not None else None


# ----------------------------------------------------------------------------------------------
# The destination: lock, state, resume


@contextmanager
def _locked(dst: Path) -> Iterator[None]:
    lock = dst / LOCK_NAME
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GptOssFp8Error(
                f"{dst}: another gptoss-fp8 convert is writing here (lock {LOCK_NAME} is held); wait for it or choose another DST"
            ) from None
        yield
    finally:
        os.close(fd)


def _dst_entries(dst: Path) -> list[Path]:
    return [p for p in dst.iterdir() if p.name not in (LOCK_NAME, PARTIAL_DIR)]


def _clear_outputs(dst: Path) -> None:
    """--overwrite: remove what loaders read (weights, index, config) and our own state."""
    for p in dst.iterdir():
        if p.name in (INDEX_NAME, "config.json", REPORT_NAME, LAYOUT_NAME) or p.name.endswith((".safetensors", ".safetensors.tmp")):
            p.unlink()
        elif p.is_dir() and p.name.startswith("rank-"):
            shutil.rmtree(p)
    shutil.rmtree(dst / PARTIAL_DIR, ignore_errors=True)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise GptOssFp8Error(f"cannot write {path}: {e.strerror}; free space and rerun with --resume") from None


def _copy_atomic(a: Path, b: Path) -> None:
    tmp = b.with_name(b.name + ".tmp")
    try:
        shutil.copyfile(a, tmp)
        os.replace(tmp, b)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise GptOssFp8Error(f"cannot copy {a.name} to {b}: {e.strerror}") from None


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


# ----------------------------------------------------------------------------------------------


@dataclass
class RankFile:
    """One output file of one rank: its path relative to DST and the jobs whose outputs it holds."""

    rank: int
    rel: str
    jobs: list[int]
    tensors: list  # PlannedTensor, in file order


def rank_dir(rank: int, tp: int) -> str:
    return "." if tp == 1 else f"rank-{rank:05d}"


def layout_files(jobs: list[Job], plans: list[dict], tp: int, shard_bytes: int) -> list[list[RankFile]]:
    """Per rank, its files: each job's outputs stay in one file; names model-0000k-of-0000N."""
    out = []
    for r, held in enumerate(plans):
        mine = [(i, [held[o.name] for o in j.outputs if o.name in held]) for i, j in enumerate(jobs)]
        mine = [(i, ts) for i, ts in mine if ts]
        shard_of = assign_shards([sum(t.nbytes for t in ts) for _, ts in mine], shard_bytes)
        names = shard_file_names(shard_of[-1] + 1)
        d = rank_dir(r, tp)
        files = [RankFile(r, names[f] if d == "." else f"{d}/{names[f]}", [], []) for f in range(len(names))]
        for (i, ts), f in zip(mine, shard_of):
            files[f].jobs.append(i)
            files[f].tensors += ts
        out.append(files)
    return out


def convert_checkpoint(
    src_path: Path,
    dst: Path,
    *,
    scale_mode: ScaleMode | str = ScaleMode.pow2,
    keep_attention_bf16: bool = False,
    tp: int = 1,
    ep: int = 1,
    device: str = "cpu",
    overwrite: bool = False,
    resume: bool = False,
    source: dict | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int, int], None] | None = None,
) -> dict:
    """Convert a local HF-layout gpt-oss MXFP4 checkpoint to FP8. Returns the report dict.

    tp/ep > 1 write one folder per rank (``rank-0000r/``) holding only that rank's slices, plus
    ``layout.json``; tp = 1 writes the plain HF layout (and ``layout.json`` too). ``source`` is
    provenance to record (e.g. {"repo_id": ..., "revision": sha}); the path is always recorded.
    ``progress(n)`` is called with source bytes done; ``on_plan(total, done)`` once before work.
    """
    src_path, dst = Path(src_path), Path(dst)
    if overwrite and resume:
        raise GptOssFp8Error("--overwrite and --resume exclude each other; pick one")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GptOssFp8Error(f"--device {device}: no CUDA GPU is visible; use --device cpu")
    opts = ConvertOptions(ScaleMode(scale_mode), keep_attention_bf16, device, shard_bytes, chunk_bytes)
    dev_is_cpu = torch.device(device).type == "cpu"
    src = SourceCheckpoint.open(src_path)
    check_layout(src.config, tp, ep)
    if dst.resolve() == src.root.resolve():
        raise GptOssFp8Error(f"{dst}: DST is the source directory; choose a new directory for the FP8 checkpoint")
    jobs = plan_jobs(src, opts)
    full = [(o.name, o.dtype, o.shape) for j in jobs for o in j.outputs]
    plans = [{t.name: t for t in plan_rank(full, src.config, Parallel(r, tp, ep))} for r in range(tp)]
    files = layout_files(jobs, plans, tp, shard_bytes)
    all_files = [f for fs in files for f in fs]
    state = {"tool": "gptoss-fp8", "version": __version__, "options": opts.identity(), "tp": tp, "ep": ep,
             "source": src.fingerprint(), "files": [f.rel for f in all_files]}

    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GptOssFp8Error(f"{dst}: cannot create directory ({e.strerror})") from None
    with _locked(dst):
        partial = dst / PARTIAL_DIR
        plan_file = partial / "plan.json"
        existing = _dst_entries(dst)
        if resume:
            if plan_file.is_file():
                if json.loads(plan_file.read_text()) != state:
                    raise GptOssFp8Error(
                        f"{dst}: the interrupted conversion there used another source or other options; "
                        "rerun with the same ones, or use --overwrite to start over"
                    )
            elif (dst / "config.json").is_file() and (dst / REPORT_NAME).is_file():
                return json.loads((dst / REPORT_NAME).read_text())  # already complete
            elif existing:
                raise GptOssFp8Error(f"{dst}: holds files but no interrupted gptoss-fp8 conversion; use --overwrite or an empty DST")
        elif existing or partial.exists():
            if not overwrite:
                raise GptOssFp8Error(
                    f"{dst}: directory is not empty; use --resume to finish an interrupted conversion, "
                    "--overwrite to replace it, or choose an empty DST"
                )
            _clear_outputs(dst)
        partial.mkdir(exist_ok=True)
        _write_text_atomic(plan_file, json.dumps(state))

        def record(f: RankFile) -> Path:
            return partial / (f.rel.replace("/", "__") + ".json")

        done = {f.rel for f in all_files if record(f).is_file() and (dst / f.rel).is_file()}
        for f in all_files:
            (dst / f.rel).parent.mkdir(parents=True, exist_ok=True)
            (dst / f"{f.rel}.tmp").unlink(missing_ok=True)
        need = sum(t.nbytes for f in all_files if f.rel not in done for t in f.tensors)
        free = shutil.disk_usage(dst).free
        if need > free:
            raise GptOssFp8Error(
                f"{dst}: needs {need / 1e9:.2f} GB more, {free / 1e9:.2f} GB free; free space (nothing was written) and rerun"
            )
        # A job is skipped when every file it writes to is done.
        file_of_job: dict[tuple[int, int], RankFile] = {(f.rank, i): f for f in all_files for i in f.jobs}
        todo = [i for i in range(len(jobs)) if any(f.rel not in done for (r, j), f in file_of_job.items() if j == i)]
        total_in = sum(j.in_bytes for j in jobs)
        if on_plan:
            on_plan(total_in, total_in - sum(jobs[i].in_bytes for i in todo))
        prog = progress or (lambda n: None)

        meta = {"format": "pt", "producer": f"gptoss-fp8 {__version__}", "quant_method": "fp8", "fmt": "e4m3",
                "weight_block_size": "[128, 128]", "scale_mode": opts.scale_mode.value}
        writers: dict[str, StreamingWriter] = {}
        stats = {r: Report() for r in range(tp)}
        finished: dict[str, dict] = {}
        for f in all_files:
            if f.rel in done:
                finished[f.rel] = json.loads(record(f).read_text())

        def write(rank: int, name: str, t: torch.Tensor) -> None:
            f = file_of_job[(rank, cur)]
            if f.rel in done:
                return
            w = writers.get(f.rel)
            if w is None:
                w = writers[f.rel] = StreamingWriter(dst / f.rel, [(t.name, t.dtype, t.shape) for t in f.tensors], meta)
            w.write(name, t)

        threads = torch.get_num_threads()
        if dev_is_cpu:
            # The parallelism is ours (expert bands on a pool, a writer thread); intra-op threads
            # on top only spin-wait against them on a small machine.
            torch.set_num_threads(1)
        try:
            for cur in todo:
                job = jobs[cur]
                holders = [(r, plans[r][job.outputs[0].name].slice) for r in range(tp)
                           if (r, cur) in file_of_job and file_of_job[(r, cur)].rel not in done]
                _run_job(src, job, holders, opts, write, stats, prog)
                for r, _ in holders:
                    f = file_of_job[(r, cur)]
                    if f.jobs[-1] == cur:  # the file is complete
                        w = writers.pop(f.rel)
                        w.commit()
                        rec = {"bytes": w.total_bytes, "sha256": w.sha256.hexdigest(),
                               "stats": {n: stats[r].tensors[n] for n in
                                         (t.name for t in f.tensors) if n in stats[r].tensors}}
                        _write_text_atomic(record(f), json.dumps(rec))
                        finished[f.rel] = rec
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        finally:
            torch.set_num_threads(threads)

        report = _merge_stats([finished[f.rel]["stats"] for f in all_files])
        _write_metadata_files(dst, src, opts, jobs, files, plans, finished, report, tp, ep, source)
        shutil.rmtree(partial, ignore_errors=True)
    (dst / LOCK_NAME).unlink(missing_ok=True)
    return json.loads((dst / REPORT_NAME).read_text())


def _merge_stats(records: list[dict]) -> Report:
    """Per-tensor exactness summed over the ranks' shards."""
    rep = Report()
    for rec in records:
        for name, t in rec.items():
            cur = rep.tensors.get(name)
            if cur is None:
                rep.tensors[name] = dict(t)
                continue
            cur["total"] += t["total"]
            cur["exact"] += t["exact"]
            cur["exact_fraction"] = cur["exact"] / cur["total"] if cur["total"] else 1.0
            cur["max_rel_err"] = max(cur["max_rel_err"], t["max_rel_err"])
    return rep


def _write_metadata_files(dst: Path, src: SourceCheckpoint, opts: ConvertOptions, jobs: list[Job],
                          files: list[list[RankFile]], plans: list[dict], finished: dict[str, dict],
                          report: Report, tp: int, ep: int, source: dict | None) -> None:
    """Indexes, layout.json, side files, conversion.json, and config.json last of all."""
    full_shapes = {o.name: o for j in jobs for o in j.outputs}
    ranks = []
    for r, fs in enumerate(files):
        weight_map = {t.name: f.rel.split("/")[-1] for f in fs for t in f.tensors}
        index = {"metadata": {"total_size": sum(t.nbytes for f in fs for t in f.tensors)}, "weight_map": weight_map}
        _write_text_atomic(dst / rank_dir(r, tp) / INDEX_NAME, json.dumps(index, indent=2) + "\n")
        par = Parallel(r, tp, ep)
        tensors = {}
        for f in fs:
            for t in f.tensors:
                tensors[t.name] = {
                    "file": f.rel, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                    "full_shape": list(full_shapes[t.name].shape),
                    "slices": [list(x) for x in t.slice.ranges] if t.slice is not None else None,
                }
        ranks.append({
            "rank": r, "dir": rank_dir(r, tp), "expert_group": par.expert_group, "intermediate_part": par.expert_part,
            "files": {f.rel: {"bytes": finished[f.rel]["bytes"], "sha256": finished[f.rel]["sha256"]} for f in fs},
            "tensors": tensors,
        })
    layout = {"format": LAYOUT_FORMAT, "world_size": tp, "tp": tp, "ep": ep,
              "scale_mode": opts.scale_mode.value, "weight_block_size": [BLOCK, BLOCK], "ranks": ranks}
    _write_text_atomic(dst / LAYOUT_NAME, json.dumps(layout, indent=1) + "\n")
    for p in side_files(src.root):
        _copy_atomic(p, dst / p.name)
    result = {
        "tool": "gptoss-fp8",
        "version": __version__,
        "source": {"path": str(src.root.resolve()), **(source or {})},
        "options": opts.identity(),
        "layout": {"tp": tp, "ep": ep},
        "exactness": {"overall": report.overall(), "tensors": report.tensors},
    }
    _write_text_atomic(dst / REPORT_NAME, json.dumps(result, indent=1) + "\n")
    _write_text_atomic(dst / "config.json", json.dumps(output_config(src.config_raw, opts), indent=2) + "\n")
