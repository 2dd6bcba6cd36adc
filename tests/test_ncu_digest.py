"""benchmarks/ncu_digest.py on small synthetic Nsight Compute pages: the metrics it keeps, the warp-state
samples by reason in order with their shares, and the hot loop's samples by opcode (cold code and the
predicate of a guarded instruction left out)."""

import importlib.util
import pathlib

import pytest

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_digest.py"


@pytest.fixture(scope="module")
def digest():
    spec = importlib.util.spec_from_file_location("ncu_digest", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_raw_page_keeps_pipes_and_orders_stall_reasons(digest, tmp_path):
    hdr = ["gpu__time_duration.sum", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", "dram__bytes.sum",
           "smsp__pcsamp_warps_issue_stalled_wait", "smsp__pcsamp_warps_issue_stalled_barrier",
           "smsp__pcsamp_warps_issue_stalled_barrier_not_issued", "smsp__pcsamp_warps_issue_stalled_sleeping"]
    raw = tmp_path / "raw.csv"
    units = ["ms", "%", "byte", "warp", "warp", "warp", "warp"]
    vals = ["3.79", "55.8", "9", "30", "70", "5", "0"]
    raw.write_text("\n".join(",".join(f'"{c}"' for c in row) for row in (hdr, units, vals)))
    out = digest.raw_digest(str(raw))
    assert "gpu__time_duration.sum [ms] = 3.79" in out and any(line.startswith("sm__inst_executed_pipe_xu") for line in out)
    assert not any("dram__bytes" in line for line in out)
    reasons = out[out.index("warp-state samples by reason:") + 1:]
    assert [r.split()[-1] for r in reasons] == ["barrier", "wait"]  # not_issued and zero counts left out
    assert "70.0%" in reasons[0] and "30.0%" in reasons[1]
    # --grep: also the metrics whose names match (the L2's sectors by source unit, DRAM's)
    out = digest.raw_digest(str(raw), r"^dram__bytes\.sum$")
    assert "dram__bytes.sum [byte] = 9" in out and not any("sleeping" in line for line in out)


def test_sass_page_sums_hot_samples_by_opcode(digest, tmp_path):
    rows = [["Kernel Name", "k"], ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"],
            ["0", "MUFU.EX2 R1, R2", "60", "500"], ["1", "@!P0 BRA 0x10", "30", "500"],
            ["2", "MUFU.EX2 R3, R4", "20", "500"], ["3", "NOP", "90", "5"]]
    sass = tmp_path / "sass.csv"
    sass.write_text("\n".join(",".join(f'"{c}"' for c in r) for r in rows))
    out = digest.sass_digest(str(sass), hot=100, top=2)
    assert out[0] == "SASS: 4 instructions, 200 samples; hot (executed >= 100): 110"
    by_op = {line.split()[0]: line for line in out[2:4]}
    assert list(by_op) == ["MUFU", "BRA"] and "72.7%" in by_op["MUFU"] and "executed 1000" in by_op["MUFU"]
    assert "NOP" in out[-2] and "MUFU.EX2 R1, R2" in out[-1]  # the top two by samples, cold code included
