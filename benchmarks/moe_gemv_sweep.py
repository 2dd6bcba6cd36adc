"""Decode-shaped MoE expert path sweep: ``moe_slots_skinny`` (kernels/moe_gemv.py) tile variants
against the current path ``moe.moe_expert_slots`` (moe_align + grouped gate_up + down), both from
x already quantized (``x_quant``), both bf16 [T*k, H] per-slot outputs with zero foreign rows.

Cases: gpt-oss 20b (E = 32) and 120b (E = 128) expert shapes, H = I = 2880, top-4, T = 1, 2, 4, 8,
16 tokens; random routing with distinct experts per token, a fresh routing per call. Variants:
``moe_skinny_tile``'s pick ("heuristic") and fixed tiles over BLOCK_N1 / BLOCK_N2 16 / 32 / 64 /
128, 2 / 4 / 8 warps, 2 / 3 / 4 / 6 stages, 1 / 2 / 4 K blocks a step (``MoeSkinnyTile``; BLOCK_N
16 / 32 runs mma.sync on fp8 widened to f16, 64+ fp8 wgmma).

Every variant's output (and the current path's) is checked before it is timed against the w8a8
specification ``spec.moe_experts_w8a8`` on the same inputs with tests/kernels/test_moe.py's GPU
tolerance (||y - ref|| / ||ref|| <= 5e-3, max |y - ref| <= 2e-2 max|ref|; outputs NaN-poisoned
first; the skinny path's fp8 wgmma and the grouped path's 16-row mma.sync tiles differ from each
other by ~4.4e-3 on these inputs, H200, the size of either against the spec): a variant over it is reported WRONG and not
timed, one that raises FAILED, with the error. Times: a CUDA graph of CALLS = 10 back-to-back calls,
each with its own routing, the median of ``--reps`` replays timed with CUDA events, divided by
CALLS (the current path through the same graph; event-timed eager calls if its capture fails, said
so in the row). The calls alternate between two copies of the experts, so an expert two calls
apart sits behind >= 200 MB of other weights (four times the H200's 50 MB L2) and the previous
call's experts are in the other copy: every call reads its experts from HBM. GB/s counts the fp8
weight bytes of the distinct experts each call touches (2I x H + H x I per expert, 24.9 MB);
"floor" is those bytes at 4.26 TB/s (the H200's measured device copy rate); "x cur" is the
current path's time over the variant's (> 1: faster).

On the GPU machine, from the repository root:

    PYTHONPATH=$(pwd) python3 benchmarks/moe_gemv_sweep.py --json $OUT/moe_gemv_sweep.json

(``--quick``: T = 1, 4, 8 and six variants.) On the H200 the quick form takes ~10 s once
compiled (thirteenth session; figures in BENCHMARKS.md "Decode"); the JSON is rewritten after
every case, and cases past ``--budget`` seconds are skipped (and listed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from gptoss_fp8 import spec
from gptoss_fp8.bench.kernels_gemm import rel_errors as _rel
from gptoss_fp8.kernels.act_quant import act_quant
from gptoss_fp8.kernels.config import KernelConfig
from gptoss_fp8.kernels.moe import moe_expert_slots
from gptoss_fp8.kernels.moe_gemv import MoeSkinnyTile, moe_skinny_tile, moe_slots_skinny
from gptoss_fp8.quant.fp8 import quantize_weight_blocks

HIDDEN, INTER, TOP_K = 2880, 2880, 4
MODELS = {"20b": 32, "120b": 128}
TOKENS = [1, 2, 4, 8, 16]
CALLS, COPIES = 10, 2
COPY_BW = 4.26e12  # bytes/s, the H200's device-to-device copy (bench/kernels_attention.COPY_BW)
EXPERT_BYTES = 2 * INTER * HIDDEN + HIDDEN * INTER
TOL_NORM, TOL_MAX = 5e-3, 2e-2  # against spec.moe_experts_w8a8: tests/kernels/test_moe.py's GPU tolerance
GROUPED = KernelConfig(moe_skinny_max_slots=None)  # the grouped path (decode-sized calls go to moe_gemv by default)

# name -> tile (None: moe_skinny_tile's pick)
VARIANTS: dict[str, MoeSkinnyTile | None] = {
    "heuristic": None,
    "64/64": MoeSkinnyTile(64, 64),
    "128/128": MoeSkinnyTile(128, 128),
    "64/128": MoeSkinnyTile(64, 128),
    "128/64": MoeSkinnyTile(128, 64),
    "32/32": MoeSkinnyTile(32, 32),
    "32/64": MoeSkinnyTile(32, 64),
    "64/32": MoeSkinnyTile(64, 32),
    "64/64 s3": MoeSkinnyTile(64, 64, num_stages=3),
    "64/64 s6": MoeSkinnyTile(64, 64, num_stages=6),
    "64/64 w8": MoeSkinnyTile(64, 64, num_warps=8),
    "128/128 w8 s3": MoeSkinnyTile(128, 128, num_warps=8, num_stages=3),
    "128/128 s6": MoeSkinnyTile(128, 128, num_stages=6),
    # exact (mma.sync) tiles with more programs: an even spread over the SMs (fourteenth session)
    "16/16": MoeSkinnyTile(16, 16),
    "16/32": MoeSkinnyTile(16, 32),
    "32/16": MoeSkinnyTile(32, 16),
    "16/16 s6": MoeSkinnyTile(16, 16, num_stages=6),
    "16/16 w2": MoeSkinnyTile(16, 16, num_warps=2),
    "32/32 s6": MoeSkinnyTile(32, 32, num_stages=6),
    "32/32 w2": MoeSkinnyTile(32, 32, num_warps=2),
    # two / four 128-wide K blocks a step: 256 / 512 contiguous bytes of each weight row together
    "32/32 k2": MoeSkinnyTile(32, 32, k_step=2),
    "32/32 s2 k2": MoeSkinnyTile(32, 32, num_stages=2, k_step=2),
    "32/32 k4": MoeSkinnyTile(32, 32, num_stages=2, k_step=4),
    "32/32 w2 k2": MoeSkinnyTile(32, 32, num_warps=2, k_step=2),
    # the shipped one-token tile (2 warps, 4 stages: 3 K blocks in flight) against 4 blocks in
    # flight three ways: contiguity (128 / 256 / 512 bytes of a row a step) at equal depth
    "32/32 w2 s5": MoeSkinnyTile(32, 32, num_warps=2, num_stages=5),
    "32/32 w2 s3 k2": MoeSkinnyTile(32, 32, num_warps=2, num_stages=3, k_step=2),
    "32/32 w2 s2 k4": MoeSkinnyTile(32, 32, num_warps=2, num_stages=2, k_step=4),
    "64/64 s3 k2": MoeSkinnyTile(64, 64, num_stages=3, k_step=2),
}
QUICK = ["heuristic", "64/64", "128/128", "64/128", "32/32", "64/64 s6"]


def _experts(e: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random fp8 experts (pow2 128x128 blocks) and bf16 biases, quantized 8 experts at a time."""

    def stacked(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [quantize_weight_blocks(torch.randn(min(8, e - j), n, k, device="cuda", generator=g) * k**-0.5)
                 for j in range(0, e, 8)]  # fmt: skip
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    w13, s13 = stacked(2 * INTER, HIDDEN)
    w2, s2 = stacked(HIDDEN, INTER)
    b13 = (0.5 * torch.randn(e, 2 * INTER, device="cuda", generator=g)).to(torch.bfloat16)
    b2 = (0.2 * torch.randn(e, HIDDEN, device="cuda", generator=g)).to(torch.bfloat16)
    return w13, s13, b13, w2, s2, b2


def _routing(t: int, e: int, g: torch.Generator) -> torch.Tensor:
    """int32 [t, TOP_K]: distinct experts per token, uniformly at random."""
    return torch.argsort(torch.rand(t, e, device="cuda", generator=g), dim=1)[:, :TOP_K].to(torch.int32).contiguous()


def _us_graph(fns: list, reps: int) -> tuple[float, bool]:
    """(median us per call of fns called in turn, replayed as one CUDA graph; True) or, where the
    capture fails, (the event-timed median of the eager sequence, False)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and warms up outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        run, graphed = graph.replay, True
    except RuntimeError as ex:  # the current path's host-side work may refuse capture: time it eagerly
        print(f"  (graph capture failed, eager event timing: {str(ex)[:120]})", flush=True)
        torch.cuda.synchronize()

        def run():
            for f in fns:
                f()

        graphed = False
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times), graphed


def sweep_case(model: str, e: int, t: int, copies: list[tuple], variants: list[str], reps: int,
               g: torch.Generator) -> list[dict]:  # fmt: skip
    """Rows of one (model, T) case: the current path, then every variant."""
    x = [(torch.randn(t, HIDDEN, device="cuda", generator=g) * 2).to(torch.bfloat16) for _ in range(CALLS)]
    xq = [act_quant(xc) for xc in x]
    ids = [_routing(t, e, g) for _ in range(CALLS)]
    distinct = sum(len(set(r.reshape(-1).tolist())) for r in ids)
    nbytes = distinct * EXPERT_BYTES / CALLS  # per call
    case = dict(
        model=model,
        experts=e,
        tokens=t,
        slots=t * TOP_K,
        distinct_per_call=distinct / CALLS,
        weight_mb=nbytes / 1e6,
        floor_us=nbytes / COPY_BW * 1e6,
    )

    def current(j: int) -> torch.Tensor:
        return moe_expert_slots(x[j], ids[j], *copies[j % COPIES], config=GROUPED, x_quant=xq[j])

    # the w8a8 specification per slot (fp32, bias included, rounded once to bf16)
    refs = [spec.moe_experts_w8a8(x[j], ids[j], *copies[j % COPIES], 0, 7.0, xq=xq[j])[0].reshape(t * TOP_K, HIDDEN)
            for j in range(CALLS)]
    for j in range(CALLS):  # the grouped path, checked the same way
        rel, mx = _rel(current(j), refs[j])
        assert rel <= TOL_NORM and mx <= TOL_MAX, f"the grouped path against the spec: {rel:.2e}, max {mx:.2e}"
    cur_us, graphed = _us_graph([lambda j=j: current(j) for j in range(CALLS)], reps)
    rows = [case | dict(variant="current", us=cur_us, gbs=nbytes / cur_us / 1e3, x_cur=1.0, ok=True, graphed=graphed)]
    outs = [torch.empty((t * TOP_K, HIDDEN), dtype=torch.bfloat16, device="cuda") for _ in range(CALLS)]
    for name in variants:
        tile = VARIANTS[name]
        picked = tile or moe_skinny_tile(t * TOP_K, 2 * INTER, HIDDEN, torch.cuda.get_device_properties(0).multi_processor_count)

        def skinny(j: int, tile=tile) -> torch.Tensor:
            return moe_slots_skinny(*xq[j], ids[j], *copies[j % COPIES], 0, 7.0, outs[j], True, tile)

        row = case | dict(variant=name, tile=f"{picked.block_n1}/{picked.block_n2} w{picked.num_warps} s{picked.num_stages}")
        try:
            worst = (0.0, 0.0)
            for j in range(CALLS):
                outs[j].fill_(float("nan"))
                rel, mx = _rel(skinny(j), refs[j])
                worst = (max(worst[0], rel), max(worst[1], mx))
            row |= dict(rel=worst[0], max_rel=worst[1], ok=worst[0] <= TOL_NORM and worst[1] <= TOL_MAX)
            if row["ok"]:
                us, graphed = _us_graph([lambda j=j: skinny(j) for j in range(CALLS)], reps)
                row |= dict(us=us, gbs=nbytes / us / 1e3, x_cur=cur_us / us, graphed=graphed)
        except Exception as ex:  # noqa: BLE001 - a failing variant is reported, the sweep goes on
            row |= dict(ok=False, error=f"{type(ex).__name__}: {str(ex)[:300]}")
        rows.append(row)
    return rows


def _print_case(rows: list[dict]) -> None:
    c = rows[0]
    print(f"{c['model']} T={c['tokens']} ({c['slots']} slots, {c['distinct_per_call']:.1f} experts, "
          f"{c['weight_mb']:.0f} MB, floor {c['floor_us']:.1f} us)", flush=True)  # fmt: skip
    for r in rows:
        if "us" in r:
            print(f"  {r['variant']:>14} {r.get('tile', ''):>16} {r['us']:8.1f} us {r['gbs']:7.0f} GB/s "
                  f"x cur {r['x_cur']:5.2f}" + ("" if r["graphed"] else " (eager)"), flush=True)  # fmt: skip
        else:
            what = "FAILED " + r["error"] if "error" in r else f"WRONG rel {r['rel']:.1e} max {r['max_rel']:.1e}"
            print(f"  {r['variant']:>14} {r.get('tile', ''):>16} {what}", flush=True)


def _save(path: str | None, rows: list[dict], skipped: list[str], t0: float) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(dict(rows=rows, skipped=skipped, seconds=time.time() - t0), f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T = 1, 4, 8 and six variants")
    ap.add_argument("--json", help="write the rows here (rewritten after every case)")
    ap.add_argument("--reps", type=int, default=30, help="graph replays per measurement (median)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds; later cases are skipped")
    ap.add_argument("--variants", help="comma-separated variant names (default: all, or --quick's)")
    ap.add_argument("--tokens", help="comma-separated token counts (default: 1,2,4,8,16, or --quick's)")
    ap.add_argument("--models", default="20b,120b")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_gemv_sweep needs a CUDA GPU (the H200)")
    t0 = time.time()
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else [1, 4, 8] if args.quick else TOKENS
    variants = args.variants.split(",") if args.variants else QUICK if args.quick else list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    rows: list[dict] = []
    skipped: list[str] = []
    for model, e in MODELS.items():
        if model not in args.models.split(","):
            continue
        copies = [_experts(e, g) for _ in range(COPIES)]
        for t in tokens:
            if time.time() - t0 > args.budget:
                skipped.append(f"{model} T={t}")
                print(f"budget spent: skipping {model} T={t}", flush=True)
                continue
            case_rows = sweep_case(model, e, t, copies, variants, args.reps, g)
            _print_case(case_rows)
            rows += case_rows
            _save(args.json, rows, skipped, t0)
        del copies
        torch.cuda.empty_cache()
    _save(args.json, rows, skipped, t0)
    print(f"done in {time.time() - t0:.0f} s" + (f"; skipped {', '.join(skipped)}" if skipped else ""), flush=True)


if __name__ == "__main__":
    main()
