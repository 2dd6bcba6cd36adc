"""The ``gptoss-fp8`` command line. Commands live one per module; this file only wires them."""

from __future__ import annotations

import os

import typer

from gptoss_fp8 import __version__
from gptoss_fp8.cli.common import DEBUG_ENV

app = typer.Typer(
    name="gptoss-fp8",
    help="Convert gpt-oss MXFP4 checkpoints to block-FP8 (e4m3, 128x128) for Hopper, and prove the result.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors (or set GPTOSS_FP8_DEBUG=1)."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    if debug:
        os.environ[DEBUG_ENV] = "1"


def _register() -> None:
    # Imported here so `--help` stays fast and each command stays in its own module.
    from gptoss_fp8.cli import bench, convert, download, golden, plan, synth, verify_logits

    app.command("synth", no_args_is_help=True)(synth.synth)
    app.command("convert", no_args_is_help=True)(convert.convert)
    app.command("download", no_args_is_help=True)(download.download)
    app.command("plan", no_args_is_help=True)(plan.plan)
    app.command("verify-logits", no_args_is_help=True)(verify_logits.verify_logits)
    app.add_typer(golden.app, name="golden")
    app.add_typer(bench.app, name="bench")


_register()

if __name__ == "__main__":
    app()
