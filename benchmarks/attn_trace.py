"""Where a step of the FP8 attention kernel's consumer warpgroups goes, from the SM clock (issue 34).

``ws_attention_prefill_fp8(trace=...)`` compiles a variant that reads the SM clock at eight points of each
128-key step of head 0's programs (``attention_ws_fp8._stamp``) and stores them; this runs it on random
inputs and prints, per warpgroup, the median cycles of each phase of a step and how often the three
warpgroups of a program are in their exponential phase at once. Slots (a step's record):

    0 top of the step        1 its two K / V stages ready   2 QK^T waited for    3 row max (m_new) known
    4 the MUFU turn taken    5 the turn passed on           6 PV issued          7 PV waited for

(2, 5, 6, 7 sit where ptxas placed the clock read: after the wgmma wait, the arrive, the PV wgmmas, the
wait; 3 and 4 depend on their values.) fp8-lin's forms with codes first (``exp_lin`` 4-6: no exponential, no
turn) stamp 3 to 6 at one point, once the step's codes and m are known (the warpgroup's flag reduced), and 7
once the PV and row-sum products are waited for and added: their "row max" is the codes' phase, "PV wait" the
packing, the PV's issue and its wait. The clock reads and stores cost a few percent: the traced
kernel's time is printed beside the untraced one. Usage (GPU):

    python3 benchmarks/attn_trace.py [--tokens 32768] [--variant turns=0,...] [--json out.json]
    python3 benchmarks/attn_trace.py --tokens 32768 --variant exp_lin=5,turns=0   (fp8-lin's default form)
"""

from __future__ import annotations

import argparse
import ast
import json

import numpy as np
import torch

from gptoss_fp8.kernels.attention_ws_fp8 import NWG, WG_ROWS, ws_attention_prefill_fp8
from gptoss_fp8.quant.fp8 import cdiv

D = 64
PHASES = ["ready wait", "QK^T", "row max", "turn wait", "exp until pass", "exp rest + cvt + PV issue",
          "PV wait", "acc update + loop"]


def _opts(text: str) -> dict:
    out = {}
    for kv in filter(None, text.split(",")):
        key, val = kv.split("=")
        out[key] = ast.literal_eval(val)
    return out


def _time(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e))
    return best


def analyse(tr: np.ndarray, n_steps: np.ndarray, skip: int = 2) -> dict:
    """tr [programs, NWG, steps, 8] uint32 clocks; n_steps [programs, NWG] steps each warpgroup ran.
    -> per-phase median / mean cycles over the steady steps (the first / last ``skip`` of each warpgroup
    left out: the ring filling, the diagonal), the step period, and the share of time 0..3 warpgroups
    spend in their exponential phase (slot 4 to 6) at once."""
    phases = {w: [[] for _ in range(8)] for w in range(NWG)}
    period = {w: [] for w in range(NWG)}
    overlap = np.zeros(NWG + 1)
    for p in range(tr.shape[0]):
        for w in range(NWG):
            n = int(n_steps[p, w])
            for i in range(skip, n - skip):
                r = tr[p, w, i].astype(np.int64)
                d = [(int(r[k + 1]) - int(r[k])) % 2**32 for k in range(7)]
                d.append((int(tr[p, w, i + 1, 0]) - int(r[7])) % 2**32)
                for k in range(8):
                    phases[w][k].append(d[k])
                period[w].append((int(tr[p, w, i + 1, 0]) - int(r[0])) % 2**32)
        # exponential phases of the three warpgroups on one timeline (cycles relative to the program's first stamp)
        lo = min(int(tr[p, w, 0, 0]) for w in range(NWG) if n_steps[p, w] > 0)
        ivs = []
        ends = []
        for w in range(NWG):
            n = int(n_steps[p, w])
            if n <= 2 * skip:
                continue
            for i in range(skip, n - skip):
                a = (int(tr[p, w, i, 4]) - lo) % 2**32
                b = (int(tr[p, w, i, 6]) - lo) % 2**32
                ivs.append((a, +1))
                ivs.append((b, -1))
            ends.append(((int(tr[p, w, skip, 0]) - lo) % 2**32, (int(tr[p, w, n - skip, 0]) - lo) % 2**32))
        if not ivs:
            continue
        t0 = max(e[0] for e in ends)
        t1 = min(e[1] for e in ends)  # the window where every warpgroup runs steady steps
        ivs.sort()
        cur, last = 0, None
        for t, dlt in ivs:
            if last is not None:
                a, b = max(last, t0), min(t, t1)
                if b > a:
                    overlap[min(cur, NWG)] += b - a
            cur += dlt
            last = t
    out = {"per_warpgroup": {}, "overlap": (overlap / max(overlap.sum(), 1)).round(3).tolist()}
    for w in range(NWG):
        if not period[w]:
            continue
        out["per_warpgroup"][w] = {
            "steps": len(period[w]),
            "period_median": float(np.median(period[w])),
            "phases_median": {PHASES[k]: float(np.median(phases[w][k])) for k in range(8)},
            "phases_mean": {PHASES[k]: round(float(np.mean(phases[w][k])), 1) for k in range(8)},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--variant", default="", help="ws_attention_prefill_fp8 keywords, e.g. turns=0")
    ap.add_argument("--programs", type=int, default=48, help="analyse this many of head 0's programs (the longest)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    T, hq, hkv = args.tokens, 64, 8
    opts = _opts(args.variant)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, hq, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(T, hkv, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(T, hkv, D, device="cuda", generator=g).bfloat16()
    sinks = torch.randn(hq, device="cuda", generator=g)
    out = torch.empty_like(q)
    npm = cdiv(T, NWG * WG_ROWS)
    steps = cdiv(cdiv(T, 64), 2)
    trace = torch.zeros(npm, NWG, steps + 1, 8, dtype=torch.int32, device="cuda")
    plain = _time(lambda: ws_attention_prefill_fp8(q, k, v, sinks, out, D ** -0.5, **opts))
    ref = out.clone()
    traced = _time(lambda: ws_attention_prefill_fp8(q, k, v, sinks, out, D ** -0.5, trace=trace, **opts))
    same = bool(torch.equal(out, ref))
    tr = trace.cpu().numpy().view(np.uint32)
    # steps each warpgroup ran: program p (pid 1) holds query rows m0 .. m0 + 191, m0 = (npm - 1 - p) * 192
    n_steps = np.zeros((npm, NWG), dtype=np.int64)
    for p in range(npm):
        m0 = (npm - 1 - p) * NWG * WG_ROWS
        for w in range(NWG):
            r0 = m0 + w * WG_ROWS
            n_blocks = cdiv(min(m0 + NWG * WG_ROWS, T), 64)
            n_steps[p, w] = cdiv(min(r0 // 64 + 1, n_blocks), 2) if r0 < T else 0
    sel = slice(0, min(args.programs, npm))  # program 0 runs the longest rows first
    res = analyse(tr[sel], n_steps[sel])
    pairs = hq * T * (T + 1) / 2
    res.update(tokens=T, variant=args.variant, ms_plain=round(plain, 3), ms_traced=round(traced, 3),
               pairs_per_s=pairs / plain * 1e3, output_identical=same)
    print(f"T={T} variant='{args.variant}': {plain:.3f} ms untraced ({pairs / plain * 1e3:.3e} pairs/s), "
          f"{traced:.3f} ms traced; outputs identical: {same}")
    for w, r in res["per_warpgroup"].items():
        print(f"  warpgroup {w}: {r['steps']} steady steps, period median {r['period_median']:.0f} cycles")
        print("    " + " | ".join(f"{k} {v:.0f}" for k, v in r["phases_median"].items()))
        print("    mean: " + " | ".join(f"{v:.0f}" for v in r["phases_mean"].values()))
    print("  share of time with 0 / 1 / 2 / 3 warpgroups in their exponential phase (slot 4 to 6):",
          " / ".join(f"{x:.3f}" for x in res["overlap"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
