"""``gptoss-fp8 plan``: each rank's tensors, shapes and bytes for a tp/ep layout, reading no weights."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gptoss_fp8.cli.common import Preset, check_vocab_parallel
from gptoss_fp8.errors import GptOssFp8Error


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def _group(name: str) -> str:
    if ".experts." in name:
        return "experts"
    if ".self_attn." in name:
        return "attention"
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "embed/lm_head"
    return "other"


def plan(
    src: Annotated[Path | None, typer.Argument(
        metavar="SRC", help="Checkpoint directory (only its config.json is read).")] = None,
    preset: Annotated[Preset | None, typer.Option(help="Plan for a preset's shapes instead.")] = None,
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel size (world size).")] = 1,
    ep: Annotated[int, typer.Option(min=1, help="Expert-parallel size (divides tp).")] = 1,
    keep_attention_bf16: Annotated[bool, typer.Option(help="Plan with attention kept in bf16.")] = False,
    vocab_parallel: Annotated[bool, typer.Option(
        help="Plan with the embedding and lm_head split by vocabulary rows (default: replicated).")] = False,
    summary: Annotated[bool, typer.Option(help="Only per-rank totals, not every tensor.")] = False,
) -> None:
    """Print what each rank holds (tensors, shapes, bytes) and the totals; no weights are read."""
    if (src is None) == (preset is None):
        raise GptOssFp8Error("give either a checkpoint directory SRC or --preset, not both or neither")
    check_vocab_parallel(vocab_parallel, tp)
    if src is not None and not src.is_dir():
        raise GptOssFp8Error(f"{src}: {'is not a directory' if src.exists() else 'no such directory'}; "
                             "give the checkpoint directory (the folder holding config.json)")
    if src is not None and not (src / "config.json").is_file():
        raise GptOssFp8Error(f"{src}: no config.json; give the checkpoint directory (the folder holding config.json)")
    from gptoss_fp8.checkpoint.plan import plan as make_plan
    from gptoss_fp8.config import GptOssConfig, preset_config

    cfg = preset_config(preset.value) if preset else GptOssConfig.from_file(src / "config.json")
    ranks = make_plan(cfg, tp, ep, keep_attention_bf16, vocab_parallel)
    vocab = "vocab-parallel" if vocab_parallel and tp > 1 else "replicated"
    typer.echo(f"layout: tp {tp}, ep {ep}, embedding and lm_head {vocab}")
    grand = 0
    for r, tensors in enumerate(ranks):
        total = sum(t.nbytes for t in tensors)
        grand += total
        typer.echo(f"rank {r}: {len(tensors)} tensors, {_gb(total)}")
        if not summary:
            for t in tensors:
                typer.echo(f"  {t.name}  {str(t.dtype).removeprefix('torch.')} {list(t.shape)}  {t.nbytes} B")
        by: dict[str, int] = {}
        for t in tensors:
            by[_group(t.name)] = by.get(_group(t.name), 0) + t.nbytes
        typer.echo("  " + ", ".join(f"{k} {_gb(v)}" for k, v in sorted(by.items())))
    typer.echo(f"total over {tp} ranks: {_gb(grand)}; largest rank {_gb(max(sum(t.nbytes for t in ts) for ts in ranks))}")
