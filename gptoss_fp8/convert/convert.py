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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from gptoss_fp8 import __version__
from gptoss_fp8.convert.layout import ATTENTION_MODULES, NOT_CONVERTED, Kind, fp8_names, rule_for, scales_name
from gptoss_fp8.convert.source import INDEX_NAME, PICKLE_SUFFIXES, SourceCheckpoint
from gptoss_fp8.convert.st_io import StreamingWriter, read_header
from gptoss_fp8.convert.synth import assign_shards, shard_file_names
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.quant.fp8 import (
    BLOCK, FP8_DTYPE, ScaleMode, dequantize_weight_blocks, fp8_exact_fraction, quantize_weight_blocks, scale_grid,
)
from gptoss_fp8.quant.mxfp4 import ExactStats, decode_mxfp4, mxfp4_to_fp8, nan_scale_count

PARTIAL_DIR = ".gptoss-fp8-partial"
LOCK_NAME = ".gptoss-fp8.lock"
REPORT_NAME = "conversion.json"
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
# Producing output tensors, chunk by chunk


def _produce(src: SourceCheckpoint, job: Job, opts: ConvertOptions, stats: Report,
             progress: Callable[[int], None]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (output name, tensor or row chunk) in output order, bounded memory."""
    dev = torch.device(opts.device)
    info = src.tensors[job.source]
    if job.kind is Kind.copy:
        rows = info.shape[0] if info.shape else 1
        row_bytes = max(1, info.nbytes // max(rows, 1))
        step = max(1, opts.chunk_bytes // row_bytes)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            yield job.source, src.read(job.source, a, b) if info.shape else src.read(job.source)
            progress(row_bytes * (b - a))
        return
    wname, sname = job.outputs[0].name, job.outputs[1].name
    if job.kind is Kind.linear_fp8:
        w = src.read(job.source).to(dev)
        q, s = quantize_weight_blocks(w, opts.scale_mode)
        st = ExactStats(total=w.numel())
        st.exact, st.max_rel_err = fp8_exact_fraction(dequantize_weight_blocks(q, s), w)
        stats.add(wname, st)
        yield wname, q
        yield sname, s
        progress(job.in_bytes)
        return
    # MXFP4 experts: a few experts at a time.
    sinfo = src.tensors[scales_name(job.source)]
    e = info.shape[0]
    per_expert = job.in_bytes // e
    step = max(1, opts.chunk_bytes // per_expert)
    total = ExactStats()
    scale_chunks = []
    for a in range(0, e, step):
        b = min(e, a + step)
        blocks = src.read(job.source, a, b).to(dev)
        scales = src.read(sinfo.name, a, b).to(dev)
        bad = nan_scale_count(scales)
        if bad:
            raise GptOssFp8Error(
                f"{sinfo.file.name}: tensor {sinfo.name} has {bad} e8m0 scale(s) equal to 255 (NaN) in experts {a}..{b - 1}; "
                "the checkpoint is corrupt: re-download it"
            )
        if ScaleMode(opts.scale_mode) is ScaleMode.pow2:
            q, s, st = mxfp4_to_fp8(blocks, scales)
        else:
            ref = decode_mxfp4(blocks, scales, torch.float32)
            q, s = quantize_weight_blocks(ref, ScaleMode.amax)
            st = ExactStats(total=ref.numel())
            st.exact, st.max_rel_err = fp8_exact_fraction(dequantize_weight_blocks(q, s), ref)
        total.add(st)
        scale_chunks.append(s.cpu())
        yield wname, q
        del blocks, scales, q
        progress(per_expert * (b - a))
    stats.add(wname, total)
    yield sname, torch.cat(scale_chunks)


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
        if p.name in (INDEX_NAME, "config.json", REPORT_NAME) or p.name.endswith((".safetensors", ".safetensors.tmp")):
            p.unlink()
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


def convert_checkpoint(
    src_path: Path,
    dst: Path,
    *,
    scale_mode: ScaleMode | str = ScaleMode.pow2,
    keep_attention_bf16: bool = False,
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

    ``source`` is provenance to record (e.g. {"repo_id": ..., "revision": sha}); the path is
    always recorded. ``progress(n)`` is called with source bytes done; ``on_plan(total, done)``
    once before work starts.
    """
    src_path, dst = Path(src_path), Path(dst)
    if overwrite and resume:
        raise GptOssFp8Error("--overwrite and --resume exclude each other; pick one")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GptOssFp8Error(f"--device {device}: no CUDA GPU is visible; use --device cpu")
    opts = ConvertOptions(ScaleMode(scale_mode), keep_attention_bf16, device, shard_bytes, chunk_bytes)
    src = SourceCheckpoint.open(src_path)
    if dst.resolve() == src.root.resolve():
        raise GptOssFp8Error(f"{dst}: DST is the source directory; choose a new directory for the FP8 checkpoint")
    jobs = plan_jobs(src, opts)
    shard_of = assign_shards([j.out_bytes for j in jobs], shard_bytes)
    names = shard_file_names(shard_of[-1] + 1)
    files = [[j for j, k in zip(jobs, shard_of) if k == f] for f in range(len(names))]
    state = {"tool": "gptoss-fp8", "version": __version__, "options": opts.identity(),
             "source": src.fingerprint(), "files": names}

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

        done = {f for f in names if (partial / f"{f}.json").is_file() and (dst / f).is_file()}
        for f in names:
            (dst / f"{f}.tmp").unlink(missing_ok=True)
        need = sum(j.out_bytes for f, js in zip(names, files) if f not in done for j in js)
        free = shutil.disk_usage(dst).free
        if need > free:
            raise GptOssFp8Error(
                f"{dst}: needs {need / 1e9:.2f} GB more, {free / 1e9:.2f} GB free; free space (nothing was written) and rerun"
            )
        total_in = sum(j.in_bytes for j in jobs)
        done_in = sum(j.in_bytes for f, js in zip(names, files) if f in done for j in js)
        if on_plan:
            on_plan(total_in, done_in)
        prog = progress or (lambda n: None)

        report = Report()
        meta = {"format": "pt", "producer": f"gptoss-fp8 {__version__}", "quant_method": "fp8", "fmt": "e4m3",
                "weight_block_size": "[128, 128]", "scale_mode": opts.scale_mode.value}
        for fname, fjobs in zip(names, files):
            rec = partial / f"{fname}.json"
            if fname in done:
                report.tensors.update(json.loads(rec.read_text()))
                continue
            part = Report()
            w = StreamingWriter(dst / fname, [(o.name, o.dtype, o.shape) for j in fjobs for o in j.outputs], meta)
            try:
                for j in fjobs:
                    for oname, t in _produce(src, j, opts, part, prog):
                        w.write(oname, t)
                w.commit()
            except BaseException:
                w.abort()
                raise
            _write_text_atomic(rec, json.dumps(part.tensors))
            report.tensors.update(part.tensors)

        # Index, side files, provenance, and config.json last of all.
        weight_map = {o.name: f for f, fjobs in zip(names, files) for j in fjobs for o in j.outputs}
        index = {"metadata": {"total_size": sum(j.out_bytes for j in jobs)}, "weight_map": weight_map}
        _write_text_atomic(dst / INDEX_NAME, json.dumps(index, indent=2) + "\n")
        for p in side_files(src.root):
            _copy_atomic(p, dst / p.name)
        result = {
            "tool": "gptoss-fp8",
            "version": __version__,
            "source": {"path": str(src.root.resolve()), **(source or {})},
            "options": opts.identity(),
            "exactness": {"overall": report.overall(), "tensors": report.tensors},
        }
        _write_text_atomic(dst / REPORT_NAME, json.dumps(result, indent=1) + "\n")
        _write_text_atomic(dst / "config.json", json.dumps(output_config(src.config_raw, opts), indent=2) + "\n")
        shutil.rmtree(partial, ignore_errors=True)
    (dst / LOCK_NAME).unlink(missing_ok=True)
    return result


def verify_shard_files(dst: Path) -> None:
    """Cheap structural check of a converted checkpoint's files (headers parse, sizes match)."""
    for f in sorted(Path(dst).glob("*.safetensors")):
        read_header(f)
