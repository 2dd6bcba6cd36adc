"""``gptoss-fp8 generate`` on a checkpoint converted for tp > 1: one process per rank.

Started for the user (``parallel.run_job``: RANK / WORLD_SIZE set as torchrun does), or under
``torchrun --nproc-per-node TP gptoss-fp8 generate ...`` (each process is one rank; WORLD_SIZE must
be the checkpoint's tp). Every rank loads its shard (``load_model``; the vocab-parallel layout is
the checkpoint's) and runs the one-process loop (verify/generate.py ``stream_reply`` /
``generate``) on it: the same prefill and decode steps, whose all-reduces leave the logits
replicated; rank 0 chooses each token (greedy, or the seeded sampler) and whether the reply stops
there, and broadcasts both (``generate.chooser``), so every rank feeds the same token and steps
as many times. With NCCL (one GPU per rank) on the kernels mode the decode steps replay as CUDA
graphs (model/graph.py captures the all-reduces); over gloo (CPU, or ranks sharing a GPU) they run
eager.

Output: rank 0 prints, the other ranks print nothing. Under torchrun rank 0's stdout is the
user's. Started here, rank 0's stdout is a pipe that a thread of this process reads, handing the
text to ``echo`` as it arrives (``launch_ranks(output=...)``): the stream reaches the user while
it is generated, through the same ``echo`` as the one-process run (so a library caller, or a test
capturing ``echo``, sees it), and rank 0's result (the ``Generation``) comes back as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.verify.generate import Generation, stream_reply

MODULE = "gptoss_fp8.verify.generate_sharded"


def run(ckpt, prompt: list[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
        device: str = "cpu", mode: str = "auto", echo: Callable[..., None] = print,
        attention: str = "bf16") -> Generation:
    """The ``generate`` command (cli/generate.py): ``generate.run`` for a tp 1 checkpoint in one
    process; a checkpoint converted for tp > 1 (or any run under torchrun) over its ranks
    (``run_sharded``), rank 0's lines reaching ``echo`` as they are printed."""
    from gptoss_fp8.parallel import under_torchrun
    from gptoss_fp8.verify import generate as one

    if ckpt.tp == 1 and not under_torchrun():
        return one.run(ckpt, prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                       device=device, mode=mode, echo=echo, attention=attention)
    one.check_request(ckpt.config, prompt, max_new_tokens, temperature)
    return run_sharded(ckpt, prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                       device=device, mode=one.resolve_mode(mode, device), echo=echo, attention=attention)


def run_sharded(ckpt, prompt: list[int], *, max_new_tokens: int, temperature: float, seed: int, device: str,
                mode: str, echo: Callable[..., None], attention: str = "bf16") -> Generation:
    """``generate.run`` of an opened Checkpoint over its tp ranks (module docstring): the request
    already checked, ``mode`` resolved. Under torchrun this process is one rank (rank 0 prints
    through ``echo``); otherwise tp rank processes are started and rank 0's output handed to
    ``echo`` as it comes. Returns rank 0's Generation (under torchrun: this rank's, the same tokens)."""
    from gptoss_fp8.parallel import device_for, run_job, under_torchrun

    job = {"ckpt": str(Path(ckpt.path).resolve()), "prompt": list(prompt), "max_new_tokens": max_new_tokens,
           "temperature": temperature, "seed": seed, "device": device, "mode": mode, "attention": attention}
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != ckpt.tp:  # every rank fails alike, before any collective
            raise GptOssFp8Error(f"{ckpt.path}: converted for tp {ckpt.tp} / ep {ckpt.ep}, torchrun started "
                                 f"WORLD_SIZE {world} processes; give --nproc-per-node {ckpt.tp}"
                                 + (" or run without torchrun" if ckpt.tp == 1 else ""))
        return run_rank(job, echo)
    device_for(device, 0)  # no GPU for --device cuda: one line here, before any rank starts
    # no time limit: the length is the user's (--max-new-tokens); a rank that fails stops the others
    out = run_job(MODULE, job, ckpt.tp, "sharded generate", timeout_s=math.inf,
                  output=lambda text: echo(text, nl=False))
    return Generation(**out)


def run_rank(job: dict, echo: Callable[..., None] | None = None) -> Generation:
    """One rank (process group from RANK / WORLD_SIZE / MASTER_*): load this rank's shard, generate
    with the others; rank 0 prints through ``echo`` and writes its Generation to ``job["result"]``
    when given."""
    import torch.distributed as dist

    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.model.load import load_model
    from gptoss_fp8.parallel import Parallel, start_rank
    from gptoss_fp8.verify.backends import ops_for

    ckpt = Checkpoint.open(job["ckpt"])
    rank, dev = start_rank(job["device"], ckpt.tp)
    try:
        model = load_model(ckpt, Parallel(rank=rank, tp=ckpt.tp, ep=ckpt.ep), dev)
        layout = f"tp {ckpt.tp} ep {ckpt.ep}{' vocab-parallel' if model.par.vocab_parallel else ''}"
        where = f"mode {job['mode']}, {job['device']}, {layout} over {dist.get_backend()}"
        ops = ops_for(job["mode"], attention=job.get("attention", "bf16"))
        g = stream_reply(model, job["prompt"], ops, where, max_new_tokens=job["max_new_tokens"],
                         temperature=job["temperature"], seed=job["seed"], echo=echo if rank == 0 else None)
        if rank == 0 and job.get("result"):
            Path(job["result"]).write_text(json.dumps(dataclasses.asdict(g)))
        dist.barrier()
        return g
    finally:
        dist.destroy_process_group()


def _stdout(text: str = "", nl: bool = True) -> None:
    """``typer.echo`` for a rank started by ``run_sharded``: its stdout is the parent's pipe."""
    sys.stdout.write(text + ("\n" if nl else ""))
    sys.stdout.flush()


if __name__ == "__main__":  # a rank started by run_sharded
    run_rank(json.loads(Path(sys.argv[1]).read_text()), echo=_stdout)
