"""Decode-shaped dense FP8 GEMM sweep: ``fp8_gemm_skinny`` (kernels/fp8_gemv.py) variants against
``fp8_gemm``'s default tile and cuBLAS blockwise ``torch._scaled_mm``.

Cases: M in 1 / 4 / 16 / 64 x (N, K) in 5120x2880 (qkv), 2880x4096 (o_proj), 5760x2880; with
``--shards`` also the tensor-parallel shards 2560x2880, 1280x2880, 640x2880, 2880x2048. Variants of
the skinny kernel, in two passes per case: a coarse grid (BLOCK_N 32 / 64 / 128 x split_k 1 / 2 / 4
/ 8 / 16 x pointer or TMA weight loads, 4 warps, 4 stages), then warps 4 / 8 x stages 3 / 4 / 6
around the best coarse variant; plus ``skinny_tile``'s pick ("heuristic"), ``fp8_gemm`` with
``config=None`` ("fp8_gemm", whatever its dispatch picks today) and cuBLAS blockwise (no bias, K
zero-padded to a multiple of 128 where it refuses the unpadded K; skipped if it refuses the call).
Split counts above ceil(K/128) are clamped by the launcher, so they are measured once.

Every variant's output (bf16, with a bf16 bias) is checked before it is timed against
``block_gemm_reference`` in fp32 with the GPU tolerances of tests/kernels/test_fp8_gemv.py
(elementwise 2^-8 |ref| + 1e-3 max|ref|, ||y - ref|| / ||ref|| <= 2e-3; outputs NaN-poisoned first):
a variant that fails the check is reported WRONG and not timed, one that raises (does not compile,
out of resources) FAILED, with the error. Times: a CUDA graph of >= 20 back-to-back calls, the median
of ``--reps`` replays timed with CUDA events, divided by the number of calls. The calls rotate over
enough weight copies that each copy is reused only after >= 150 MB of other weights (three times the
H200's 50 MB L2), so every call reads its weight from HBM; x is shared (L2-resident, as at decode).
GB/s counts the weight's N * K bytes only.

On the GPU machine, from the repository root:

    PYTHONPATH=$(pwd) python3 benchmarks/skinny_sweep.py --json $OUT/skinny_sweep.json

(``--quick``: M 1 and 16 and a smaller coarse grid, no second pass.) On the H200 the quick form
takes ~20 s (thirteenth session; figures in BENCHMARKS.md "Decode"). Its cuBLAS column
gave WRONG outputs for K = 2880 there (unpadded K, as in benchmarks/gemm_sweep.py); both now pad
K (bench/kernels_gemm.py ``cublas_blockwise``), not yet re-run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch

from gptoss_fp8.bench.kernels_attention import _ms_graph
from gptoss_fp8.bench.kernels_gemm import cublas_blockwise
from gptoss_fp8.kernels import sm_count
from gptoss_fp8.kernels.config import KernelConfig
from gptoss_fp8.kernels.fp8_gemm import fp8_gemm
from gptoss_fp8.kernels.fp8_gemv import SkinnyTile, fp8_gemm_skinny, skinny_tile
from gptoss_fp8.quant.fp8 import block_gemm_reference, cdiv, quantize_act, quantize_weight_blocks

SHAPES = [("qkv", 5120, 2880), ("o_proj", 2880, 4096), ("5760", 5760, 2880)]
SHARDS = [("tp2-2560", 2560, 2880), ("tp4-1280", 1280, 2880), ("tp8-640", 640, 2880), ("o-tp2-2048", 2880, 2048)]
MS = [1, 4, 16, 64]
QUICK_MS = [1, 16]
L2_BYTES = 50 * 2**20
MIN_CALLS = 20
DEV = "cuda"

NO_SKINNY = KernelConfig(dense_skinny_max_rows=None)  # fp8_gemm's Triton tiles at every M


def coarse_variants(quick: bool) -> list[SkinnyTile]:
    bns, splits = ((32, 64), (1, 4, 8)) if quick else ((32, 64, 128), (1, 2, 4, 8, 16))
    return [SkinnyTile(bn, s, 4, 4, tma) for bn in bns for s in splits for tma in (False, True)]


def fine_variants(best: SkinnyTile) -> list[SkinnyTile]:
    return [dataclasses.replace(best, num_warps=w, num_stages=st) for w in (4, 8) for st in (3, 4, 6)]


def tile_name(t: SkinnyTile) -> str:
    return f"bn{t.block_n}-s{t.split_k}-w{t.num_warps}-st{t.num_stages}{'-tma' if t.tma else ''}"


def check(y: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """(within the GPU test tolerances, ||y - ref|| / ||ref||)."""
    y, ref = y.float(), ref.float()
    if torch.isnan(y).any():
        return False, float("inf")
    err = (y - ref).abs()
    rel = ((y - ref).norm() / ref.norm()).item()
    ok = bool((err <= 2.0**-8 * ref.abs() + 1e-3 * ref.abs().max()).all()) and rel <= 2e-3
    return ok, rel


def time_calls(calls: list, reps: int) -> float:
    """us per call: a CUDA graph of ``calls`` in order, median of ``reps`` event-timed replays
    (bench/kernels_attention.py ``_ms_graph``: warm-up on a side stream, then the capture)."""
    return _ms_graph(calls, reps) * 1e3


class Case:
    """One (M, N, K) problem: x, bias, ``copies`` weight copies (copy 0 checked), its fp32 reference."""

    def __init__(self, m: int, n: int, k: int, seed: int):
        self.m, self.n, self.k = m, n, k
        g = torch.Generator(device=DEV).manual_seed(seed)
        x = torch.randn(m, k, device=DEV, generator=g) * (1 + 3 * torch.rand(m, 1, device=DEV, generator=g))
        self.x, self.x_s = quantize_act(x)
        self.bias = (torch.randn(n, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
        self.copies = max(4, math.ceil(3 * L2_BYTES / (n * k)))
        self.ncalls = self.copies * cdiv(MIN_CALLS, self.copies)
        self.w = [quantize_weight_blocks(torch.randn(n, k, device=DEV, generator=g) * 0.05) for _ in range(self.copies)]
        self.ref = block_gemm_reference(self.x, self.x_s, *self.w[0], self.bias, torch.float32)
        self.ref_nobias = block_gemm_reference(self.x, self.x_s, *self.w[0], None, torch.float32)
        self.out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)

    def calls(self, fn) -> list:
        """The graph's calls: ``fn(copy index)`` rotating over the weight copies."""
        return [lambda i=i: fn(i % self.copies) for i in range(self.ncalls)]


def first_line(ex: Exception) -> str:
    text = str(ex).strip()
    return text.splitlines()[0][:160] if text else ""


def measure(case: Case, fn, ref: torch.Tensor, reps: int) -> dict:
    """Check ``fn(copy index)`` (returns its output) on copy 0, then time it over the copies."""
    try:
        case.out.fill_(float("nan"))
        y = fn(0)
        torch.cuda.synchronize()
    except Exception as ex:  # noqa: BLE001 - a variant that does not compile or launch is reported, not fatal
        return {"status": f"FAILED {type(ex).__name__}: {first_line(ex)}"}
    ok, rel = check(y, ref)
    if not ok:
        return {"status": "WRONG", "rel_err": rel}
    us = time_calls(case.calls(fn), reps)
    return {"status": "ok", "rel_err": rel, "us": us, "gbps": case.n * case.k / (us * 1e-6) / 1e9}


def cublas_fn(case: Case):
    """cuBLAS blockwise FP8 (no bias) as ``fn(copy index)`` (bench/kernels_gemm.py
    ``cublas_blockwise``: K padded to the 128 grid, the unpadded K = 2880 gives wrong values); None
    (the reason printed) when torch refuses it."""
    fns = [cublas_blockwise(case.x, case.x_s, w, s) for w, s in case.w]
    try:
        fns[0]()
    except (RuntimeError, ValueError, NotImplementedError) as ex:
        print(f"  cuBLAS blockwise refused: {first_line(ex)}", flush=True)
        return None
    return lambda i: fns[i]()


def run_case(name: str, m: int, n: int, k: int, quick: bool, reps: int, with_cublas: bool) -> list[dict]:
    case = Case(m, n, k, seed=m * 131 + n + k)
    sms = sm_count(torch.device(DEV))
    base = {"shape": name, "m": m, "n": n, "k": k}
    rows = []

    def skinny(tile: SkinnyTile):
        return lambda i: fp8_gemm_skinny(case.x, case.x_s, *case.w[i], case.bias, case.out, tile=tile)

    def add(label: str, kind: str, fn, ref, tile: SkinnyTile | None = None) -> dict:
        r = {**base, "variant": label, "kind": kind, **(dataclasses.asdict(tile) if tile else {})}
        r |= measure(case, fn, ref, reps)
        rows.append(r)
        us = f"{r['us']:8.2f} us {r['gbps']:7.0f} GB/s" if "us" in r else r["status"]
        print(f"  {label:28s} {us}", flush=True)
        return r

    print(f"{name} M={m} N={n} K={k} ({case.copies} weight copies, {case.ncalls} calls per graph)", flush=True)
    # fp8_gemm without its skinny dispatch: the Triton small-M tile decode used before fp8_gemv
    add("fp8_gemm", "fp8_gemm", lambda i: fp8_gemm(case.x, case.x_s, *case.w[i], case.bias, out=case.out,
                                                   config=NO_SKINNY), case.ref)
    if with_cublas:
        f = cublas_fn(case)
        if f is not None:
            add("cublas-blockwise(no bias)", "cublas", f, case.ref_nobias)
    heur = skinny_tile(m, n, k, sms)
    add(f"heuristic:{tile_name(heur)}", "heuristic", skinny(heur), case.ref, heur)
    seen = set()
    kb = cdiv(k, 128)

    def sweep(tiles: list[SkinnyTile]) -> None:
        for t in tiles:
            t = dataclasses.replace(t, split_k=min(t.split_k, kb))  # what the launcher runs
            if t not in seen:
                seen.add(t)
                add(tile_name(t), "skinny", skinny(t), case.ref, t)

    sweep(coarse_variants(quick))
    if not quick:
        timed = [r for r in rows if r["kind"] == "skinny" and "us" in r]
        if timed:
            b = min(timed, key=lambda r: r["us"])
            sweep(fine_variants(SkinnyTile(b["block_n"], b["split_k"], b["num_warps"], b["num_stages"], b["tma"])))
    return rows


def summary(rows: list[dict]) -> None:
    print(
        "\nshape      M | fp8_gemm us | cuBLAS us | heuristic us | best skinny us (GB/s)             | best/fp8_gemm | heur/best"
    )
    keys = list(dict.fromkeys((r["shape"], r["m"]) for r in rows))  # in run order
    for shape, m in keys:
        rs = [r for r in rows if r["shape"] == shape and r["m"] == m]

        def us_of(kind, rs=rs):
            t = [r["us"] for r in rs if r["kind"] == kind and "us" in r]
            return min(t) if t else float("nan")

        sk = [r for r in rs if r["kind"] in ("skinny", "heuristic") and "us" in r]
        best = min(sk, key=lambda r: r["us"]) if sk else None
        b = f"{best['us']:6.2f} {best['variant'][:24]:24s} ({best['gbps']:5.0f})" if best else "none"
        ratio = best["us"] / us_of("fp8_gemm") if best else float("nan")
        heur = us_of("heuristic") / best["us"] if best else float("nan")
        print(
            f"{shape:10s} {m:2d} | {us_of('fp8_gemm'):11.2f} | {us_of('cublas'):9.2f} | "
            f"{us_of('heuristic'):12.2f} | {b} | {ratio:13.2f} | {heur:9.2f}"
        )
    bad = [r for r in rows if r["status"] != "ok"]
    for r in bad:
        print(f"not timed: {r['shape']} M={r['m']} {r['variant']}: {r['status']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="M 1 and 16, a smaller coarse grid, no second pass")
    ap.add_argument("--shards", action="store_true", help="also the tensor-parallel shard shapes")
    ap.add_argument("--no-cublas", action="store_true", help="skip torch._scaled_mm blockwise")
    ap.add_argument("--reps", type=int, default=15, help="graph replays per variant (median)")
    ap.add_argument("--json", metavar="PATH", help="write every row (variant, tile, us, GB/s, status) here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("skinny_sweep needs a CUDA GPU (an H200 for the figures the kernels are tuned on)")
    shapes = SHAPES + (SHARDS if args.shards else [])
    ms = QUICK_MS if args.quick else MS
    print(f"{torch.cuda.get_device_name()}, {sm_count(torch.device('cuda'))} SMs", flush=True)
    rows = []
    for name, n, k in shapes:
        for m in ms:
            rows += run_case(name, m, n, k, args.quick, args.reps, not args.no_cublas)
            torch.cuda.empty_cache()  # the case's weight copies are gone: give their memory back
    summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "sms": sm_count(torch.device("cuda")), "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
