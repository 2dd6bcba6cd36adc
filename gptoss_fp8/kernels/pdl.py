"""Programmatic dependent launch (PDL, sm_90) for the decode-sized kernels: the launch helpers and
the two device-side pieces every such kernel uses.

A decode step is ~270 short kernels in one CUDA graph; without PDL each starts only when the one
before has drained, then ramps its loads up from nothing. Launched with ``launch_pdl=True`` (the
programmatic stream-serialization attribute; captured into a graph as a programmatic edge), a
kernel may start while its predecessor runs, and must then call ``pdl_wait`` (``griddepcontrol.
wait``: blocks until every prerequisite grid has completed and its memory is visible) before it
touches anything an earlier kernel wrote or may still read. ``pdl_wait`` then triggers the next
kernel's launch (``griddepcontrol.launch_dependents``), so at most two kernels overlap and the
chain stays transitive: a kernel passes its wait only after its predecessor passed its own.

The contract of a kernel launched with PDL (``pdl_launch`` true), checked by review and by the
tests that run the decode path bit for bit with and without it:
* before ``pdl_wait``: only reads of tensors no kernel of the step writes (weights, scales,
  biases, norm weights) and pure arithmetic; no store, no atomic, no read of an activation, an id
  or a counter. ``prefetch_l2`` of any address is allowed (a hint into the coherent L2: never a
  wrong value, whoever writes that line);
* every program calls ``pdl_wait`` exactly once on every path that stores (a program that returns
  early without touching memory needs no wait).
Kernels launched without the attribute, torch's and cuBLAS's included, wait for their predecessor
as usual, so the chain may mix both.

``KernelConfig.pdl_max_rows`` bounds it to calls of a few token rows (decode steps): prefill's
large kernels gained nothing from it (fifth session, benchmarks/notes/prefill.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def pdl_launch(config, rows: int, device: torch.device) -> bool:
    """Whether a call of ``rows`` token rows on ``device`` launches with PDL under ``config``
    (a ``KernelConfig``): on a CUDA device, not under the interpreter, rows <= pdl_max_rows."""
    limit = config.pdl_max_rows
    return (limit is not None and rows <= limit and device.type == "cuda"
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))


def launch_kwargs(pdl: bool) -> dict:
    """The launch keyword for a PDL launch (nothing otherwise: the interpreter knows no such option)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait for the predecessor grid (its writes visible), then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """A hint: fetch the lines of ``ptrs`` (where ``mask``) into L2 without waiting for them
    (``prefetch.global.L2``, no register written). Used before ``pdl_wait`` on weights, so their
    first bytes stream from HBM while the predecessor finishes."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
