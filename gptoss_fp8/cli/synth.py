"""``gptoss-fp8 synth``: write a synthetic gpt-oss MXFP4 checkpoint."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer

from gptoss_fp8.cli.common import Preset, check_new_dir, progress_bar
from gptoss_fp8.config import LIMITS


class Layout(str, enum.Enum):
    hf = "hf"
    original = "original"
    both = "both"


def synth(
    dst: Annotated[Path, typer.Argument(metavar="DST", help="Directory to create (must be empty or new).")],
    preset: Annotated[Preset, typer.Option(
        help="Shapes: tiny (tests), 20b or 120b (real shapes, streamed to disk).")] = Preset.tiny,
    layers: Annotated[int | None, typer.Option(min=1, help="Number of layers (default: the preset's).")] = None,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed regenerates the same bytes.")] = 0,
    layout: Annotated[Layout, typer.Option(
        help="hf (Hugging Face root layout), original (OpenAI's original/), or both.")] = Layout.hf,
    vocab_size: Annotated[int | None, typer.Option(
        min=4, max=LIMITS["vocab_size"], help="Vocabulary ids (default: the preset's; tiny has 503). 201088, "
        "o200k_harmony's, makes a checkpoint that serve runs the chat and Responses APIs on (its random weights "
        "write noise).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Write into a non-empty DST.")] = False,
) -> None:
    """Write a synthetic gpt-oss MXFP4 checkpoint with realistic statistics (no network needed)."""
    check_new_dir(dst, "DST")
    from gptoss_fp8.checkpoint.format import hf_source_tensors
    from gptoss_fp8.config import preset_config
    from gptoss_fp8.convert.synth import spec_bytes, write_synthetic

    overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
    cfg = preset_config(preset.value, layers, **overrides)
    total = sum(map(spec_bytes, hf_source_tensors(cfg))) * (2 if layout is Layout.both else 1)
    with progress_bar(total, "synth") as bar:
        write_synthetic(dst, preset.value, layers=layers, seed=seed, layout=layout.value, overwrite=overwrite,
                        progress=bar.update, **overrides)
    typer.echo(f"wrote {preset.value} checkpoint ({cfg.num_hidden_layers} layers, vocabulary {cfg.vocab_size}, seed "
               f"{seed}, layout {layout.value}) to {dst}")
