"""Router sweep at decode sizes: the split form's variants against router_config's pick, the tiled form and torch.

On the GPU machine, from the repository root:

    PYTHONPATH=$(pwd) python3 benchmarks/router_sweep.py --json $OUT/router_sweep.json

Cases: T in 1 / 4 / 16 / 64 tokens x E in 32 / 128 experts, H = 2880, top-4, with bias. Per case:
* ``pick``: ``router`` as the model calls it (``router_config``'s choice);
* ``tiled``: the single-program form, ``router_config(T, E, True, split=False)``'s tile (what
  every T ran before the split form);
* ``torch``: ``spec.route`` (F.linear + topk + softmax) and the int32 cast of the ids the MoE takes;
* ``split S/K/W/St``: ``RouterSplit(S, K, W, St)`` for every S of ``--splits``, BLOCK_K of
  ``--block-k``, warps of ``--warps`` and stages of ``--stages`` (at 64 tokens too: 4 row tiles).
Every kernel variant is checked before it is timed: against torch with the tolerances of
tests/kernels/test_router.py, two calls bit-identical, the arrival counters zero after them, and the
CUDA graph's output equal to an eager call's. A variant failing any of these is marked WRONG and
not timed.

Times, per call in microseconds: a CUDA graph of 20 back-to-back calls on 20 copies of (x, W, b),
the median over replays (CUDA events, a spin kernel queued first so that the graph's launch is not
timed). ``hot``: the copies stay in L2 between replays (15 MB at 128 experts); ``cold``: a 256 MB
write before each replay evicts them (a decode step's router reads its weight from HBM).

The console gets, per case, the pick, the tiled form, torch and the fastest split variants; then per
expert count the split variant with the lowest geometric-mean cold time over T <= 16 (the candidate
for ``router_config``). Every row goes to the JSON and, as a table, beside it (.txt). Expected run
time on the H200: 2-4 minutes, most of it compiling the 36 variants per expert count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch

from gptoss_fp8 import spec
from gptoss_fp8.kernels import arrival_counters
from gptoss_fp8.kernels.router import RouterSplit, router, router_config

HIDDEN, TOP_K = 2880, 4
ULP = 2.0**-7  # bf16 relative spacing
CALLS = 20  # back-to-back calls per graph, each on its own copy of the inputs
FLUSH_BYTES = 256 << 20  # more than the H200's L2


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",")]


def _inputs(t: int, e: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """CALLS copies of (x bf16 [t, H], W bf16 [e, H], b bf16 [e]), random, as the tests draw them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(CALLS):
        x = torch.randn(t, HIDDEN, device="cuda", generator=g).bfloat16()
        w = (torch.randn(e, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).bfloat16()
        b = (0.1 * torch.randn(e, device="cuda", generator=g)).bfloat16()
        out.append((x, w, b))
    return out


def _check(out, x, w, b) -> str:
    """'' when ``out`` = (logits, ids, weights) meets the tests' tolerances against torch, else why not."""
    logits, ids, wts = out
    lg = logits.float()
    if not torch.isfinite(lg).all():
        return "non-finite logits"
    exact = (x.double() @ w.double().T + b.double()).to(torch.bfloat16).float()
    bad = (lg - exact).abs() > exact.abs() * ULP + 1e-5
    if bad.any():
        return f"{int(bad.sum())} logits more than an ulp off"
    if not torch.equal(ids.long(), torch.sort(-lg, dim=-1, stable=True).indices[:, :TOP_K]):
        return "ids are not the top-k of the logits (ties to the lowest id)"
    want = torch.softmax(torch.gather(lg, 1, ids.long()), dim=-1).to(torch.bfloat16).float()
    if ((wts.float() - want).abs() > want.abs() * ULP + 1e-6).any():
        return "weights more than an ulp off the softmax"
    ref_logits, ref_ids, _ = spec.route(x, w, b, TOP_K)
    srt = torch.sort(ref_logits.float(), dim=-1, descending=True).values
    clear = (srt[:, TOP_K - 1] - srt[:, TOP_K]) > 2 * ULP * srt[:, TOP_K - 1].abs()
    same = (ids.long().sort(-1).values == ref_ids.sort(-1).values).all(-1)
    if not bool(same[clear].all()):
        return f"{int((~same[clear]).sum())} clear tokens route unlike torch"
    return ""


def _replay_ms(graph: torch.cuda.CUDAGraph, replays: int, flush: torch.Tensor | None) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for s, e in zip(starts, ends, strict=True):
        if flush is not None:
            flush.zero_()
        torch.cuda._sleep(100_000)  # ~50 us of queued work: the replay's launch happens behind it
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def _measure(fn, copies, flush: torch.Tensor, replays: int, kernel: bool) -> dict:
    """{"error"} or {"hot_us", "cold_us"}: ``fn(x, w, b)`` checked (``kernel``: the router's
    determinism, counters and graph output too), then timed in a graph of one call per copy."""
    x, w, b = copies[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (compiles, cuBLAS workspaces, counters)
        first = fn(x, w, b)
        for c in copies:
            fn(*c)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if kernel:
        err = _check(first, x, w, b)
        again = fn(x, w, b)
        if not err and not all(torch.equal(p, q) for p, q in zip(first, again, strict=True)):
            err = "two calls differ"
        torch.cuda.synchronize()
        if not err and int(arrival_counters(x.device, 1).count_nonzero()):
            err = "arrival counters not zero after the call"
        if err:
            return {"error": err}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(*c) for c in copies]
    graph.replay()
    torch.cuda.synchronize()
    if kernel and not all(torch.equal(p, q) for p, q in zip(outs[0], first, strict=True)):
        return {"error": "the graph's output differs from an eager call's"}
    hot = _replay_ms(graph, replays, None)
    cold = _replay_ms(graph, replays, flush)
    return {"hot_us": hot * 1e3 / len(copies), "cold_us": cold * 1e3 / len(copies)}


def _torch_route(x, w, b):
    logits, ids, wts = spec.route(x, w, b, TOP_K)
    return logits, ids.to(torch.int32), wts


def _variants(t: int, e: int, a) -> list[tuple[str, str, object, bool]]:
    """(name, config, fn(x, w, b), is one of our kernels) for every variant of a case."""
    tile = router_config(t, e, True, split=False)
    out = [
        ("pick", str(tuple(router_config(t, e, True))), lambda x, w, b: router(x, w, b, TOP_K), True),
        ("tiled", str(tile), lambda x, w, b: router(x, w, b, TOP_K, config=tile), True),
        ("torch", "spec.route + int32 ids", _torch_route, False),
    ]
    for s in a.splits:
        for k in a.block_k:
            for nw in a.warps:
                for st in a.stages:
                    cfg = RouterSplit(s, k, nw, st)
                    fn = lambda x, w, b, cfg=cfg: router(x, w, b, TOP_K, config=cfg)  # noqa: E731
                    out.append((f"split {s}/{k}/{nw}/{st}", str(tuple(cfg)), fn, True))
    return out


def _fmt(us: float | None) -> str:
    return f"{us:7.2f}" if us is not None else "      -"


HEADER = f"{'T':>3} {'E':>4}  {'variant':<18} {'config':<24} {'hot us':>7} {'cold us':>7}  note"


def _line(r: dict) -> str:
    note = "WRONG: " + r["error"] if "error" in r else ""
    return (
        f"{r['t']:>3} {r['e']:>4}  {r['variant']:<18} {r['config']:<24} {_fmt(r.get('hot_us'))} {_fmt(r.get('cold_us'))}  {note}"
    )


def _summary(rows: list[dict], experts: list[int], top: int) -> list[str]:
    """Per case the fixed variants, the ``top`` fastest split ones (hot) and every wrong one; per
    expert count the split variant of the lowest geometric-mean cold time over T <= 16."""
    lines = [HEADER]
    for e, t in sorted({(r["e"], r["t"]) for r in rows}):
        case = [r for r in rows if r["e"] == e and r["t"] == t]
        split = [r for r in case if r["variant"].startswith("split")]
        fast = sorted((r for r in split if "hot_us" in r), key=lambda r: r["hot_us"])[:top]
        wrong = [r for r in split if "error" in r]
        lines += [_line(r) for r in case if not r["variant"].startswith("split")]
        lines += [_line(r) for r in fast + wrong] + [""]
    for e in experts:
        cold: dict[str, list[float]] = {}
        for r in rows:
            if r["e"] == e and r["t"] <= 16 and r["variant"].startswith("split"):
                cold.setdefault(r["config"], []).append(r.get("cold_us", math.inf))
        score = {c: math.exp(statistics.fmean(math.log(v) for v in vs)) for c, vs in cold.items()}
        if score:
            best = min(score, key=score.get)
            lines.append(f"E={e}: lowest geometric-mean cold time over T <= 16: RouterSplit{best} ({score[best]:.2f} us)")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write every row here (and the table beside it, .txt)")
    p.add_argument("--tokens", type=_ints, default=[1, 4, 16, 64], help="comma-separated token counts")
    p.add_argument("--experts", type=_ints, default=[32, 128], help="comma-separated expert counts")
    p.add_argument("--splits", type=_ints, default=[4, 8, 16, 32], help="RouterSplit.splits to try")
    p.add_argument("--block-k", type=_ints, default=[32, 64, 128], help="RouterSplit.block_k to try")
    p.add_argument("--warps", type=_ints, default=[2, 4, 8], help="RouterSplit.num_warps to try")
    p.add_argument("--stages", type=_ints, default=[3], help="RouterSplit.num_stages to try")
    p.add_argument("--replays", type=int, default=30, help="timed replays per graph and mode")
    p.add_argument("--top", type=int, default=6, help="split variants per case in the console summary")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("router_sweep: needs a CUDA GPU (run it on the GPU machine; --help works anywhere)")
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    rows = []
    for e in a.experts:
        for t in a.tokens:
            copies = _inputs(t, e, seed=1000 * e + t)
            for name, config, fn, kernel in _variants(t, e, a):
                rows.append({"t": t, "e": e, "variant": name, "config": config, **_measure(fn, copies, flush, a.replays, kernel)})
                if not name.startswith("split"):
                    print(_line(rows[-1]), flush=True)
    print("\n" + "\n".join(_summary(rows, a.experts, a.top)))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"hidden": HIDDEN, "top_k": TOP_K, "calls_per_graph": CALLS, "rows": rows}, f, indent=1)
        with open(os.path.splitext(a.json)[0] + ".txt", "w") as f:
            f.write("\n".join([HEADER, *map(_line, rows)]) + "\n")


if __name__ == "__main__":
    main()
