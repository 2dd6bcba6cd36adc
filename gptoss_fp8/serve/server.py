"""Build the served engine from a one-rank checkpoint and run the HTTP server (uvicorn): in the
foreground (``serve``), or in a thread (``Server``: tests, ``bench serve --launch``)."""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.serve.app import Served, create_app
from gptoss_fp8.serve.vocab import HARMONY_VOCAB

GRACE_S = 5  # on Ctrl-C, open streams get this long before the server closes them


def check_options(ckpt, *, device: str, mode: str, max_batch: int, max_context: int | None,
                  chunk: int | None, attention: str = "bf16", prefix_cache: bool = True) -> dict:
    """serve's options on an opened checkpoint, checked (one line each) and resolved -> the job
    dict every rank builds from (mode, max_context, chunk, max_batch, device, attention, prefix_cache, vocab: the
    text's, serve/vocab.py)."""
    from gptoss_fp8.serve.vocab import vocab_of
    from gptoss_fp8.verify.generate import context_of, resolve_mode

    cfg = ckpt.config
    # the text's vocabulary (o200k_harmony's encoding made now: a missing package is one line before the weights load)
    vocab = vocab_of(ckpt.path, cfg.vocab_size)
    if max_batch < 1:
        raise GptOssFp8Error(f"--max-batch {max_batch}: give at least 1")
    ctx = context_of(cfg)
    max_context = max_context or min(ctx, 8192)
    if not 2 <= max_context <= ctx:
        raise GptOssFp8Error(f"--max-context {max_context}: give 2..{ctx} (the model's context)")
    chunk = chunk or (8192 if device.startswith("cuda") else 256)
    from gptoss_fp8.model.ops import check_attention_kind

    check_attention_kind(attention)  # a bad kind: one line now, before the weights load
    return {"device": device, "mode": resolve_mode(mode, device), "max_batch": max_batch, "max_context": max_context,
            "chunk": chunk, "attention": attention, "prefix_cache": prefix_cache, "vocab": vocab.name}


def build(ckpt_path, *, device: str = "cpu", mode: str = "auto", max_batch: int = 8,
          max_context: int | None = None, chunk: int | None = None, max_waiting: int | None = None,
          api_key: str | None = None, model_name: str | None = None,
          echo: Callable[[str], None] = print, attention: str = "bf16", prefix_cache: bool = True) -> Served:
    """Load ``ckpt_path`` (tp 1) and start its engine thread -> what ``create_app`` serves.

    ``max_context``: tokens per request, prompt and reply (default min(model context, 8192));
    ``max_batch``: KV slots at most (on CUDA fewer when free memory holds fewer; printed);
    ``chunk``: prompt tokens per prefill chunk (default 256 on CPU, 8192 on CUDA: smaller chunks
    measured slower under load, docs/serve.md); ``max_waiting``: requests queued beyond the free
    slots before 429 (default 4 x slots); ``attention``: prefill attention's numerics, "bf16" or
    "fp8" (model/ops.py ``with_attention``); ``prefix_cache``: keep prompts' keys for requests that
    start with them (runtime/prefix.py). A tp / ep > 1 checkpoint: ``serve`` (its ranks)."""
    import torch

    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.model.load import load_model
    from gptoss_fp8.parallel import Parallel, device_for

    ckpt = Checkpoint.of(ckpt_path)
    if ckpt.tp != 1 or ckpt.ep != 1:
        raise GptOssFp8Error(f"{ckpt.path}: converted for tp {ckpt.tp} / ep {ckpt.ep}: serve it with `gptoss-fp8 serve` "
                             "(one process per rank); build() runs one-rank checkpoints in this process")
    opts = check_options(ckpt, device=device, mode=mode, max_batch=max_batch, max_context=max_context, chunk=chunk,
                         attention=attention, prefix_cache=prefix_cache)
    dev = torch.device(device_for(device, 0))
    t0 = time.perf_counter()
    model = load_model(ckpt, Parallel(), dev)
    echo(f"loaded {ckpt.path} ({ckpt.config.num_hidden_layers} layers) on {dev} in {time.perf_counter() - t0:.1f} s, "
         f"mode {opts['mode']}" + (f", {attention.upper()} prefill attention" if attention != "bf16" else ""))
    return start_model(model, opts, max_waiting, api_key, model_name or Path(ckpt.path).name, echo)


def build_null(*, max_batch: int = 8, max_context: int = 2048, step_ms: float = 0.0, chunk: int = 8192,
               max_waiting: int | None = None, api_key: str | None = None, model_name: str = "null",
               echo: Callable[[str], None] = print) -> Served:
    """The server's engine over ``runtime.null.NullRunner`` (no weights; a decode step sleeps
    ``step_ms``) and its preset reply: the host path measured alone (``bench serve --null-model``)."""
    from gptoss_fp8.runtime.null import REPLY, NullRunner, ScriptSampler
    from gptoss_fp8.serve.harmony import encoding

    if max_batch < 1 or max_context < 2 or step_ms < 0:
        raise GptOssFp8Error(f"null model: --max-batch {max_batch}, context {max_context}, step {step_ms} ms: "
                             "give a batch >= 1, a context >= 2 and a step >= 0 ms")
    runner = NullRunner(max_batch, max_context, vocab=HARMONY_VOCAB, step_s=step_ms / 1e3)
    echo(f"null model: {max_batch} slots x {max_context} tokens, a decode step sleeps {step_ms:g} ms, "
         "every reply is the same preset text")
    return start_engine(runner, chunk, max_waiting, api_key, model_name, echo,
                        sampler=ScriptSampler(encoding().encode(REPLY)))


def start_model(model, opts: dict, max_waiting: int | None, api_key: str | None, name: str,
                echo: Callable[[str], None]) -> Served:
    """A loaded model (``check_options``' opts): its KV slots sized from free memory (printed), its
    runner, the engine started."""
    from gptoss_fp8.runtime.runner import ModelRunner
    from gptoss_fp8.runtime.slots import slots_for_memory
    from gptoss_fp8.verify.backends import ops_for

    keep = opts.get("prefix_cache", True)
    slots, line = slots_for_memory(model, opts["max_context"], opts["max_batch"], model.model.embed_tokens.weight.device,
                                   prefix_cache=keep)
    echo(line + ("" if keep else "; no prefix cache"))
    runner = ModelRunner(model, ops_for(opts["mode"], attention=opts["attention"]), slots, opts["max_context"],
                         prefix_cache=keep)
    return start_engine(runner, opts["chunk"], max_waiting, api_key, name, echo, vocab=opts.get("vocab"))


def start_engine(runner, chunk: int, max_waiting: int | None, api_key: str | None, name: str,
                 echo: Callable[[str], None], sampler=None, vocab: str | None = None) -> Served:
    """Capture the decode graphs (if any), start the engine thread -> Served (``vocab``: its text's, by name; None:
    o200k_harmony)."""
    from gptoss_fp8.runtime.engine import Engine, EngineThread
    from gptoss_fp8.serve.vocab import vocab_named

    if runner.graphs is not None:
        t0 = time.perf_counter()
        runner.capture_all()
        echo(f"captured {len(runner.buckets)} decode CUDA graphs (batch {', '.join(map(str, runner.buckets))}) "
             f"in {time.perf_counter() - t0:.1f} s")
    slots = runner.slots
    engine = Engine(runner, chunk=chunk, max_waiting=max_waiting if max_waiting is not None else 4 * slots,
                    sampler=sampler)
    return Served(engine, EngineThread(engine).start(), name, api_key, vocab=vocab_named(vocab or "o200k_harmony"))


def say_serving(served: Served, host: str, port: int, echo: Callable[[str], None]) -> None:
    echo(f"serving {served.model_name!r} on http://{host}:{port} (OpenAI API under /v1"
         + (", bearer key required" if served.api_key else "") + ")")


class Server:
    """uvicorn serving ``served`` in a background thread (tests, ``bench serve --launch``):
    ``start`` returns once it listens; ``stop`` shuts it down and stops the engine."""

    def __init__(self, served: Served, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.served = served
        config = uvicorn.Config(create_app(served), host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=GRACE_S)
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, name="gptoss-fp8-http", daemon=True)

    def start(self, timeout: float = 30.0) -> Server:
        self.thread.start()
        t0 = time.perf_counter()
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.perf_counter() - t0 > timeout:
                raise GptOssFp8Error("the HTTP server did not start (is the port taken?)")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        sock = self.uvicorn.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.served.thread.stop()


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound now, before any weights load: an address that cannot be listened on (a port another
    process holds) is one line instead of a traceback after the load."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise GptOssFp8Error(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn's own: a restart reuses the port at once)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = "another process is listening there: stop it or pick another --port" if e.errno == errno.EADDRINUSE \
            else "pick another --host / --port"
        raise GptOssFp8Error(f"--host {host} --port {port}: cannot listen there ({e.strerror}); {why}") from None
    sock.set_inheritable(True)
    return sock


def serve(ckpt_path, *, host: str = "127.0.0.1", port: int = 8000, echo: Callable[[str], None] = print,
          **kw) -> None:
    """One process: the socket bound (``bind``), ``build`` (its options), then serve until Ctrl-C (serve/launch.py
    picks this or the ranks)."""
    import uvicorn

    sock = bind(host, port)
    try:
        served = build(ckpt_path, echo=echo, **kw)
    except BaseException:
        sock.close()
        raise
    say_serving(served, host, sock.getsockname()[1], echo)
    try:
        uvicorn.Server(uvicorn.Config(create_app(served), log_level="warning", timeout_graceful_shutdown=GRACE_S)
                       ).run(sockets=[sock])
    finally:
        sock.close()
        served.thread.stop()
