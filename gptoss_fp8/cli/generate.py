"""``gptoss-fp8 generate``: a Harmony chat reply from a converted checkpoint, decoded through the KV cache."""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import Annotated

import typer

from gptoss_fp8.cli.common import Attention, AttentionOption
from gptoss_fp8.cli.verify_logits import Device, read_tokens
from gptoss_fp8.errors import GptOssFp8Error


class GenMode(str, enum.Enum):
    auto = "auto"
    weights = "weights"
    w8a8 = "w8a8"
    kernels = "kernels"


def _check_temperature(value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise typer.BadParameter(f"{value:g}; give a finite number >= 0 (0: greedy)")
    return value


def generate(
    ckpt: Annotated[Path, typer.Argument(metavar="DST", help="Converted FP8 checkpoint directory.")],
    prompt: Annotated[str | None, typer.Option(help="User message, rendered as a Harmony chat (offline tokenizer); "
                                                 "for a byte-level model (golden/trained), text to continue.")] = None,
    tokens: Annotated[Path | None, typer.Option(help="JSON list of prompt token ids, used as they are.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Stop after this many new tokens.")] = 128,
    temperature: Annotated[float, typer.Option(
        callback=_check_temperature, help="0: greedy (argmax); above 0: sample from softmax(logits / T).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the sampler (temperature > 0): same seed, same tokens.")] = 0,
    device: Annotated[Device, typer.Option(help="Where the model runs.")] = Device.cpu,
    mode: Annotated[GenMode, typer.Option(
        help="What computes the logits (as in verify-logits): weights (FP8 weights, bf16 activations, torch), "
             "w8a8 (the torch spec), kernels (our Triton kernels, --device cuda). auto: kernels on cuda, else weights.")
    ] = GenMode.auto,
    attention: AttentionOption = Attention.bf16,
) -> None:
    """Prefill the prompt, then decode token by token (streamed), until a Harmony stop token or
    --max-new-tokens; prints the reply's channels and tokens/s of prefill and decode. A checkpoint
    converted with --tp T runs one process per rank: started for you, or each process of
    torchrun --nproc-per-node T is one."""
    if (prompt is None) == (tokens is None):
        raise GptOssFp8Error("pass exactly one of --prompt TEXT or --tokens FILE")
    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.verify.generate_sharded import run
    from gptoss_fp8.verify.prompt import encode_prompt

    opened = Checkpoint.open(ckpt)
    cfg = opened.config
    if tokens is not None:
        ids = read_tokens(tokens, cfg.vocab_size)
    else:
        ids = encode_prompt(prompt, cfg, f"--prompt of {ckpt}", ckpt=ckpt)
    run(opened, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, device=device.value,
        mode=mode.value, echo=typer.echo, attention=attention.value)
