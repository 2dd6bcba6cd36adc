"""benchmarks/attn_trace.py's reading of the FP8 attention kernel's clock stamps (CPU: synthetic stamps)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trace_mod():
    spec = importlib.util.spec_from_file_location("attn_trace", ROOT / "benchmarks" / "attn_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stamps(durations, starts, steps, programs=2, wrap_at=None):
    """[programs, 3, steps + 1, 8] uint32 clocks: warpgroup w starts at starts[w] and runs its steps' phases
    back to back (durations[w]: the 8 phase lengths); wrap_at: a start that makes the 32-bit clock wrap."""
    tr = np.zeros((programs, 3, steps + 1, 8), dtype=np.uint32)
    for p in range(programs):
        for w in range(3):
            t = (wrap_at if wrap_at is not None else 0) + starts[w]
            for i in range(steps + 1):
                for k in range(8):
                    tr[p, w, i, k] = t % 2**32
                    t += durations[w][k]
    return tr


def test_phases_and_period_through_a_clock_wrap(trace_mod):
    rng = np.random.default_rng(7)
    durations = [list(rng.integers(20, 400, size=8)) for _ in range(3)]
    tr = _stamps(durations, [0, 150, 310], steps=24, wrap_at=2**32 - 5000)
    res = trace_mod.analyse(tr, np.full((2, 3), 24))
    for w in range(3):
        r = res["per_warpgroup"][w]
        assert r["steps"] == 2 * (24 - 4)  # the first and last two of each warpgroup's steps left out
        assert r["period_median"] == sum(durations[w])
        assert list(r["phases_median"].values()) == [float(d) for d in durations[w]]
    assert sum(res["overlap"]) == pytest.approx(1.0, abs=1e-3)


def test_overlap_counts_warpgroups_in_their_exponential_phase(trace_mod):
    # slots 4 -> 6 (the exponential phase) take 600 of each 1000-cycle step
    d = [100, 100, 100, 50, 300, 300, 25, 25]
    # in step: all three start together -> the phase is shared by all three for its whole length
    res = trace_mod.analyse(_stamps([d] * 3, [0, 0, 0], steps=30), np.full((2, 3), 30))
    assert res["overlap"][3] == pytest.approx(0.6, abs=0.01) and res["overlap"][0] == pytest.approx(0.4, abs=0.01)
    # staggered by a third of a step: 600 of 1000 each, never all three, never none
    res = trace_mod.analyse(_stamps([d] * 3, [0, 333, 666], steps=30), np.full((2, 3), 30))
    assert res["overlap"][0] < 0.01 and res["overlap"][3] < 0.01
    assert res["overlap"][1] + res["overlap"][2] == pytest.approx(1.0, abs=0.01)


def test_short_warpgroups_are_left_out(trace_mod):
    d = [10] * 8
    tr = _stamps([d] * 3, [0, 5, 9], steps=10)
    n = np.array([[10, 3, 10], [10, 10, 4]])  # too few steps for a steady one: skipped, not misread
    res = trace_mod.analyse(tr, n)
    assert res["per_warpgroup"][0]["steps"] == 12 and res["per_warpgroup"][1]["steps"] == 6
    assert res["per_warpgroup"][2]["steps"] == 6


def test_energy_line_reads_power_and_time_or_shows_the_failure():
    """benchmarks/energy_line.py (gpu_suite.sh attn-energy): energy a launch = median power x time from the
    two tools' printed lines; a run without them comes back as its own output, not as a figure."""
    spec = importlib.util.spec_from_file_location("energy_line", ROOT / "benchmarks" / "energy_line.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = ("ran {'probe': 'mma'} 128000 40 launches in 5.5 s: 137.190 ms each\n# 114 samples, 58 with the GPU busy\n"
           "# SM clock MHz while busy: min 1425, median 1725, max 1770; power W: median 691, max 703\n"
           "# throttle-reason masks while busy (mask: samples): {'0x0000000000000004': 58}\n")
    line = mod.energy_line("fp8=True,probe=mma", "128000", out)
    assert line == "fp8=True,probe=mma T=128000: 137.190 ms, 1725 MHz, 691 W, 94.80 J a launch, SW power cap"
    failed = mod.energy_line("fp8=True", "8192", "Traceback ...\nAssertionError: probe='mma' takes no turns\n")
    assert "no figure" in failed and "takes no turns" in failed and " J " not in failed
