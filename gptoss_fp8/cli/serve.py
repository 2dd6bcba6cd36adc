"""``gptoss-fp8 serve``: an OpenAI-compatible server over a converted checkpoint (docs/serve.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gptoss_fp8.cli.common import Attention, AttentionOption
from gptoss_fp8.cli.generate import GenMode
from gptoss_fp8.cli.verify_logits import Device


def serve(
    ckpt: Annotated[Path, typer.Argument(help="Converted FP8 checkpoint directory.")],
    host: Annotated[str, typer.Option(help="Address to bind (loopback unless told otherwise).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port.")] = 8000,
    device: Annotated[Device, typer.Option(help="Where the model runs.")] = Device.cpu,
    mode: Annotated[GenMode, typer.Option(
        help="What computes the logits (as in generate): weights, w8a8, kernels (--device cuda); auto: kernels on "
             "cuda, else weights.")] = GenMode.auto,
    max_batch: Annotated[int, typer.Option(min=1, help="KV cache slots at most (requests running at once).")] = 8,
    max_context: Annotated[int | None, typer.Option(
        min=2, help="Tokens per request, prompt and reply (default min(model context, 8192)).")] = None,
    prefill_chunk: Annotated[int | None, typer.Option(
        min=1, help="Prompt tokens per prefill chunk (default 256 on cpu, 8192 on cuda).")] = None,
    max_waiting: Annotated[int | None, typer.Option(
        min=0, help="Requests queued beyond the slots before 429 (default 4 x slots).")] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer key every route but /health requires.")] = None,
    model_name: Annotated[str | None, typer.Option(help="The model id clients send (default: the directory name).")] = None,
    attention: AttentionOption = Attention.bf16,
    prefix_cache: Annotated[bool, typer.Option(
        help="Keep each prompt's keys, and each chat's system and developer messages', for requests that start with the "
             "whole of them (a conversation's next turn, the same instructions, n choices): they prefill only what "
             "follows. A few MB a slot.")] = True,
) -> None:
    """Serve the OpenAI API with continuous batching: /v1/chat/completions, /v1/responses,
    /v1/completions, /v1/models, /health, /metrics. A byte-level model (the trained fixture) serves
    /v1/completions only (it has no chat format). A checkpoint converted with --tp T runs one
    process per rank: started for you, or each process of torchrun --nproc-per-node T is one."""
    from gptoss_fp8.serve.launch import serve as run

    run(ckpt, host=host, port=port, device=device.value, mode=mode.value, max_batch=max_batch, max_context=max_context,
        chunk=prefill_chunk, max_waiting=max_waiting, api_key=api_key, model_name=model_name, echo=typer.echo,
        attention=attention.value, prefix_cache=prefix_cache)
