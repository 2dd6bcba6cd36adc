"""``gptoss-fp8 bench ...``: benchmarks that print figures (never timed tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gptoss_fp8.cli.common import (
    Attention,
    AttentionBackend,
    AttentionBackendOption,
    AttentionOption,
    BenchVocabParallel,
    DistinctLayersOption,
    EpOption,
    Gemm,
    GemmOption,
    KernelOptionOption,
    OverwriteOutputs,
    TorchCommand,
    TpOption,
    check_one_gpu_distinct_layers,
    check_vocab_parallel,
    plot_ready,
)
from gptoss_fp8.errors import GptOssFp8Error

app = typer.Typer(help="Benchmarks (print figures; record them in BENCHMARKS.md).", no_args_is_help=True,
                  rich_markup_mode=None)

KERNEL_SUITES = ("gemm", "attention")


def _lengths(tokens: str) -> list[int]:
    """--tokens "1024,2048": positive comma-separated token counts."""
    parts = [t.strip() for t in tokens.split(",") if t.strip()]
    if not parts or not all(t.isdigit() and 0 < int(t) <= 1 << 24 for t in parts):
        raise GptOssFp8Error(f"--tokens {tokens!r}: give positive comma-separated token counts (at most {1 << 24})")
    return [int(t) for t in parts]


def _kernel_config(gemm: Gemm, attention_backend: AttentionBackend = AttentionBackend.ours):
    """--gemm / --attention-backend: None (TritonOps' default KernelConfig) for ours and ours; else
    that default with the libraries named, after checking each imports (one line if not)."""
    if gemm is Gemm.ours and attention_backend is AttentionBackend.ours:
        return None
    from dataclasses import replace

    from gptoss_fp8.kernels import deepgemm, flashinfer_attention
    from gptoss_fp8.model.triton_ops import default_config

    if gemm is not Gemm.ours:
        deepgemm.require()
    if attention_backend is not AttentionBackend.ours:
        flashinfer_attention.require()
    return replace(default_config(), gemm=gemm.value, attention_backend=attention_backend.value)


def _one_gpu_kernel_options(config, options: list[str] | None, tp: int, ep: int):
    """--kernel-option NAME=VALUE (repeatable) checked before anything else: refused with --tp / --ep (each rank
    builds the default config), else applied to config (None: the default); one line on a bad one."""
    if not options:
        return config
    if tp > 1 or ep > 1:
        raise GptOssFp8Error("--kernel-option is for the one-GPU bench; drop it or --tp / --ep (each rank builds "
                             "the default config)")
    from gptoss_fp8.kernels.config import with_options
    from gptoss_fp8.model.triton_ops import default_config

    try:
        return with_options(config or default_config(), options)
    except ValueError as err:
        raise GptOssFp8Error(f"--kernel-option {err}") from None


def _print_rows(rows: list[dict], above: list[str] | None = None) -> list[str]:
    """Print rows under a header of their columns (unless ``above``, the columns last printed, are the same) ->
    their columns."""
    cols = ["suite", "case", "ms", "tflops", "peer", "peer_ms", "peer_tflops", "ratio"]
    if any("graph_ratio" in r for r in rows):  # device-time columns (CUDA-graph replay) where measured
        cols += ["graph_ms", "peer_graph_ms", "graph_ratio"]
    if not rows:
        return above or []
    if cols != above:
        typer.echo(" | ".join(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        typer.echo(" | ".join(cells))
    return cols


@app.command("kernels", cls=TorchCommand)
def kernels(
    tokens: Annotated[str, typer.Option(help="Comma-separated token counts.")] = "1024,2048,4096,8192,16384,32768",
    only: Annotated[str, typer.Option(
        help=f"Comma-separated suites out of {','.join(KERNEL_SUITES)}.")] = ",".join(KERNEL_SUITES),
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the rows as JSON here.")] = None,
    gemm: GemmOption = Gemm.ours,
    attention: AttentionOption = Attention.bf16,
    attention_backend: AttentionBackendOption = AttentionBackend.ours,
    kernel_option: KernelOptionOption = None,
    overwrite_outputs: OverwriteOutputs = False,
) -> None:
    """Kernel throughput (TFLOP/s) beside peers measured in the same run (needs a CUDA GPU). The
    gemm suite prints DeepGEMM and our deep_gemm backend beside our kernels whenever deep_gemm is
    importable; --gemm deep_gemm makes that a requirement. The attention suite likewise times
    FlashInfer's sink prefill beside ours whenever flashinfer is importable; --attention-backend
    flashinfer makes that a requirement."""
    from gptoss_fp8.checkpoint.outputs import check_output_path, write_atomic

    if json_out is not None:
        check_output_path(json_out, overwrite=overwrite_outputs, option="--json")
    kernel_config = _one_gpu_kernel_options(_kernel_config(gemm, attention_backend), kernel_option, 1, 1)
    import torch

    if not torch.cuda.is_available():
        raise GptOssFp8Error("bench kernels needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    token_list = _lengths(tokens)
    from gptoss_fp8.kernels.config import kernel_paths

    if kernel_option:
        typer.echo(f"# kernel options: {' '.join(kernel_option)}")
    typer.echo(f"# {kernel_paths(torch.device('cuda'), kernel_config)}")
    rows: list[dict] = []
    for suite in [s.strip() for s in only.split(",") if s.strip()]:
        if suite not in KERNEL_SUITES:
            raise GptOssFp8Error(f"unknown kernel suite {suite!r}; choose from {', '.join(KERNEL_SUITES)}")
        if suite == "gemm":
            from gptoss_fp8.bench import kernels_gemm as mod
        else:
            from gptoss_fp8.bench import kernels_attention as mod
        shown: list[dict] = []
        cols: list[list[str]] = [[]]

        def emit(batch: list[dict], suite=suite, shown=shown, cols=cols) -> None:  # rows printed as they are measured
            for r in batch:
                r.setdefault("suite", suite)
                r["kernel_options"] = list(kernel_option or [])
            cols[0] = _print_rows(batch, cols[0])
            shown += batch

        suite_rows = (mod.bench(token_list, gemm=gemm.value, config=kernel_config) if suite == "gemm"
                      else mod.bench(token_list, attention=attention.value, attention_backend=attention_backend.value,
                                     config=kernel_config, emit=emit))
        emit(suite_rows[len(shown):])  # (what the suite did not print itself: its rows come in the order emitted)
        rows += suite_rows
    if json_out is not None:
        write_atomic(json_out, json.dumps(rows, indent=1) + "\n", overwrite=overwrite_outputs)


@app.command("prefill", cls=TorchCommand)
def prefill(
    model: Annotated[str, typer.Option(help="Synthetic preset whose real shapes to build: 20b or 120b.")] = "20b",
    tokens: Annotated[str, typer.Option(help="Comma-separated prompt lengths.")] = "8192,32768",
    layers: Annotated[int | None, typer.Option(
        min=1, help="Build only the first N layers (latency also scaled to the full depth, less what the whole "
                    "model's pruned last layer saves).")] = None,
    runs: Annotated[int, typer.Option(min=1, help="Timed runs per length (median reported).")] = 5,
    warmup: Annotated[int, typer.Option(
        min=0, help="Untimed runs first (kernel compilation), and at least 2 s of them (GPU clocks settle).")] = 2,
    moe_chunk: Annotated[int | None, typer.Option(
        min=1, help="Tokens per MoE call (bounds activation memory). Default: the model's, enough for 4096 rows an "
                    "expert (32768 on the 20b, 131072 on the 120b).")] = None,
    peer: Annotated[bool, typer.Option(
        help="Also time transformers' bf16 GptOss (flex_attention) on the same shapes, when importable.")] = True,
    peer_runs: Annotated[int, typer.Option(min=1, help="Timed runs of the transformers peer per length (median reported).")] = 3,
    checkpoint: Annotated[Path | None, typer.Option(
        help="Time this converted checkpoint (tp=1 layout) instead of random weights at --model's shapes.")] = None,
    cuda_graph: Annotated[bool, typer.Option(
        help="Also time the same forward captured as a CUDA graph per length (no host launches; "
             "eager latency stays the headline).")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the rows as JSON here.")] = None,
    full_last_layer: Annotated[bool, typer.Option(
        help="Run the last layer on every row, as a forward of all rows' logits would. Default: past its K / V "
             "only on the last row, the one whose logits a prefill returns (a model cut by --layers runs every "
             "row).")] = False,
    distinct_layers: DistinctLayersOption = None,
    gemm: GemmOption = Gemm.ours,
    attention: AttentionOption = Attention.bf16,
    attention_backend: AttentionBackendOption = AttentionBackend.ours,
    tp: TpOption = 1,
    ep: EpOption = 1,
    vocab_parallel: BenchVocabParallel = False,
    kernel_option: KernelOptionOption = None,
    overwrite_outputs: OverwriteOutputs = False,
) -> None:
    """Batch-1 prefill latency (prompt -> last-position logits) on our kernels, random FP8 weights
    at real shapes built on the GPU (or a converted checkpoint's); beside the seed's figures and
    the floor, with a per-part breakdown and transformers' bf16 GptOss in the same run. With --tp
    the sharded model (bench/prefill_sharded.py): rank 0's latency, the all-reduces in the breakdown,
    the seed's row for the same layout."""
    from gptoss_fp8.checkpoint.outputs import check_output_path, write_atomic

    if json_out is not None:
        check_output_path(json_out, overwrite=overwrite_outputs, forbidden=[checkpoint] if checkpoint else [], option="--json")
    check_vocab_parallel(vocab_parallel, tp)
    check_one_gpu_distinct_layers(distinct_layers, tp, ep)
    kernel_config = _one_gpu_kernel_options(_kernel_config(gemm, attention_backend), kernel_option, tp, ep)
    import torch

    if not torch.cuda.is_available():
        raise GptOssFp8Error("bench prefill needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    if model not in ("20b", "120b"):
        raise GptOssFp8Error(f"unknown model {model!r}; choose 20b or 120b")
    token_list = _lengths(tokens)
    if kernel_option:
        typer.echo(f"# kernel options: {' '.join(kernel_option)}")
    from gptoss_fp8.bench.prefill import bench as run_prefill

    if checkpoint is not None and not (checkpoint / "config.json").is_file():
        raise GptOssFp8Error(f"--checkpoint {checkpoint}: no config.json; point at a converted checkpoint directory")
    if tp > 1 or ep > 1:
        from gptoss_fp8.bench.prefill_sharded import bench_sharded

        if torch.cuda.device_count() < tp:
            typer.echo(f"# {torch.cuda.device_count()} GPU(s) for {tp} ranks: ranks share a GPU over gloo "
                       "(the mechanics run; the figures are not a measurement)")
        rows = bench_sharded(model, token_list, tp, ep, layers, runs=runs, warmup=warmup, moe_chunk=moe_chunk,
                             echo=typer.echo, checkpoint=checkpoint, kernel_config=kernel_config,
                             vocab_parallel=vocab_parallel, cuda_graph=cuda_graph, attention=attention.value,
                             full_last_layer=full_last_layer)
    else:
        rows = run_prefill(model, token_list, layers, runs=runs, warmup=warmup, moe_chunk=moe_chunk, peer=peer,
                           peer_runs=peer_runs, echo=typer.echo, checkpoint=checkpoint, cuda_graph=cuda_graph,
                           kernel_config=kernel_config, attention=attention.value, full_last_layer=full_last_layer,
                           distinct_layers=distinct_layers)
        for r in rows:
            r["kernel_options"] = list(kernel_option or [])
    if json_out is not None and rows:
        write_atomic(json_out, json.dumps(rows, indent=1) + "\n", overwrite=overwrite_outputs)


@app.command("decode", cls=TorchCommand)
def decode(
    model: Annotated[str, typer.Option(help="Synthetic preset whose real shapes to build: 20b or 120b.")] = "20b",
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes (sequences per step).")] = "1,8,32,64,128",
    context: Annotated[str, typer.Option(help="Comma-separated cached tokens per sequence.")] = "8192,32768",
    layers: Annotated[int | None, typer.Option(min=1, help="Build only the first N layers (floor likewise).")] = None,
    runs: Annotated[int, typer.Option(min=1, help="Timed graph replays per case (median reported).")] = 20,
    peer: Annotated[bool, typer.Option(
        help="Also time transformers' bf16 GptOss (eager attention, its own cache) decode steps on the same cases, "
             "when importable (20b only).")] = True,
    peer_steps: Annotated[int, typer.Option(
        min=1, help="Timed decode steps of the transformers peer per case (median reported).")] = 20,
    peer_mode: Annotated[str, typer.Option(
        help="Comma-separated peer modes: eager (its generate loop on a DynamicCache) and/or compiled (a StaticCache, "
             "the step torch.compile'd and replayed as a CUDA graph; compile time reported apart). Speedups are "
             "against the faster.")] = "eager,compiled",
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the rows as JSON here.")] = None,
    tp: TpOption = 1,
    ep: EpOption = 1,
    vocab_parallel: BenchVocabParallel = False,
    kernel_option: KernelOptionOption = None,
    distinct_layers: DistinctLayersOption = None,
    overwrite_outputs: OverwriteOutputs = False,
) -> None:
    """Decode step latency per (batch, context) on our kernels as a replayed CUDA graph, random FP8
    weights at real shapes and a synthetic bf16 KV cache: ms/step, tokens/s per user and total,
    $ per 1M output tokens, the HBM floor and floor/ours, cache bytes; beside it transformers'
    bf16 GptOss decode in the same run (20b; bench/decode.py). With --tp the sharded model
    (bench/decode_sharded.py): one process per GPU, each case's step a CUDA graph on every rank,
    rank 0's step time, the per-rank floor, the all-reduces in the breakdown (no peer)."""
    from gptoss_fp8.checkpoint.outputs import check_output_path, write_atomic

    if json_out is not None:
        check_output_path(json_out, overwrite=overwrite_outputs, option="--json")
    if model not in ("20b", "120b"):
        raise GptOssFp8Error(f"unknown model {model!r}; choose 20b or 120b")
    batches, contexts = _counts("--batch", batch, 1 << 12), _counts("--context", context, 1 << 20)
    from gptoss_fp8.bench.decode_peer import PEER_MODES

    peer_modes = tuple(dict.fromkeys(m.strip() for m in peer_mode.split(",") if m.strip()))
    if not peer_modes or any(m not in PEER_MODES for m in peer_modes):
        raise GptOssFp8Error(f"--peer-mode {peer_mode!r}: give one or more of {', '.join(PEER_MODES)}, comma-separated")
    check_vocab_parallel(vocab_parallel, tp)
    check_one_gpu_distinct_layers(distinct_layers, tp, ep)
    kernel_config = _one_gpu_kernel_options(None, kernel_option, tp, ep)
    import torch

    if not torch.cuda.is_available():
        raise GptOssFp8Error("bench decode needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    if tp > 1 or ep > 1:
        from gptoss_fp8.bench.decode_sharded import bench_decode_sharded

        if torch.cuda.device_count() < tp:
            typer.echo(f"# {torch.cuda.device_count()} GPU(s) for {tp} ranks: ranks share a GPU over gloo, eager "
                       "steps (the mechanics run; the figures are not a measurement)")
        rows = bench_decode_sharded(model, batches, contexts, tp, ep, layers, runs=runs, echo=typer.echo,
                                    vocab_parallel=vocab_parallel)
    else:
        from gptoss_fp8.bench.decode import bench as run_decode

        if kernel_option:
            typer.echo(f"# kernel options: {' '.join(kernel_option)}")
        rows = run_decode(model, batches, contexts, layers, runs=runs, echo=typer.echo, peer=peer,
                          peer_steps=peer_steps, peer_modes=peer_modes, kernel_config=kernel_config,
                          distinct_layers=distinct_layers)
        for r in rows:
            r["kernel_options"] = list(kernel_option or [])
    if json_out is not None and rows:  # under torchrun only rank 0 has rows
        write_atomic(json_out, json.dumps(rows, indent=1) + "\n", overwrite=overwrite_outputs)


@app.command("serve")
def serve(
    url: Annotated[str | None, typer.Argument(help="Base URL of a running OpenAI-compatible server.")] = None,
    launch: Annotated[Path | None, typer.Option(help="Start `gptoss-fp8 serve` on this checkpoint (in this process) "
                                                     "and measure it instead of URL.")] = None,
    concurrency: Annotated[str, typer.Option(help="Comma-separated requests in flight.")] = "1,8,32,64,128",
    prompt_len: Annotated[str, typer.Option(help="Comma-separated prompt lengths (tokens).")] = "1024,8192",
    output_len: Annotated[int, typer.Option(min=1, help="Output tokens per request (ignore_eos).")] = 256,
    requests: Annotated[int | None, typer.Option(min=1, help="Requests per case (default 2 x concurrency, >= 8).")] = None,
    model_name: Annotated[str | None, typer.Option(help="Model id to send (default: the server's first).")] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer key of the server.")] = None,
    device: Annotated[str, typer.Option(help="--launch: cpu or cuda.")] = "cuda",
    mode: Annotated[str, typer.Option(help="--launch: weights, w8a8, kernels or auto.")] = "auto",
    gpus: Annotated[int, typer.Option(min=1, help="GPUs the server uses ($ per 1M tokens).")] = 1,
    client_procs: Annotated[int | None, typer.Option(
        min=1, help="Load-generator processes (default: one per 16 streams, at most a quarter of the CPUs).")] = None,
    synthetic: Annotated[str | None, typer.Option(
        help="Launch the server (in this process) over random FP8 weights at this preset's shapes (20b, 120b, "
             "...; --layers: the first N), no checkpoint on disk: the speed of that model served.")] = None,
    layers: Annotated[int | None, typer.Option(min=1, help="--synthetic: build only the first N layers.")] = None,
    prefill_chunk: Annotated[int | None, typer.Option(
        min=1, help="--launch / --synthetic: prompt tokens per prefill chunk (as `serve --prefill-chunk`; default "
                    "256 on cpu, 8192 on cuda).")] = None,
    null_model: Annotated[bool, typer.Option(
        "--null-model", help="Launch the server over a model that costs nothing (runtime/null.py): the host "
                             "path alone.")] = False,
    null_step_ms: Annotated[float, typer.Option(min=0, help="--null-model: each decode step sleeps this long "
                                                            "(GIL free, a GPU step the host waits on).")] = 0.0,
    peer: Annotated[str, typer.Option(
        help="The server at URL: gptoss (ours: token-id prompts, ignore_eos) or transformers (`transformers serve "
             "--continuous-batching`: text prompts of the same token counts in --tokenizer, the output length forced "
             "through generation_config; bench/serve_peer.py).")] = "gptoss",
    tokenizer: Annotated[Path | None, typer.Option(
        help="--peer transformers: the checkpoint directory the server loaded (its tokenizer.json), or a "
             "tokenizer.json.")] = None,
    warmup: Annotated[int | None, typer.Option(
        min=0, help="Requests sent at once before the cases, unmeasured (default: the largest concurrency with "
                    "--peer transformers, none with ours).")] = None,
    shared_prefix: Annotated[int, typer.Option(
        min=0, help="Every case's prompts start with the same this many token ids (a shared system prompt or "
                    "document: the server's prefix cache; the cached_pct column).")] = 0,
    structured: Annotated[bool, typer.Option(
        help="Every completion held to a JSON string (response_format) that does not close within --output-len: "
             "each step inside a JSON string, structured output's costliest state (a token checked, masked where refused), "
             "its host cost under load (our server).")] = False,
    attention: Annotated[Attention, typer.Option(
        help="--launch / --synthetic: the launched server's prefill attention numerics (as `serve --attention`: bf16, "
             "fp8 or fp8-lin; a server at URL keeps its own).")] = Attention.bf16,
    distinct_layers: DistinctLayersOption = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the rows as JSON here.")] = None,
    plot_out: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of the curves here.")] = None,
    decode_json: Annotated[Path | None, typer.Option(
        help="`bench decode --json` rows to draw beside the curves (--plot).")] = None,
    overwrite_outputs: OverwriteOutputs = False,
) -> None:
    """Stream requests at each concurrency and print output tokens/s (total, per user), TTFT and
    inter-token latency p50 / p99 and $ per 1M output tokens at $3 per GPU-hour (bench/serve.py)."""
    from gptoss_fp8.checkpoint.outputs import check_output_path, write_atomic

    if (url is not None) + (launch is not None) + null_model + (synthetic is not None) != 1:
        raise GptOssFp8Error("give exactly one of URL, --launch DST, --synthetic PRESET or --null-model")
    if peer != "gptoss" and url is None:
        raise GptOssFp8Error(f"--peer {peer} measures a server already running at URL")
    if attention != Attention.bf16 and launch is None and synthetic is None:
        raise GptOssFp8Error(f"--attention {attention.value} sets the server this command launches (--launch / "
                             "--synthetic); a server at URL keeps the numerics it was started with")
    if distinct_layers is not None and synthetic is None:
        raise GptOssFp8Error("--distinct-layers repeats random weights: it goes with --synthetic PRESET (a checkpoint "
                             "brings its own weights for every layer)")
    for out, opt in ((json_out, "--json"), (plot_out, "--plot")):
        if out is not None:
            check_output_path(out, overwrite=overwrite_outputs, option=opt)
    if plot_out is not None:
        plot_ready(plot_out)
    decode_rows = None
    if decode_json is not None:
        try:
            decode_rows = json.loads(decode_json.read_text())
            assert isinstance(decode_rows, list) and all("batch" in r and "context" in r for r in decode_rows)
        except (OSError, ValueError, AssertionError):
            raise GptOssFp8Error(f"--decode-json {decode_json}: not a `bench decode --json` file") from None
    conc = _counts("--concurrency", concurrency, 1 << 12)
    lens = _counts("--prompt-len", prompt_len, 1 << 20)
    from gptoss_fp8.bench.serve import bench as run_bench
    from gptoss_fp8.bench.serve import plot

    server = None
    if launch is not None:
        from gptoss_fp8.serve.server import Server, build

        served = build(launch, device=device, mode=mode, max_batch=max(conc), max_context=max(lens) + output_len + 1,
                       chunk=prefill_chunk, api_key=api_key, model_name=model_name, echo=typer.echo,
                       attention=attention.value)
        server = Server(served).start()
        url = server.url
    elif synthetic is not None:
        from gptoss_fp8.bench.serve import build_synthetic
        from gptoss_fp8.serve.server import Server

        served = build_synthetic(synthetic, layers=layers, device=device, mode=mode, max_batch=max(conc),
                                 max_context=max(lens) + output_len + 1, chunk=prefill_chunk, api_key=api_key,
                                 echo=typer.echo, attention=attention.value, distinct_layers=distinct_layers)
        server = Server(served).start()
        url = server.url
    elif null_model:
        from gptoss_fp8.serve.server import Server, build_null

        served = build_null(max_batch=max(conc), max_context=max(lens) + output_len + 1, step_ms=null_step_ms,
                            api_key=api_key, echo=typer.echo)
        server = Server(served).start()
        url = server.url
    try:
        rows = run_bench(url.rstrip("/"), model=model_name, concurrency=conc, prompt_lens=lens, output_len=output_len,
                         requests=requests, api_key=api_key, gpus=gpus, procs=client_procs, peer=peer,
                         tokenizer=tokenizer, warmup=warmup, echo=typer.echo, shared_prefix=shared_prefix,
                         structured=structured)
    finally:
        if server is not None:
            server.stop()
    if json_out is not None:
        write_atomic(json_out, json.dumps(rows, indent=1) + "\n", overwrite=overwrite_outputs)
    if plot_out is not None:
        plot(rows, plot_out, decode_rows=decode_rows)
        typer.echo(f"plot: {plot_out}")


def _counts(option: str, text: str, top: int) -> list[int]:
    """``--batch "1,8"``: positive comma-separated integers up to ``top``."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts or not all(t.isdigit() and 0 < int(t) <= top for t in parts):
        raise GptOssFp8Error(f"{option} {text!r}: give positive comma-separated integers (at most {top})")
    return [int(t) for t in parts]
