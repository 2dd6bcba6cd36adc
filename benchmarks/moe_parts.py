"""The prefill MoE's parts on the GPU at the 20b's shapes (issue 34: where the MoE's 18% of a 128000-token prefill goes).

1. ``gather_act_quant`` (the gate_up's A rows copied from the norm's FP8 rows into sorted order) per program tile
   (rows, groups of 128 columns), event medians, with the bytes it moves a second; then walking the tokens in order
   (``slot_rows=``, ``KernelConfig.moe_gather_by_token``) per tile (tokens, columns a step), and moe_align against
   moe_align_rows (the slot -> row map it needs);
2. with --seconds S: ``moe_expert_slots`` (gather, gate_up, down) launched back to back for S seconds, so that
   benchmarks/clock_watch.py around this script reads the clock and board power the MoE holds (at the power cap?);
3. with --plans S: each of PLANS (the launches' tiles: ring depth, tile order, persistent programs) launched back
   to back for S seconds, two passes interleaved, each checked against the default's output first. At the 700 W
   cap a launch's time back to back is its energy: a tile that wins a short burst can lose here.

4. with --launch PLAN: that plan (a key of PLANS, or a prefix of one) launched --launches times and nothing else
   timed (for Nsight Compute to pick one launch of its gate_up / down: gpu_suite.sh moe-ncu-plans).

    PYTHONPATH=$(pwd) python3 benchmarks/moe_parts.py [--tokens 32768] [--experts 32] [--seconds 5] [--plans 3]
        [--only gather,stage]

Each tile's output is compared with the 16 x 1 tile's (bit for bit) before it is timed.
"""

from __future__ import annotations

import argparse

import torch
import triton
from clock_watch import back_to_back

from gptoss_fp8 import spec
from gptoss_fp8.kernels.act_quant import act_quant
from gptoss_fp8.kernels.config import DEFAULT, GluonTile, KernelConfig, MoePlan, TritonTile
from gptoss_fp8.kernels.moe import gather_act_quant, gather_by_token_tile, gather_tile, moe_expert_slots
from gptoss_fp8.kernels.moe_align import moe_align, moe_align_rows
from gptoss_fp8.quant.fp8 import quantize_weight_blocks

HIDDEN, INTER, TOP_K = 2880, 2880, 4
TILES = [(16, 1), (16, 4), (32, 4), (32, 8), (8, 23), (4, 23), (16, 23), (8, 12)]
BY_TOKEN_TILES = [(16, 128), (8, 128), (32, 128), (8, 256), (16, 256), (4, 512), (8, 512), (32, 64)]


def _wide(gather: bool = False, **kw) -> MoePlan:
    """The heavy-load plan (128-row segments, wide gate_up + Gluon down) with ``kw`` changed in both tiles;
    ``gather``: the gate_up copies its A rows from the tokens' own (``GluonTile.gather``)."""
    base = dict(stages=4, group_m=16, block_m=128, promote="serial") | kw
    return MoePlan(128, GluonTile(**base, gather=gather), GluonTile(**base))


PLANS = {
    "default": None,
    "gather by token (the pre-gathered rows written walking the tokens)": KernelConfig(moe_gather_by_token=True),
    "thread release (each consumer thread releases its stages)": _wide(stage_scales=True, thread_release=True),
    "balance": _wide(balance=True),
    "group_m 8 (before the 27th session)": _wide(group_m=8),
    "group_m 32": _wide(group_m=32),
    "stages 3": _wide(stages=3),
    "turns (the warpgroups' wgmmas in turns)": _wide(turns=True),
    "stage scales (the scales through the stages, TMA)": _wide(stage_scales=True),
    "stage scales, group_m 8": _wide(stage_scales=True, group_m=8),
    "stage scales, group_m 32 (one 120b expert's ~32 row tiles at 128000 tokens)": _wide(stage_scales=True, group_m=32),
    "stage scales, group_m 64": _wide(stage_scales=True, group_m=64),
    "turns + stage scales": _wide(turns=True, stage_scales=True),
    "gather + stage scales (the gate_up's 4-warp producer copies rows and row scales)": _wide(True, stage_scales=True),
    "gather (its consumers load the tokens' row scales)": _wide(True),
    "gather + stage scales, group_m 8": _wide(True, stage_scales=True, group_m=8),
    "gather + stage scales, group_m 32": _wide(True, stage_scales=True, group_m=32),
    "64x256 gate_up + Triton down": MoePlan(64, GluonTile(promote="serial"), TritonTile(64, 128, group_m=8, num_warps=4,
                                                                                         num_stages=4)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=0.0)
    ap.add_argument("--plans", type=float, default=0.0, help="seconds back to back for each of PLANS (0: none)")
    ap.add_argument("--launch", default=None, help="only launch this plan (a PLANS key or its prefix), --launches times")
    ap.add_argument("--launches", type=int, default=8)
    ap.add_argument("--pad-rows", type=int, default=0, help="the norm's FP8 rows (x_quant) in rows of this many bytes "
                                                             "(a multiple of 128 >= the hidden size; 0: unpadded)")
    ap.add_argument("--only", default=None, help="with --plans: only the default and the plans whose names start with "
                                                 "one of these comma-separated prefixes")
    a = ap.parse_args()
    plans = PLANS if a.only is None else {
        name: p for name, p in PLANS.items() if name == "default" or name.startswith(tuple(a.only.split(",")))}
    g = torch.Generator(device="cuda").manual_seed(0)
    t, e = a.tokens, a.experts
    x = (1.5 * torch.randn(t, HIDDEN, device="cuda", generator=g)).to(torch.bfloat16)
    wr = (torch.randn(e, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).to(torch.bfloat16)
    br = (0.1 * torch.randn(e, device="cuda", generator=g)).to(torch.bfloat16)
    _, ids, _ = spec.route(x, wr, br, TOP_K)
    ids = ids.to(torch.int32)
    xq = act_quant(x)
    if a.pad_rows:  # the same bytes in longer rows: each row's K blocks start on 128-byte lines (the gather's reads)
        assert a.pad_rows % 128 == 0 and a.pad_rows >= HIDDEN, a.pad_rows
        padded = torch.zeros(t, a.pad_rows, dtype=xq[0].dtype, device="cuda")
        padded[:, :HIDDEN] = xq[0]
        xq = (padded[:, :HIDDEN], xq[1])
        print(f"# x_quant rows padded to {a.pad_rows} bytes")
    plan = DEFAULT.moe_plan(t, TOP_K, e, True)
    slots, _ = moe_align(ids, 0, e, plan.align_m)
    if a.launch is None:  # the gather's tiles
        ref = gather_act_quant(x, slots, TOP_K, xq, tile=(16, 1))
        nbytes = 2 * slots.shape[0] * (HIDDEN + 4 * triton.cdiv(HIDDEN, 128))
        print(f"# gather_act_quant: {slots.shape[0]} rows x {HIDDEN} (T {t}, E {e}, align {plan.align_m}); "
              f"the default tile {gather_tile(slots.shape[0], triton.cdiv(HIDDEN, 128))}")
        for tile in TILES:
            got = gather_act_quant(x, slots, TOP_K, xq, tile=tile)
            same = torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(got[1], ref[1])
            ms = triton.testing.do_bench(lambda tile=tile: gather_act_quant(x, slots, TOP_K, xq, tile=tile),
                                         warmup=20, rep=200, return_mode="median")
            print(f"tile {tile}: {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:6.2f} TB/s  {'same bits' if same else 'DIFFERS'}")
        for name, fn in (("moe_align", lambda: moe_align(ids, 0, e, plan.align_m)),
                         ("moe_align_rows", lambda: moe_align_rows(ids, 0, e, plan.align_m))):
            ms = triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median")
            print(f"{name}: {ms * 1e3:8.1f} us")
        slots, _, rows = moe_align_rows(ids, 0, e, plan.align_m)  # (the atomics' order: both from one call)
        # each token's row read once (T rows), the k rows written, the scales both ways
        nbytes_tok = (t + slots.shape[0]) * (HIDDEN + 4 * triton.cdiv(HIDDEN, 128))
        print(f"# walking the tokens (slot_rows=): the default tile {gather_by_token_tile(t)}; TB/s of "
              f"{nbytes_tok / 1e9:.3f} GB (T rows read once, the sorted rows written); scales MN-major (the model's)")
        sorted_tile = gather_tile(slots.shape[0], triton.cdiv(HIDDEN, 128))
        ref = gather_act_quant(x, slots, TOP_K, xq, tile=sorted_tile, scale_mn_major=True)
        ways = {f"sorted {sorted_tile}": dict(tile=sorted_tile)} | {
            f"by token {tile}": dict(tile=tile, slot_rows=rows) for tile in BY_TOKEN_TILES}
        for rnd in range(3):  # rounds, the order rotated (do_bench blocks drift with the card's state)
            names = list(ways)[rnd % len(ways):] + list(ways)[:rnd % len(ways)]
            for name in names:
                kw = ways[name]
                got = gather_act_quant(x, slots, TOP_K, xq, scale_mn_major=True, **kw)
                same = torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(got[1], ref[1])
                ms = triton.testing.do_bench(lambda kw=kw: gather_act_quant(x, slots, TOP_K, xq, scale_mn_major=True,
                                                                            **kw),
                                             warmup=20, rep=200, return_mode="median")
                print(f"round {rnd} {name}: {ms * 1e3:8.1f} us  {nbytes_tok / ms / 1e9:6.2f} TB/s  "
                      f"{'same bits' if same else 'DIFFERS'}")
    if a.launch is not None:
        names = [a.launch] if a.launch in PLANS else [name for name in PLANS if name.startswith(a.launch)]
        assert len(names) == 1, f"--launch {a.launch!r}: one of {list(PLANS)}"
        a.seconds = a.plans = 0.0
    if a.seconds > 0 or a.plans > 0 or a.launch is not None:
        w13, s13 = quantize_weight_blocks(torch.randn(e, 2 * INTER, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5)
        w2, s2 = quantize_weight_blocks(torch.randn(e, HIDDEN, INTER, device="cuda", generator=g) / INTER**0.5)
        b13 = (0.3 * torch.randn(e, 2 * INTER, device="cuda", generator=g)).to(torch.bfloat16)
        b2 = (0.1 * torch.randn(e, HIDDEN, device="cuda", generator=g)).to(torch.bfloat16)

        def run(plan=None):
            """plan: a PLANS value (None: the default; a KernelConfig: that config's own plan)."""
            cfg = plan if isinstance(plan, KernelConfig) else None
            return moe_expert_slots(x, ids, w13, s13, b13, w2, s2, b2, x_quant=xq, config=cfg,
                                    plan=None if cfg else plan)

        flops = 2.0 * t * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)
        if a.launch is not None:
            for _ in range(a.launches):
                run(PLANS[names[0]])
            torch.cuda.synchronize()
            print(f"launched plan {names[0]!r} {a.launches} times")
        if a.seconds > 0:
            ms = triton.testing.do_bench(run, warmup=10, rep=100, return_mode="median")
            n, dt = back_to_back(run, a.seconds)
            print(f"moe_expert_slots: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s); back to back {n} launches in "
                  f"{dt:.1f} s: {dt / n * 1e3:.3f} ms each")
        if a.plans > 0:
            want = run().float()
            for name, plan in plans.items():
                got = run(plan)
                err = ((got.float() - want).norm() / want.norm()).item()
                print(f"plan {name}: rel. error against the default {err:.1e}"
                      f"{' (the same bits)' if torch.equal(got, want.to(got.dtype)) else ''}")
                assert err < 1e-2, f"plan {name} computes something else"
            for rnd in range(2):
                for name, plan in plans.items():
                    ms_burst = triton.testing.do_bench(lambda plan=plan: run(plan), warmup=10, rep=100,
                                                       return_mode="median")
                    n, dt = back_to_back(lambda plan=plan: run(plan), a.plans)
                    ms = dt / n * 1e3
                    print(f"pass {rnd} plan {name}: burst {ms_burst:.3f} ms, back to back {ms:.3f} ms "
                          f"({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)


if __name__ == "__main__":
    main()
