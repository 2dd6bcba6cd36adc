"""The model side of a step: the KV cache of all slots, prompt chunks, decode steps by bucket.

One ``KVCache`` of ``slots`` rows x ``max_context`` positions holds every sequence (slot = row).
A decode step runs over rows 0..b-1, a prefix view of the cache (``KVCache.prefix``), where b is
the smallest batch bucket covering the highest decoding slot; rows in the prefix that are free or
still prefilling ride along with token 0 (their K / V at their current length is overwritten by
their next chunk, and their lengths are put back after the step; a free slot holds length 0). On CUDA with the triton backend
each bucket's step is a CUDA graph (model/graph.py), captured once per bucket (``capture_all`` at
start, or at its first use); buckets are the powers of two up to the slot count, and the slot
count. Without graphs (CPU) a bucket is exactly the highest slot + 1.

With ``prefix_cache`` the runner keeps, per slot, three copies of each sliding-window layer's ring and
each full layer's position 0: as they were when its prompt was all in (buffer 0), when its
prefill passed the request's ``keep`` (buffer 1, a chat's head) and when the request ended (buffer 2,
its reply's keys in too) (``snapshot``); ``restore`` puts
a cached prompt's keys in a slot (runtime/prefix.py says why these parts). A prompt that shares only part of
a cached one gets the full layers' rows of the shared part, and its rings are rebuilt by its next chunk, which
prefills the last ``rebuild`` shared tokens again without writing their full layers' rows (``restore``'s ``start``)
and may go on past them.
"""

from __future__ import annotations

import torch

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.cache import KVCache, device_ints
from gptoss_fp8.runtime.prefix import KINDS


class ModelRunner:
    """``model`` (one rank's GptOss) with ``ops``, ``slots`` sequences of up to ``max_context`` tokens."""

    def __init__(self, model, ops, slots: int, max_context: int, *, cuda_graph: bool | None = None,
                 prefix_cache: bool = False):
        from gptoss_fp8.model.graph import DecodeGraphs, capturable

        self.model, self.ops, self.slots, self.max_context = model, ops, slots, max_context
        self.device = model.model.embed_tokens.weight.device
        self.cache: KVCache = model.new_cache(max_context, batch=slots)
        if cuda_graph is None:
            cuda_graph = self.device.type == "cuda" and getattr(ops, "name", "") == "triton" and capturable(model.par)
        self.graphs = DecodeGraphs(model, ops) if cuda_graph else None
        if self.graphs is not None:
            b, self.buckets = 1, []
            while b < slots:
                self.buckets.append(b)
                b *= 2
            self.buckets.append(slots)
        else:
            self.buckets = list(range(1, slots + 1))
        self._views: dict[int, KVCache] = {}
        self._pinned: dict[int, torch.Tensor] = {}
        self.prefix_cache = prefix_cache
        c = self.cache  # saved per slot and buffer (a prompt's end, a head's): a ring whole, a full layer's position 0
        self._saved = [[[t.new_empty(t.shape if c.is_ring(i) else (t.shape[0], *t.shape[2:])) for i, t in enumerate(kv)]
                        for kv in (c.k, c.v)] for _ in range(KINDS)] if prefix_cache else None
        self._kept: dict[int, int] = {}  # slot -> end of its full layers' kept rows, while its rings are rebuilt
        # the tokens a ring rebuild prefills again: each sliding layer's rows depend on window - 1 earlier positions
        # of the layer before (runtime/prefix.py)
        self.rebuild = sum(w - 1 for w in c.windows if w > 0)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def view(self, b: int) -> KVCache:
        v = self._views.get(b)
        if v is None:
            v = self._views[b] = self.cache.prefix(b)
        v.host_lengths = self.cache.host_lengths[:b]
        return v

    def capture_all(self) -> None:
        """Capture every bucket's graph now (each leaves the cache as it was)."""
        if self.graphs is not None:
            for b in self.buckets:
                self.graphs.capture_into(self.view(b))

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        """Prompt tokens at positions start.. of sequence ``slot`` -> logits bf16 [1, V] of the last."""
        t = device_ints(tokens, self.device)  # (no host sync: the step's decode may still run)
        kept = self._kept_chunk(slot, start, len(tokens))
        _, logits = self.model.prefill(t, self.ops, cache=self.cache, row=slot, start=start, kept=kept)
        self._kept.pop(slot, None)
        return logits

    def _kept_chunk(self, slot: int, start: int, n: int) -> int:
        """Where ``slot``'s kept full-layer rows end when the chunk start..start + n is its ring rebuild (``restore``
        with a start), else 0. The rebuild is one chunk, from the restored start to that end or past it (riders
        write at the end meanwhile: ``restore``)."""
        end = self._kept.get(slot)
        if end is None:
            return 0
        if start + n < end or self.cache.host_lengths[slot] != start:
            raise GptOssFp8Error(f"slot {slot} rebuilds its rings over positions {self.cache.host_lengths[slot]}.."
                                 f"{end - 1} in one chunk; got positions {start}..{start + n - 1}")
        return end

    @torch.inference_mode()
    def prefill_many(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Several sequences' prompt chunks (slot, tokens, start) in one forward (``GptOss.prefill_many``:
        one GEMM per weight for all their rows) -> logits bf16 [len(chunks), V], each chunk's last."""
        if len(chunks) == 1:
            (slot, tokens, start), = chunks
            return self.prefill(slot, tokens, start)
        flat = device_ints([t for _, tokens, _ in chunks for t in tokens], self.device)  # (one copy for all)
        parts, r0 = [], 0
        for slot, tokens, start in chunks:
            parts.append((slot, flat[r0:r0 + len(tokens)], start))
            r0 += len(tokens)
        kept = {slot: end for slot, tokens, start in chunks if (end := self._kept_chunk(slot, start, len(tokens)))}
        logits = self.model.prefill_many(parts, self.ops, self.cache, kept)
        for slot in kept:
            del self._kept[slot]
        return logits

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """One token per listed slot (each slot's next position) -> logits bf16 [len(slots), V], in
        the order given. The step's host data (token per row, which rows ride along, the rows to
        return) goes to the device in one copy before the step (pinned and asynchronous on CUDA),
        and the riders' lengths are put back on the device after it: no host synchronisation here
        (the sampler's one read of the tokens is the step's)."""
        host = self.cache.host_lengths
        b = self.bucket(max(slots) + 1)
        ids, ride = [0] * b, [1] * b
        for s, t in zip(slots, tokens, strict=True):
            ids[s], ride[s] = t, 0
        staged = self._stage(b, [ids, ride, slots + [0] * (b - len(slots))])  # [3, b] int64 on the device
        view = self.view(b)
        if self.graphs is not None:
            logits = self.graphs.step(view, staged[0])
        else:
            logits = self.model.decode(view, staged[0], self.ops)
        lengths = self.cache.lengths[:b]
        lengths.sub_(staged[1].to(lengths.dtype))  # the step advanced every row; riders go back
        for s in slots:
            host[s] += 1
        if slots == list(range(b)):
            return logits
        return logits.index_select(0, staged[2, :len(slots)])

    def _stage(self, b: int, rows: list[list[int]]) -> torch.Tensor:
        """rows (equal lengths b) as an int64 tensor on the device. On CUDA through a pinned buffer
        per bucket, copied asynchronously; the buffer is rewritten at the next step of its bucket,
        after the sampler's host read has waited for this step (and so for this copy)."""
        t = torch.tensor(rows, dtype=torch.long)
        if self.device.type != "cuda":
            return t
        pin = self._pinned.get(b)
        if pin is None:
            pin = self._pinned[b] = torch.empty((len(rows), b), dtype=torch.long, pin_memory=True)
        pin.copy_(t)
        return pin.to(self.device, non_blocking=True)

    def snapshot(self, slots: list[int], kind: int = 0) -> None:
        """Save ``slots``' rings and full layers' position 0 in their buffer ``kind`` (their prompts, or heads,
        are in, nothing of this step's decode written yet), in one multi-tensor copy."""
        c, dst, src = self.cache, [], []
        for slot in slots:
            for saved, live in zip(self._saved[kind], (c.k, c.v), strict=True):
                for i, t in enumerate(live):
                    dst.append(saved[i][slot])
                    src.append(t[slot] if c.is_ring(i) else t[slot, 0])
        torch._foreach_copy_(dst, src)

    def restore(self, slot: int, src: int, n: int, kind: int = 0, start: int | None = None) -> None:
        """Slot ``slot`` holds the first ``n`` keys of what slot ``src`` saved in its buffer ``kind`` (its rows
        1..n-1 of the full layers copied unless src is slot itself, the rest from that buffer); length n.

        ``start`` < n (at least ``rebuild`` before it): a prompt that shares n tokens with src's, not at the end of
        its saved rings. The full layers' rows alone are restored, the length set to ``start``, and the slot's next
        chunk must cover start..n - 1: it rebuilds the rings and leaves the full layers' rows before n as they are
        (``prefill``'s ``kept``). Until it runs the slot rides in decode steps at position n (the device length),
        which that chunk writes in every layer if it goes on past n (a ring's row there holds position n - window
        until then, which no query of the chunk from n on reads), or else the prompt's next chunk or its first decode
        step does: never at a kept row."""
        c, dst, frm = self.cache, [], []
        rebuild = start is not None and start < n
        if rebuild and (start < 1 or n - start < self.rebuild or n >= self.max_context):
            raise GptOssFp8Error(f"restore of slot {slot}: a ring rebuild from {start} to {n} must cover at least "
                                 f"{self.rebuild} tokens after position 0 and end inside the context")
        for saved, live in zip(self._saved[kind], (c.k, c.v), strict=True):
            for i, t in enumerate(live):
                if c.is_ring(i):
                    if not rebuild:
                        dst.append(t[slot])
                        frm.append(saved[i][src])
                    continue
                if src != slot and n > 1:
                    dst.append(t[slot, 1:n])
                    frm.append(t[src, 1:n])
                dst.append(t[slot, 0])
                frm.append(saved[i][src])
        torch._foreach_copy_(dst, frm)
        c.set_length(slot, n)
        self._kept.pop(slot, None)
        if rebuild:
            c.host_lengths[slot] = start
            self._kept[slot] = n

    def release(self, slot: int) -> None:
        """A slot's sequence left: its length back to 0 (it may ride along in decode steps)."""
        self._kept.pop(slot, None)
        self.cache.set_length(slot, 0)
