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

This module runs a conversion: validates its arguments, decides what a resume may reuse, runs the
jobs (``jobs.py``: what each source tensor becomes, decode / requantize / slice, exactness) and
records each finished file; the output directory (lock, resume records, atomic writes, metadata
files, free space) is ``writer.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from gptoss_fp8 import __version__
from gptoss_fp8.checkpoint.format import REPORT_NAME
from gptoss_fp8.checkpoint.plan import plan_rank
from gptoss_fp8.checkpoint.source import SourceCheckpoint
from gptoss_fp8.checkpoint.st_io import StreamingWriter
from gptoss_fp8.convert.jobs import (  # noqa: F401  (re-exported)
    DEFAULT_CHUNK_BYTES,
    DEFAULT_SHARD_BYTES,
    ConvertOptions,
    Job,
    Report,
    output_config,
    plan_jobs,
    reslice_blocks,
    run_job,
)
from gptoss_fp8.convert.writer import (  # noqa: F401  (LOCK_NAME, PARTIAL_DIR: re-exported)
    FILE_OVERHEAD,
    LOCK_NAME,
    PARTIAL_DIR,
    RESUME_KEY,
    OutputDir,
    RankFile,
    check_free_space,
    describe_difference,
    layout_files,
    write_metadata_files,
)
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.parallel import Parallel, check_layout
from gptoss_fp8.quant.fp8 import BLOCK, ScaleMode


def _positive_int(v: object, what: str) -> int:
    """A positive whole number of bytes (an int, or an integral finite float), else one clear line."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0 and v == int(v)
    if not ok:
        raise GptOssFp8Error(f"{what} must be a positive whole number of bytes, got {v!r}")
    return int(v)


def _options(scale_mode, keep_attention_bf16, device, shard_bytes, chunk_bytes, tp, ep) -> ConvertOptions:
    """convert_checkpoint's own arguments, validated (library callers get the CLI's errors too)."""
    try:
        mode = ScaleMode(scale_mode)
    except ValueError:
        raise GptOssFp8Error(f"scale mode {scale_mode!r}: choose {' or '.join(m.value for m in ScaleMode)}") from None
    for name, v in (("tp", tp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise GptOssFp8Error(f"--{name} must be a positive integer, got {v!r}")
    if not isinstance(device, str):
        raise GptOssFp8Error(f"--device must be a string such as cpu or cuda:0, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise GptOssFp8Error(f"--device {device}: the converter runs on cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise GptOssFp8Error(f"--device {device}: no CUDA GPU is visible; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise GptOssFp8Error(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return ConvertOptions(mode, bool(keep_attention_bf16), device, _positive_int(shard_bytes, "max shard size (shard_bytes)"),
                          _positive_int(chunk_bytes, "chunk_bytes"))


def convert_checkpoint(
    src_path: Path,
    dst: Path,
    *,
    scale_mode: ScaleMode | str = ScaleMode.pow2,
    keep_attention_bf16: bool = False,
    tp: int = 1,
    ep: int = 1,
    vocab_parallel: bool = False,
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
    ``layout.json``; tp = 1 writes the plain HF layout (and ``layout.json`` too).
    ``vocab_parallel`` (tp > 1) splits the embedding and lm_head by vocabulary rows over the ranks
    instead of replicating them (recorded in ``layout.json``; at tp 1 it changes nothing). ``source`` is
    provenance to record (e.g. {"repo_id": ..., "revision": sha}); the path is always recorded.
    ``progress(n)`` is called with source bytes done; ``on_plan(total, done)`` once before work.

    ``resume`` continues an interrupted conversion with the same source (config, index and header
    hashes), options and layout, re-checking every finished file; on a finished DST with the same
    everything it re-verifies the files and returns the report with ``"status"`` saying it was
    already complete (nothing rewritten). Anything different is refused, offering ``overwrite``.
    """
    src_path, dst = Path(src_path), Path(dst)
    if overwrite and resume:
        raise GptOssFp8Error("--overwrite and --resume exclude each other; pick one")
    opts = _options(scale_mode, keep_attention_bf16, device, shard_bytes, chunk_bytes, tp, ep)
    dev_is_cpu = torch.device(device).type == "cpu"
    src = SourceCheckpoint.open(src_path)
    check_layout(src.config, tp, ep, vocab_parallel)
    vocab_parallel = bool(vocab_parallel) and tp > 1  # tp 1: one rank holds the whole vocabulary
    if dst.resolve() == src.root.resolve():
        raise GptOssFp8Error(f"{dst}: DST is the source directory; choose a new directory for the FP8 checkpoint")
    jobs = plan_jobs(src, opts)
    full = [(o.name, o.dtype, o.shape) for j in jobs for o in j.outputs]
    plans = [{t.name: t for t in plan_rank(full, src.config, Parallel(r, tp, ep, vocab_parallel=vocab_parallel))}
             for r in range(tp)]
    files = layout_files([[o.name for o in j.outputs] for j in jobs], plans, tp, opts.shard_bytes)
    all_files = [f for fs in files for f in fs]
    # the vocab_parallel key only when set: a replicated conversion's record is what it was before
    # the option existed, so --resume of one made then still matches
    vocab = {"vocab_parallel": True} if vocab_parallel else {}
    state = {"tool": "gptoss-fp8", "version": __version__, "options": opts.identity(), "tp": tp, "ep": ep, **vocab,
             "source": src.fingerprint(), "files": [f.rel for f in all_files]}
    total_in = sum(j.in_bytes for j in jobs)

    def need(done: set[str] | dict) -> int:
        return sum(f.nbytes + FILE_OVERHEAD for f in all_files if f.rel not in done)

    out = OutputDir(dst)
    out.check_target()
    # Free space first, before DST, the lock or plan.json exist (an estimate; exact under the lock).
    finished_dst = (dst / "config.json").is_file() and not out.plan_file.exists()
    if not (resume and finished_dst):
        est_done = out.done_estimate(all_files) if resume else set()
        check_free_space(dst, need(est_done), out.reclaimable() if overwrite else 0)
    with out.session():
        existing = out.entries()
        if resume:
            if out.plan_file.exists():
                recorded = out.read_plan()
                if not isinstance(recorded, dict):
                    raise GptOssFp8Error(f"{out.plan_file}: the resume record is unreadable; use --overwrite to start over")
                if recorded != state:
                    kind, what = describe_difference(recorded, state)
                    raise GptOssFp8Error(
                        f"{dst}: the interrupted conversion there used {kind} ({what}); "
                        "rerun with the same source and options, or use --overwrite to start over"
                    )
            elif (dst / "config.json").is_file():
                return _already_complete(out, state, all_files, total_in, on_plan)
            elif existing:
                raise GptOssFp8Error(f"{dst}: holds files but no interrupted gptoss-fp8 conversion; "
                                     "use --overwrite or an empty DST")
        elif existing or out.partial.exists() or out.partial.is_symlink():
            if not overwrite:
                raise GptOssFp8Error(
                    f"{dst}: directory is not empty; use --resume to finish an interrupted conversion, "
                    "--overwrite to replace it, or choose an empty DST"
                )
        finished = out.verify_done(all_files) if resume else {}
        check_free_space(dst, need(finished), out.reclaimable() if overwrite else 0)
        if overwrite:
            out.clear_outputs()
        out.prepare_dirs(all_files)
        out.write_plan(state)
        out.started = True
        _run_jobs(src, jobs, plans, all_files, opts, out, finished, tp, dev_is_cpu, total_in, progress, on_plan)

        report = _merge_stats([finished[f.rel]["stats"] for f in all_files])
        conversion = {
            "tool": "gptoss-fp8",
            "version": __version__,
            "source": {"path": str(src.root.resolve()), **(source or {})},
            "options": opts.identity(),
            "layout": {"tp": tp, "ep": ep, **vocab},
            "exactness": {"overall": report.overall(), "tensors": report.tensors},
            RESUME_KEY: state,
        }
        write_metadata_files(dst, files, {name: shape for name, _, shape in full}, finished, tp, ep,
                             {"vocab_parallel": vocab_parallel, "scale_mode": opts.scale_mode.value,
                              "weight_block_size": [BLOCK, BLOCK]},
                             src.root, conversion, output_config(src.config_raw, opts))
        out.remove_partial()
    return json.loads((dst / REPORT_NAME).read_text())


def _already_complete(out: OutputDir, state: dict, all_files: list[RankFile], total_in: int,
                      on_plan: Callable[[int, int], None] | None) -> dict:
    """--resume on a finished DST: the same conversion (re-verified) returns its report; any other is refused."""
    recorded, conversion = out.finished_state()
    if recorded is None or conversion is None:
        raise GptOssFp8Error(
            f"{out.root}: holds a finished conversion without a resume record ({REPORT_NAME} missing or from an older "
            "gptoss-fp8), so it cannot be checked against this one; use --overwrite to convert again"
        )
    if recorded != state:
        kind, what = describe_difference(recorded, state)
        raise GptOssFp8Error(
            f"{out.root}: holds a finished conversion made with {kind} ({what}); nothing to resume: "
            "use --overwrite to replace it, or choose another DST"
        )
    out.verify_finished(all_files)
    if on_plan:
        on_plan(total_in, total_in)
    conversion["status"] = (f"already complete: the {len(all_files)} weight file(s) in {out.root} match the recorded "
                            "size and sha256; nothing was rewritten")
    return conversion


def _run_jobs(src: SourceCheckpoint, jobs: list[Job], plans: list[dict], all_files: list[RankFile], opts: ConvertOptions,
              out: OutputDir, finished: dict[str, dict], tp: int, dev_is_cpu: bool, total_in: int,
              progress: Callable[[int], None] | None, on_plan: Callable[[int, int], None] | None) -> None:
    """Every job whose files are not all finished; each completed file is committed and recorded
    in ``finished`` (and on disk, for --resume)."""
    done = set(finished)
    # A job is skipped when every file it writes to is done.
    file_of_job: dict[tuple[int, int], RankFile] = {(f.rank, i): f for f in all_files for i in f.jobs}
    todo = [i for i in range(len(jobs)) if any(f.rel not in done for (r, j), f in file_of_job.items() if j == i)]
    if on_plan:
        on_plan(total_in, total_in - sum(jobs[i].in_bytes for i in todo))
    prog = progress or (lambda n: None)
    meta = {"format": "pt", "producer": f"gptoss-fp8 {__version__}", "quant_method": "fp8", "fmt": "e4m3",
            "weight_block_size": "[128, 128]", "scale_mode": opts.scale_mode.value}
    writers: dict[str, StreamingWriter] = {}
    stats = {r: Report() for r in range(tp)}
    cur = -1

    def write(rank: int, name: str, t: torch.Tensor) -> None:
        f = file_of_job[(rank, cur)]
        if f.rel in done:
            return
        w = writers.get(f.rel)
        if w is None:
            w = writers[f.rel] = StreamingWriter(out.root / f.rel, [(t.name, t.dtype, t.shape) for t in f.tensors], meta)
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
            run_job(src, job, holders, opts, write, stats, prog)
            for r, _ in holders:
                f = file_of_job[(r, cur)]
                if f.jobs[-1] == cur:  # the file is complete
                    w = writers[f.rel]
                    w.commit()  # (left in ``writers`` until it has: a Ctrl-C meanwhile aborts it below)
                    del writers[f.rel]
                    rec = {"bytes": w.total_bytes, "sha256": w.sha256.hexdigest(),
                           "stats": {n: stats[r].tensors[n] for n in
                                     (t.name for t in f.tensors) if n in stats[r].tensors}}
                    out.write_record(f, rec)
                    finished[f.rel] = rec
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        torch.set_num_threads(threads)


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
            for k in ("err_sq", "ref_sq"):
                cur[k] = cur.get(k, 0.0) + t.get(k, 0.0)
    return rep
