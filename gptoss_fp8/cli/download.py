"""``gptoss-fp8 download``: fetch the files the converter needs from the Hugging Face hub."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gptoss_fp8.errors import GptOssFp8Error


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def download(
    repo_id: Annotated[str, typer.Argument(
        metavar="REPO_ID", help="Hub model repo, ORG/NAME or ORG/NAME@REVISION (e.g. openai/gpt-oss-20b).")],
    revision: Annotated[str | None, typer.Option(help="Branch, tag or commit (default: main).")] = None,
    local_dir: Annotated[
        Path | None, typer.Option(help="Put the files here instead of the Hugging Face cache (HF_HOME).")
    ] = None,
    include_original: Annotated[
        bool, typer.Option("--include-original", help="Also fetch original/ (OpenAI layout) and metal/.")
    ] = False,
    token: Annotated[
        str | None, typer.Option(help="Hub token (default: HF_TOKEN or the token saved by `hf auth login`).")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List the files and bytes; download nothing.")] = False,
) -> None:
    """Download a gpt-oss checkpoint (safetensors, index, config, tokenizer, chat template) from the hub.

    Skips original/ and metal/ unless --include-original. Honours HF_TOKEN, HF_HOME / HF_HUB_CACHE, \
HF_ENDPOINT and HF_HUB_OFFLINE. A dropped transfer resumes; every file is checked against the size \
and hash the hub announces.
    """
    from gptoss_fp8.checkpoint.hub import download as hub_download
    from gptoss_fp8.checkpoint.hub import parse_repo_spec

    repo, rev = parse_repo_spec(repo_id)
    if rev is not None and revision is not None and rev != revision:
        raise GptOssFp8Error(f"{repo_id} names revision {rev!r} but --revision says {revision!r}; give one of them")
    result = hub_download(
        repo,
        revision=rev or revision,
        local_dir=local_dir,
        include_original=include_original,
        token=token,
        dry_run=dry_run,
    )
    if dry_run:
        width = max(len(f.path) for f in result.files)
        for f in result.files:
            typer.echo(f"{f.path:<{width}}  {f.size:>15,d}  {'cached' if f.cached else ''}".rstrip())
        typer.echo(
            f"{len(result.files)} files, {result.total_bytes:,d} bytes ({_human(result.total_bytes)}); "
            f"to download: {result.bytes_to_fetch:,d} bytes ({_human(result.bytes_to_fetch)})"
        )
        typer.echo(f"commit {result.revision}, into {result.path}")
        return
    if result.offline:
        typer.echo("hub not contacted (offline or unreachable): using the cached files", err=True)
    typer.echo(f"{len(result.files)} files, {result.total_bytes:,d} bytes ({_human(result.total_bytes)})")
    typer.echo(f"commit {result.revision}")
    typer.echo(str(result.path))
