"""Decode-shaped attention with sinks: a few new queries against a long KV cache, split-KV (Triton).

KV cache layout (contiguous per sequence, token-major, the layout prefill's k/v rows already have):
    k_cache, v_cache [B, L_max, Hkv, D] bf16; row t of sequence b at [b, t]; the last dim contiguous,
        the other strides free (a slice of a bigger cache works);
    kv_lens [B] int32: valid tokens of sequence b, the NQ new ones included. The caller writes the
        new (already rotated) k/v rows at kv_lens[b]-NQ .. kv_lens[b]-1 before the call, so
        kv_lens[b] >= NQ is required;
    q [B, NQ, Hq, D] bf16: new query t of sequence b sits at position kv_lens[b] - NQ + t;
    out [B, NQ, Hq, D] bf16.
Visibility as in prefill: key j is visible to a query at position i iff j <= i and i - window < j.

Ring caches (``ring=True``, a sliding-window layer's cache of L_max = window rows, position p in
row p % L_max): one new query per sequence (NQ = 1) sees every key the ring holds, rows
0 .. min(kv_lens[b], L_max) - 1 (once the ring is full those are exactly positions
kv_lens[b] - L_max .. kv_lens[b] - 1, all inside the window; before, positions 0 .. kv_lens[b] - 1
in rows of the same index). The kernel runs as a full-causal call with kv_lens capped at L_max: the
order of the keys in the ring is not position order, which the softmax does not care about (only
the fp32 summation order differs). kv_lens stays the sequence length, so the caller passes the
same kv_lens tensor to every layer (no per-layer min on the host or the device).

The kernel packs the GROUP = Hq / Hkv query heads that share a KV head, for all NQ new tokens, into
the rows of one tile (row r = t * GROUP + g), so each KV tile is read once per KV head, not once per
query head. The tile's key range is split into num_splits chunks of whole BLOCK_N blocks, one program
each. Every split starts its online softmax at m = sink (per row); split 0 alone starts with l = 1,
the others with l = 0, so the sink is counted once. Splits write (acc, m, l) in fp32 and are merged:
M = max m_s, o = sum acc_s 2^(m_s-M) / sum l_s 2^(m_s-M). A split with no visible key leaves
(0, sink, 0) and contributes nothing. By default the last split of each tile to finish does the
merge (an arrival counter per tile, the split-K semaphore pattern: no second launch); with
fused_merge=False a second small kernel does it, its rows spread over the SMs. A one-wave call
(batch 1 against a long full-causal cache) takes the second form by default, with ~2 programs per
SM of 64-key tiles (``one_wave_splits``): the fused merge runs serially in one program per tile
and grows with the split count. With one split the kernel writes the output
directly. The splits' partials are fp32 [num_splits, B, NQ, Hq, D] (+ m, l): at batch 1 and 32768
cached tokens, 17 splits x 64 heads x 64 x 4 B = 0.3 MB beside 67 MB of KV.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gptoss_fp8 import spec
from gptoss_fp8.kernels import arrival_counters, sm_count
from gptoss_fp8.kernels.attention import LOG2E
from gptoss_fp8.kernels.config import CPU_DECODE_TILE, DEFAULT, DecodeTile, KernelConfig
from gptoss_fp8.kernels.pdl import launch_kwargs, pdl_launch, pdl_wait
from gptoss_fp8.quant.fp8 import cdiv, next_pow2


@triton.jit
def _merge_rows(
    Part, PartM, PartL,
    srow, row_ok,  # [ROWS] partial row of split 0, validity
    stride_s, num_splits,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,  # splits loaded per step, as one [MERGE_CHUNK, ROWS, HEAD_DIM] tile
):
    """o = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), M = max_s m_s, in one online pass over
    chunks of splits (a chunk's loads are independent: one memory round trip per chunk, not per split).
    Partials are read through L2 (.cg): other programs of this launch wrote them."""
    offs_c = tl.arange(0, MERGE_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    m_run = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([ROWS], dtype=tl.float32)
    o_run = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, num_splits, MERGE_CHUNK):
        s_ok = (s0 + offs_c) < num_splits
        prow = (s0 + offs_c)[:, None] * stride_s + srow[None, :]  # [MERGE_CHUNK, ROWS]
        ok = s_ok[:, None] & row_ok[None, :]
        m_c = tl.load(PartM + prow, mask=ok, other=0.0, cache_modifier=".cg")
        m_c = tl.where(s_ok[:, None], m_c, float("-inf"))  # absent splits weigh 0
        l_c = tl.load(PartL + prow, mask=ok, other=0.0, cache_modifier=".cg")
        a_c = tl.load(Part + prow[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok[:, :, None], other=0.0,
                      cache_modifier=".cg")
        # split 0 is in the first chunk and has m >= sink > -inf, so m_new is finite from then on
        m_new = tl.maximum(m_run, tl.max(m_c, 0))
        scale = tl.math.exp2(m_run - m_new)
        w = tl.math.exp2(m_c - m_new[None, :])  # [MERGE_CHUNK, ROWS]
        l_run = l_run * scale + tl.sum(w * l_c, 0)
        o_run = o_run * scale[:, None] + tl.sum(a_c * w[:, :, None], 0)
        m_run = m_new
    # split 0 carries l >= 2^(sink - M) > 0 for every valid row
    return o_run / tl.where(row_ok, l_run, 1.0)[:, None]


@triton.jit
def _attn_decode_kernel(
    Q, Kc, Vc, Sinks, KvLens, Out, Part, PartM, PartL, Counter,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    qk_scale, window, chunk, kv_cap,
    NQ, HQ, B,
    NUM_M: tl.constexpr,  # row tiles per KV head: cdiv(NQ * GROUP, BLOCK_M)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # True: write fp32 partials for a merge
    FUSED_MERGE: tl.constexpr,  # True: the last split of each tile merges; False: _attn_merge_kernel
    MERGE_CHUNK: tl.constexpr,  # 2 splits x 16 rows: larger merge tiles cost the main loop registers
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pid_s = tl.program_id(0)
    pid_hm = tl.program_id(1)
    pid_b = tl.program_id(2)
    b64 = pid_b.to(tl.int64)  # B * L_max * Hkv * D can pass 2^31
    kv_h = pid_hm // NUM_M
    pid_m = pid_hm % NUM_M
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < NQ * GROUP
    t = rows // GROUP
    h = kv_h * GROUP + rows % GROUP
    sink = tl.load(Sinks + h, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # a weight: before the wait
    pdl_wait(PDL)
    kv_len = tl.minimum(tl.load(KvLens + pid_b), kv_cap)  # kv_cap: a ring's rows (else 2^30)
    qpos = kv_len - NQ + t  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q_ptrs = Q + b64 * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys any row of this tile may see: [lo, hi), lo aligned down to BLOCK_N; this split's share.
    t_min = (pid_m * BLOCK_M) // GROUP
    t_max = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, NQ - 1)
    hi = kv_len - NQ + t_max + 1
    lo = tl.maximum(kv_len - NQ + t_min - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    s_lo = lo + pid_s * chunk
    s_hi = tl.minimum(s_lo + chunk, hi)

    m_i = sink
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + (pid_s == 0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    k_base = Kc + b64 * stride_kb + kv_h * stride_kh
    v_base = Vc + b64 * stride_vb + kv_h * stride_vh
    for start_n in range(s_lo, s_hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < s_hi
        kt = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        qk = tl.dot(q, kt) * qk_scale  # [BLOCK_M, BLOCK_N]
        rel = qpos[:, None] - cols[None, :]
        qk = tl.where((rel >= 0) & (rel < window), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if UPCAST:
            acc = tl.dot(p, v.to(tl.float32), acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    if SPLIT:
        # partials [S, B, NQ, HQ, (D)], contiguous
        prow = ((pid_s * B + pid_b) * NQ + t) * HQ + h  # [BLOCK_M]
        tl.store(Part + prow[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(PartM + prow, m_i, mask=row_ok)
        tl.store(PartL + prow, l_i, mask=row_ok)
        if FUSED_MERGE:
            # The last split of this tile to finish merges all of them (no second launch). The
            # barrier + one acq_rel atomic is the split-K semaphore pattern: every thread's partial
            # stores happen before the count, and the last program's .cg loads (L2) see them all.
            tile = pid_b * tl.num_programs(1) + pid_hm
            tl.debug_barrier()
            arrived = tl.atomic_add(Counter + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(0) - 1:
                tl.store(Counter + tile, 0)  # ready for the next call
                srow = (pid_b * NQ + t) * HQ + h  # row of split 0; split s adds s * B * NQ * HQ
                out = _merge_rows(Part, PartM, PartL, srow, row_ok, B * NQ * HQ, tl.num_programs(0),
                                  HEAD_DIM, BLOCK_M, MERGE_CHUNK)
                o_ptrs = Out + b64 * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :]
                tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        out = acc / l_i[:, None]
        o_ptrs = Out + b64 * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attn_merge_kernel(
    Part, PartM, PartL, Out,
    R,  # rows = B * NQ * HQ; Out is [R, HEAD_DIM] contiguous
    NUM_SPLITS,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    out = _merge_rows(Part, PartM, PartL, rows, row_ok, R, NUM_SPLITS, HEAD_DIM, BLOCK_R, MERGE_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(Out + rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])


_NO_WINDOW = 1 << 30


def one_wave_splits(tiles: int, l_max: int, windowed: bool, sms: int, config: KernelConfig | None = None) -> int | None:
    """Splits per row tile for a one-wave call (16+ SMs per row tile) against a long full-causal
    cache, ~``decode_one_wave_programs_per_sm`` programs per SM with at least 4 key blocks of
    ``decode_one_wave`` each: fewer splits where the cache is too short for that many, down to
    3/4 of them; None when the call is not one (then the ``decode`` tile runs). At 8192 cached
    tokens (129 blocks of 64: 32 of 33 splits) the 20b's batch-1 step took 2035.5 against 2056.3 us
    on the ``decode`` tile (benchmarks/ab_decode.py "one-wave-8k", H200, fourteenth session)."""
    cfg = config or DEFAULT
    want = cdiv(cfg.decode_one_wave_programs_per_sm * sms, tiles)
    splits = min(want, cdiv(l_max, cfg.decode_one_wave.block_n) // 4)
    if windowed or tiles * 16 > sms or 4 * splits < 3 * want:
        return None
    return splits


def _merge_chunk(rows: int, head_dim: int, values: int) -> int:
    """Splits per merge step: a [chunk, rows, head_dim] fp32 tile of about `values` values."""
    return max(1, values // (rows * head_dim))


def attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    sinks: torch.Tensor,
    sliding_window: int = 0,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    config: KernelConfig | None = None,
    block_m: int | None = None,
    fused_merge: bool | None = None,
    merge_chunk: int | None = None,
    tile: DecodeTile | None = None,
    ring: bool = False,
) -> torch.Tensor:
    """Attention with sinks of NQ new queries per sequence against a KV cache (layout: module doc).

    q [B, NQ, Hq, D] bf16, k_cache/v_cache [B, L_max, Hkv, D] bf16 (last dim contiguous),
    kv_lens int32 [B] (>= NQ, new tokens included), sinks [Hq]. sliding_window 0 = full causal.
    num_splits: KV splits per (sequence, KV head, row tile); None picks enough to fill the GPU.
    fused_merge: True: the last split of each tile merges them (one launch; uses a per-device
    counter buffer that the kernel leaves zeroed, so calls on one device must not run concurrently
    on different streams); False: a second small merge kernel. None (default): True, except for a
    one-wave call (few row tiles, e.g. batch 1) against a long full-causal cache on a GPU with
    tile and num_splits left to the launcher: ``config.decode_one_wave``, ~2 programs per SM,
    separate merge. ``config``: the tuning (None: kernels/config.DEFAULT); ``tile``: this launch's
    (BLOCK_N, warps, stages) instead of ``config.decode``.
    merge_chunk: splits the fused merge loads per step (a power of two); None: 2048 values per step.
    (All splits in one step, tried at batch 1 where the launch is one wave: no faster; notes.)
    ring: the cache is a ring of L_max rows (module doc): NQ must be 1 and sliding_window 0 or
    >= L_max (every held row is visible); kv_lens are the sequences' lengths, capped at L_max here.
    No host synchronisation (graph-capturable): every launch parameter follows from shapes.
    Launched with programmatic dependent launch (kernels/pdl.py) when ``config.pdl_max_rows`` admits
    B * NQ query rows. Returns out [B, NQ, Hq, D] bf16.
    """
    assert q.dim() == 4, f"q {q.shape}: want [B, NQ, Hq, D]"
    B, NQ, Hq, D = q.shape
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, f"k_cache {k_cache.shape} v_cache {v_cache.shape}"
    assert k_cache.shape[0] == B and k_cache.shape[3] == D, f"q {q.shape} k_cache {k_cache.shape}"
    L_max, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert Hq % Hkv == 0, f"{Hq} query heads not a multiple of {Hkv} kv heads"
    assert D in (16, 32, 64, 128, 256), f"head_dim {D} must be a power of two in 16..256"
    assert 1 <= NQ <= L_max, f"{NQ} new queries against a cache of {L_max} rows"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.dtype == torch.bfloat16, f"{name} dtype {t.dtype}, want bfloat16"
        assert t.stride(-1) == 1, f"{name} last dim not contiguous (strides {t.stride()})"
        assert t.device == q.device, f"{name} on {t.device}, q on {q.device}"
    assert kv_lens.shape == (B,) and kv_lens.dtype == torch.int32 and kv_lens.device == q.device, (
        f"kv_lens {kv_lens.dtype} {kv_lens.shape} on {kv_lens.device}: want int32 [{B}] on {q.device}"
    )
    assert sinks.shape == (Hq,) and sinks.is_floating_point() and sinks.device == q.device, f"sinks {sinks.shape}"
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    G = Hq // Hkv
    rows = NQ * G
    on_gpu = q.device.type == "cuda"
    BLOCK_M = block_m or min(64 if on_gpu else 32, max(16, next_pow2(rows)))
    num_m = cdiv(rows, BLOCK_M)
    window = sliding_window if 0 < sliding_window < L_max else _NO_WINDOW
    if ring:
        assert NQ == 1 and window == _NO_WINDOW, (
            f"a ring cache takes one new query (got {NQ}) and a window >= its {L_max} rows (got {sliding_window})")
    kv_cap = L_max if ring else _NO_WINDOW
    cfg = config or DEFAULT
    pdl = pdl_launch(cfg, B * NQ, q.device)
    if on_gpu and tile is None and num_splits is None and fused_merge is None:
        splits = one_wave_splits(B * Hkv * num_m, L_max, window != _NO_WINDOW, sm_count(q.device), cfg)
        if splits:
            tile, num_splits, fused_merge = cfg.decode_one_wave, splits, False
    fused_merge = True if fused_merge is None else fused_merge
    tile = tile or (cfg.decode if on_gpu else CPU_DECODE_TILE)
    BLOCK_N, num_warps, num_stages = tile.block_n, tile.num_warps, tile.num_stages
    # Widest key range one row tile can need (lo is aligned down, hence the extra block).
    span = L_max if window == _NO_WINDOW else min(L_max, window + NQ - 1 + BLOCK_N)
    blocks = cdiv(span, BLOCK_N)
    if num_splits is None:
        # At least one program per SM, and at least 4 splits (long KV loops per program lose to
        # shorter ones with more loads in flight; measured); every split keeps >= 4 blocks.
        want = max(cdiv(sm_count(q.device), B * Hkv * num_m), 4)
        num_splits = max(1, min(want, cdiv(blocks, 4)))
    num_splits = max(1, min(num_splits, blocks))
    chunk = cdiv(blocks, num_splits) * BLOCK_N
    num_splits = cdiv(span, chunk)  # no empty trailing splits

    out = torch.empty((B, NQ, Hq, D), dtype=q.dtype, device=q.device)
    split = num_splits > 1
    if split:
        part = torch.empty((num_splits, B, NQ, Hq, D), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_splits, B, NQ, Hq), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part = part_m = part_l = out  # unused
    fused = split and fused_merge
    if merge_chunk is None:
        merge_chunk = _merge_chunk(BLOCK_M, D, 2048)
    assert merge_chunk >= 1 and merge_chunk & (merge_chunk - 1) == 0, f"merge_chunk {merge_chunk}: want a power of two"
    counter = arrival_counters(q.device, B * Hkv * num_m) if fused else kv_lens  # unused unless fused
    grid = (num_splits, Hkv * num_m, B)
    _attn_decode_kernel[grid](
        q, k_cache, v_cache, sinks, kv_lens, out, part, part_m, part_l, counter,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        sm_scale * LOG2E, window, chunk, kv_cap,
        NQ, Hq, B,
        NUM_M=num_m, GROUP=G, HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLIT=split,
        FUSED_MERGE=fused, MERGE_CHUNK=merge_chunk, UPCAST=not on_gpu, PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **launch_kwargs(pdl),
    )
    if split and not fused:
        R = B * NQ * Hq
        # rows per program: enough programs to spread the merge over the SMs (2 rows each at batch 1)
        BLOCK_R = min(16, max(2, next_pow2(cdiv(R, sm_count(q.device)))))
        _attn_merge_kernel[(cdiv(R, BLOCK_R),)](
            part, part_m, part_l, out, R, num_splits,
            HEAD_DIM=D, BLOCK_R=BLOCK_R, MERGE_CHUNK=_merge_chunk(BLOCK_R, D, 8192), PDL=pdl, num_warps=4,
            **launch_kwargs(pdl),
        )
    return out


def attention_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    sinks: torch.Tensor,
    sliding_window: int = 0,
    sm_scale: float | None = None,
    ring: bool = False,
) -> torch.Tensor:
    """``attention_decode``'s contract, sequence by sequence with ``spec.attention`` in fp32 (a
    ring: its min(n, L_max) held rows, all visible)."""
    B, NQ = q.shape[:2]
    out = torch.empty_like(q)
    for b, n in enumerate(kv_lens.tolist()):
        if ring:
            n, sliding_window = min(n, k_cache.shape[1]), 0
        out[b] = spec.attention(q[b], k_cache[b, :n], v_cache[b, :n], sinks, sm_scale, sliding_window,
                                q_offset=n - NQ, dtype=torch.float32)
    return out
