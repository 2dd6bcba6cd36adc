"""Parallelism passed into the model: which rank this process is, and the group to reduce over.

Layout (the shard plan in checkpoint/plan.py decides which tensors each rank loads):
* tensor parallel over ``tp`` ranks: attention heads split by rank (kv heads replicated when
  tp > kv heads), o_proj split by input columns, so its output is a partial sum;
* experts: ``ep`` expert groups of ``tp // ep`` ranks each; rank r holds the experts of group
  ``r // (tp // ep)`` and, within them, part ``r % (tp // ep)`` of the intermediate dimension.
  Every rank's down projection is a partial sum over (expert, intermediate part).
The model all-reduces exactly where OpenAI's reference does: after o_proj and after the MoE down
projection (biases added once, by their owner rank, before the sum).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptoss_fp8.errors import GptOssFp8Error


@dataclass(frozen=True)
class Parallel:
    """Where a rank sits (passed in, never a global): rank r of a world of ``tp`` ranks, ``ep``
    expert groups, and the process group to reduce over (None: the default group)."""

    rank: int = 0
    tp: int = 1
    ep: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        assert self.tp >= 1 and self.ep >= 1, f"tp {self.tp} / ep {self.ep} must be >= 1"
        assert 0 <= self.rank < self.tp, f"rank {self.rank} outside world {self.tp}"
        assert self.tp % self.ep == 0, f"tp {self.tp} not a multiple of ep {self.ep}"

    @property
    def world(self) -> int:
        """World size: one rank per tensor-parallel part."""
        return self.tp

    @property
    def parts(self) -> int:
        """Ranks per expert group (intermediate-dimension parts of each expert)."""
        return self.tp // self.ep

    @property
    def expert_group(self) -> int:
        return self.rank // self.parts

    @property
    def expert_part(self) -> int:
        """Which part of each of its experts' intermediate dimension this rank holds."""
        return self.rank % self.parts

    @property
    def owns_row_bias(self) -> bool:
        """Whether this rank adds the bias of a row-parallel (partial-sum) linear such as o_proj."""
        return self.rank == 0

    @property
    def owns_expert_bias(self) -> bool:
        """Whether this rank adds down_proj_bias for its experts (part 0 of its expert group)."""
        return self.expert_part == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in float32 (gloo has no bf16, and fp32 sums keep partials exact
        enough); returns a tensor of t's dtype. Identity when world == 1."""
        if self.world == 1:
            return t
        buf = t.float().contiguous()
        if buf.is_cuda and dist.get_backend(self.group) == "gloo":
            # Several ranks sharing one GPU (NCCL refuses that): reduce through host memory.
            host = buf.cpu()
            dist.all_reduce(host, op=dist.ReduceOp.SUM, group=self.group)
            return host.to(device=t.device, dtype=t.dtype)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        return buf.to(t.dtype)


SINGLE = Parallel()


def check_layout(cfg, tp: int, ep: int) -> None:
    """One-line error for a (tp, ep) this model cannot be split into (cfg: a GptOssConfig)."""
    def bad(msg: str) -> GptOssFp8Error:
        return GptOssFp8Error(f"--tp {tp} --ep {ep}: {msg}; choose another --tp/--ep")

    if tp < 1 or ep < 1:
        raise bad("tp and ep must be >= 1")
    if tp % ep:
        raise bad("ep must divide tp (world size = tp)")
    if cfg.num_local_experts % ep:
        raise bad(f"{cfg.num_local_experts} experts cannot be split evenly over ep={ep} groups")
    if cfg.num_attention_heads % tp:
        raise bad(f"{cfg.num_attention_heads} attention heads cannot be split evenly over tp={tp}")
    kv = cfg.num_key_value_heads
    if kv % tp and tp % kv:
        raise bad(f"{kv} kv heads: tp must divide it or be a multiple of it")
    parts = tp // ep
    if cfg.intermediate_size % parts:
        raise bad(f"intermediate_size {cfg.intermediate_size} cannot be split into tp/ep={parts} parts")


# ------------------------------------------------------------------------------------------------
# Rank processes (verify-logits' sharded workers, bench prefill --tp): one process per rank


def device_for(device: str, rank: int) -> str:
    """The device rank ``rank`` runs on: its own GPU (round robin over the visible ones) or the CPU."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise GptOssFp8Error(f"--device {device}: no CUDA GPU is visible; use --device cpu")
        return f"cuda:{rank % torch.cuda.device_count()}"
    return device


def backend_for(dev: str, world: int) -> str:
    """NCCL with one GPU per rank; gloo on CPU, and when ranks share a GPU (NCCL refuses two ranks on
    one device; ``Parallel.all_reduce`` then stages the sums through host memory)."""
    return "nccl" if dev.startswith("cuda") and torch.cuda.device_count() >= world else "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def launch_ranks(module: str, job: Path, world: int, what: str, timeout_s: float = 3600.0) -> None:
    """Run ``python -m module job`` once per rank (RANK / WORLD_SIZE / MASTER_* set, as torchrun
    does) and wait; the first rank to fail stops the others. A rank's GptOssFp8Error comes back as
    one; any other failure as a RuntimeError with that rank's stderr tail. Ranks' stderr is kept
    beside ``job`` (rank<r>.err)."""
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    errs = [job.parent / f"rank{r}.err" for r in range(world)]
    procs = []
    for r in range(world):
        with open(errs[r], "w") as err:  # the child holds its own descriptor
            procs.append(subprocess.Popen([sys.executable, "-m", module, str(job)],
                                          env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                          stdout=subprocess.DEVNULL, stderr=err))
    deadline = time.monotonic() + timeout_s
    failed = None
    while any(p.poll() is None for p in procs):
        bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad or time.monotonic() > deadline:
            failed = bad[0] if bad else -1
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()
    if failed is None:
        failed = next((i for i, p in enumerate(procs) if p.returncode != 0), None)
    if failed is None:
        return
    if failed < 0:
        raise GptOssFp8Error(f"{what} (tp {world}) timed out after {timeout_s:.0f} s")
    err = errs[failed].read_text().strip().splitlines()
    last = err[-1] if err else f"exit code {procs[failed].returncode}"
    if "GptOssFp8Error:" in last:
        raise GptOssFp8Error(last.split("GptOssFp8Error:", 1)[1].strip())
    raise RuntimeError(f"rank {failed} of the {what} failed:\n" + "\n".join(err[-30:]))
