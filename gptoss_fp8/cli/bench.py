"""``gptoss-fp8 bench ...``: benchmarks that print figures (never timed tests)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Benchmarks (print figures; record them in BENCHMARKS.md).", no_args_is_help=True)
