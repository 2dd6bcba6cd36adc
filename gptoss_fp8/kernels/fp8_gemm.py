"""Dense FP8 block GEMM with fused bias (Triton): y = (x_fp8 * s_x) @ (W_fp8 * s_W)^T + b.

Layouts (gptoss_fp8.quant.fp8): x_fp8 float8_e4m3fn [M, K] with x_scale float32 [M, ceil(K/128)]
(1x128 groups per token); W float8_e4m3fn [N, K] with scale_inv float32 [ceil(N/128), ceil(K/128)]
(128x128 blocks, partial at the edges); bias [N] (bf16 or fp32) or None; out bf16 [M, N].

Numerics: the K loop steps one scale group (128) at a time; each step's fp8 tensor-core product is
scaled by s_x[row] * s_W[col block] and added to an fp32 accumulator (DeepSeek-V3's "promotion
every 128": Hopper's fp8 MMA accumulates with reduced precision inside one instruction chain, so the
chain is kept to one group). The bias is added in fp32 in the epilogue, then one cast to bf16.
Tail handling: K tails read as zeros (masked loads, or the TMA engine's zero fill), M and N tails
are clamped indices (or zero fill) on load and masked stores, so any M >= 1, N >= 1 and K >= 1
with 16-byte aligned rows (K % 16 == 0) works.

Performance notes (H200, benchmarks/notes/kernels_gemm.md): the weight scale is a scalar per
128-column half and K step, so the per-step rescale is one FMA per accumulator element (with a
per-column scale vector, 128x128 tiles spilled registers and ran at 417 instead of 732 TFLOP/s);
loads go through tensor descriptors (TMA).

Tiles: BLOCK_N <= 128 here (one weight-scale block per tile; 256-wide dense tiles ran at 0.70-0.92x
of the 128-wide ones, notes/kernels_gemm.md, fourth session). The launch is
``KernelConfig.dense_tile`` (kernels/config.py) unless a ``tile`` is given; up to
``KernelConfig.dense_skinny_max_rows`` rows (decode) the skinny split-K kernel of fp8_gemv.py; on sm_90, from
``KernelConfig.dense_gluon_min_rows`` rows, that is the warp-specialized Gluon kernel of
fp8_gemm_ws.py (same contract and numerics). ``fp8_block_mainloop`` is shared with the grouped
expert GEMMs in moe_gemm.py. Not done here: fp8 output, per-tensor scales, transposed operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gptoss_fp8.kernels import fp8_gemm_ws, sm_count
from gptoss_fp8.kernels.act_quant import act_quant
from gptoss_fp8.kernels.config import DEFAULT, GluonTile, KernelConfig, TritonTile
from gptoss_fp8.kernels.pdl import pdl_launch
from gptoss_fp8.quant.fp8 import BLOCK, FP8_DTYPE, block_gemm_reference, cdiv, scale_grid


@triton.jit
def _load_b_tile(b_src, b_row0, b_col0, N_B, k0, K, stride_bn, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, B_TMA: tl.constexpr):
    """[BLOCK_K, WIDTH] fp8 tile of B^T: B rows b_col0 .. b_col0 + WIDTH, K columns k0 .. k0 + BLOCK_K."""
    if B_TMA:
        b = b_src.load([b_row0, k0]).T
    else:
        offs_k = tl.arange(0, BLOCK_K)
        cols = tl.minimum(b_col0 + tl.arange(0, WIDTH), N_B - 1).to(tl.int64)
        b = tl.load(b_src + cols[None, :] * stride_bn + (k0 + offs_k)[:, None], mask=offs_k[:, None] < K - k0, other=0.0)
    return b


@triton.jit
def fp8_block_mainloop(
    a_src, a_row0, a_rows, stride_am, as_ptr, stride_asm,
    b_src, b_row0, b_col0, N_B, stride_bn, bs_ptr, stride_bsn,
    K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, SPLIT_N: tl.constexpr = True,
):
    """sum over K of (A[rows] * s_a) @ (B[b_col0 : b_col0 + BLOCK_N] * s_b)^T in fp32.

    Returns (acc_lo, acc_hi). BLOCK_N = 256 (the MoE gate_up) is computed as two 128-column halves
    (lo, hi), each inside one weight scale block, so the weight scale is one scalar per half and K
    step; BLOCK_N <= 128 gives acc_lo [BLOCK_M, BLOCK_N] (acc_hi is the same tensor, unused), and
    so does BLOCK_N = 256 with SPLIT_N=False: one 256-wide product scaled by a per-column vector.
    b_col0 must be a multiple of min(BLOCK_N, 128): tiles never straddle a weight block.

    A operand: with A_TMA, ``a_src`` is a tensor descriptor over A [rows, K] (block [BLOCK_M,
    BLOCK_K]) and the tile starts at row ``a_row0`` (out-of-range rows and K read as zeros);
    otherwise ``a_src`` points at A and ``a_rows`` [BLOCK_M] (int64, clamped to valid rows) are
    gathered. ``a_rows`` also index the activation scales (as_ptr + row * stride_asm + k block).
    B operand [N_B, K]: with B_TMA a descriptor (block [min(BLOCK_N, 128), BLOCK_K]) read from row
    ``b_row0``, else a pointer (rows clamped to N_B - 1). Weight scales at bs_ptr + (col // 128) *
    stride_bsn + k block. BLOCK_K must equal the group (128).
    """
    offs_k = tl.arange(0, BLOCK_K)
    if not A_TMA:
        a_ptrs = a_src + a_rows[:, None] * stride_am + offs_k[None, :]
    as_ptrs = as_ptr + a_rows * stride_asm
    bs_lo = bs_ptr + (b_col0 // BLOCK_K) * stride_bsn
    if BLOCK_N > BLOCK_K:
        bs_hi = bs_ptr + (tl.minimum(b_col0 + BLOCK_K, N_B - 1) // BLOCK_K) * stride_bsn
    if BLOCK_N > BLOCK_K and SPLIT_N:
        acc_lo = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        acc_hi = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    else:
        acc_lo = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        if A_TMA:
            a = a_src.load([a_row0, k0])
        else:
            a = tl.load(a_ptrs + k0, mask=offs_k[None, :] < K - k0, other=0.0)
        s_a = tl.load(as_ptrs + kb)
        if BLOCK_N > BLOCK_K and SPLIT_N:
            b_lo = _load_b_tile(b_src, b_row0, b_col0, N_B, k0, K, stride_bn, BLOCK_K, BLOCK_K, B_TMA)
            b_hi = _load_b_tile(b_src, b_row0 + BLOCK_K, b_col0 + BLOCK_K, N_B, k0, K, stride_bn, BLOCK_K, BLOCK_K, B_TMA)
            acc_lo += tl.dot(a, b_lo) * (s_a * tl.load(bs_lo + kb))[:, None]
            acc_hi += tl.dot(a, b_hi) * (s_a * tl.load(bs_hi + kb))[:, None]
        elif BLOCK_N > BLOCK_K:
            b = _load_b_tile(b_src, b_row0, b_col0, N_B, k0, K, stride_bn, BLOCK_N, BLOCK_K, B_TMA)
            s_b = tl.where(tl.arange(0, BLOCK_N) < BLOCK_K, tl.load(bs_lo + kb), tl.load(bs_hi + kb))
            acc_lo += tl.dot(a, b) * s_a[:, None] * s_b[None, :]
        else:
            b = _load_b_tile(b_src, b_row0, b_col0, N_B, k0, K, stride_bn, BLOCK_N, BLOCK_K, B_TMA)
            acc_lo += tl.dot(a, b) * (s_a * tl.load(bs_lo + kb))[:, None]
    if BLOCK_N > BLOCK_K and SPLIT_N:
        return acc_lo, acc_hi
    else:
        return acc_lo, acc_lo


@triton.jit
def store_rows(c_ptr, rows, row_mask, acc, col0, N, stride_cm, bias_ptr, HAS_BIAS: tl.constexpr, WIDTH: tl.constexpr,
               r_ptr=None, HAS_RES: tl.constexpr = False):
    """c[rows, col0 : col0 + WIDTH] = acc (+ bias[cols]) cast to c's dtype; masked by row_mask and N. HAS_RES: that
    rounded to bf16, plus r[rows, cols] (bf16, c's strides), rounded again (torch's bf16 ``r + delta``)."""
    offs_n = col0 + tl.arange(0, WIDTH)
    n_mask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    offs = rows[:, None] * stride_cm + offs_n[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        acc = acc.to(tl.bfloat16).to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemm_kernel(
    a_src, as_ptr, b_src, bs_ptr, bias_ptr, c_ptr,
    M, N, K, num_progs,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    HAS_BIAS: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr = False, r_ptr=None, HAS_RES: tl.constexpr = False,
):
    # num_progs programs walk the tiles (persistent when it is the SM count); FLATTEN fuses the
    # tile and K loops into one software-pipelined loop (the next tile's loads overlap this
    # tile's epilogue). Grouped order:
    # GROUP_M row tiles sweep the N tiles together, so their A rows and the weight tiles they share
    # stay in L2.
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, num_progs, flatten=FLATTEN):
        group = tile // per_group
        first_m = group * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_rows
        pid_n = (tile % per_group) // group_rows

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        a_rows = (offs_m % M).to(tl.int64)
        acc_lo, acc_hi = fp8_block_mainloop(
            a_src, pid_m * BLOCK_M, a_rows, stride_am, as_ptr, stride_asm,
            b_src, pid_n * BLOCK_N, pid_n * BLOCK_N, N, stride_bn, bs_ptr, stride_bsn,
            K, BLOCK_M, BLOCK_N, BLOCK_K, TMA, TMA,
        )
        rows = offs_m.to(tl.int64)
        row_mask = offs_m < M
        store_rows(c_ptr, rows, row_mask, acc_lo, pid_n * BLOCK_N, N, stride_cm, bias_ptr, HAS_BIAS, BLOCK_N, r_ptr,
                   HAS_RES)


def _checked(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
             bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_gemm``'s operand rules (``fp8_gemm_q8``'s too); returns x and its scales as [M, K] / [M, K / 128]."""
    assert x_fp8.dtype == FP8_DTYPE and w_fp8.dtype == FP8_DTYPE, f"fp8 operands expected, got {x_fp8.dtype}, {w_fp8.dtype}"
    assert w_fp8.dim() == 2, f"weight must be [N, K], got {tuple(w_fp8.shape)}"
    n, k = w_fp8.shape
    assert x_fp8.shape[-1] == k, f"x {tuple(x_fp8.shape)} does not match weight {tuple(w_fp8.shape)}"
    assert k % 16 == 0, f"K={k} must be a multiple of 16 (16-byte rows)"
    a = x_fp8.reshape(-1, k)
    a_s = x_scale.reshape(-1, x_scale.shape[-1])
    assert a_s.shape == (a.shape[0], cdiv(k, BLOCK)), f"x_scale {tuple(x_scale.shape)} does not fit x {tuple(x_fp8.shape)}"
    assert a_s.dtype == torch.float32 and w_scale_inv.dtype == torch.float32, "scales must be float32"
    assert w_scale_inv.shape == scale_grid(n, k), \
        f"w_scale_inv {tuple(w_scale_inv.shape)} does not fit weight {tuple(w_fp8.shape)}"
    assert a.stride(-1) == 1 and a_s.stride(-1) == 1, "x and x_scale need a contiguous last dimension"
    assert w_fp8.is_contiguous() and w_scale_inv.is_contiguous(), "weight and its scales must be contiguous"
    if bias is not None:
        assert bias.shape == (n,) and bias.dtype in (torch.bfloat16, torch.float32), f"bias {tuple(bias.shape)} {bias.dtype}"
        assert bias.is_contiguous()
    return a, a_s


def fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
    tile: TritonTile | GluonTile | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 block GEMM with fused bias.

    x_fp8 float8_e4m3fn [..., K] (last dim contiguous) with x_scale float32 [..., ceil(K/128)];
    w_fp8 float8_e4m3fn [N, K] contiguous with w_scale_inv float32 [ceil(N/128), ceil(K/128)];
    bias [N] bf16/fp32 or None; ``out`` an optional contiguous [..., N] tensor to write into.
    Returns ``out_dtype`` [..., N]. Agrees with
    ``gptoss_fp8.quant.fp8.block_gemm_reference`` up to fp32 summation order.
    ``config``: the tuning (None: kernels/config.DEFAULT); ``tile``: this launch instead of
    ``config.dense_tile``'s choice (a ``GluonTile`` forces the Gluon kernel).
    ``residual`` (bf16 [..., N] contiguous, bf16 out, not overlapping ``out``): returns residual + the product
    + bias rounded to bf16, rounded again (``spec.add_rms_norm``'s x + delta, ``fp8_gemm_reference(residual=)``):
    added in the epilogue of the Triton kernel and of the Gluon wide tiles (``residual_fused``), after the
    GEMM elsewhere (the skinny kernel, the Gluon 128 x 128 tile).
    """
    a, a_s = _checked(x_fp8, x_scale, w_fp8, w_scale_inv, bias)
    n, k = w_fp8.shape
    lead = x_fp8.shape[:-1]
    m = a.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    else:
        assert out.shape == (*lead, n) and out.dtype == out_dtype and out.is_contiguous(), (
            f"out {tuple(out.shape)} {out.dtype} is not a contiguous {(*lead, n)} {out_dtype}"
        )
        out = out.view(m, n)
    res = None
    if residual is not None:
        assert out_dtype == torch.bfloat16 and residual.dtype == torch.bfloat16 and residual.shape == (*lead, n), (
            f"residual {tuple(residual.shape)} {residual.dtype}: a bf16 {(*lead, n)} with bf16 out")
        assert residual.is_contiguous(), "residual must be contiguous"
        res = residual.view(m, n)
        assert res.data_ptr() != out.data_ptr() or m == 0, "residual and out must not overlap"
    if m == 0:
        return out.reshape(*lead, n)
    cfg = config or DEFAULT
    if tile is None and cfg.dense_skinny_max_rows is not None and m <= cfg.dense_skinny_max_rows:
        from gptoss_fp8.kernels.fp8_gemv import fp8_gemm_skinny, skinny_tile

        fp8_gemm_skinny(a, a_s, w_fp8, w_scale_inv, bias, out, skinny_tile(m, n, k, sm_count(x_fp8.device)),
                        pdl=pdl_launch(cfg, m, x_fp8.device))
        return _plus(out, res).reshape(*lead, n)
    ws = out_dtype == torch.bfloat16 and n % 8 == 0 and _tma_ok(a, w_fp8, out, cfg)
    tile = tile or cfg.dense_tile(m, n, k, ws)
    if isinstance(tile, GluonTile):
        assert ws, ("a GluonTile needs the Gluon kernel's conditions: config.gluon, an sm_90 GPU, triton with "
                    "Gluon, bf16 out, N % 8 == 0, 16-byte aligned x rows, weight and out")
        bm, bn = tile.block_m or fp8_gemm_ws.BM, tile.block_n or fp8_gemm_ws.BN
        fused = res is not None and fp8_gemm_ws.residual_fused(bm, bn, tile.stages, tile.stage_scales, k)
        _ws_launch(a, a_s, w_fp8, w_scale_inv, bias, out, tile, residual=res if fused else None)
        return (out if fused else _plus(out, res)).reshape(*lead, n)
    bm, bn = tile.block_m, tile.block_n
    assert bn in (16, 32, 64, 128), f"BLOCK_N={bn}: tiles must lie inside one 128-column weight block"
    num_tiles = cdiv(m, bm) * cdiv(n, bn)
    # persistent: n programs per SM, each walking tiles
    num_progs = min(num_tiles, tile.persistent * sm_count(x_fp8.device)) if tile.persistent else num_tiles
    tma = tile.tma and a.data_ptr() % 16 == 0 and w_fp8.data_ptr() % 16 == 0 and a.stride(0) % 16 == 0
    if tma:
        a_src = TensorDescriptor.from_tensor(a, [bm, BLOCK])
        b_src = TensorDescriptor.from_tensor(w_fp8, [bn, BLOCK])
    else:
        a_src, b_src = a, w_fp8
    _fp8_gemm_kernel[(num_progs,)](
        a_src, a_s, b_src, w_scale_inv, bias if bias is not None else out, out,
        m, n, k, num_progs,
        a.stride(0), a_s.stride(0), w_fp8.stride(0), w_scale_inv.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, TMA=tma, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, GROUP_M=tile.group_m,
        FLATTEN=tile.flatten, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **({} if res is None else dict(r_ptr=res, HAS_RES=True)),
    )
    return out.reshape(*lead, n)


def _ws_launch(a, a_s, w, w_scale_inv, bias, out, tile: GluonTile, **extra) -> None:
    """``fp8_gemm_ws.ws_fp8_gemm`` on a GluonTile's launch (its shape, ring, order and options), ``extra`` its
    epilogue's (residual, q_fp8)."""
    fp8_gemm_ws.check_thread_release(tile.thread_release, False, "the dense GEMM")
    fp8_gemm_ws.ws_fp8_gemm(a, a_s, w, w_scale_inv, bias, out, stages=tile.stages, group_m=tile.group_m,
                            block_m=tile.block_m or fp8_gemm_ws.BM, block_n=tile.block_n or fp8_gemm_ws.BN,
                            balance=tile.balance, promote=tile.promote, turns=tile.turns,
                            stage_scales=tile.stage_scales, narrow=tile.narrow, **extra)


def _tma_ok(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, cfg: KernelConfig) -> bool:
    """The Gluon kernel's TMA bases and rows (x rows, weight, out 16-byte aligned; None: one torch allocates) on a
    device it runs on."""
    return (a.data_ptr() % 16 == 0 and a.stride(0) % 16 == 0 and w.data_ptr() % 16 == 0
            and (out is None or out.data_ptr() % 16 == 0) and cfg.gluon_on(a.device))


def q8_in_epilogue(m: int, n: int, k: int, q_cols: int, config: KernelConfig | None = None,
                   gluon_ok: bool = False) -> bool:
    """Whether ``fp8_gemm_q8`` of an [m, k] x [n, k] call quantizes Q in the GEMM's epilogue: its default launch is
    the Gluon 128 x 256 tile (``gluon_ok``: the Gluon kernel can take the call) and Q's q_cols columns are whole
    tiles of it (a multiple of 256, below n, n - q_cols a multiple of 8)."""
    cfg = config or DEFAULT
    if cfg.dense_skinny_max_rows is not None and m <= cfg.dense_skinny_max_rows:
        return False
    tile = cfg.dense_tile(m, n, k, gluon_ok)
    return (isinstance(tile, GluonTile) and (tile.block_m or fp8_gemm_ws.BM, tile.block_n) == (fp8_gemm_ws.BM, fp8_gemm_ws.WIDE)
            and 0 < q_cols < n and q_cols % fp8_gemm_ws.WIDE == 0 and (n - q_cols) % 8 == 0)


def fp8_gemm_q8(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                bias: torch.Tensor | None, q_cols: int, rope: tuple[torch.Tensor, torch.Tensor],
                config: KernelConfig | None = None, head_dim: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp8_gemm`` of x [M, K] whose first q_cols output columns are Q's heads (the full layers' q / k / v GEMM
    under ``--attention fp8``) -> (q8 e4m3 [M, H, D], qs fp32 [H, ceil(M / 64)], rest bf16 [M, N - q_cols]; D =
    head_dim, H = q_cols / D): q8, qs = ``attn_quant.quantize_qk(y[:, :q_cols] as heads, rope=rope)`` (rotated at
    positions 0.. by rope = (cos, sin) fp32 [>= M, D / 2], contiguous), rest = y[:, q_cols:], y = ``fp8_gemm``'s
    bf16 product, bit for bit. Where ``q8_in_epilogue`` holds (D = 64), in one launch: the Gluon 128 x 256 tile rotates and
    quantizes Q's tiles in its epilogue (``fp8_gemm_ws.ws_fp8_gemm(q_fp8=)``), Q's bf16 columns never written
    (~0.27 GB a full layer at 32768 tokens, and their quantization pass's read); elsewhere the GEMM, then
    ``quantize_qk`` (rest a view of the GEMM's output)."""
    from gptoss_fp8.kernels import attn_quant

    cfg = config or DEFAULT
    n, k = w_fp8.shape
    m = x_fp8.shape[0]
    assert x_fp8.dim() == 2 and q_cols % head_dim == 0, f"x {tuple(x_fp8.shape)}, q_cols {q_cols}, head_dim {head_dim}"
    heads = q_cols // head_dim
    if m and head_dim == fp8_gemm_ws.Q_HEAD and q8_in_epilogue(m, n, k, q_cols, cfg, _tma_ok(x_fp8, w_fp8, None, cfg)):
        _checked(x_fp8, x_scale, w_fp8, w_scale_inv, bias)  # (fp8_gemm's rules: the other branch checks them there)
        tile = cfg.dense_tile(m, n, k, True)
        rest = torch.empty((m, n - q_cols), dtype=torch.bfloat16, device=x_fp8.device)
        q8 = torch.empty((m, heads, fp8_gemm_ws.Q_HEAD), dtype=FP8_DTYPE, device=x_fp8.device)
        qs = torch.empty((heads, cdiv(m, fp8_gemm_ws.Q_HEAD)), dtype=torch.float32, device=x_fp8.device)
        _ws_launch(x_fp8, x_scale, w_fp8, w_scale_inv, bias, rest, tile,
                   q_fp8=(q8.view(m, q_cols), qs, *rope))
        return q8, qs, rest
    y = fp8_gemm(x_fp8, x_scale, w_fp8, w_scale_inv, bias, config=cfg)
    q8, qs = attn_quant.quantize_qk(y[:, :q_cols].view(m, heads, head_dim), rope=rope)
    return q8, qs, y[:, q_cols:]


def residual_in_epilogue(m: int, n: int, k: int, config: KernelConfig | None = None, gluon_ok: bool = False) -> bool:
    """Whether ``fp8_gemm(residual=)`` of an [m, k] x [n, k] call on its default launch adds the residual in the
    GEMM's epilogue (``gluon_ok``: the Gluon kernel can take the call): the Triton tiles and the Gluon wide ones
    (``fp8_gemm_ws.residual_fused``); not the skinny decode kernel or the Gluon 128 x 128 tile (there the add is
    a pass of its own)."""
    cfg = config or DEFAULT
    if cfg.dense_skinny_max_rows is not None and m <= cfg.dense_skinny_max_rows:
        return False
    tile = cfg.dense_tile(m, n, k, gluon_ok)
    if isinstance(tile, GluonTile):
        return fp8_gemm_ws.residual_fused(tile.block_m or fp8_gemm_ws.BM, tile.block_n or fp8_gemm_ws.BN, tile.stages,
                                          tile.stage_scales, k)
    return True


def _plus(out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """out <- residual + out in place (bf16: torch's rounding, the fused epilogues' too); out without one."""
    return out if residual is None else out.add_(residual)


def fp8_linear(
    x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """bf16 [..., K] -> bf16 [..., N]: per-token 1x128 quantization, then the block GEMM + bias."""
    x_fp8, x_scale = act_quant(x)
    return fp8_gemm(x_fp8, x_scale, w_fp8, w_scale_inv, bias,
                    out_dtype=x.dtype if x.dtype != torch.float32 else torch.bfloat16, config=config)


def fp8_gemm_reference(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain-torch specification (quant/fp8.py), accepting [..., K] activations; ``residual`` (bf16 [..., N],
    bf16 out): residual + the result, torch's bf16 add (``spec.add_rms_norm``'s x + delta)."""
    k = x_fp8.shape[-1]
    y = block_gemm_reference(
        x_fp8.reshape(-1, k), x_scale.reshape(-1, x_scale.shape[-1]), w_fp8, w_scale_inv, bias, out_dtype
    )
    y = y.reshape(*x_fp8.shape[:-1], w_fp8.shape[0])
    return y if residual is None else residual + y
