"""The KV cache's fixed budget of slots: one slot = one cache row of ``max_context`` positions.

Slots are handed out lowest first, so the running sequences crowd the low rows and a decode step
over rows 0..b-1 (runtime/runner.py: batch buckets) wastes few rows on free ones; with the prefix
cache (runtime/prefix.py) a free slot that still holds a prompt is kept for its next turn while
a slot without one is free. On CUDA the
number of slots comes from the free GPU memory at start (``slots_for_memory``), printed by the
caller; on CPU it is ``--max-batch``.
"""

from __future__ import annotations

import heapq

import torch

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.cache import KVCache
from gptoss_fp8.runtime.prefix import KINDS


class SlotManager:
    """``total`` slots numbered 0..total-1; ``alloc`` the lowest free one, ``free`` it back."""

    def __init__(self, total: int):
        if total < 1:
            raise GptOssFp8Error(f"the KV cache needs at least one slot, got {total}")
        self.total = total
        self._free = list(range(total))

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free)

    def alloc(self) -> int | None:
        """The lowest free slot, or None when all are taken."""
        return heapq.heappop(self._free) if self._free else None

    def take(self, slot: int) -> None:
        """Take free slot ``slot`` (a placement's choice, runtime/prefix.py)."""
        self._free.remove(slot)
        heapq.heapify(self._free)

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.total and slot not in self._free, f"slot {slot} of {self.total} freed twice"
        heapq.heappush(self._free, slot)


def slot_bytes(model, max_context: int, prefix_cache: bool = False) -> int:
    """KV cache bytes of one slot of ``max_context`` tokens for ``model`` (bf16 K and V, every layer),
    with ``prefix_cache`` its saved copies of the rings and full layers' position 0 too (runtime/prefix.py's KINDS)."""
    windows = [layer.window for layer in model.model.layers]
    n_kv, d = model.model.layers[0].self_attn.n_kv, model.cfg.head_dim
    per = KVCache.bytes_for(windows, n_kv, d, max_context)
    if prefix_cache:
        per += KINDS * KVCache.bytes_for([w for w in windows if w > 0], n_kv, d, max_context)
        per += KINDS * KVCache.bytes_for([0] * sum(w == 0 for w in windows), n_kv, d, 1)
    return per


def slots_for_memory(model, max_context: int, max_batch: int, device: torch.device, fraction: float = 0.85,
                     reserve: int = 2 << 30, prefix_cache: bool = False) -> tuple[int, str]:
    """How many slots fit: on CUDA, ``fraction`` of the free memory less ``reserve`` bytes (the
    step's activations, the CUDA graphs' pools, the logits), at most ``max_batch``; on CPU
    ``max_batch``. -> (slots, a line saying how that was decided). One line if none fits."""
    per = slot_bytes(model, max_context, prefix_cache)
    if device.type != "cuda":
        return max_batch, f"KV cache: {max_batch} slots x {max_context} tokens = {per * max_batch / 2**30:.2f} GiB (cpu)"
    free, total = torch.cuda.mem_get_info(device)
    budget = int(free * fraction) - reserve
    n = min(max_batch, max(0, budget // per))
    if n < 1:
        raise GptOssFp8Error(f"KV cache: one slot of {max_context} tokens needs {per / 2**30:.2f} GiB, "
                             f"{free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB free; give a smaller --max-context")
    return n, (f"KV cache: {n} slots x {max_context} tokens = {n * per / 2**30:.2f} GiB "
               f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB; --max-batch {max_batch})")
