"""One-process sweep of the Gluon GEMM variants against the shipped default, cuBLAS and DeepGEMM.

Dense: M in 1024 / 4096 / 8192 / 32768 x (N, K) in 5120x2880 (qkv), 2880x4096 (o_proj), 5760x2880;
every ``GluonTile`` variant of ``VARIANTS`` with bias, the shipped default (``fp8_gemm`` with
``config=None``: Triton below its Gluon threshold), cuBLAS blockwise ``torch._scaled_mm`` without
bias, DeepGEMM ``gemm_fp8_fp8_bf16_nt`` without bias when importable (K zero-padded to 2944; TFLOP/s
count the real K everywhere). MoE: the whole expert FFN ``moe_experts`` (gate_up + bias + SwiGLU +
FP8, down + bias, combine) for each ``MoePlan`` of ``moe_plans`` (the 64 x 256 Gluon gate_up on
either loop, the wide Gluon gate_up, the Gluon down, balanced grids), against DeepGEMM's two grouped
GEMMs alone (rows padded to 128, no bias), 32 / 128 experts x 8192 / 32768 / 2048 tokens, top-4.

Every variant's output is checked before it is timed: dense against ``fp8_gemm_reference`` (fp32),
MoE against ``spec.moe_w8a8`` (at 8192 tokens; at 32768 against the default's output). Outputs are
NaN-poisoned first. A variant over the tolerance (dense: ||y - ref|| / ||ref|| > 3e-3 or any NaN;
MoE: > 1e-2) is marked WRONG in the table, and its ratio is not reported. The peers' outputs are
checked too (against the reference without bias), so a wrong operand format shows as their error.
The console gets a summary (per case the default, our best correct variant, the peers; per variant
its geometric-mean speedup over the default); the full table goes beside the JSON (.txt). Times:
CUDA-graph replay medians (``triton.testing.do_bench_cudagraph``) for dense, event medians
(``do_bench``) for the MoE (its host-side routing buffers) and for DeepGEMM (as in the peers'
README), after two warm-up calls.

On the GPU machine, from the repository root, .peers carried:

    source .peers/deepgemm_setup.sh .peers/deepgemm-03d0be3.tgz; \
    PYTHONPATH=$(pwd) python3 benchmarks/gemm_sweep.py --json $OUT/gemm_sweep.json

(``--quick``: M 8192 and the 32- and 128-expert 8192-token MoE only; ``--no-moe`` / ``--no-dense`` /
``--no-deepgemm``.) Expected run time on the H200: 3-5 minutes, of which DeepGEMM's JIT compiles
(nvcc, ~10 s per kernel configuration on a fresh machine) take 1-2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace

try:  # DeepGEMM's JIT wants NVRTC's bindings loaded before torch (its tests do the same)
    import cuda.bindings.nvrtc  # noqa: F401
except ImportError:
    pass
import torch
import triton

from gptoss_fp8 import spec
from gptoss_fp8.bench.kernels_gemm import cublas_blockwise, pad_k
from gptoss_fp8.bench.kernels_gemm import rel_errors as _rel
from gptoss_fp8.kernels.config import GluonTile, KernelConfig, MoePlan, TritonTile
from gptoss_fp8.kernels.fp8_gemm import fp8_gemm, fp8_gemm_reference
from gptoss_fp8.kernels.moe import moe_experts
from gptoss_fp8.quant.fp8 import quantize_act, quantize_weight_blocks

try:
    import deep_gemm
except ImportError:  # not set up: the DeepGEMM columns stay empty
    deep_gemm = None

HIDDEN, INTER, TOP_K = 2880, 2880, 4
DENSE_SHAPES = [("qkv", 5120, 2880), ("o_proj", 2880, 4096), ("5760", 5760, 2880)]
DENSE_M = [1024, 4096, 8192, 32768]
MOE_CASES = [(32, 8192), (128, 8192), (32, 32768), (128, 32768), (32, 2048), (128, 2048)]
DENSE_TOL, MOE_TOL = 3e-3, 1e-2

# name -> GluonTile (forced Gluon kernel); "default" is the shipped path (config=None).
VARIANTS: dict[str, GluonTile | None] = {
    "default": None,
    "g128": GluonTile(stages=5, group_m=8),
    "g128-bal": GluonTile(stages=5, group_m=8, balance=True),
    # promote="serial": the default's numerics (a separate fp32 accumulator, promotion every 128)
    # with no wgmma in flight across a loop back edge (ptxas does not serialize them); the wide
    # tiles' only loop (their in-place accumulation lost accuracy and was removed)
    "g128-serial": GluonTile(stages=5, group_m=8, promote="serial"),
    "g128-serial-bal": GluonTile(stages=5, group_m=8, balance=True, promote="serial"),
    "w256x128-serial-s3": GluonTile(stages=3, group_m=8, block_m=256, promote="serial"),
    "w256x128-serial-s4": GluonTile(stages=4, group_m=8, block_m=256, promote="serial"),
    "w128x256-serial-s3": GluonTile(stages=3, group_m=8, block_n=256, promote="serial"),
    "w128x256-serial-s4": GluonTile(stages=4, group_m=8, block_n=256, promote="serial"),
    "w256x128-serial-s4-bal": GluonTile(stages=4, group_m=8, block_m=256, balance=True, promote="serial"),
    "w256x128-serial-s4-g16": GluonTile(stages=4, group_m=16, block_m=256, promote="serial"),
    "w128x256-serial-s3-bal": GluonTile(stages=3, group_m=8, block_n=256, balance=True, promote="serial"),
}


def moe_plans(t: int, e: int) -> dict[str, MoePlan | None]:
    """The MoE variants at t tokens, e experts: the shipped default (``KernelConfig.moe_plan``), the
    64 x 256 gate_up on either loop, and the wide gate_up / Gluon down ones (serial
    promotion, their only loop)."""
    narrow = KernelConfig(moe_wide_min_rows_per_expert=None)  # the 64 x 256 gate_up wherever it runs
    base = narrow.moe_plan(t, TOP_K, e, gluon_ok=True)
    wide_serial = GluonTile(4, 8, block_m=128, promote="serial")
    wide = replace(narrow, moe_gluon_gate_up=wide_serial).moe_plan(t, TOP_K, e, gluon_ok=True)
    plans: dict[str, MoePlan | None] = {"default": None}
    if wide.align_m != 128:  # too few rows per expert for 64-row alignment: no Gluon gate_up here
        return plans
    plans["gu64-pipelined"] = MoePlan(base.align_m, GluonTile(4, 8), base.down)
    plans["gu64-pipelined-bal"] = MoePlan(base.align_m, GluonTile(4, 8, balance=True), base.down)
    plans["gu64-serial"] = MoePlan(base.align_m, GluonTile(4, 8, promote="serial"), base.down)
    plans["gu64-serial-bal"] = MoePlan(base.align_m, GluonTile(4, 8, balance=True, promote="serial"), base.down)
    plans["wide-serial"] = wide
    plans["wide-serial-s3"] = MoePlan(128, GluonTile(3, 8, block_m=128, promote="serial"), wide.down)
    plans["wide-serial-bal"] = MoePlan(128, GluonTile(4, 8, block_m=128, balance=True, promote="serial"), wide.down)
    plans["wide-serial-down128"] = MoePlan(128, wide_serial, TritonTile(128, 128, 8, 8, 4))
    plans["wide-serial+gdown-serial"] = MoePlan(128, wide_serial, wide_serial)
    plans["wide-serial+gdown-serial-s3"] = MoePlan(128, GluonTile(3, 8, block_m=128, promote="serial"),
                                                   GluonTile(3, 8, block_m=128, promote="serial"))
    plans["wide-serial+gdown-serial-bal"] = MoePlan(128, GluonTile(4, 8, block_m=128, balance=True, promote="serial"),
                                                    GluonTile(4, 8, block_m=128, balance=True, promote="serial"))
    return plans


def _ms_graph(fn) -> float:
    """CUDA-graph replay median (host launch cost out of the figure); event median where a launch
    cannot be captured."""
    fn()
    fn()
    torch.cuda.synchronize()
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))
    except RuntimeError as ex:
        print(f"  (graph capture failed, event timing: {str(ex)[:120]})", flush=True)
        torch.cuda.synchronize()
        return _ms(fn)


def _ms(fn) -> float:
    fn()
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms and math.isfinite(ms) else float("nan")


def _cublas(x_fp8, x_s, w_fp8, w_s):
    """cuBLAS blockwise FP8 (no bias), K padded to the 128 grid (bench/kernels_gemm.py
    ``cublas_blockwise``: the unpadded K = 2880 gives wrong values)."""
    f = cublas_blockwise(x_fp8, x_s, w_fp8, w_s)
    f()
    return f


def _deepgemm_dense(x: torch.Tensor, w: torch.Tensor, m: int, n: int):
    """DeepGEMM's dense call on K padded to 128 (our 1x128 / 128x128 codecs: its operand format)."""
    xq, xs = quantize_act(pad_k(x))
    wq, ws = quantize_weight_blocks(pad_k(w))
    xs = deep_gemm.get_col_major_tma_aligned_tensor(xs)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def run(out=out):
        deep_gemm.gemm_fp8_fp8_bf16_nt((xq, xs), (wq, ws), out)
        return out

    return run


class Budget:
    """Wall-clock budget of the sweep: cases past it are skipped (and said so), so the table and the
    JSON come back inside the device call's limit; the JSON is rewritten after every case."""

    def __init__(self, seconds: float, json_path: str | None):
        self.t0, self.seconds, self.json_path, self.skipped = time.time(), seconds, json_path, []

    def left(self, case: str) -> bool:
        if time.time() - self.t0 <= self.seconds:
            return True
        self.skipped.append(case)
        print(f"budget spent: skipping {case}", flush=True)
        return False

    def save(self, rows: list[dict]) -> None:
        if self.json_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.json_path)), exist_ok=True)
            with open(self.json_path, "w") as f:
                json.dump(dict(rows=rows, seconds=time.time() - self.t0, deepgemm=deep_gemm is not None,
                               skipped=self.skipped), f, indent=1)


def _progress(rows: list[dict]) -> None:
    """One line for the case just measured: the default, our fastest correct variant, the peers."""
    last = rows[-1]
    case = [r for r in rows if (r["kind"], r["shape"], r["m"]) == (last["kind"], last["shape"], last["m"])]
    ours = [r for r in case if not r.get("peer") and "rel" in r and r.get("ok") and math.isfinite(r["ms"])]
    best = min(ours, key=lambda r: r["ms"], default=None)
    peers = ", ".join(f"{r['variant']} {r['tflops']:.0f}" for r in case if r.get("peer"))
    wrong = [r["variant"] for r in case if not r.get("ok")]
    dflt = next((r for r in case if r["variant"] == "default"), None)
    print(f"  {last['kind']} {last['shape']} M={last['m']}: default {dflt['tflops'] if dflt else float('nan'):.0f}, "
          f"best {best['variant'] if best else '-'} {best['tflops'] if best else float('nan'):.0f} TFLOP/s; {peers}"
          + (f"; WRONG: {', '.join(wrong)}" if wrong else ""), flush=True)


def dense_rows(ms: list[int], g: torch.Generator, budget: Budget, rows: list[dict]) -> list[dict]:
    for m in ms:
        for name, n, k in DENSE_SHAPES:
            if not budget.left(f"dense {name} M={m}"):
                continue
            x = torch.randn(m, k, device="cuda", generator=g) * (1 + 3 * torch.rand(m, 1, device="cuda", generator=g))
            w = torch.randn(n, k, device="cuda", generator=g) * 0.05
            bias = (0.5 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
            x_fp8, x_s = quantize_act(x)
            w_fp8, w_s = quantize_weight_blocks(w)
            ref = fp8_gemm_reference(x_fp8, x_s, w_fp8, w_s, bias, out_dtype=torch.float32)
            flops = 2.0 * m * n * k
            case = dict(kind="dense", shape=name, m=m, n=n, k=k)
            for vname, tile in VARIANTS.items():
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                def fn(out=out, tile=tile):
                    return fp8_gemm(x_fp8, x_s, w_fp8, w_s, bias, out=out, tile=tile)  # forwards tile.promote

                try:
                    fn()
                    torch.cuda.synchronize()
                    rel, mx = _rel(out, ref)
                    ok = rel <= DENSE_TOL
                    t_ms = _ms_graph(fn)
                    err = ""
                except Exception as ex:  # noqa: BLE001 - a failing variant is reported, the sweep goes on
                    rel = mx = float("inf")
                    ok, t_ms, err = False, float("nan"), f"{type(ex).__name__}: {str(ex)[:200]}"
                rows.append(case | dict(variant=vname, ms=t_ms, tflops=_tflops(flops, t_ms), rel=rel, max_rel=mx,
                                        ok=ok, error=err))
            ref -= bias.float()  # the peers add no bias: their outputs are checked against this
            cublas = _cublas(x_fp8, x_s, w_fp8, w_s)
            rel, mx = _rel(cublas(), ref)
            rows.append(case | dict(variant="cublas-nobias", ms=(t := _ms_graph(cublas)), tflops=_tflops(flops, t),
                                    rel=rel, max_rel=mx, ok=True, peer=True))
            if deep_gemm is not None:
                try:
                    dg = _deepgemm_dense(x, w, m, n)
                    dg()
                    rel, mx = _rel(dg(), ref)
                    t = _ms(dg)  # events, as in the peers' README (a failed capture could poison the process)
                except Exception as ex:  # noqa: BLE001
                    print(f"DeepGEMM dense {m}x{n}x{k}: {ex}", flush=True)
                    t, rel, mx = float("nan"), float("inf"), float("inf")
                rows.append(case | dict(variant="deepgemm-nobias", ms=t, tflops=_tflops(flops, t), rel=rel,
                                        max_rel=mx, ok=True, peer=True))
            del ref
            _progress(rows)
            budget.save(rows)
            torch.cuda.empty_cache()
    return rows


def _deepgemm_moe(ids: torch.Tensor, e: int, g: torch.Generator) -> float:
    """DeepGEMM's grouped gate_up + down alone on the same routing (segments padded to 128)."""
    align = 128
    counts = torch.bincount(ids.reshape(-1).long(), minlength=e).tolist()
    padded = [(c + align - 1) // align * align for c in counts]
    m = sum(padded)
    m_indices = torch.full((m,), -1, device="cuda", dtype=torch.int32)
    start = 0
    for i, (c, p) in enumerate(zip(counts, padded, strict=True)):
        m_indices[start:start + c] = i
        start += p
    a, a_s = quantize_act(pad_k(torch.randn(m, HIDDEN, device="cuda", generator=g)))
    a_s = deep_gemm.get_col_major_tma_aligned_tensor(a_s)
    total = 0.0
    for n in (2 * INTER, HIDDEN):
        w, w_s = quantize_weight_blocks(pad_k(torch.randn(e, n, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5))
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        total += _ms(lambda w=w, w_s=w_s, out=out: deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(
            (a, a_s), (w, w_s), out, m_indices))
        del w, w_s, out
        torch.cuda.empty_cache()
    return total


def moe_rows(cases: list[tuple[int, int]], g: torch.Generator, budget: Budget, rows: list[dict]) -> list[dict]:
    for e, t in cases:
        if not budget.left(f"moe E={e} T={t}"):
            continue
        x = (1.5 * torch.randn(t, HIDDEN, device="cuda", generator=g)).to(torch.bfloat16)
        wr = (torch.randn(e, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).to(torch.bfloat16)
        br = (0.1 * torch.randn(e, device="cuda", generator=g)).to(torch.bfloat16)
        _, ids, weights = spec.route(x, wr, br, TOP_K)
        ids = ids.to(torch.int32)
        w13, s13 = quantize_weight_blocks(torch.randn(e, 2 * INTER, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5)
        w2, s2 = quantize_weight_blocks(torch.randn(e, HIDDEN, INTER, device="cuda", generator=g) / INTER**0.5)
        b13 = (0.3 * torch.randn(e, 2 * INTER, device="cuda", generator=g)).to(torch.bfloat16)
        b2 = (0.1 * torch.randn(e, HIDDEN, device="cuda", generator=g)).to(torch.bfloat16)
        experts = (w13, s13, b13, w2, s2, b2)
        flops = 2.0 * t * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)
        case = dict(kind="moe", shape=f"E={e}", m=t, n=2 * INTER, k=HIDDEN, experts=e)
        ref = spec.moe_w8a8(x, weights, ids, *experts, 0) if t <= 8192 else None
        ref_name = "spec.moe_w8a8" if ref is not None else "default"
        for vname, plan in moe_plans(t, e).items():
            def fn(plan=plan, experts=experts):
                return moe_experts(x, weights, ids, *experts, plan=plan)

            try:
                y = fn()
                torch.cuda.synchronize()
                if ref is None:
                    ref = y.float()  # the default runs first
                rel, mx = _rel(y, ref)
                ok = rel <= MOE_TOL
                t_ms = _ms(fn)
                err = ""
            except Exception as ex:  # noqa: BLE001
                rel = mx = float("inf")
                ok, t_ms, err = False, float("nan"), f"{type(ex).__name__}: {str(ex)[:200]}"
            rows.append(case | dict(variant=vname, ms=t_ms, tflops=_tflops(flops, t_ms), rel=rel, max_rel=mx, ok=ok,
                                    ref=ref_name, error=err))
        del ref
        if deep_gemm is not None:
            try:
                t_ms = _deepgemm_moe(ids, e, g)
            except Exception as ex:  # noqa: BLE001
                print(f"DeepGEMM grouped E={e} T={t}: {ex}", flush=True)
                t_ms = float("nan")
            rows.append(case | dict(variant="deepgemm-2gemms-nobias", ms=t_ms, tflops=_tflops(flops, t_ms), ok=True,
                                    peer=True))
        _progress(rows)
        budget.save(rows)
        del experts, w13, w2
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    """One line per (case, variant): ms, TFLOP/s, vs DeepGEMM / cuBLAS / default (time ratios,
    > 1 = faster than that peer), the error; WRONG where over the tolerance."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault((r["kind"], r["shape"], r["m"]), {})[r["variant"]] = r
    lines = [f"{'case':<22} {'variant':<24} {'ms':>9} {'TFLOP/s':>8} {'/DG':>6} {'/cuBLAS':>8} {'/default':>8} "
             f"{'rel err':>9}"]
    for (kind, shape, m), vs in by_case.items():
        dg = next((v["ms"] for k, v in vs.items() if k.startswith("deepgemm")), float("nan"))
        cb = vs.get("cublas-nobias", {}).get("ms", float("nan"))
        df = vs.get("default", {}).get("ms", float("nan"))
        best = min((v["ms"] for k, v in vs.items() if v.get("ok") and not v.get("peer") and "rel" in v
                    and math.isfinite(v["ms"])),
                   default=float("nan"))
        for name, v in vs.items():
            t = v["ms"]
            wrong = not v.get("ok", True)

            def ratio(p, t=t, wrong=wrong):
                return "" if wrong or not math.isfinite(p) or not math.isfinite(t) else f"{p / t:.3f}"

            mark = " WRONG" if wrong else (" *" if t == best else "")
            err = f"{v['rel']:.2e}" if "rel" in v else ""
            lines.append(f"{kind + ' ' + shape + ' M=' + str(m):<22} {name:<24} {t * 1e3 if kind == 'dense' else t:>9.3f}"
                         f"{'us' if kind == 'dense' else 'ms'} {v['tflops']:>7.0f} {ratio(dg):>6} {ratio(cb):>8} "
                         f"{ratio(df):>8} {err:>9}{mark}" + (f" [{v['error']}]" if v.get("error") else ""))
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """The short form for the console: per case the default, our best correct variant and the peers
    (TFLOP/s, time ratios), any WRONG variant; per variant its geometric-mean speedup over the default
    (dense and MoE separately; a WRONG or failed case counts as missing)."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault((r["kind"], r["shape"], r["m"]), {})[r["variant"]] = r
    out = [f"{'case':<20} {'default':>8} {'best of ours':<26} {'TF/s':>5} {'xdef':>5} {'/DG':>5} {'/cuBLAS':>7}  wrong"]
    speedups: dict[tuple[str, str], list[float]] = {}
    for (kind, shape, m), vs in by_case.items():
        df = vs.get("default", {})
        ours = {k: v for k, v in vs.items() if not v.get("peer") and v.get("ok") and math.isfinite(v["ms"])}
        best = min(ours.items(), key=lambda kv: kv[1]["ms"], default=(None, None))
        dg = next((v["ms"] for k, v in vs.items() if k.startswith("deepgemm")), float("nan"))
        cb = vs.get("cublas-nobias", {}).get("ms", float("nan"))
        wrong = [k for k, v in vs.items() if not v.get("ok")]
        for k, v in ours.items():
            if df.get("ok") and math.isfinite(df.get("ms", float("nan"))):
                speedups.setdefault((kind, k), []).append(df["ms"] / v["ms"])
        if best[0] is None:
            out.append(f"{kind + ' ' + shape + ' M=' + str(m):<20} no correct variant; wrong: {', '.join(wrong)}")
            continue
        b = best[1]["ms"]
        out.append(f"{kind + ' ' + shape + ' M=' + str(m):<20} {df.get('tflops', float('nan')):>8.0f} {best[0]:<26} "
                   f"{best[1]['tflops']:>5.0f} {df.get('ms', float('nan')) / b:>5.2f} {dg / b:>5.2f} {cb / b:>7.2f}  "
                   + ", ".join(wrong))
    out.append("variant speedup over the default, geometric mean (min..max, cases):")
    for (kind, k), xs in sorted(speedups.items()):
        gm = math.exp(sum(math.log(x) for x in xs) / len(xs))
        out.append(f"  {kind:<5} {k:<26} {gm:.3f} ({min(xs):.2f}..{max(xs):.2f}, {len(xs)})")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write every row (with errors and times) here")
    p.add_argument("--quick", action="store_true", help="M 8192 and the 32- and 128-expert 8192-token MoE only")
    p.add_argument("--no-moe", action="store_true")
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--no-deepgemm", action="store_true", help="skip DeepGEMM (its JIT compiles ~10 s per config)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="skip the cases left after this many seconds (the device call's limit is 600)")
    args = p.parse_args()
    if args.no_deepgemm:
        global deep_gemm
        deep_gemm = None
    assert torch.cuda.is_available(), "the sweep runs on the GPU machine"
    budget = Budget(args.budget_s, args.json)
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, DeepGEMM {'importable' if deep_gemm else 'not importable'}",
          flush=True)
    rows: list[dict] = []
    # the MoE first when both run: its cases are the fewer and the larger share of a prefill
    if not args.no_moe:
        moe_rows(MOE_CASES[:2] if args.quick else MOE_CASES, g, budget, rows)
    if not args.no_dense:
        dense_rows([8192] if args.quick else DENSE_M, g, budget, rows)
    budget.save(rows)
    full = table(rows)
    if args.json:  # the full table beside the JSON; the console gets the summary (the call returns its tail)
        with open(os.path.splitext(args.json)[0] + ".txt", "w") as f:
            f.write(full + "\n")
    else:
        print(full)
    print(summary(rows))
    print(f"{time.time() - budget.t0:.0f} s; ratios are time ratios (> 1: this variant is faster than that peer); "
          f"* = fastest correct variant of ours in the case"
          + (f"; skipped past the budget: {', '.join(budget.skipped)}" if budget.skipped else ""), flush=True)


if __name__ == "__main__":
    main()
