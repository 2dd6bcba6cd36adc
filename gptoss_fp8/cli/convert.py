"""``gptoss-fp8 convert``: MXFP4 checkpoint -> FP8 (e4m3, 128x128 blocks)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer

from gptoss_fp8.cli.common import (
    OverwriteOutputs,
    ScaleModeChoice,
    check_device,
    check_new_dir,
    check_shard_size,
    check_vocab_parallel,
    progress_bar,
)


def print_report(report: dict, dst: Path, worst: int = 5) -> None:
    """The exactness summary: what is exact first (the experts: MXFP4 -> FP8 is lossless in the
    default pow2 mode), then what FP8 rounds and the error it adds (RMS relative, per group)."""
    ex = report["exactness"]
    groups: dict[str, list] = {}
    for name, t in ex["tensors"].items():
        key = "experts" if ".experts." in name else "attention projections" if ".self_attn." in name else "other weights"
        groups.setdefault(key, []).append((name, t))
    exact = {k: v for k, v in groups.items() if all(t["exact"] == t["total"] for _, t in v)}
    rounded = {k: v for k, v in groups.items() if k not in exact}
    for key, ts in exact.items():
        n = sum(t["total"] for _, t in ts)
        typer.echo(f"exact: the {key}, {len(ts)} tensors, all {n:,} values bit for bit")
    for key, ts in rounded.items():
        tot, exa = sum(t["total"] for _, t in ts), sum(t["exact"] for _, t in ts)
        err, ref = sum(t.get("err_sq", 0.0) for _, t in ts), sum(t.get("ref_sq", 0.0) for _, t in ts)
        rms = f"RMS relative error {math.sqrt(err / ref):.2%}" if ref > 0 else "error not recorded"
        hint = " (--keep-attention-bf16 keeps them exact)" if key == "attention projections" else ""
        typer.echo(f"rounded to FP8: the {key}, {len(ts)} tensors, {rms}; {100 * exa / tot:.1f}% of values "
                   f"unchanged{hint}")
    lossy = sorted(((n, t) for n, t in ex["tensors"].items() if t["exact"] < t["total"]),
                   key=lambda nt: -(nt[1].get("err_sq", 0.0) / max(nt[1].get("ref_sq", 0.0), 1e-300)))[:worst]
    if lossy:
        typer.echo("  largest rounding:")
        for n, t in lossy:
            ref = t.get("ref_sq", 0.0)
            rms = f"RMS relative error {math.sqrt(t['err_sq'] / ref):.2%}" if ref > 0 else ""
            typer.echo(f"    {n}: {rms}, {100 * t['exact_fraction']:.1f}% of values unchanged")
    typer.echo(f"report: {dst / 'conversion.json'}")


def convert(
    src: Annotated[str, typer.Argument(
        metavar="SRC", help="Local HF-layout gpt-oss directory, or a hub repo id ORG/NAME[@REVISION].")],
    dst: Annotated[Path, typer.Argument(metavar="DST", help="Output directory for the FP8 checkpoint.")],
    scale_mode: Annotated[ScaleModeChoice, typer.Option(
        help="pow2: power-of-two block scales (lossless for MXFP4); amax: amax/448 (DeepSeek).")] = ScaleModeChoice.pow2,
    keep_attention_bf16: Annotated[bool, typer.Option(help="Leave attention q/k/v/o projections in bf16.")] = False,
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel size: one folder per rank when > 1.")] = 1,
    ep: Annotated[int, typer.Option(min=1, help="Expert-parallel size (divides tp).")] = 1,
    vocab_parallel: Annotated[bool, typer.Option(
        help="Split the embedding and lm_head by vocabulary rows over the tp ranks (default: replicated).")] = False,
    device: Annotated[str, typer.Option(callback=check_device, help="Where the math runs: cpu, cuda, cuda:N.")] = "cpu",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing checkpoint in DST.")] = False,
    resume: Annotated[bool, typer.Option(help="Finish an interrupted conversion into DST (same source and options).")] = False,
    revision: Annotated[str | None, typer.Option(help="Hub revision when SRC is a repo id.")] = None,
    token: Annotated[str | None, typer.Option(help="Hub token (default: HF_TOKEN / the saved login).")] = None,
    max_shard_size: Annotated[float, typer.Option(callback=check_shard_size, help="Largest output file, in GB.")] = 5.0,
    report: Annotated[Path | None, typer.Option(
        help="Also write the exactness/provenance JSON here (not inside SRC or DST).")] = None,
    overwrite_outputs: OverwriteOutputs = False,
) -> None:
    """Convert a gpt-oss MXFP4 checkpoint to FP8 e4m3 with 128x128 block scales, streaming."""
    from gptoss_fp8.checkpoint.hub import resolve_source
    from gptoss_fp8.checkpoint.outputs import check_output_path, write_atomic

    check_vocab_parallel(vocab_parallel, tp)
    check_new_dir(dst, "DST")

    def check_report(*inputs: Path) -> None:  # before the conversion (and any download), not after it
        if report is not None:
            check_output_path(report, overwrite=overwrite_outputs, forbidden=[*inputs, dst], option="--report")

    check_report(*([Path(src)] if Path(src).exists() else []))
    resolved = resolve_source(src, revision=revision, token=token)
    check_report(resolved.path)
    from gptoss_fp8.convert.convert import convert_checkpoint

    source = {k: v for k, v in (("repo_id", resolved.repo_id), ("revision", resolved.revision)) if v}
    bar = None

    def on_plan(total: int, done: int) -> None:
        nonlocal bar
        bar = progress_bar(total, "convert", initial=done)

    try:
        result = convert_checkpoint(
            resolved.path, dst, scale_mode=scale_mode.value, keep_attention_bf16=keep_attention_bf16, tp=tp, ep=ep,
            vocab_parallel=vocab_parallel, device=device,
            overwrite=overwrite, resume=resume, source=source, shard_bytes=int(max_shard_size * 1e9),
            progress=lambda n: bar.update(n) if bar is not None else None, on_plan=on_plan,
        )
    finally:
        if bar is not None:
            bar.close()
    print_report(result, dst)
    if report is not None:
        write_atomic(report, json.dumps(result, indent=1) + "\n", overwrite=overwrite_outputs)
    if result.get("status"):  # --resume on a finished, matching DST: nothing was written
        typer.echo(f"{dst}: {result['status']}")
    else:
        typer.echo(f"wrote FP8 checkpoint to {dst}")
    if tp == 1:  # docs/format.md "Loading it elsewhere": plain from_pretrained routes quant_method fp8 to its own loader
        typer.echo(f"transformers: import gptoss_fp8.hf first, then AutoModelForCausalLM.from_pretrained('{dst}'); "
                   "without the import its fp8 loader cannot read this layout and fails ([hf] extra)")
    else:
        typer.echo("transformers (import gptoss_fp8.hf) loads a --tp 1 conversion only; this one is for gptoss-fp8's "
                   "own generate / serve / verify-logits")
