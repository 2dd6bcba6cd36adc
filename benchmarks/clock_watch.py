"""Sample the GPU's SM clock, power and throttle reasons while a command runs (read-only queries).

Usage (GPU machine): python3 benchmarks/clock_watch.py OUT.csv -- COMMAND ARGS...
Runs COMMAND with ``nvidia-smi --query-gpu=... -lms 100`` sampling beside it, then prints the SM
clock (min / median / max), the power draw and each throttle-reason bitmask seen, over the samples
taken while the GPU was busy (utilization > 50%). The question it answers: do the kernels run
slower inside long full-depth prefills than in short profiles because the clock drops (eighth
session: ~9% gap, BENCHMARKS.md)? It queries and never sets anything.
"""

from __future__ import annotations

import csv
import shutil
import statistics
import subprocess
import sys
import time

FIELDS = ["timestamp", "utilization.gpu", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu",
          "clocks_throttle_reasons.active"]


def back_to_back(run, seconds: float) -> tuple[int, float]:
    """Launch ``run`` (GPU work) back to back for about ``seconds``, ten at a time, synchronizing after each ten:
    (launches, wall seconds). What the scripts run under this watcher call, so that it samples one kernel's steady
    clock and power (benchmarks/attn_ncu.py, benchmarks/moe_parts.py)."""
    import torch

    n, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
        n += 10
    return n, time.time() - t0


def _query_fields() -> list[str]:
    """FIELDS, less the throttle reasons where this nvidia-smi does not know that field."""
    probe = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
    return FIELDS if probe.returncode == 0 else FIELDS[:-1]


def _num(v: str) -> float | None:
    try:
        return float(v.strip().split()[0])
    except (ValueError, IndexError):
        return None


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out, cmd = sys.argv[1], sys.argv[3:]
    if shutil.which("nvidia-smi") is None:
        print("clock_watch: nvidia-smi not found; run this on the GPU machine", file=sys.stderr)
        return 2
    fields = _query_fields()
    with open(out, "w") as f:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                                "-lms", "100"], stdout=f, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            rc = subprocess.call(cmd)
        finally:
            smi.terminate()
            smi.wait()
    with open(out) as f:
        rows = [dict(zip(fields, r, strict=True)) for r in csv.reader(f) if len(r) == len(fields)]
    busy = [r for r in rows if (_num(r["utilization.gpu"]) or 0) > 50]
    clocks = [c for c in (_num(r["clocks.sm"]) for r in busy) if c is not None]
    power = [p for p in (_num(r["power.draw"]) for r in busy) if p is not None]
    print(f"# {len(rows)} samples, {len(busy)} with the GPU busy (> 50%)")
    if clocks:
        print(f"# SM clock MHz while busy: min {min(clocks):.0f}, median {statistics.median(clocks):.0f}, "
              f"max {max(clocks):.0f}; power W: median {statistics.median(power):.0f}, max {max(power):.0f}")
    if "clocks_throttle_reasons.active" in fields:
        seen: dict[str, int] = {}
        for r in busy:
            key = r["clocks_throttle_reasons.active"].strip()
            seen[key] = seen.get(key, 0) + 1
        print(f"# throttle-reason masks while busy (mask: samples): {seen}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
