"""``gptoss-fp8 bench ...``: benchmarks that print figures (never timed tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gptoss_fp8.cli.common import user_errors
from gptoss_fp8.errors import GptOssFp8Error

app = typer.Typer(help="Benchmarks (print figures; record them in BENCHMARKS.md).", no_args_is_help=True)

KERNEL_SUITES = ("gemm", "attention")


def _print_rows(rows: list[dict]) -> None:
    cols = ["suite", "case", "ms", "tflops", "peer", "peer_ms", "peer_tflops", "ratio"]
    typer.echo(" | ".join(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        typer.echo(" | ".join(cells))


@app.command("kernels")
@user_errors
def kernels(
    tokens: Annotated[str, typer.Option(help="Comma-separated token counts.")] = "1024,2048,4096,8192,16384,32768",
    only: Annotated[str, typer.Option(help=f"Comma-separated suites out of {','.join(KERNEL_SUITES)}.")] = ",".join(KERNEL_SUITES),
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the rows as JSON here.")] = None,
) -> None:
    """Kernel throughput (TFLOP/s) beside peers measured in the same run (needs a CUDA GPU)."""
    import torch

    if not torch.cuda.is_available():
        raise GptOssFp8Error("bench kernels needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    token_list = [int(t) for t in tokens.split(",") if t.strip()]
    rows: list[dict] = []
    for suite in [s.strip() for s in only.split(",") if s.strip()]:
        if suite not in KERNEL_SUITES:
            raise GptOssFp8Error(f"unknown kernel suite {suite!r}; choose from {', '.join(KERNEL_SUITES)}")
        if suite == "gemm":
            from gptoss_fp8.bench import kernels_gemm as mod
        else:
            from gptoss_fp8.bench import kernels_attention as mod
        suite_rows = mod.bench(token_list)
        for r in suite_rows:
            r.setdefault("suite", suite)
        _print_rows(suite_rows)
        rows += suite_rows
    if json_out is not None:
        json_out.write_text(json.dumps(rows, indent=1))
