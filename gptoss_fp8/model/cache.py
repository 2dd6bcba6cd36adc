"""The KV cache of one sequence: per layer, the bf16 K and V after RoPE.

Full-attention layers hold the whole sequence, preallocated to ``max_len`` positions (position p
in row p); sliding-window layers hold a ring of ``sliding_window`` rows (position p in row
p % window), all a query at position p can see (keys p - window < j <= p). ``length`` counts the
tokens seen (written and advanced past). Batch 1 only for now: one sequence per cache (batches of
sequences of different lengths, tp-sharded heads beyond this rank's, and the GPU decode kernel's
layout come later; a rank's cache already holds only its local kv heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptoss_fp8.errors import GptOssFp8Error


@dataclass
class KVCache:
    """Per layer i: ``k[i]`` / ``v[i]`` bf16 [rows, kv heads, head_dim] (rows = ``max_len`` for a
    full-attention layer, ``windows[i]`` for a sliding-window one); ``windows[i]`` 0 = full;
    ``cos`` / ``sin`` float32 [max_len, head_dim / 2]: the model's RoPE table, row p for position p."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    windows: list[int]
    max_len: int
    cos: torch.Tensor
    sin: torch.Tensor
    length: int = field(default=0)

    @staticmethod
    def ring_size(window: int) -> int:
        """Rows of a sliding-window layer's ring: the window (the current key included)."""
        return window

    @classmethod
    def empty(cls, windows: list[int], n_kv: int, head_dim: int, max_len: int,
              rope: tuple[torch.Tensor, torch.Tensor], device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.bfloat16) -> KVCache:
        """A zeroed cache for up to ``max_len`` tokens; ``rope`` = (cos, sin) of at least max_len rows."""
        if max_len < 1:
            raise GptOssFp8Error(f"KV cache max_len must be a positive number of tokens, got {max_len}")
        rows = [min(cls.ring_size(w), max_len) if w > 0 else max_len for w in windows]
        k = [torch.zeros(r, n_kv, head_dim, dtype=dtype, device=device) for r in rows]
        v = [torch.zeros(r, n_kv, head_dim, dtype=dtype, device=device) for r in rows]
        cos, sin = rope
        return cls(k, v, list(windows), max_len, cos[:max_len], sin[:max_len])

    def rows(self, i: int) -> int:
        return self.k[i].shape[0]

    def slot(self, i: int, pos: torch.Tensor) -> torch.Tensor:
        """Row of layer i holding positions ``pos`` (int tensor)."""
        return pos % self.rows(i) if self.windows[i] > 0 else pos

    def write(self, i: int, pos0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer i's keys / values [n, kv heads, D] of positions pos0..pos0 + n - 1 (a ring
        keeps the last rows of them)."""
        n = k.shape[0]
        if pos0 + n > self.max_len:
            raise GptOssFp8Error(f"KV cache full: {pos0 + n} tokens, max_len {self.max_len}")
        keep = min(n, self.rows(i))
        pos = torch.arange(pos0 + n - keep, pos0 + n, device=k.device)
        s = self.slot(i, pos)
        self.k[i][s] = k[n - keep:].to(self.k[i].dtype)
        self.v[i][s] = v[n - keep:].to(self.v[i].dtype)

    def read(self, i: int, end: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layer i's keys / values visible to a query at position end - 1, in position order:
        (k, v [n, kv heads, D], position of the first). A ring's view is a gather (a copy)."""
        if self.windows[i] == 0:
            return self.k[i][:end], self.v[i][:end], 0
        first = max(0, end - self.rows(i))
        s = self.slot(i, torch.arange(first, end, device=self.k[i].device))
        return self.k[i][s], self.v[i][s], first

    def rope_rows(self, pos0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows of positions pos0..pos0 + n - 1."""
        return self.cos[pos0:pos0 + n], self.sin[pos0:pos0 + n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
