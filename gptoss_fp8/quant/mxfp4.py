"""MXFP4 (OCP microscaling, e2m1 values + e8m0 scales) codec and the direct MXFP4 -> FP8 path.

Byte layout (gpt-oss checkpoints)
---------------------------------
* ``blocks`` uint8 [..., N, G, 16]: 32 e2m1 values per group along the last (input) dimension,
  two per byte, LOW nibble = even element, HIGH nibble = odd element. K = 32 * G.
* ``scales`` uint8 [..., N, G]: one e8m0 exponent per group, value 2^(s - 127); 255 is NaN in the
  OCP MX spec and is rejected.
* e2m1 nibble -> value: ``[+0, +.5, +1, +1.5, +2, +3, +4, +6, -0, -.5, -1, -1.5, -2, -3, -4, -6]``.
* Decoded weight [..., N, K] = e2m1(nibble) * 2^(s - 127).

Direct path to FP8 (no float intermediates)
-------------------------------------------
For a 128x128 block in ``pow2`` mode the scale is 2^k with k = (largest value exponent in the
block) - 8 (see quant/fp8.py: amax = m * 2^e with m in {1, 1.5} fits under 448 = 1.75 * 2^8).
Each group then needs a shift d = s - 127 - k, and every byte of the group maps to two e4m3 bytes
by a table ``T[byte, d]`` (uint16, low byte = even element). Every value of a group is exact when
d >= -8 (the smallest e4m3 subnormal is 2^-9); groups with smaller d are rounded (RNE, as a float
cast would) and counted in the exactness statistics. The result is bit-identical to
``quantize_weight_blocks(decode_mxfp4(...), "pow2")``, which tests check on random inputs.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from gptoss_fp8.quant.fp8 import BLOCK, FP8_DTYPE, cdiv, to_fp8_saturating

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
E8M0_NAN = 255
VALUES_PER_GROUP = 32
BYTES_PER_GROUP = 16

# Exponent of each e2m1 magnitude code 0..7 (value = m * 2^e, m in {1, 1.5}); code 0 has none.
_CODE_EXP = (-1000, -1, 0, 0, 1, 1, 2, 2)
# Shift range held in the table. d <= 9 always holds for a group with a nonzero value; groups of
# zeros may have any d, and their bytes map to (signed) zeros for every d. d < D_MIN rounds
# everything to zero, exactly as d = D_MIN does (6 * 2^-17 < 2^-10).
D_MIN, D_MAX = -17, 9
EXACT_MIN_SHIFT = -8


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode MXFP4: blocks uint8 [..., G, 16], scales uint8 [..., G] -> ``dtype`` [..., G * 32].

    Values are computed exactly in float32 (e2m1 times a power of two) and cast once; for
    bf16/fp32 outputs and scales below 253 this is exact, and bit-identical to OpenAI's
    ``gpt_oss.torch.weights.Checkpoint``.
    """
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == BYTES_PER_GROUP, (
        f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match"
    )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]
    vals = lut[codes].flatten(-2)  # [..., G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1))
    return vals.flatten(-2).to(dtype)


def nan_scale_count(scales: torch.Tensor) -> int:
    """Number of e8m0 scales equal to 255 (NaN in the OCP MX spec)."""
    if int(scales.max()) < E8M0_NAN:  # the usual case, 200x cheaper than counting
        return 0
    return int((scales == E8M0_NAN).sum())


@dataclass
class _Tables:
    # Flat tables indexed by (d - D_MIN) * 256 + byte.
    pair: torch.Tensor  # int16: two e4m3 bytes, little-endian (low byte = even element)
    exact: torch.Tensor  # uint8: how many of the two values are exact (0..2)
    relerr: torch.Tensor  # float32: max relative error of the two values
    code_exp: torch.Tensor  # int32 [8]: exponent of magnitude codes 0..7


_TABLES: dict[torch.device, _Tables] = {}


def _build_tables(device: torch.device) -> _Tables:
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    byte = torch.arange(256)
    pair_vals = torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1)  # [256, 2]
    d = torch.arange(D_MIN, D_MAX + 1, dtype=torch.float64)
    vals = torch.pow(2.0, d)[:, None, None] * pair_vals[None]  # [nd, 256, 2]
    # Built once with the same RNE saturating cast the float path uses.
    q = to_fp8_saturating(vals.float())
    back = q.double()
    exact = (back == vals).sum(-1).to(torch.uint8)
    rel = torch.where(vals != 0, (back - vals).abs() / vals.abs().clamp(min=1e-300), torch.zeros_like(vals))
    pair = q.contiguous().view(torch.uint8).view(torch.int16).squeeze(-1)  # [nd, 256], little-endian
    return _Tables(
        pair=pair.reshape(-1).to(device),
        exact=exact.reshape(-1).to(device),
        relerr=rel.amax(-1).float().reshape(-1).to(device),
        code_exp=torch.tensor(_CODE_EXP, dtype=torch.int32, device=device),
    )


def _tables(device: torch.device) -> _Tables:
    if device not in _TABLES:
        _TABLES[device] = _build_tables(device)
    return _TABLES[device]


@dataclass
class ExactStats:
    """Exactness of a conversion: how many values equal their source bit for bit."""

    total: int = 0
    exact: int = 0
    max_rel_err: float = 0.0
    # sum of squared errors and of squared source values (their ratio's root: the tensor's RMS
    # relative error); 0 / 0 where every value is exact
    err_sq: float = 0.0
    ref_sq: float = 0.0

    def add(self, other: ExactStats) -> None:
        self.total += other.total
        self.exact += other.exact
        self.max_rel_err = max(self.max_rel_err, other.max_rel_err)
        self.err_sq += other.err_sq
        self.ref_sq += other.ref_sq

    @property
    def exact_fraction(self) -> float:
        return self.exact / self.total if self.total else 1.0


_MAG = 0x7777777777777777  # magnitude bits of 16 nibbles
_PAIR_BIT = 0x2222222222222222  # bit 1 of each nibble
# Exponent of the largest code given the OR of a group's codes (bits 0..2), when no code is 6 or 7:
# OR has bit 2 -> a code in 4..5 (exp 1); bit 1 -> 2..3 (exp 0); bit 0 -> 1 (exp -1); 0 -> zero group.
_EXP_FROM_OR = (-1000, -1, 0, 0, 1, 1, 1, 1)


def group_exponents(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Exponent of each group's largest value (int32 [..., N, G]); -1000 for all-zero groups.

    Bit-parallel on int64 words (16 nibbles each) instead of per byte: the group's largest code
    is 6 or 7 iff some nibble has bits 2 and 1 set, otherwise the OR of its codes tells.
    """
    x = blocks.contiguous().view(torch.int64)  # [..., N, G, 2]
    m = x & _MAG
    big = ((m & (m >> 1) & _PAIR_BIT) != 0).any(dim=-1)  # some code in {6, 7}
    o = m[..., 0] | m[..., 1]
    o = o | (o >> 32)
    o = o | (o >> 16)
    o = o | (o >> 8)
    o = (o | (o >> 4)) & 0x7
    lut = torch.tensor(_EXP_FROM_OR, dtype=torch.int32, device=blocks.device)
    e = torch.where(big, torch.full_like(o, 2, dtype=torch.int32), lut[o.int()])
    return torch.where(e > -1000, e + scales.to(torch.int32) - E8M0_BIAS, e)


def block_scale_exponents(group_exp: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Pow2 block-scale exponent k per 128x128 block from group exponents [..., N, G].

    k = max exponent in the block - 8; all-zero blocks get k = 0 (scale 1.0).
    Returns int32 [..., ceil(N/128), ceil(K/128)].
    """
    assert block % VALUES_PER_GROUP == 0
    gpb = block // VALUES_PER_GROUP  # groups per block column
    *lead, n, g = group_exp.shape
    nb, kb = cdiv(n, block), cdiv(g, gpb)
    e = torch.nn.functional.pad(group_exp, (0, kb * gpb - g, 0, nb * block - n), value=-1000)
    emax = e.reshape(*lead, nb, block, kb, gpb).amax(dim=(-3, -1))
    return torch.where(emax > -1000, emax - 8, torch.zeros_like(emax))


def mxfp4_to_fp8(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    *,
    with_stats: bool = True,
    block: int = BLOCK,
    rows_per_piece: int | None = None,
    workers: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, ExactStats]:
    """Direct MXFP4 -> FP8 e4m3 with pow2 128x128 block scales, by integer arithmetic and tables.

    blocks uint8 [..., N, G, 16], scales uint8 [..., N, G] (no 255s; check with nan_scale_count).
    Returns (w_fp8 float8_e4m3fn [..., N, 32G], scale_inv float32 [..., ceil(N/128), ceil(32G/128)],
    stats) where stats counts values that are bit-exact against the MXFP4 source.

    On CPU the work is cut into bands of ``rows_per_piece`` rows (a multiple of 128, so bands hold
    whole blocks) that stay in cache, run on ``workers`` threads (torch ops release the GIL); on
    CUDA one piece per tensor.
    """
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == BYTES_PER_GROUP, (
        f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match"
    )
    *lead, n, g, _ = blocks.shape
    if blocks.device.type != "cpu":
        return _mxfp4_to_fp8_piece(blocks, scales, with_stats, block)
    rows = rows_per_piece or max(block, (2 * 1024 * 1024 // max(g * BYTES_PER_GROUP, 1)) // block * block)
    assert rows % block == 0, rows
    bf, sf = blocks.reshape(-1, n, g, BYTES_PER_GROUP), scales.reshape(-1, n, g)
    nb, kb = cdiv(n, block), cdiv(g * VALUES_PER_GROUP, block)
    out = torch.empty((bf.shape[0], n, g * VALUES_PER_GROUP), dtype=torch.uint8)
    scale_inv = torch.empty((bf.shape[0], nb, kb), dtype=torch.float32)
    pieces = [(e, r0, min(n, r0 + rows)) for e in range(bf.shape[0]) for r0 in range(0, n, rows)]

    def work(p: tuple[int, int, int]) -> ExactStats:
        e, r0, r1 = p
        q, s_, st = _mxfp4_to_fp8_piece(bf[e, r0:r1], sf[e, r0:r1], with_stats, block)
        out[e, r0:r1] = q.view(torch.uint8)
        scale_inv[e, r0 // block : cdiv(r1, block)] = s_
        return st

    stats = ExactStats()
    nworkers = min(workers or os.cpu_count() or 1, len(pieces))
    # One torch thread per worker: the pieces are the parallelism. Intra-op threads on small
    # pieces only spin-wait on each other (20x slower on a busy 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if nworkers > 1:
            with ThreadPoolExecutor(nworkers) as ex:
                for st in ex.map(work, pieces):
                    stats.add(st)
        else:
            for p in pieces:
                stats.add(work(p))
    finally:
        torch.set_num_threads(threads)
    return out.view(FP8_DTYPE).reshape(*lead, n, g * VALUES_PER_GROUP), scale_inv.reshape(*lead, nb, kb), stats


def _mxfp4_to_fp8_piece(
    blocks: torch.Tensor, scales: torch.Tensor, with_stats: bool, block: int
) -> tuple[torch.Tensor, torch.Tensor, ExactStats]:
    """mxfp4_to_fp8 on one piece (any leading dims), in one go."""
    t = _tables(blocks.device)
    *lead, n, g, _ = blocks.shape
    gpb = block // VALUES_PER_GROUP
    k_exp = block_scale_exponents(group_exponents(blocks, scales), block)  # [..., nb, kb]
    # Per-group shift d = s - 127 - k of its block.
    k_group = k_exp.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(gpb, dim=-1)[..., :g]
    d = (scales.to(torch.int32) - E8M0_BIAS - k_group).clamp(D_MIN, D_MAX)  # [..., N, G]
    # int32 indices: index_select takes them, and they cost half of int64 to build. On pieces that
    # fit in cache this gather beats bit-parallel (SWAR) encodings of the same bytes.
    idx = ((d - D_MIN) * 256).unsqueeze(-1) + blocks  # int32 [..., N, G, 16]
    out = t.pair.index_select(0, idx.reshape(-1)).view(torch.uint8)  # two e4m3 bytes per input byte
    stats = ExactStats(total=blocks.numel() * 2, exact=blocks.numel() * 2)
    lossy = d < EXACT_MIN_SHIFT  # only these groups can lose bits
    if with_stats and bool(lossy.any()):
        sub = idx[lossy].reshape(-1)
        stats.exact -= sub.numel() * 2 - int(t.exact.index_select(0, sub).sum())
        stats.max_rel_err = float(t.relerr.index_select(0, sub).max())
    w_fp8 = out.view(FP8_DTYPE).reshape(*lead, n, g * VALUES_PER_GROUP)
    scale_inv = torch.ldexp(torch.ones(k_exp.shape, dtype=torch.float32, device=blocks.device), k_exp)
    return w_fp8, scale_inv, stats


# e2m1 magnitudes (codes 0..7) and the midpoints between neighbours, for encoding.
_E2M1_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_MAX = 6.0


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode w float [..., K] (K a multiple of 32) as MXFP4: (blocks uint8 [..., K / 32, 16],
    scales uint8 [..., K / 32]), the layout ``decode_mxfp4`` reads.

    Each group of 32 gets the smallest power-of-two scale 2^e with amax / 2^e <= 6 (so nothing
    saturates); every value is rounded to the nearest e2m1 value, ties to the even code (as a float
    cast rounds). A group of zeros gets scale 2^-127. ``decode_mxfp4(*encode_mxfp4(w))`` is the
    nearest MXFP4 tensor under that scale choice; for w already on an MXFP4 grid whose group amax
    is 4 or 6 times its scale (every nonzero group of a real checkpoint has one of those), it is w.
    """
    assert w.shape[-1] % VALUES_PER_GROUP == 0, f"last dim {w.shape[-1]} is not a multiple of {VALUES_PER_GROUP}"
    x = w.float().reshape(*w.shape[:-1], -1, VALUES_PER_GROUP)  # [..., G, 32]
    amax = x.abs().amax(-1)  # [..., G]
    # smallest e with amax <= 6 * 2^e: frexp gives amax / 6 = m * 2^q with m in [0.5, 1)
    m, q = torch.frexp(amax / E2M1_MAX)
    e = torch.where(m == 0.5, q - 1, q)  # an exact power of two needs no extra binade
    e = torch.where(amax > 0, e, torch.full_like(e, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_NAN - 1 - E8M0_BIAS)
    y = torch.ldexp(x, -e.unsqueeze(-1))  # exact: a power-of-two rescale
    mag = y.abs()
    mids = torch.tensor(_E2M1_MIDS, dtype=torch.float32, device=w.device)
    code = torch.bucketize(mag, mids)  # lower code on an exact midpoint
    tie = (code < len(_E2M1_MIDS)) & (mag == mids[code.clamp(max=len(_E2M1_MIDS) - 1)])
    code = torch.where(tie & (code % 2 == 1), code + 1, code)  # ties to the even code
    code = code | (torch.signbit(y).long() << 3)
    code = code.to(torch.uint8).reshape(*x.shape[:-1], BYTES_PER_GROUP, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), (e + E8M0_BIAS).to(torch.uint8)
