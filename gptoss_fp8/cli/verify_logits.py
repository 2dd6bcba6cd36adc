"""``gptoss-fp8 verify-logits``: the FP8 forward pass against OpenAI's reference logits."""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated

import typer

from gptoss_fp8.cli.common import (
    Attention,
    AttentionBackend,
    AttentionBackendOption,
    AttentionOption,
    Gemm,
    GemmOption,
    KernelOptionOption,
    OverwriteOutputs,
    check_distinct,
    check_fraction,
    check_threshold,
    plot_ready,
)
from gptoss_fp8.errors import GptOssFp8Error


class Mode(str, enum.Enum):
    auto = "auto"
    weights = "weights"
    w8a8 = "w8a8"
    kernels = "kernels"
    both = "both"
    all = "all"


class Device(str, enum.Enum):
    cpu = "cpu"
    cuda = "cuda"




TOKENS_MAX_BYTES = 64 << 20  # a JSON list of ~10M token ids; more is not a tokens file


def read_tokens(path: Path, vocab_size: int | None = None) -> list[int]:
    """A JSON list of token ids, each in [0, vocab_size) when given."""
    path = Path(path)
    if not path.exists():
        raise GptOssFp8Error(f"--tokens {path}: no such tokens file; pass a JSON list of token ids")
    if not path.is_file():  # a directory, or a FIFO that would block the read
        raise GptOssFp8Error(f"--tokens {path}: {'is a directory' if path.is_dir() else 'not a regular file'}; "
                             "pass a JSON file holding a list of token ids")
    if path.stat().st_size > TOKENS_MAX_BYTES:
        raise GptOssFp8Error(f"--tokens {path}: larger than {TOKENS_MAX_BYTES >> 20} MiB; not a JSON list of token ids")
    try:
        ids = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GptOssFp8Error(f"--tokens {path}: invalid JSON ({e}); pass a JSON list of token ids") from None
    except RecursionError:
        raise GptOssFp8Error(f"--tokens {path}: JSON nested too deeply; pass a flat JSON list of token ids") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise GptOssFp8Error(f"--tokens {path}: expected a non-empty JSON list of non-negative integer token ids")
    if vocab_size is not None:
        check_vocab(ids, vocab_size, f"--tokens {path}")
    return ids


def check_vocab(ids: list[int], vocab_size: int, where: str) -> None:
    """Every id in [0, vocab_size): the embedding has no row for others."""
    bad = next(((k, i) for k, i in enumerate(ids) if not 0 <= i < vocab_size), None)
    if bad is not None:
        k, i = bad
        shown = str(i) if len(str(i)) <= 24 else f"{str(i)[:12]}...({len(str(i))} digits)"
        raise GptOssFp8Error(f"{where}: token id {shown} at position {k} is outside the vocabulary (vocab_size "
                             f"{vocab_size}); use token ids the model has (--prompt needs the real 201088-token vocabulary)")


def verify_logits(
    ckpt: Annotated[Path, typer.Argument(metavar="DST", help="Converted FP8 checkpoint directory.")],
    reference: Annotated[Path, typer.Option(
        help="The SOURCE MXFP4 checkpoint (HF layout or original/), or a saved reference logits file (.safetensors).")],
    tokens: Annotated[Path | None, typer.Option(help="JSON list of token ids to run (default: a built-in sample).")] = None,
    prompt: Annotated[str | None, typer.Option(help="Text, rendered as a Harmony chat (openai-harmony, offline).")] = None,
    mode: Annotated[list[Mode] | None, typer.Option(
        metavar="auto|weights|w8a8|kernels|both|all",
        help="What computes our logits; repeat to combine. weights: FP8 weights dequantized, bf16 activations "
             "(torch); w8a8: FP8 activations too, the torch spec of what serving computes; kernels: the same w8a8 "
             "numerics on our Triton kernels (needs --device cuda); both = weights + w8a8; all = the three. "
             "Default auto: weights + w8a8, plus kernels on --device cuda (then also checked against w8a8).",
        show_default=False)] = None,
    tp: Annotated[int | None, typer.Option(
        min=1, help="Tensor-parallel processes (default: the checkpoint's layout.json; must match it).")] = None,
    ep: Annotated[int | None, typer.Option(
        min=1, help="Expert-parallel groups, dividing tp (default: the checkpoint's layout).")] = None,
    device: Annotated[Device, typer.Option(help="Where the forward passes run.")] = Device.cpu,
    json_report: Annotated[Path | None, typer.Option("--json", help="Write the JSON report here.")] = None,
    dump_logits: Annotated[Path | None, typer.Option(
        help="Write our logits (safetensors, key 'logits', float32 [T, V]); "
             "FILE.<mode>.safetensors per mode when several run.")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Write a PNG of per-layer errors and per-position KL (needs matplotlib).")] = None,
    save_reference: Annotated[Path | None, typer.Option(
        help="Also save the reference logits and hidden states here, to reuse with --reference FILE.")] = None,
    max_kl_mean: Annotated[float | None, typer.Option(
        callback=check_threshold, help="Override: largest mean KL(ref||ours), nats.")] = None,
    max_kl: Annotated[float | None, typer.Option(
        callback=check_threshold, help="Override: largest KL at any position, nats.")] = None,
    min_top1: Annotated[float | None, typer.Option(
        callback=check_fraction, help="Override: smallest top-1 agreement (0..1).")] = None,
    layer_rel_err: Annotated[float | None, typer.Option(
        callback=check_threshold, help="Override: hidden-state relative error that marks a layer as diverging.")] = None,
    max_part_err: Annotated[float | None, typer.Option(
        callback=check_threshold,
        help="Override: largest teacher-forced relative error of any part (attention, MoE, router).")] = None,
    allow_fallback: Annotated[bool, typer.Option(
        help="Let the kernels mode pass when some ops ran the torch spec instead of a kernel (experiments).")] = False,
    gemm: GemmOption = Gemm.ours,
    attention: AttentionOption = Attention.bf16,
    attention_backend: AttentionBackendOption = AttentionBackend.ours,
    kernel_option: KernelOptionOption = None,
    decode: Annotated[int, typer.Option(
        min=0, metavar="N",
        help="Also prefill all but the last N tokens and decode those one at a time through the KV cache; each "
             "step must match the same mode's full forward at that position (logits and every layer).")] = 0,
    overwrite_outputs: OverwriteOutputs = False,
) -> None:
    """Compare the FP8 checkpoint's logits with OpenAI's reference on the source; exit 1 on failure.

    On --device cuda the default runs our GPU kernels too (mode kernels) and checks them against the
    reference and against the torch w8a8 spec; the report names the ops backend of every mode."""
    if tokens is not None and prompt is not None:
        raise GptOssFp8Error("pass --tokens or --prompt, not both")
    # Every output path is checked before any model runs: a bad one is one line now, not a
    # traceback (or a clobbered file) after the reference and all modes have run.
    from gptoss_fp8.checkpoint.outputs import atomic_output, check_output_path, write_atomic
    from gptoss_fp8.verify import report as verdict
    from gptoss_fp8.verify import run
    from gptoss_fp8.verify.backends import check_attention_backend, check_gemm, check_kernel_options

    # before any model runs: a mode this device cannot run is one line now, not after the reference
    modes = run.resolve_modes([m.value for m in mode] if mode else None, device.value)
    check_gemm(gemm.value, modes)
    check_attention_backend(attention_backend.value, modes)
    check_kernel_options(kernel_option, modes)
    run.check_one_process(kernel_option, 1, run.under_torchrun())
    run.check_attention(attention.value, decode)
    inputs = [p for p in (ckpt, reference, tokens) if p is not None]  # never written into or over
    named = {"--json": json_report, "--plot": plot, "--save-reference": save_reference}
    if dump_logits is not None:
        named |= {f"--dump-logits ({m})": p for m, p in verdict.dump_paths(dump_logits, modes).items()}
    check_distinct(named)
    for option, p in named.items():
        if p is not None:
            check_output_path(p, overwrite=overwrite_outputs, forbidden=inputs, option=option)
    if plot is not None:
        plot_ready(plot)
    import torch

    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.verify.reference import reference_for
    from gptoss_fp8.verify.reference import save_reference as save_ref

    opened = Checkpoint.open(ckpt)  # config, layout and conversion record, read once
    cfg = opened.config
    tp, ep = opened.resolve_layout(tp, ep)
    run.check_one_process(kernel_option, tp)  # (the checkpoint's layout)
    from gptoss_fp8.verify.reference import check_reference_matches

    check_reference_matches(reference, cfg, ckpt)  # another model's reference: one line, before anything runs
    ids, tokens_from = None, "reference file"
    if tokens is not None:
        ids, tokens_from = read_tokens(tokens, cfg.vocab_size), f"--tokens {tokens}"
    elif prompt is not None:
        from gptoss_fp8.tokenizer import byte_tokenizer_of
        from gptoss_fp8.verify.prompt import encode_prompt

        ids = encode_prompt(prompt, cfg, f"--prompt of {ckpt}", ckpt=ckpt)
        tokens_from = "--prompt (bytes)" if byte_tokenizer_of(ckpt) is not None else "--prompt (Harmony)"
    elif not Path(reference).is_file():  # nothing given and no reference file to take them from
        from gptoss_fp8.verify.samples import default_tokens

        ids, tokens_from = default_tokens(ckpt, cfg.vocab_size)
        typer.echo(f"tokens: {tokens_from}")
    if ids is not None:
        ids = torch.tensor(ids, dtype=torch.long)
        if decode:
            from gptoss_fp8.verify.decode import check_decode_steps

            check_decode_steps(decode, int(ids.numel()))
    overrides = {"kl_mean": max_kl_mean, "kl_max": max_kl, "top1_min": min_top1, "layer_rel_err": layer_rel_err,
                 "part_rel_err": max_part_err}

    if run.under_torchrun():
        report, outputs, ref = run.verify_under_torchrun(opened, reference, ids, modes=modes, ep=ep, device=device.value,
                                                         overrides=overrides, tokens_from=tokens_from,
                                                         save_reference=save_reference, allow_fallback=allow_fallback,
                                                         gemm=gemm.value, decode=decode, attention=attention.value,
                                                         attention_backend=attention_backend.value)
        if outputs is None:  # ranks > 0: same exit status as rank 0, no output
            raise typer.Exit(0 if report["passed"] else 1)
    else:
        rounding, exact = verdict.rounding_for(opened)
        ref = reference_for(reference, ids, device.value, None if exact else rounding)
        if save_reference is not None:
            with atomic_output(save_reference, overwrite=overwrite_outputs) as tmp:
                save_ref(ref, tmp)
            typer.echo(f"reference saved to {save_reference}")
        report, outputs = run.verify_checkpoint(opened, ref, modes=modes, tp=tp, ep=ep, device=device.value,
                                                overrides=overrides, tokens_from=tokens_from,
                                                allow_fallback=allow_fallback, gemm=gemm.value, decode=decode,
                                                attention_backend=attention_backend.value,
                                                attention=attention.value, kernel_options=tuple(kernel_option or ()))
        report["kernel_options"] = list(kernel_option or [])
    if gemm is not Gemm.ours:  # the report names the ops backend; this says which GEMMs it ran
        typer.echo(f"kernels mode: dense and grouped FP8 GEMMs on {gemm.value} (--gemm)")
    if attention_backend is not AttentionBackend.ours:
        typer.echo(f"kernels mode: bf16 prefill attention on {attention_backend.value} (--attention-backend)")
    if kernel_option:
        typer.echo(f"kernels mode: kernel options {' '.join(kernel_option)} (--kernel-option)")
    for line in verdict.summary_lines(report):
        typer.echo(line)
    if json_report is not None:
        write_atomic(json_report, json.dumps(report, indent=1) + "\n", overwrite=overwrite_outputs)
        typer.echo(f"report: {json_report}")
    if dump_logits is not None:
        for p in verdict.dump_logits(outputs, dump_logits, ref.tokens, overwrite=overwrite_outputs):
            typer.echo(f"logits: {p}")
    if plot is not None:
        from gptoss_fp8.verify.plot import plot_report

        with atomic_output(plot, overwrite=overwrite_outputs) as tmp:
            plot_report(report, tmp)
        typer.echo(f"plot: {plot}")
    if not report["passed"]:
        raise typer.Exit(1)
