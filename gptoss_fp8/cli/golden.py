"""``gptoss-fp8 golden ...``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gptoss_fp8.cli.common import TorchCommand

app = typer.Typer(help="Golden checks: deterministic synthetic checkpoints and reference logits.", no_args_is_help=True,
                  rich_markup_mode=None)

DirOption = Annotated[Path | None, typer.Option("--dir", help="Golden folder (default: golden/ of this source tree).")]


@app.command("regen", cls=TorchCommand)
def regen(golden_dir: DirOption = None) -> None:
    """Regenerate golden/: synthetic sources (hashes), OpenAI's reference logits, expected metrics."""
    from gptoss_fp8.verify.golden import default_dir
    from gptoss_fp8.verify.golden import regen as do_regen

    do_regen(golden_dir, log=typer.echo)
    typer.echo(f"golden written to {golden_dir or default_dir()}")


@app.command("check", cls=TorchCommand)
def check(golden_dir: DirOption = None) -> None:
    """Convert the golden sources, run verify-logits (tp 1, 2; ep 1, 2), fail on drift."""
    from gptoss_fp8.verify.golden import check as do_check

    failures = do_check(golden_dir, log=typer.echo)
    for f in failures:
        typer.echo(f"drift: {f}", err=True)
    typer.echo("golden check: " + ("PASSED" if not failures else f"FAILED ({len(failures)} problem(s))"))
    if failures:
        raise typer.Exit(1)
