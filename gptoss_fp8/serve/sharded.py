"""``gptoss-fp8 serve`` on a checkpoint converted for tp / ep > 1: one process per rank.

Started for the user (``parallel.run_job``, as ``generate`` does), or under ``torchrun
--nproc-per-node TP gptoss-fp8 serve ...``. Every rank loads its shard and makes a runner over
the same number of slots (rank 0 sizes them from its free memory and shares the number); rank 0
runs the engine (runtime/ranks.py ``Leader``) and the HTTP server, the others follow its model
calls (``follow``) until it stops. The other ranks ignore Ctrl-C: rank 0's server shuts down on
it and then tells them to stop.
"""

from __future__ import annotations

import json
import math
import signal
import sys
from pathlib import Path

MODULE = "gptoss_fp8.serve.sharded"


def run_sharded(ckpt, job: dict) -> None:
    """Start the ranks of ``ckpt`` (an opened Checkpoint) on ``job`` (serve's options) and wait;
    rank 0's output reaches this process's stdout as it comes. Under torchrun: be this rank."""
    from gptoss_fp8.errors import GptOssFp8Error
    from gptoss_fp8.parallel import device_for, run_job, under_torchrun

    job = {**job, "ckpt": str(Path(ckpt.path).resolve())}
    if under_torchrun():
        import os

        if int(os.environ["WORLD_SIZE"]) != ckpt.tp:
            raise GptOssFp8Error(f"{ckpt.path}: converted for tp {ckpt.tp} / ep {ckpt.ep}, torchrun started "
                                 f"WORLD_SIZE {os.environ['WORLD_SIZE']} processes; give --nproc-per-node {ckpt.tp}")
        run_rank(job)
        return
    device_for(job["device"], 0)  # no GPU for --device cuda: one line before any rank starts

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    run_job(MODULE, job, ckpt.tp, "sharded serve", timeout_s=math.inf, output=out)


def run_rank(job: dict) -> None:
    """One rank (process group from RANK / WORLD_SIZE / MASTER_*): module docstring."""
    import torch.distributed as dist

    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.model.load import load_model
    from gptoss_fp8.parallel import Parallel, start_rank
    from gptoss_fp8.runtime.ranks import follow, share
    from gptoss_fp8.runtime.runner import ModelRunner
    from gptoss_fp8.runtime.slots import slots_for_memory
    from gptoss_fp8.verify.backends import ops_for

    ckpt = Checkpoint.open(job["ckpt"])
    rank, dev = start_rank(job["device"], ckpt.tp)
    if rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        model = load_model(ckpt, Parallel(rank=rank, tp=ckpt.tp, ep=ckpt.ep), dev)
        par = model.par
        import torch

        keep = job.get("prefix_cache", True)
        slots, line = slots_for_memory(model, job["max_context"], job["max_batch"], torch.device(dev), prefix_cache=keep)
        slots = share(slots, par)
        runner = ModelRunner(model, ops_for(job["mode"], attention=job.get("attention", "bf16")), slots,
                             job["max_context"], prefix_cache=keep)
        if rank != 0:
            follow(runner, par)
            return
        layout = f"tp {ckpt.tp} ep {ckpt.ep} over {dist.get_backend()}"
        run_leader(runner, par, job, f"{line.replace(f'{slots} slots', f'{slots} slots per rank', 1)}; {layout}")
    finally:
        dist.destroy_process_group()


def run_leader(runner, par, job: dict, line: str) -> None:
    """Rank 0: the engine over a ``Leader`` and the HTTP server, until Ctrl-C; then the other
    ranks are told to stop."""
    import uvicorn

    from gptoss_fp8.runtime.ranks import Leader
    from gptoss_fp8.serve.app import create_app
    from gptoss_fp8.serve.server import GRACE_S, say_serving, start_engine

    leader = Leader(runner, par)
    print(line, flush=True)
    served = start_engine(leader, job["chunk"], job.get("max_waiting"), job.get("api_key"), job["model_name"],
                          lambda t: print(t, flush=True), vocab=job.get("vocab"))
    say_serving(served, job["host"], job["port"], lambda t: print(t, flush=True))
    try:
        uvicorn.run(create_app(served), host=job["host"], port=job["port"], log_level="warning",
                    timeout_graceful_shutdown=GRACE_S)
    finally:
        served.thread.stop()
        leader.stop()


if __name__ == "__main__":  # a rank started by run_sharded
    run_rank(json.loads(Path(sys.argv[1]).read_text()))
