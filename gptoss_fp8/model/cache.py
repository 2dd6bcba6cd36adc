"""The KV cache of a batch of B sequences: per layer, the bf16 K and V after RoPE.

Layout, per layer i (``k[i]`` / ``v[i]`` bf16 [B, rows, kv heads, head_dim], sequence b in row b):
* a full-attention layer holds ``rows = max_len`` positions, position p in row p;
* a sliding-window layer holds a ring of ``rows = min(window, max_len)`` rows, position p in row
  p % rows: everything a query at position p can see (keys p - window < j <= p).
One rule covers both: position p lives in row p % rows (p < max_len, so a full layer never wraps).
This is the layout kernels/attention_decode.py reads directly (full layers by length, rings with
``ring=True``); a rank's cache holds only its local kv heads (model/gptoss.py ``local_heads``).

Lengths: ``lengths`` int32 [B] on the cache's device (tokens held per sequence: the next token of
sequence b sits at position lengths[b]) is what a decode step reads, so the step never looks at
host values (graph-capturable). ``host_lengths`` mirrors it on the host for the bookkeeping that
must not read the device (room checks, ``length``); whoever advances the device lengths advances
the mirror (``GptOss.decode`` and model/graph.py do).

Prefill writes one sequence (row b) at positions 0..n-1 with Python ints (``write``); a decode step
writes one new token per sequence at positions ``lengths`` by index tensors (``append``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.kernels import device_ints


@dataclass
class DecodeStep:
    """One decode step's positions on the device, computed once per step (no host reads):
    ``pos`` int64 [B] the new tokens' positions, ``n`` int32 [B] keys per sequence once they are
    written (pos + 1), ``seq`` int64 [B] = 0..B-1; ``slots`` caches pos % rows per ring size."""

    pos: torch.Tensor
    n: torch.Tensor
    seq: torch.Tensor
    slots: dict[int, torch.Tensor] = field(default_factory=dict)

    def slot(self, rows: int, full: bool) -> torch.Tensor:
        """Row of each new token in a layer of ``rows`` rows (int64 [B])."""
        if full:
            return self.pos
        s = self.slots.get(rows)
        if s is None:
            s = self.slots[rows] = torch.remainder(self.pos, rows)
        return s


@dataclass
class ChunkRows:
    """``KVCache.chunk_rows``: several chunks' rows in one layer kind's cache (device int64 indices). ``dst``: the
    flat cache rows (b * rows + position % rows) the chunks' kept rows go to; ``src``: those rows of the chunks
    (None: all, in order); ``packed``: a ring's packed key rows (0: a full layer, whose keys the cache holds);
    ``new_dst`` / ``prev_src`` / ``prev_dst``: where a ring's chunk rows and its cached keys before them go in the
    packed keys; ``starts`` / ``offsets``: each chunk's first key row there (or in the cache's flat view) and its
    query position among its keys."""

    dst: torch.Tensor
    src: torch.Tensor | None
    packed: int
    new_dst: torch.Tensor | None
    prev_src: torch.Tensor | None
    prev_dst: torch.Tensor | None
    starts: list[int]
    offsets: list[int]


@dataclass(eq=False)  # identity: model/graph.py keys its graphs by the cache object
class KVCache:
    """Per layer i: ``k[i]`` / ``v[i]`` bf16 [B, rows, kv heads, head_dim] (module docstring);
    ``windows[i]`` 0 = full attention; ``cos`` / ``sin`` float32 [max_len, head_dim / 2]: the
    model's RoPE table, row p for position p; ``lengths`` int32 [B] (device) and its host mirror."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    windows: list[int]
    max_len: int
    cos: torch.Tensor
    sin: torch.Tensor
    lengths: torch.Tensor
    host_lengths: list[int]

    @staticmethod
    def ring_size(window: int) -> int:
        """Rows of a sliding-window layer's ring: the window (the current key included)."""
        return window

    @classmethod
    def empty(cls, windows: list[int], n_kv: int, head_dim: int, max_len: int,
              rope: tuple[torch.Tensor, torch.Tensor], device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.bfloat16, batch: int = 1) -> KVCache:
        """A zeroed cache for ``batch`` sequences of up to ``max_len`` tokens each, all empty;
        ``rope`` = (cos, sin) of at least max_len rows."""
        if max_len < 1:
            raise GptOssFp8Error(f"KV cache max_len must be a positive number of tokens, got {max_len}")
        if batch < 1:
            raise GptOssFp8Error(f"KV cache batch must be a positive number of sequences, got {batch}")
        rows = [min(cls.ring_size(w), max_len) if w > 0 else max_len for w in windows]
        k = [torch.zeros(batch, r, n_kv, head_dim, dtype=dtype, device=device) for r in rows]
        v = [torch.zeros(batch, r, n_kv, head_dim, dtype=dtype, device=device) for r in rows]
        cos, sin = rope
        lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        return cls(k, v, list(windows), max_len, cos[:max_len], sin[:max_len], lengths, [0] * batch)

    @staticmethod
    def bytes_for(windows: list[int], n_kv: int, head_dim: int, max_len: int, batch: int = 1,
                  elem: int = 2) -> int:
        """Bytes ``empty`` allocates for K and V (no allocation)."""
        rows = sum(min(KVCache.ring_size(w), max_len) if w > 0 else max_len for w in windows)
        return 2 * batch * rows * n_kv * head_dim * elem

    def prefix(self, b: int) -> KVCache:
        """A cache of this one's first ``b`` sequences sharing its memory (K / V and the device
        ``lengths`` are views, no copy): a decode step over it steps sequences 0..b-1 only. The
        runtime decodes its running slots this way (runtime/runner.py: one view per batch bucket,
        each its own CUDA graph). The view's host mirror is a copy: whoever steps the view
        updates this cache's mirror too."""
        if not 1 <= b <= self.batch:
            raise GptOssFp8Error(f"a prefix of {b} sequences of a cache of {self.batch}")
        return KVCache([t[:b] for t in self.k], [t[:b] for t in self.v], self.windows, self.max_len, self.cos,
                       self.sin, self.lengths[:b], self.host_lengths[:b])

    # --- shape and bookkeeping ------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def length(self) -> int:
        """Tokens held (batch 1; the host mirror, no device read)."""
        if self.batch != 1:
            raise GptOssFp8Error(f"cache.length is for a batch-1 cache; this one holds {self.batch} sequences "
                                 "(read cache.host_lengths)")
        return self.host_lengths[0]

    @length.setter
    def length(self, n: int) -> None:
        self.set_length(0, n)

    def set_length(self, b: int, n: int) -> None:
        """Sequence b holds n tokens (device lengths and host mirror)."""
        if not 0 <= n <= self.max_len:
            raise GptOssFp8Error(f"KV cache length {n} outside 0..{self.max_len}")
        self.lengths[b] = n
        self.host_lengths[b] = n

    def set_lengths(self, rows: list[int], ns: list[int]) -> None:
        """Sequence rows[j] holds ns[j] tokens, for every j (one device copy, no host sync)."""
        for n in ns:
            if not 0 <= n <= self.max_len:
                raise GptOssFp8Error(f"KV cache length {n} outside 0..{self.max_len}")
        dev = self.lengths.device
        self.lengths.index_copy_(0, device_ints(rows, dev), device_ints(ns, dev, self.lengths.dtype))
        for b, n in zip(rows, ns, strict=True):
            self.host_lengths[b] = n

    def check_room(self, n: int = 1) -> None:
        """Raise unless every sequence has room for n more tokens (host mirror only)."""
        top = max(self.host_lengths)
        if top + n > self.max_len:
            raise GptOssFp8Error(f"KV cache full: {top + n} tokens, max_len {self.max_len}; "
                                 "make the cache with a larger max_len")

    def advance_host(self, n: int = 1) -> None:
        """The host mirror of a step that advanced every device length by n."""
        self.host_lengths = [x + n for x in self.host_lengths]

    def rows(self, i: int) -> int:
        return self.k[i].shape[1]

    def is_ring(self, i: int) -> bool:
        return self.windows[i] > 0

    def slot(self, i: int, pos: torch.Tensor) -> torch.Tensor:
        """Row of layer i holding positions ``pos`` (int tensor)."""
        return pos % self.rows(i)

    # --- prefill (host positions) ----------------------------------------------------------------
    def write(self, i: int, b: int, pos0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store sequence b's keys / values [n, kv heads, D] of layer i at positions pos0..pos0 + n - 1
        (a ring keeps the last rows of them)."""
        n = k.shape[0]
        if pos0 + n > self.max_len:
            raise GptOssFp8Error(f"KV cache full: {pos0 + n} tokens, max_len {self.max_len}")
        keep = min(n, self.rows(i))
        pos = torch.arange(pos0 + n - keep, pos0 + n, device=k.device)
        s = self.slot(i, pos)
        self.k[i][b, s] = k[n - keep:].to(self.k[i].dtype)
        self.v[i][b, s] = v[n - keep:].to(self.v[i].dtype)

    def read(self, i: int, b: int, end: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Sequence b's layer-i keys / values visible to a query at position end - 1, in position
        order: (k, v [n, kv heads, D], position of the first). A wrapped ring's view is a gather."""
        first = max(0, end - self.rows(i))
        if end <= self.rows(i):
            return self.k[i][b, :end], self.v[i][b, :end], 0
        s = self.slot(i, torch.arange(first, end, device=self.k[i].device))
        return self.k[i][b, s], self.v[i][b, s], first

    def rope_rows(self, pos0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows of positions pos0..pos0 + n - 1."""
        return self.cos[pos0:pos0 + n], self.sin[pos0:pos0 + n]

    # --- several sequences' prompt chunks at once (``GptOss.prefill_many``) ----------------------------
    def chunk_rows(self, i: int, chunks: list[tuple[int, int, int]], kept: dict[int, int] | None = None) -> ChunkRows:
        """Where chunks (sequence b, start, rows; their rows one after another) go in layer i's rows and where their
        attention finds its keys, as device indices made once (the same for every layer of this one's rows): the
        writes and reads of ``write`` / ``read`` on each chunk, a few launches a layer instead of a few a chunk.
        ``kept``: sequence b -> the position up to which its full layers already hold the keys (the prefix cache's
        ring rebuild, runtime/prefix.py): a full layer writes its chunk's rows from there on only."""
        rows, ring = self.rows(i), self.is_ring(i)
        dst, src, prev_src, prev_dst, new_dst, starts, offsets = [], [], [], [], [], [], []
        r0 = kn = 0
        for b, pos0, n in chunks:
            if pos0 + n > self.max_len:
                raise GptOssFp8Error(f"KV cache full: {pos0 + n} tokens, max_len {self.max_len}")
            keep = min(n, rows)  # a ring keeps the last rows of a chunk longer than itself
            if kept and not ring:
                keep = min(keep, max(0, pos0 + n - kept.get(b, 0)))
            dst += [b * rows + p % rows for p in range(pos0 + n - keep, pos0 + n)]
            src += range(r0 + n - keep, r0 + n)
            first = max(0, pos0 - rows) if ring else 0  # a ring: the keys before the chunk it still holds
            if ring:
                prev_src += [b * rows + p % rows for p in range(first, pos0)]
                prev_dst += range(kn, kn + pos0 - first)
                new_dst += range(kn + pos0 - first, kn + pos0 - first + n)
                starts.append(kn)
                kn += pos0 - first + n
            else:
                starts.append(b * rows)
            offsets.append(pos0 - first)
            r0 += n
        dev = self.k[i].device
        return ChunkRows(device_ints(dst, dev), None if src == list(range(r0)) else device_ints(src, dev),
                         kn if ring else 0, device_ints(new_dst, dev) if ring else None,
                         device_ints(prev_src, dev) if prev_src else None, device_ints(prev_dst, dev) if prev_dst else None,
                         starts, offsets)

    def _flat(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V as [batch * rows, kv heads, D] views (row b * rows + r: sequence b's row r)."""
        return self.k[i].view(-1, *self.k[i].shape[2:]), self.v[i].view(-1, *self.v[i].shape[2:])

    def chunk_keys(self, i: int, plan: ChunkRows, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys / values the chunks' attention reads (``plan.starts`` / ``plan.offsets`` say where each chunk's
        are), k / v [T, kv heads, D] the chunks' own: a full layer's are the cache itself (its flat view: the chunks
        are written first, ``write_chunks``), a ring's each chunk's cached keys then its own, packed (call this before
        ``write_chunks``, which overwrites ring rows)."""
        fk, fv = self._flat(i)
        if not plan.packed:
            return fk, fv
        pk = fk.new_empty((plan.packed, *fk.shape[1:]))
        pv = fv.new_empty((plan.packed, *fv.shape[1:]))
        pk.index_copy_(0, plan.new_dst, k.to(pk.dtype))
        pv.index_copy_(0, plan.new_dst, v.to(pv.dtype))
        if plan.prev_src is not None:
            pk.index_copy_(0, plan.prev_dst, fk.index_select(0, plan.prev_src))
            pv.index_copy_(0, plan.prev_dst, fv.index_select(0, plan.prev_src))
        return pk, pv

    def write_chunks(self, i: int, plan: ChunkRows, k: torch.Tensor, v: torch.Tensor) -> None:
        """``write`` of every chunk (k / v [T, kv heads, D], the chunks' rows one after another), in one copy each."""
        fk, fv = self._flat(i)
        if plan.src is not None:
            k, v = k.index_select(0, plan.src), v.index_select(0, plan.src)
        fk.index_copy_(0, plan.dst, k.to(fk.dtype))
        fv.index_copy_(0, plan.dst, v.to(fv.dtype))

    # --- decode (device positions, no host reads) ------------------------------------------------
    def step(self) -> DecodeStep:
        """This step's positions: one new token per sequence at ``lengths``."""
        pos = self.lengths.long()
        seq = torch.arange(self.batch, device=self.lengths.device)
        return DecodeStep(pos, self.lengths + 1, seq)

    def append(self, i: int, step: DecodeStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer i's new keys / values [B, kv heads, D] at the step's positions (index tensors)."""
        s = step.slot(self.rows(i), not self.is_ring(i))
        self.k[i].index_put_((step.seq, s), k.to(self.k[i].dtype))
        self.v[i].index_put_((step.seq, s), v.to(self.v[i].dtype))

    def advance(self, n: int = 1) -> None:
        """Every sequence holds n more tokens: the device lengths (in place) and the host mirror."""
        self.lengths.add_(n)
        self.advance_host(n)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


def decode_tokens(cache: KVCache, token, device: torch.device | str | None = None) -> torch.Tensor:
    """One decode step's tokens for ``cache``: an int / one-element tensor (batch 1) or a [B] tensor
    -> int tensor [B] on ``device``; anything else is one clear error."""
    t = torch.as_tensor(token, device=device)
    if t.numel() == 1 and cache.batch == 1:
        t = t.reshape(1)
    if t.shape != (cache.batch,) or t.is_floating_point():
        raise GptOssFp8Error(f"decode takes one integer token per sequence: {cache.batch} for this cache, "
                             f"got {t.dtype} {list(t.shape)}")
    return t

