"""``gptoss-fp8 serve``: one process (serve/server.py) or one per rank (serve/sharded.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gptoss_fp8.errors import GptOssFp8Error

INSTALL = "pip install 'gptoss-fp8[serve]'"


def serve(ckpt_path: str | Path, *, host: str = "127.0.0.1", port: int = 8000, echo: Callable[[str], None] = print,
          device: str = "cpu", mode: str = "auto", max_batch: int = 8, max_context: int | None = None,
          chunk: int | None = None, max_waiting: int | None = None, api_key: str | None = None,
          model_name: str | None = None, attention: str = "bf16", prefix_cache: bool = True) -> None:
    """Serve ``ckpt_path`` until Ctrl-C (server.build's options): in this process for a one-rank
    checkpoint, else one process per rank (also under torchrun), rank 0 serving."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise GptOssFp8Error(f"serve needs fastapi and uvicorn; run: {INSTALL}") from None
    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.parallel import under_torchrun
    from gptoss_fp8.serve import server

    ckpt = Checkpoint.open(ckpt_path)
    opts = {"max_waiting": max_waiting, "api_key": api_key, "model_name": model_name or Path(ckpt.path).name}
    if ckpt.tp == 1 and ckpt.ep == 1 and not under_torchrun():
        server.serve(ckpt, host=host, port=port, echo=echo, device=device, mode=mode, max_batch=max_batch,
                     max_context=max_context, chunk=chunk, attention=attention, prefix_cache=prefix_cache, **opts)
        return
    from gptoss_fp8.serve.sharded import run_sharded

    job = server.check_options(ckpt, device=device, mode=mode, max_batch=max_batch, max_context=max_context,
                               chunk=chunk, attention=attention, prefix_cache=prefix_cache)
    server.bind(host, port).close()  # (rank 0 listens there once every rank has loaded: a taken port, one line now)
    run_sharded(ckpt, {**job, "host": host, "port": port, **opts})
