"""The sliding-window (128-key) prefill attention's Triton tiles side by side (issue 34: the window layers at their bound).

gpt-oss's shapes (64 query / 8 KV heads, head dim 64, bf16, sinks), one sequence of T tokens: each ``PrefillTile``
of TILES is checked against ``spec.attention_varlen`` on the first 4096 tokens (rel. error), then timed (event
median) at every T, beside the bytes floor (Q read + O written + K, V read once, at 4.0 TB/s). ``--model-form``: as
the 20b's window layers call it, q / k / v views of one [T, 5120] projection, q's rope fused, o_proj's FP8 input
written (``quant_out``; the floor then counts O's e4m3 bytes and scales). GLUON: the warp-specialized Gluon kernel's
option sets (``window_attention_prefill``), timed the same way.

    PYTHONPATH=$(pwd) python3 benchmarks/window_sweep.py [--tokens 8192,32768,128000] [--model-form] [--only NAME,..]
"""

from __future__ import annotations

import argparse

import torch
import triton

from gptoss_fp8 import spec
from gptoss_fp8.kernels.attention import attention_prefill
from gptoss_fp8.kernels.config import DEFAULT, PrefillTile

HQ, HKV, D, WINDOW = 64, 8, 64, 128
TILES = {
    "default": None,
    "64x32 p2 w4 s2": PrefillTile(64, 32, 4, 2, maxnreg=128, pack=2),
    "128x32 p4 w4 s2": PrefillTile(128, 32, 4, 2, maxnreg=128, pack=4),
    "128x32 p4 w4 s2 r-": PrefillTile(128, 32, 4, 2, pack=4),
    "128x32 p4 w4 s3": PrefillTile(128, 32, 4, 3, maxnreg=128, pack=4),
    "128x32 p4 w4 s1": PrefillTile(128, 32, 4, 1, maxnreg=128, pack=4),
    "128x64 p2 w4 s2": PrefillTile(128, 64, 4, 2, maxnreg=128, pack=2),
    "256x32 p4 w8 s2": PrefillTile(256, 32, 8, 2, pack=4),
    "128x16 p8 w4 s2": PrefillTile(128, 16, 4, 2, maxnreg=128, pack=8),
    "128x16 p4 w4 s2": PrefillTile(128, 16, 4, 2, maxnreg=128, pack=4),
    "256x32 p8 w4 s2": PrefillTile(256, 32, 4, 2, pack=8),
    # one masked loop over the tile's 5 key blocks (PrefillTile.one_loop)
    "128x32 p4 w4 s2 1L": PrefillTile(128, 32, 4, 2, maxnreg=128, pack=4, one_loop=True),
    "128x32 p4 w4 s3 1L": PrefillTile(128, 32, 4, 3, maxnreg=128, pack=4, one_loop=True),
    "128x32 p4 w4 s4 1L": PrefillTile(128, 32, 4, 4, maxnreg=128, pack=4, one_loop=True),
    "128x32 p4 w4 s3 1L r-": PrefillTile(128, 32, 4, 3, pack=4, one_loop=True),
    "128x16 p8 w4 s3 1L": PrefillTile(128, 16, 4, 3, maxnreg=128, pack=8, one_loop=True),
    "64x16 p4 w4 s3 1L": PrefillTile(64, 16, 4, 3, maxnreg=96, pack=4, one_loop=True),
    "64x16 p4 w4 s4 1L": PrefillTile(64, 16, 4, 4, pack=4, one_loop=True),
    "128x64 p2 w4 s3 1L": PrefillTile(128, 64, 4, 3, maxnreg=128, pack=2, one_loop=True),
    # fewer K / V rows read again from L2 (each key is read by (QB + 127) / QB tiles x 8 / pack programs)
    "256x32 p8 w8 s3 1L": PrefillTile(256, 32, 8, 3, pack=8, one_loop=True),
    "256x32 p4 w8 s3 1L": PrefillTile(256, 32, 8, 3, pack=4, one_loop=True),
    "256x64 p4 w8 s3 1L": PrefillTile(256, 64, 8, 3, pack=4, one_loop=True),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# the warp-specialized Gluon kernel (kernels/attention_window_ws.py, 41st session): window_attention_prefill's options
GLUON = {
    "gluon r8 c2": dict(run=8, consumers=2, q_stages=2, stages=4),
    "gluon r8 c2 q3": dict(run=8, consumers=2, q_stages=3, stages=4),
    "gluon r4 c2": dict(run=4, consumers=2, q_stages=2, stages=4),
    "gluon r16 c2": dict(run=16, consumers=2, q_stages=2, stages=4),
    "gluon r8 c2 online": dict(run=8, consumers=2, q_stages=2, stages=4, merge=False),
    "gluon r8 c2 pair": dict(run=8, consumers=2, q_stages=2, stages=4, pair=True),  # 42nd: the two heads interleaved
    "gluon r16 c2 pair": dict(run=16, consumers=2, q_stages=2, stages=4, pair=True),
    "gluon r12 c2 pair": dict(run=12, consumers=2, q_stages=2, stages=4, pair=True),
    "gluon r8 c2 pair q3": dict(run=8, consumers=2, q_stages=3, stages=4, pair=True),
    "gluon r16 c2 pair s5": dict(run=16, consumers=2, q_stages=2, stages=5, pair=True),
    "gluon r32 c2 pair": dict(run=32, consumers=2, q_stages=2, stages=4, pair=True),
}


def _call(name, q, k, v, sinks, kw):
    """One launch of variant ``name`` (a Triton tile of TILES or a Gluon option set of GLUON)."""
    if name in GLUON:
        from gptoss_fp8.kernels.attention_window_ws import window_attention_prefill

        return window_attention_prefill(q, k, v, sinks, D ** -0.5, WINDOW, **kw, **GLUON[name])
    return attention_prefill(q, k, v, sinks, sliding_window=WINDOW, tile=TILES[name], **kw)


def _operands(t: int, g: torch.Generator, model_form: bool):
    """q, k, v (views of one projection's rows with ``model_form``) and the keyword arguments of the model's call."""
    if not model_form:
        return (*(torch.randn(t, h, D, device="cuda", generator=g).bfloat16() for h in (HQ, HKV, HKV)), {})
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", generator=g).bfloat16()
    q = qkv[:, :HQ * D].view(t, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
    return q, k, v, dict(rope=spec.rope_table(t, D, device="cuda"), quant_out=True)


def _dequant(out) -> torch.Tensor:
    """The bf16 rows' values (o_proj's FP8 input dequantized where the call wrote it)."""
    if isinstance(out, tuple):
        q8, s = out
        return (q8.float().view(q8.shape[0], -1, 128) * s[:, :, None]).view(q8.shape[0], HQ, D)
    return out.float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,32768,128000")
    ap.add_argument("--model-form", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated tile names (default: all)")
    a = ap.parse_args()
    tiles = [n for n in [*TILES, *GLUON] if not a.only or n in a.only.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    sinks = (torch.rand(HQ, device="cuda", generator=g) * 4 - 2).bfloat16()
    print(f"# default window tile: {DEFAULT.prefill_tile(True, True, HQ // HKV)}; model form {a.model_form}")
    n = 4096
    q, k, v, kw = _operands(n, g, a.model_form)
    if a.model_form:  # the reference on q rotated first (spec's rope; rounded to bf16 as the unfused path would)
        cos, sin = kw["rope"]
        qr = spec.apply_rope(q, cos[:n], sin[:n], dtype=torch.float32).float()
    else:
        qr = q.float()
    ref = spec.attention_varlen(qr, k.float(), v.float(), sinks.float(), None, window=WINDOW)
    ok = {}
    for name in tiles:
        ok[name] = _rel(_dequant(_call(name, q, k, v, sinks, kw)), ref)
    for t in (int(x) for x in a.tokens.split(",")):
        q, k, v, kw = _operands(t, g, a.model_form)
        o_bytes = HQ * D * (1 + 4 / 128) if a.model_form else 2 * HQ * D
        floor_ms = t * (2 * HQ * D + o_bytes + 4 * HKV * D) / 4.0e12 * 1e3
        print(f"T {t}: bytes floor {floor_ms:.3f} ms at 4.0 TB/s")
        for name in tiles:
            ms = triton.testing.do_bench(lambda name=name: _call(name, q, k, v, sinks, kw), warmup=10, rep=100,
                                         return_mode="median")
            print(f"  {name:22s} {ms:8.3f} ms  x{ms / floor_ms:5.2f} floor  rel {ok[name]:.2e}")


if __name__ == "__main__":
    main()
