"""The engine over a sharded model: rank 0 leads, the other ranks follow step by step.

A checkpoint converted for tp / ep > 1 runs one process per rank, each with its own shard and
its own ``ModelRunner`` (the same slots, the same KV cache layout over its local kv heads). Rank
0 owns the scheduler and the sampling: its ``Leader`` is the runner the engine sees, and before
each model call it broadcasts the call (``("prefill", slot, tokens, start)``, ``("decode", slots,
tokens)``, ``("release", slot)``, ``("snapshot", slots, kind)``, ``("restore", slot, src, n, kind, start)``, ``("capture",)``,
``("stop",)``) to the other ranks, whose ``follow`` loop makes the same call; the model's
all-reduces inside each call keep the ranks in step, and the logits (replicated by the model)
are used on rank 0 only. Every model call happens on rank 0's engine thread, so the order is the
one the engine runs.

A call that raises on rank 0 would leave the followers inside the call's collectives, so it is
not one request's failure here: ``RankFailure`` (a BaseException, which the engine does not catch
per request) stops the engine, and /health reports it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gptoss_fp8.runtime.runner import ModelRunner


class RankFailure(BaseException):
    """A model call failed on the leading rank of a sharded engine: the ranks are out of step."""


def share(obj, par):
    """``obj`` from rank 0 on every rank (a small picklable value)."""
    box = [obj if par.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=par.group)
    return box[0]


class Leader:
    """``runner``'s interface on rank 0 of ``par``, each model call sent to the followers first."""

    def __init__(self, runner: ModelRunner, par):
        self.runner, self.par = runner, par
        self.slots, self.max_context, self.device = runner.slots, runner.max_context, runner.device
        self.model, self.cache, self.graphs, self.buckets = runner.model, runner.cache, runner.graphs, runner.buckets
        self.prefix_cache, self.rebuild = runner.prefix_cache, runner.rebuild

    def _both(self, cmd: tuple):
        share(cmd, self.par)
        try:
            return getattr(self.runner, _METHODS[cmd[0]])(*cmd[1:])
        except Exception as e:
            raise RankFailure(f"rank 0 failed in {cmd[0]} ({type(e).__name__}: {e}); the ranks are out of step") from e

    def prefill(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        return self._both(("prefill", slot, list(tokens), start))

    def prefill_many(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        return self._both(("prefill_many", [(slot, list(tokens), start) for slot, tokens, start in chunks]))

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        return self._both(("decode", list(slots), list(tokens)))

    def release(self, slot: int) -> None:
        self._both(("release", slot))

    def snapshot(self, slots: list[int], kind: int = 0) -> None:
        self._both(("snapshot", list(slots), kind))

    def restore(self, slot: int, src: int, n: int, kind: int = 0, start: int | None = None) -> None:
        self._both(("restore", slot, src, n, kind, start))

    def capture_all(self) -> None:
        self._both(("capture",))

    def stop(self) -> None:
        share(("stop",), self.par)


_METHODS = {"prefill": "prefill", "prefill_many": "prefill_many", "decode": "decode", "release": "release",
            "capture": "capture_all", "snapshot": "snapshot", "restore": "restore"}


def follow(runner: ModelRunner, par) -> int:
    """On a rank > 0: make rank 0's model calls until it sends ``stop`` -> the calls made."""
    n = 0
    while True:
        cmd = share(None, par)
        if cmd[0] == "stop":
            return n
        getattr(runner, _METHODS[cmd[0]])(*cmd[1:])
        n += 1
