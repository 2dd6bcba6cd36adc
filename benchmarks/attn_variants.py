"""Variants of the warp-specialized causal prefill attention (kernels/attention_ws.py), side by side in
one process on an sm_90 GPU (issue 34): correctness of each against the fp32 spec
(``spec.attention``, what ``attention_prefill_ref`` computes) on the GPU tests' shapes, then time at
each length, passes interleaved so that clock drift hits every variant alike.

Run on the GPU machine from the repository root:
    PYTHONPATH=$PWD python3 benchmarks/attn_variants.py [--tokens 8192,32768,128000] [--variants a,b]
        [--passes 2] [--json PATH]
Prints one line per (variant, length) and a table last. FLOPs = 4 x visible pairs x 64 x 64 heads
(BENCHMARKS.md's convention, 64 query / 8 KV heads, head_dim 64); pairs/s = visible (query, key)
pairs x 64 heads / s = FLOP/s / 256 (each costs 256 FLOPs of MMA and one exponential). Max error:
the largest |out - ref| on sampled 64-row chunks (first, middle, last) of every length, against
spec.attention in fp32. The checks run one process per variant in parallel (they also fill
Triton's on-disk cache, so the timed process compiles nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from gptoss_fp8 import spec
from gptoss_fp8.kernels.attention_ws import ws_attention_prefill
from gptoss_fp8.kernels.attention_ws_fp8 import S16_Q_MAX, spec_row_sum, ws_attention_prefill_fp8

# "base" is the tile before Q moved into registers (q_in_registers, the default since 2026-12-03)
BASE = dict(block_n=64, stages=4, warpgroups=3, q_in_registers=False)
VARIANTS = {
    "base": {},
    "qreg": dict(q_in_registers=True),
    "cond8": dict(rescale_threshold=8.0),
    "fma25": dict(exp="fma25"),
    "fma50": dict(exp="fma50"),
    "bf16x2": dict(exp="bf16x2"),
    "qreg+cond8": dict(q_in_registers=True, rescale_threshold=8.0),
    "qreg+fma25": dict(q_in_registers=True, exp="fma25"),
    "deep": dict(deep=True),
    "n128-2wg": dict(block_n=128, stages=3, warpgroups=2),
    "n128-2wg-qreg": dict(block_n=128, stages=3, warpgroups=2, q_in_registers=True),
    "qreg+tree": dict(q_in_registers=True, tree=True),
    "qreg+ord": dict(q_in_registers=True, ordered=True),
    "qreg+ord+tree": dict(q_in_registers=True, ordered=True, tree=True),
    "2wg+ord+tree": dict(stages=4, warpgroups=2, q_in_registers=True, ordered=True, tree=True),
    "n128-2wg+ord+tree": dict(block_n=128, stages=3, warpgroups=2, q_in_registers=True, ordered=True, tree=True),
    "4wg": dict(warpgroups=4, stages=4),
    "4wg-6st": dict(warpgroups=4, stages=6),
    "4wg+ord": dict(warpgroups=4, stages=4, ordered=True),
    # each block's MMAs waited for within its step (no P carried: 128-key blocks fit three warpgroups)
    "n128-sync": dict(block_n=128, stages=3, q_in_registers=True, sync=True),
    "n128-sync-tree": dict(block_n=128, stages=3, q_in_registers=True, sync=True, tree=True),
    # timing probes (wrong values: no check): the loop's MMAs alone, its softmax alone
    "probe-mma": dict(q_in_registers=True, exp="probe-mma-only"),
    "probe-softmax": dict(q_in_registers=True, exp="probe-softmax-only"),
    # FP8 attention on the Gluon pipeline (kernels/attention_ws_fp8.py; checked against spec.attention_fp8)
    # (the default: 128 keys a step, the row sum by the tensor core: P8 x ones; the warpgroups take turns at the
    # first block's exponentials; one release of a step's two ring stages)
    "fp8": dict(fp8=True),
    "fp8-3st": dict(fp8=True, stages=3),
    "fp8-6st": dict(fp8=True, stages=6),
    "fp8-64": dict(fp8=True, pairs=False),  # one 64-key block a step (fp32 row sum)
    "fp8-sum": dict(fp8=True, ones=False),  # 128 keys a step, the row sum of the fp32 P on the FMA pipes
    "fp8-fma25": dict(fp8=True, exp_fma=1),  # a quarter of the unmasked 2^x by the FMA pipes' polynomial
    "fp8-fma50": dict(fp8=True, exp_fma=2),  # half (ptxas spills 16 bytes)
    "fp8-free": dict(fp8=True, turns=0, pair_release=False),  # no turns, two releases a step (the 22nd session's)
    "fp8-turn": dict(fp8=True, turns=1),  # the turn held over both blocks' exponentials
    "fp8-turn-q": dict(fp8=True, turns=3),  # .. passed on after the first block's first half
    "fp8-noturn": dict(fp8=True, turns=0),  # one release a step, no turns
    "fp8-ready2": dict(fp8=True, pair_ready=False),  # two ready barriers a step (the 23rd session's default)
    "fp8-qreg": dict(fp8=True, q_in_registers=True),  # Q loaded into registers once (28th session, unmeasured)
    "fp8-s16": dict(fp8=True, s16=True),  # QK^T in f16, the unmasked scores on f16 pairs (36th session: 7-9% slower)
    "fp8-lanemax": dict(fp8=True, lane_max=True),  # the row max, one shuffle pair a step (33rd session, unmeasured)
    # no 2^x: P * 256's e4m3 codes from the scores (45th session; spec.attention_fp8(p_code="lin"), another spec):
    # clamped as 32-bit integers, as 16-bit pairs (clamped as floats first where the scores' bound could wrap them),
    # with the turn held over both blocks, with the row max reduced across lanes once, Q in registers, other rings
    "fp8-lin": dict(fp8=True, exp_lin=1),
    "fp8-lin16": dict(fp8=True, exp_lin=2),
    "fp8-lin16-turn": dict(fp8=True, exp_lin=2, turns=1),
    "fp8-lin16n": dict(fp8=True, exp_lin=3),  # the 16-bit clamp's bound from row norms (not yet run on a GPU)
    # the codes against the running max first, row maxima on packed halves, m raised only where a code passes 126
    # (46th session), with the bound of 2 / of 3
    "fp8-lin4": dict(fp8=True, exp_lin=4),
    "fp8-lin4n": dict(fp8=True, exp_lin=5),
    # 5 with the fast steps whose codes are all <= 0 skipping their PV and row-sum MMAs (51st session; the same bytes)
    "fp8-lin6": dict(fp8=True, exp_lin=6),
    # 5 with the fast step's rescale made every step (d = 0 where none is needed): no warpgroup-wide maximum and branch
    # (54th session; the same bytes)
    "fp8-lin8": dict(fp8=True, exp_lin=8),
    "fp8-lin16-lanemax": dict(fp8=True, exp_lin=2, lane_max=True),
    "fp8-lin16-qreg": dict(fp8=True, exp_lin=2, q_in_registers=True),
    "fp8-lin16-2st": dict(fp8=True, exp_lin=2, stages=2),
    "fp8-lin16-6st": dict(fp8=True, exp_lin=2, stages=6),
    # timing probes of the FP8 kernel (wrong values: no check; the MMA probe without turns)
    "fp8-probe-mma": dict(fp8=True, probe="mma"),
    "fp8-probe-softmax": dict(fp8=True, probe="softmax"),
}
PROBE_VARIANTS = {n for n, v in VARIANTS.items() if str(v.get("exp", "")).startswith("probe") or "probe" in v}
TEST_SHAPES = [(1, 8, 1), (63, 8, 1), (64, 16, 2), (65, 8, 8), (129, 64, 8), (1000, 8, 1), (4099, 64, 8)]
D = 64


def _inputs(T, hq, hkv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    fused = torch.randn(T, (hq + 2 * hkv) * D, device="cuda", generator=g).bfloat16()
    q, k, v = (t.view(T, -1, D) for t in fused.split([hq * D, hkv * D, hkv * D], dim=1))
    sinks = torch.rand(hq, device="cuda", generator=g) * 20 - 10  # fp32, as the GPU tests' (same compiles)
    sinks[0], sinks[-1] = -10.0, 10.0
    return q, k, v, sinks


def _run(cfg, q, k, v, sinks, out=None):
    if out is None:
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    if cfg.get("fp8"):
        return ws_attention_prefill_fp8(q, k, v, sinks, out, D ** -0.5, **{k: v for k, v in cfg.items() if k != "fp8"})
    return ws_attention_prefill(q, k, v, sinks, out, D ** -0.5, **{**BASE, **cfg})


def _spec(cfg):
    """The variant's reference: spec.attention in fp32, or spec.attention_fp8 for the FP8 kernel."""
    if cfg.get("fp8"):
        rs = spec_row_sum(cfg.get("pairs", True), cfg.get("ones", True))  # the e4m3 P's row sum, or the fp32 P's
        qm = S16_Q_MAX if cfg.get("s16") else None  # (QK^T in f16: Q quantized to 1.75)
        pc = "lin" if cfg.get("exp_lin") else "e4m3"
        return lambda q, k, v, sinks, q_offset=0: spec.attention_fp8(q, k, v, sinks, D ** -0.5, 0, q_offset,
                                                                     row_sum=rs, q_max=qm, p_code=pc)
    return lambda q, k, v, sinks, q_offset=0: spec.attention(q, k, v, sinks, D ** -0.5, 0, q_offset=q_offset,
                                                             dtype=torch.float32)


def _ref_rows(q, k, v, sinks, r0, r1, cfg=None):
    if cfg and cfg.get("fp8"):  # the whole sequence's quantization (V's channel scales span all rows)
        return _spec(cfg)(q, k, v, sinks)[r0:r1]
    return spec.attention(q[r0:r1], k[:r1], v[:r1], sinks, D ** -0.5, 0, q_offset=r0, dtype=torch.float32)


def check(name):
    """check(VARIANTS[name]) in a worker process, then one launch at a timed shape's specialization
    (T a multiple of 16, several programs per head) to compile it there."""
    try:
        r = check_cfg(VARIANTS[name])
        q, k, v, sinks = _inputs(1024, 64, 8, 0)
        _run(VARIANTS[name], q, k, v, sinks)
        torch.cuda.synchronize()
        return r
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
        return math.nan, math.nan, [f"{type(e).__name__}: {str(e)[-600:]}"]


def check_cfg(cfg):
    """The GPU tests' criteria (tests/kernels/test_attention.py::_check, gpu=True) on their shapes:
    (worst relative error, worst max abs error, failures)."""
    worst_rel, worst_abs, fails = 0.0, 0.0, []
    for T, hq, hkv in TEST_SHAPES:
        q, k, v, sinks = _inputs(T, hq, hkv, T + hq)
        out = _run(cfg, q, k, v, sinks).float()
        ref = _spec(cfg)(q, k, v, sinks).float()
        if not torch.isfinite(out).all():
            fails.append(f"T={T} non-finite")
            continue
        rel = ((out - ref).norm() / ref.norm()).item()
        err = (out - ref).abs().max().item()
        worst_rel, worst_abs = max(worst_rel, rel), max(worst_abs, err)
        if cfg.get("fp8"):  # how far from exact attention (fp32 spec): what the FP8 roundings cost
            exact = spec.attention(q.float(), k.float(), v.float(), sinks, D ** -0.5, 0, dtype=torch.float32)
            print(f"  {cfg} T={T} hq={hq}: rel vs spec.attention (fp32) "
                  f"{((out - exact).norm() / exact.norm()).item():.2e}", flush=True)
        try:
            assert rel < 1e-2, f"relative error {rel:.2e}"
            if not cfg.get("fp8"):  # (FP8: the GPU tests' criterion, the norm only: e4m3 roundings of P flip)
                torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
        except AssertionError as e:
            fails.append(f"T={T} hq={hq} hkv={hkv}: {str(e).splitlines()[0]}")
    return worst_rel, worst_abs, fails


def sampled_error(out, q, k, v, sinks, cfg=None):
    T = q.shape[0]
    if cfg and cfg.get("fp8") and T > 4096:
        return math.nan  # (spec.attention_fp8 quantizes the whole sequence: too big to sample here)
    worst = 0.0
    for r0 in sorted({0, (T // 2) // 64 * 64, max(T - 64, 0)}):
        r1 = min(r0 + 64, T)
        worst = max(worst, (out[r0:r1].float() - _ref_rows(q, k, v, sinks, r0, r1, cfg).float()).abs().max().item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,32768,128000")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--qk-scale", type=float, default=1.0,
                    help="the timed Q and K times this (the random inputs' amax ~4.5; a trained model's ~30: exp_lin's "
                         "16-bit clamp then meets its bound's float clamp)")
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    names = args.variants.split(",")
    res: dict = {"variants": {n: {**BASE, **VARIANTS[n]} for n in names}, "check": {}, "timing": {}}
    t0 = time.time()
    checks = {n: (0.0, 0.0, []) for n in names}
    tocheck = [] if args.skip_check else [n for n in names if n not in PROBE_VARIANTS]
    if tocheck:
        ctx = multiprocessing.get_context("spawn")
        # (a check's FP8 spec at 4099 x 64 heads holds ~25 GB: as many workers as the card holds, 3 on an H100)
        per_card = max(1, int(torch.cuda.get_device_properties(0).total_memory / 26e9))
        with ProcessPoolExecutor(max_workers=min(len(tocheck), 14, per_card), mp_context=ctx) as pool:
            checks.update(zip(tocheck, pool.map(check, tocheck), strict=True))
    for n in names:
        rel, err, fails = checks[n]
        res["check"][n] = {"rel": rel, "max_abs": err, "fails": fails}
        print(f"check {n}: rel {rel:.2e} max_abs {err:.2e} {'PASS' if not fails else 'FAIL ' + '; '.join(fails)}",
              flush=True)
    print(f"checks and compiles: {time.time() - t0:.1f} s", flush=True)
    ok = [n for n in names if not res["check"][n]["fails"]]
    hq, hkv = 64, 8
    for T in [int(t) for t in args.tokens.split(",")]:
        q, k, v, sinks = _inputs(T, hq, hkv, 1234 + T)
        if args.qk_scale != 1.0:
            q, k = (q.float() * args.qk_scale).bfloat16(), (k.float() * args.qk_scale).bfloat16()
        pairs = T * (T + 1) // 2 * hq
        flops = 4 * pairs * D
        outs = {n: torch.empty_like(q) for n in ok}
        errs = {}
        for n in ok:
            _run(VARIANTS[n], q, k, v, sinks, outs[n])
            torch.cuda.synchronize()
            errs[n] = sampled_error(outs[n], q, k, v, sinks, VARIANTS[n])
        base_out = outs.get("base")
        rep = 300 if T <= 8192 else (600 if T <= 32768 else 1200)
        times: dict = {n: [] for n in ok}
        for p in range(args.passes):
            for n in ok:
                ms = do_bench(lambda n=n: _run(VARIANTS[n], q, k, v, sinks, outs[n]), warmup=min(rep // 3, 300),
                              rep=rep, return_mode="median")
                times[n].append(ms)
                print(f"T={T} pass {p} {n}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
        for n in ok:
            ms = min(times[n])
            vs_base = ((outs[n].float() - base_out.float()).abs().max().item() if base_out is not None else math.nan)
            res["timing"].setdefault(str(T), {})[n] = {
                "ms": times[n], "tflops": flops / ms / 1e9, "pairs_per_s": pairs / ms * 1e3,
                "max_abs_vs_ref_sampled": errs[n], "max_abs_vs_base": vs_base}
        q = k = v = outs = base_out = None  # free the length's buffers before the next
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print("\n| variant | " + " | ".join(f"{T}: ms (TFLOP/s, pairs/s), max err" for T in res["timing"]) + " |")
    for n in names:
        cells = []
        for row in res["timing"].values():
            r = row.get(n)
            cells.append("-" if r is None else
                         f"{'/'.join(f'{x:.3f}' for x in r['ms'])} ({r['tflops']:.0f}, {r['pairs_per_s']:.2e}), "
                         f"{r['max_abs_vs_ref_sampled']:.1e}")
        c = res["check"][n]
        print(f"| {n} | " + " | ".join(cells) + f" | tests {'PASS' if not c['fails'] else 'FAIL'} rel {c['rel']:.1e} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
