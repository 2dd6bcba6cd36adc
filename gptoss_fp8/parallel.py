"""Parallelism passed into the model: which rank this process is, and the group to reduce over.

Layout (the shard plan in checkpoint/plan.py decides which tensors each rank loads):
* tensor parallel over ``tp`` ranks: attention heads split by rank (kv heads replicated when
  tp > kv heads), o_proj split by input columns, so its output is a partial sum;
* experts: ``ep`` expert groups of ``tp // ep`` ranks each; rank r holds the experts of group
  ``r // (tp // ep)`` and, within them, part ``r % (tp // ep)`` of the intermediate dimension.
  Every rank's down projection is a partial sum over (expert, intermediate part);
* the embedding and lm_head: replicated, or with ``vocab_parallel`` (tp > 1) split by vocabulary
  rows, rank r holding rows ``[V * r // tp, V * (r + 1) // tp)`` of both (``vocab_rows``:
  contiguous, sizes differing by at most one when tp does not divide V).
The model all-reduces exactly where OpenAI's reference does: after o_proj and after the MoE down
projection (biases added once, by their owner rank, before the sum); vocab-parallel adds an
all-reduce of the embedding rows (each row nonzero on one rank only: exact) and an all-gather of
the logits' vocabulary slices.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptoss_fp8.errors import GptOssFp8Error


@dataclass(frozen=True)
class Parallel:
    """Where a rank sits (passed in, never a global): rank r of a world of ``tp`` ranks, ``ep``
    expert groups, the process group to reduce over (None: the default group), and whether the
    embedding and lm_head are split by vocabulary rows (``vocab_parallel``; at tp 1 one rank holds
    the whole vocabulary, so the flag is normalized to False there)."""

    rank: int = 0
    tp: int = 1
    ep: int = 1
    group: Any = None
    vocab_parallel: bool = False

    def __post_init__(self) -> None:
        assert self.tp >= 1 and self.ep >= 1, f"tp {self.tp} / ep {self.ep} must be >= 1"
        assert 0 <= self.rank < self.tp, f"rank {self.rank} outside world {self.tp}"
        assert self.tp % self.ep == 0, f"tp {self.tp} not a multiple of ep {self.ep}"
        if self.tp == 1 and self.vocab_parallel:  # one slice is the whole vocabulary: the plain layout
            object.__setattr__(self, "vocab_parallel", False)

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

    def vocab_rows(self, vocab_size: int, rank: int | None = None) -> tuple[int, int]:
        """[start, stop) of the embedding / lm_head rows rank ``rank`` (default: this one) holds:
        all of them when replicated; with ``vocab_parallel``, contiguous near-equal slices
        ``[V * r // tp, V * (r + 1) // tp)`` (the shard plan slices the files by this too)."""
        r = self.rank if rank is None else rank
        if not self.vocab_parallel:
            return 0, vocab_size
        return vocab_size * r // self.tp, vocab_size * (r + 1) // self.tp

    def vocab_sizes(self, vocab_size: int) -> list[int]:
        """Rows of the vocabulary each rank holds, in rank order (``all_gather``'s ``sizes``)."""
        return [b - a for a, b in (self.vocab_rows(vocab_size, r) for r in range(self.world))]

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

    def all_gather(self, t: torch.Tensor, sizes: Sequence[int] | None = None, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order (t's dtype, exact: a copy).
        ``sizes``: each rank's extent along ``dim`` when they differ (default: all t's); the other
        dims must agree. Identity when world == 1. Shapes depend on ``sizes`` only, never on
        data, and NCCL needs no host sync, so a CUDA graph can capture it."""
        if self.world == 1:
            return t
        dim = dim % t.dim()
        sizes = [t.shape[dim]] * self.world if sizes is None else list(sizes)
        assert len(sizes) == self.world and t.shape[dim] == sizes[self.rank], \
            f"rank {self.rank}: extent {t.shape[dim]} along dim {dim}, sizes {sizes}"
        n = max(sizes)
        if t.shape[dim] == n:
            buf = t.contiguous()
        else:  # collectives want equal pieces: pad to the largest, cut the padding off below
            shape = list(t.shape)
            shape[dim] = n
            buf = t.new_zeros(shape)
            buf.narrow(dim, 0, t.shape[dim]).copy_(t)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name since torch 2.13
        if buf.is_cuda and dist.get_backend(self.group) == "gloo":
            # Several ranks sharing one GPU (NCCL refuses that): gather through host memory.
            host = buf.cpu()
            out = host.new_empty((self.world * host.shape[0], *host.shape[1:]))
            gather(out, host, group=self.group)
            out = out.to(t.device)
        else:
            out = buf.new_empty((self.world * buf.shape[0], *buf.shape[1:]))
            gather(out, buf, group=self.group)
        parts = out.view(self.world, *buf.shape).unbind(0)  # [world, *buf.shape]: rank r's piece at r
        return torch.cat([p.narrow(dim, 0, k) for p, k in zip(parts, sizes, strict=True)], dim)


SINGLE = Parallel()


def check_layout(cfg, tp: int, ep: int, vocab_parallel: bool = False) -> None:
    """One-line error for a (tp, ep) this model cannot be split into (cfg: a GptOssConfig), and,
    with ``vocab_parallel``, for a vocabulary too small to give every rank a row."""
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
    if vocab_parallel and tp > 1 and cfg.vocab_size < tp:
        raise GptOssFp8Error(f"--tp {tp} --vocab-parallel: vocab_size {cfg.vocab_size} gives some rank no "
                             "vocabulary rows; drop --vocab-parallel or use a smaller --tp")


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


def start_rank(device: str, world: int, threads: int | None = None) -> tuple[int, str]:
    """In a rank process (RANK / WORLD_SIZE / MASTER_* set by ``launch_ranks`` or torchrun): pick
    its device (``device_for``), set its CPU threads (``threads``; default on CPU a 1/world share
    of the cores) and join the process group (``backend_for``) -> (rank, device). The caller
    destroys the group when done."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dev = device_for(device, int(os.environ.get("LOCAL_RANK", rank)))
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    if threads is not None:
        torch.set_num_threads(threads)
    elif not dev.startswith("cuda"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend_for(dev, world), init_method="env://", rank=rank, world_size=world)
    return rank, dev


def check_torchrun_world(tp: int) -> None:
    """Under torchrun: one line unless its WORLD_SIZE is ``tp`` (one process per rank)."""
    if int(os.environ["WORLD_SIZE"]) != tp:
        raise GptOssFp8Error(f"--tp {tp} under torchrun with WORLD_SIZE {os.environ['WORLD_SIZE']}; "
                             "give --nproc-per-node equal to --tp")


def run_job(module: str, job: dict, world: int, what: str, timeout_s: float = 3600.0,
            output: Callable[[str], None] | None = None):
    """``launch_ranks`` on ``job`` (written as JSON to a temporary folder, with ``job["result"]`` the
    path rank 0 writes its JSON result to) -> that result, parsed. ``output``: see ``launch_ranks``."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gptoss-fp8-ranks-") as tmp:
        job = dict(job, result=str(Path(tmp) / "result.json"))
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        launch_ranks(module, path, world, what, timeout_s, output)
        return json.loads(Path(job["result"]).read_text())


def _forward(pipe, output: Callable[[str], None]) -> None:
    """Hand rank 0's stdout to ``output`` as it arrives (UTF-8 text, in the chunks the pipe gives),
    until the pipe closes (the rank exits, or is killed)."""
    import codecs

    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split across reads waits
    with pipe:
        while chunk := os.read(pipe.fileno(), 65536):
            if text := utf8.decode(chunk):
                output(text)
    if text := utf8.decode(b"", final=True):
        output(text)


def launch_ranks(module: str, job: Path, world: int, what: str, timeout_s: float = 3600.0,
                 output: Callable[[str], None] | None = None) -> None:
    """Run ``python -m module job`` once per rank (RANK / WORLD_SIZE / MASTER_* set, as torchrun
    does) and wait; the first rank to fail stops the others. A rank's GptOssFp8Error comes back as
    one; any other failure as a RuntimeError with that rank's stderr tail. Ranks' stderr is kept
    beside ``job`` (rank<r>.err). Their stdout is dropped, except, given ``output``, rank 0's: read
    through a pipe by a thread of this process and handed to ``output`` (text, as it arrives) while
    the ranks run, so what rank 0 prints reaches the caller's own stdout (or whatever ``output``
    writes to) as it would from this process."""
    import threading

    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    errs = [job.parent / f"rank{r}.err" for r in range(world)]
    procs = []
    reader = None
    for r in range(world):
        piped = r == 0 and output is not None
        rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        if piped:  # text as it is printed, in UTF-8 whatever the locale
            rank_env |= {"PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"}
        with open(errs[r], "w") as err:  # the child holds its own descriptor
            procs.append(subprocess.Popen([sys.executable, "-m", module, str(job)], env=rank_env,
                                          stdout=subprocess.PIPE if piped else subprocess.DEVNULL, stderr=err))
        if piped:
            reader = threading.Thread(target=_forward, args=(procs[0].stdout, output), daemon=True)
            reader.start()
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
    if reader is not None:
        reader.join()  # rank 0 has exited: its pipe is at its end
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
