"""One short text digest of an Nsight Compute report (issue 34): pipe utilizations, the warp-state samples by
reason, and the sampled stalls by SASS opcode in the hot loops and by instruction. What came back from the GPU
machine as whole CSV pages (a raw page of ~1200 metrics, a source page of ~4000 SASS lines) ran into the
limit on files a call returns; this reads them there and writes what the analysis needs:

    ncu --import REP.ncu-rep --page raw --csv > raw.csv
    ncu --import REP.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 benchmarks/ncu_digest.py raw.csv sass.csv [--hot 100000] [--grep REGEX] > digest.txt

``--hot``: an instruction executed at least this many times (warp-level, the whole launch) counts as part of a
hot loop in the by-opcode table.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re

PIPES = ("pipe_xu", "pipe_tensor", "pipe_alu", "pipe_fma", "pipe_fmaheavy", "pipe_fmalite", "pipe_uniform",
         "issue_active", "inst_issued")

# a memory- or latency-bound kernel's figures (the window attention's): bytes, throughputs, what limits occupancy
MEMORY = ("dram__bytes_read.sum", "dram__bytes_write.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
          "lts__throughput.avg.pct_of_peak_sustained_elapsed", "l1tex__throughput.avg.pct_of_peak_sustained_active",
          "sm__throughput.avg.pct_of_peak_sustained_elapsed", "launch__occupancy_limit_registers",
          "launch__occupancy_limit_shared_mem", "launch__occupancy_limit_warps", "launch__waves_per_multiprocessor",
          "launch__shared_mem_per_block_dynamic", "launch__shared_mem_per_block_static", "lts__t_sector_hit_rate.pct")


def _num(text: str) -> float:
    """A page's number ("1,234" and "" included; anything else 0)."""
    try:
        return float(text.replace(",", "") or 0)
    except ValueError:
        return 0.0


def raw_digest(path: str, grep: str | None = None) -> list[str]:
    """The raw page: duration, clocks, pipe utilizations, occupancy and the warp-state samples by reason; ``grep``:
    also every metric whose name matches this regular expression (e.g. the L2's sectors by source unit and hit /
    miss, to see where DRAM reads come from)."""
    rows = list(csv.reader(open(path)))
    hdr, units, vals = rows[0], rows[1], rows[2]
    out = []
    for h, u, v in zip(hdr, units, vals, strict=True):
        keep = (h in ("gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second", "launch__registers_per_thread",
                      "sm__warps_active.avg.per_cycle_active", "smsp__warps_eligible.avg.per_cycle_active")
                or h in MEMORY
                or (any(p in h for p in PIPES) and h.endswith("pct_of_peak_sustained_active"))
                or (grep is not None and re.search(grep, h) is not None))
        if keep:
            out.append(f"{h} [{u}] = {v}")
    stalls = [(_num(v), h) for h, v in zip(hdr, vals, strict=True)
              if re.fullmatch(r"smsp__pcsamp_warps_issue_stalled_[a-z_]+", h) and "not_issued" not in h]
    total = sum(s for s, _ in stalls) or 1.0
    out.append("warp-state samples by reason:")
    out += [f"  {s:10.0f} {100 * s / total:5.1f}%  {h.removeprefix('smsp__pcsamp_warps_issue_stalled_')}"
            for s, h in sorted(stalls, reverse=True) if s]
    return out


def sass_digest(path: str, hot: int, top: int = 40) -> list[str]:
    """The source page: sampled stalls by opcode over the hot instructions, then the top instructions."""
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if "Source" in r and any("Sampl" in c for c in r))
    hdr = rows[start]
    src, samp, execd = (hdr.index(c) for c in ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"))
    insts = []
    for k, r in enumerate(rows[start + 1:]):
        if len(r) == len(hdr):
            insts.append((k, r[src].strip(), _num(r[samp]), int(_num(r[execd]))))
    total = sum(s for _, _, s, _ in insts) or 1.0
    by_op = collections.defaultdict(lambda: [0.0, 0])
    for _, text, s, n in insts:
        if n >= hot:
            op = next((t for t in text.split() if not t.startswith("@")), "?").split(".")[0]
            by_op[op][0] += s
            by_op[op][1] += n
    hot_total = sum(v[0] for v in by_op.values()) or 1.0
    out = [f"SASS: {len(insts)} instructions, {total:.0f} samples; hot (executed >= {hot}): {hot_total:.0f}",
           "hot samples by opcode:"]
    out += [f"  {op:14s} {v[0]:9.0f} {100 * v[0] / hot_total:5.1f}%  executed {v[1]}"
            for op, v in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:25]]
    out.append(f"top {top} instructions by samples (index in the source page, samples, share, executed):")
    out += [f"  {k:5d} {s:8.0f} {100 * s / total:5.1f}% {n:10d} | {text[:90]}"
            for k, text, s, n in sorted(insts, key=lambda t: -t[2])[:top]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("sass")
    ap.add_argument("--hot", type=int, default=100000)
    ap.add_argument("--grep", default=None, help="also the raw metrics whose names match this regular expression")
    args = ap.parse_args()
    print("\n".join(raw_digest(args.raw, args.grep) + sass_digest(args.sass, args.hot)))


if __name__ == "__main__":
    main()
