"""Decode steps captured as CUDA graphs and replayed: one graph per KV cache (= per batch bucket).

A decode step at batch B runs ~20 small kernels per layer; at batch 1 each does a few microseconds
of work, so the host's launch path (Python, the ops dispatch, Triton's launcher) would set the pace.
``GptOss.decode_step`` has no host synchronisation and no data-dependent shape on the ``triton``
backend: positions are read from the cache's device ``lengths`` (RoPE rows gathered, K / V rows
written by index tensors, the decode kernel's lengths on the device, its grid sized by the cache's
capacity), and the MoE sizes its buffers by upper bounds. So one step can be captured once and
replayed: the graph reads the token ids from a static input buffer, writes the logits to a static
output buffer, and advances ``lengths`` on the device; the runner advances the host mirror.

Capture (the first ``step`` on a cache): ``warmup`` eager steps on a side stream (compilation, the
fused q/k/v weights, the decode kernel's counters), then the capture; each of them writes K / V
at positions ``lengths`` (rows the next real step overwrites: for a ring, the oldest row, which the
next query no longer sees) and the device lengths are restored after each, so the cache is as it
was. A graph holds its cache's addresses: keep the cache alive while the graph is used (the runner
keys graphs by the cache object and drops a graph with its cache). Each graph has its own memory
pool (one step's activations: a few MB, plus the logits [B, V]), so graphs replay in any order.

A sharded model (``model.par.world > 1``, one process per rank): the all-reduces are NCCL calls,
which a graph captures (one GPU per rank; gloo, used when ranks share a GPU, reduces through host
memory and cannot be captured: refused). Every rank captures the same step: the warm-up steps run
their collectives eagerly, then all ranks wait for their GPU and meet at a barrier before the
capture, and the capture is ``thread_local`` so that the process group's watchdog thread, which
queries the events of the eager collectives, cannot invalidate it. Replays must then be issued
by every rank in the same order (each replay's all-reduces wait for the other ranks').
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.cache import KVCache, decode_tokens


def capturable(par) -> bool:
    """Whether a step of this rank can be captured as a CUDA graph: one process, or ranks over
    NCCL (gloo, used when ranks share a GPU, reduces through host memory, which a graph cannot)."""
    return par.world == 1 or dist.get_backend(par.group) == "nccl"


def check_capturable(par) -> None:
    """One line where ``capturable`` is False."""
    if not capturable(par):
        raise GptOssFp8Error(f"CUDA graphs of a sharded model need NCCL, one GPU per rank; this one reduces over "
                             f"{dist.get_backend(par.group)} (ranks sharing a GPU): run eager")


def capture_args(model, device) -> dict:
    """Ready a capture of ``model``'s step: one rank's model needs nothing (``{}``); a sharded one
    (``par.world > 1``) needs NCCL (one GPU per rank: gloo reduces through host memory, which a
    graph cannot capture; one line otherwise), every rank's eager work done (device synchronized,
    then a barrier, so all ranks capture together) and a ``thread_local`` capture (the process
    group's watchdog thread queries the eager collectives' events, which a global capture would
    refuse) -> ``torch.cuda.graph``'s keyword arguments."""
    par = model.par
    if par.world == 1:
        return {}
    check_capturable(par)
    torch.cuda.synchronize(device)
    dist.barrier(group=par.group)
    return {"capture_error_mode": "thread_local"}


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # static input, int64 [B]
    logits: torch.Tensor  # static output, bf16 [B, V]


class DecodeGraphs:
    """``step(cache, tokens) -> logits [B, V]``: ``model.decode`` as a replayed CUDA graph.

    ``model`` on a CUDA device, ``ops`` a backend with no host synchronisation in the step (the
    ``triton`` one). The returned logits are the graph's output buffer, overwritten by the next
    replay of that cache's graph: clone to keep.
    """

    def __init__(self, model, ops, warmup: int = 2):
        if model.model.embed_tokens.weight.device.type != "cuda":
            raise GptOssFp8Error("CUDA-graph decode needs the model on a CUDA device")
        check_capturable(model.par)
        self.model, self.ops, self.warmup = model, ops, warmup
        self._graphs: weakref.WeakKeyDictionary[KVCache, _Captured] = weakref.WeakKeyDictionary()
        self.captured = 0  # graphs captured so far

    @torch.inference_mode()
    def capture(self, cache: KVCache) -> _Captured:
        """Capture one decode step of this cache (module docstring); the cache is left as it was."""
        cache.check_room(1)
        dev = cache.lengths.device
        tokens = torch.zeros(cache.batch, dtype=torch.long, device=dev)
        saved = cache.lengths.clone()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # torch's recipe: warm-up runs on a side stream before capture
            for _ in range(self.warmup):
                self.model.decode_step(cache, tokens, self.ops)
                cache.lengths.copy_(saved)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, **capture_args(self.model, dev)):
            logits = self.model.decode_step(cache, tokens, self.ops)
        cache.lengths.copy_(saved)
        self.captured += 1
        return _Captured(graph, tokens, logits)

    def capture_into(self, cache: KVCache) -> None:
        """Capture this cache's graph now unless it has one (a server captures every batch bucket
        at start, so no request waits for a capture)."""
        if cache not in self._graphs:
            self._graphs[cache] = self.capture(cache)

    @torch.inference_mode()
    def step(self, cache: KVCache, tokens: torch.Tensor | int) -> torch.Tensor:
        """One decode step of every sequence of ``cache`` (tokens int [B], or an int / one-element
        tensor for batch 1) by graph replay -> logits bf16 [B, V] (the static buffer)."""
        got = self._graphs.get(cache)
        if got is None:
            got = self._graphs[cache] = self.capture(cache)
        t = decode_tokens(cache, tokens)
        cache.check_room(1)
        got.tokens.copy_(t, non_blocking=True)
        got.graph.replay()
        cache.advance_host()
        return got.logits
