"""Grouping the MoE's (token, slot) pairs by local expert, each expert's rows padded (Triton).

Contract: topk_ids int32 [T, k] (contiguous) of global expert ids; a rank holds experts
[expert_start, expert_start + E_local). ``moe_align`` returns ``sorted_slots`` int32 [max_rows]
(flat slot t*k + j per padded row, T*k for padding) and ``block_expert`` int32
[max_rows / ALIGN_M] (each row tile's local expert, E_local past the last segment);
``moe_align_rows`` the inverse map too (``slot_rows`` int32 [T*k], each slot's row), with
max_rows = round_up(T*k + E_local*(ALIGN_M - 1), ALIGN_M) an upper bound, so the host never
synchronises. Pairs routed to other ranks are dropped. Three small kernels (count with atomics,
offsets, scatter); the order inside one expert's segment follows the atomics (it changes nothing
downstream: rows are independent and written back by slot). ``moe_align_reference`` is the
plain-torch form (stable order inside each segment). Not done here: the GEMMs (moe_gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptoss_fp8.quant.fp8 import cdiv, next_pow2


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, rank_ptr, n_slots, expert_start, num_experts, BLOCK: tl.constexpr,
                        E_POW2: tl.constexpr):
    """Count the slots of each local expert; each slot's rank within its expert: its rank among the block's slots of
    that expert (a running sum over the block's one-hot [BLOCK, E_POW2]) after the block's base, one atomic add an
    expert a block (the blocks' order follows the atomics). Before the forty-fourth session one atomic a slot: each
    expert's ~4096 adds at 32768 tokens in a row (~30 us a launch)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_slots
    e = tl.load(ids_ptr + offs, mask=m, other=0) - expert_start
    here = m & (e >= 0) & (e < num_experts)
    experts = tl.arange(0, E_POW2)
    onehot = ((e[:, None] == experts[None, :]) & here[:, None]).to(tl.int32)
    before = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # the block's earlier slots of its expert
    count = tl.sum(onehot, axis=0)
    base = tl.atomic_add(counts_ptr + experts, count, mask=count > 0)
    base = tl.where(count > 0, base, 0)
    tl.store(rank_ptr + offs, tl.sum(onehot * base[None, :], axis=1) + before, mask=m)


@triton.jit
def _align_offsets_kernel(counts_ptr, pad_start_ptr, block_expert_ptr, num_experts, num_tiles,
                          ALIGN_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program: padded segment starts (exclusive cumsum of counts rounded up to ALIGN_M) and
    the expert of every ALIGN_M-row tile (num_experts past the last segment)."""
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    counts = tl.load(counts_ptr + offs_e, mask=e_mask, other=0)
    padded = (counts + ALIGN_M - 1) // ALIGN_M * ALIGN_M
    pad_end = tl.cumsum(padded, axis=0)
    tl.store(pad_start_ptr + offs_e, pad_end - padded, mask=e_mask)
    tile_end = tl.where(e_mask, pad_end // ALIGN_M, 2147483647)  # [BLOCK_E] tile index ends
    for t0 in range(0, num_tiles, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        # expert of tile t = number of experts whose segment ends at or before t
        expert = tl.sum((tile_end[None, :] <= offs_t[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + offs_t, expert, mask=offs_t < num_tiles)


@triton.jit
def _align_scatter_kernel(ids_ptr, rank_ptr, pad_start_ptr, sorted_ptr, rows_ptr, n_slots, expert_start, num_experts,
                          BLOCK: tl.constexpr, ROWS: tl.constexpr = False):
    """sorted_slots[pad_start[e] + rank] = slot for every slot routed to a local expert; ROWS: also
    slot_rows[slot] = that row (-1 for a slot routed to another rank)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_slots
    e = tl.load(ids_ptr + offs, mask=m, other=0) - expert_start
    here = m & (e >= 0) & (e < num_experts)
    rank = tl.load(rank_ptr + offs, mask=here, other=0)
    start = tl.load(pad_start_ptr + tl.where(here, e, 0), mask=here, other=0)
    tl.store(sorted_ptr + start + rank, offs, mask=here)
    if ROWS:
        tl.store(rows_ptr + offs, tl.where(here, start + rank, -1), mask=m)


def moe_align(
    topk_ids: torch.Tensor, expert_start: int, num_local: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align_rows`` without the slots' rows: (sorted_slots, block_expert)."""
    sorted_slots, block_expert, _ = _align(topk_ids, expert_start, num_local, block_m, False)
    return sorted_slots, block_expert


def moe_align_rows(
    topk_ids: torch.Tensor, expert_start: int, num_local: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by local expert, padding each expert's segment to block_m rows.

    topk_ids [T, k] int32 global expert ids. Returns
    - ``sorted_slots`` int32 [max_rows]: flat slot index t*k + j per padded row, T*k for padding;
    - ``block_expert`` int32 [max_rows / block_m]: the local expert of each row tile, num_local for
      tiles past the last expert's segment (the kernels skip those);
    - ``slot_rows`` int32 [T*k]: each slot's row (the inverse of sorted_slots), -1 for a slot routed to
      another rank's expert (``gather_act_quant(slot_rows=)`` walks the tokens in order with it).
    max_rows = round_up(T*k + num_local*(block_m - 1), block_m) is an upper bound, so no host sync.
    Three small Triton kernels (count with atomics, offsets, scatter); the order of the slots
    inside one expert's segment follows the atomics (a block's slots in order) and may change
    between runs, which changes nothing in the results (rows are independent and written back by
    slot index).
    """
    return _align(topk_ids, expert_start, num_local, block_m, True)


def _align(topk_ids: torch.Tensor, expert_start: int, num_local: int, block_m: int,
           rows: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous(), f"topk_ids {topk_ids.dtype}"
    dev = topk_ids.device
    n_slots = topk_ids.numel()
    max_rows = cdiv(n_slots + num_local * (block_m - 1), block_m) * block_m
    num_tiles = max_rows // block_m
    counts = torch.zeros(num_local, dtype=torch.int32, device=dev)
    rank = torch.empty(n_slots, dtype=torch.int32, device=dev)
    pad_start = torch.empty(num_local, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_tiles, dtype=torch.int32, device=dev)
    sorted_slots = torch.full((max_rows,), n_slots, dtype=torch.int32, device=dev)
    e_pow2 = max(16, next_pow2(num_local))
    count_block = max(16, 8192 // e_pow2)  # (the one-hot: 8192 elements a program)
    _align_count_kernel[(cdiv(n_slots, count_block),)](topk_ids, counts, rank, n_slots, expert_start, num_local,
                                                       BLOCK=count_block, E_POW2=e_pow2, num_warps=4)
    block = 1024
    grid = (cdiv(n_slots, block),)
    _align_offsets_kernel[(1,)](
        counts, pad_start, block_expert, num_local, num_tiles, ALIGN_M=block_m, BLOCK_E=e_pow2, BLOCK_T=64,
    )
    slot_rows = torch.empty(n_slots, dtype=torch.int32, device=dev) if rows else None
    _align_scatter_kernel[grid](topk_ids, rank, pad_start, sorted_slots, slot_rows if rows else sorted_slots, n_slots,
                                expert_start, num_local, BLOCK=block, ROWS=rows)
    return sorted_slots, block_expert, slot_rows


def moe_align_reference(
    topk_ids: torch.Tensor, expert_start: int, num_local: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch ``moe_align`` (stable order inside each expert's segment)."""
    n_slots = topk_ids.numel()
    max_rows = cdiv(n_slots + num_local * (block_m - 1), block_m) * block_m
    key = topk_ids.reshape(-1).long() - expert_start
    key = torch.where((key >= 0) & (key < num_local), key, num_local)
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    sorted_slots = torch.full((max_rows,), n_slots, dtype=torch.int32, device=topk_ids.device)
    for e in range(num_local):
        slots = (key == e).nonzero().reshape(-1)
        start = int(pad_end[e] - padded[e])
        sorted_slots[start:start + slots.numel()] = slots.int()
    tiles = torch.arange(0, max_rows, block_m, device=topk_ids.device)
    return sorted_slots, torch.searchsorted(pad_end, tiles, right=True).int()


def slot_rows_reference(sorted_slots: torch.Tensor, n_slots: int) -> torch.Tensor:
    """Plain-torch ``moe_align_rows``' slot_rows: each slot's row in sorted_slots, -1 where it has none."""
    rows = torch.full((n_slots,), -1, dtype=torch.int32, device=sorted_slots.device)
    valid = sorted_slots < n_slots
    rows[sorted_slots[valid].long()] = torch.arange(sorted_slots.numel(), device=sorted_slots.device,
                                                    dtype=torch.int32)[valid]
    return rows
