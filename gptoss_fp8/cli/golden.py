"""``gptoss-fp8 golden ...``."""

from __future__ import annotations

import typer

app = typer.Typer(help="Golden checks: deterministic synthetic checkpoints and reference logits.", no_args_is_help=True)
