"""``kernels.config.with_options`` and ``bench prefill / decode / kernels --kernel-option``: a KernelConfig field set
by name for one run (an opt-in timed by the bench itself), every bad option one line naming it."""

import json

import pytest
from typer.testing import CliRunner

from gptoss_fp8.cli.main import app
from gptoss_fp8.kernels.config import GluonTile, KernelConfig, with_options


def test_options_set_fields_and_tile_fields():
    base = KernelConfig()
    got = with_options(base, ["attention_fp8_lane_max=true", "moe_gluon_wide_gate_up.stages=3",
                              "moe_gluon_wide_gate_up.stage_scales=false", "moe_gluon_wide_gate_up.gather=on",
                              "dense_gluon_min_rows=none", "gemm=deep_gemm",
                              "attention_fp8_lane_max = 0"])
    assert got.attention_fp8_lane_max is False  # the last setting of a name wins
    assert got.moe_gluon_wide_gate_up.stages == 3 and got.moe_gluon_wide_gate_up.gather is True
    assert isinstance(got.moe_gluon_wide_gate_up, GluonTile)
    assert got.dense_gluon_min_rows is None and got.gemm == "deep_gemm"
    # nothing else moved, the tile's other fields included
    assert got.moe_gluon_wide_gate_up.group_m == base.moe_gluon_wide_gate_up.group_m
    assert got.moe_gluon_down == base.moe_gluon_down and got.prefill_causal == base.prefill_causal
    assert with_options(base, []) is base


@pytest.mark.parametrize("option,needle", [
    ("lane_max=true", "no field 'lane_max' in KernelConfig (did you mean attention_fp8_lane_max?)"),
    ("attention_fp8_lane_max=maybe", "give true or false"),
    ("moe_gluon_wide_gate_up=3", "is a GluonTile; set one of its fields as moe_gluon_wide_gate_up.FIELD=VALUE"),
    ("moe_gluon_wide_gate_up.stages=x", "give an int"),
    ("moe_gluon_wide_gate_up.nope=1", "no field 'nope' in GluonTile"),
    ("gemm=cublas", "KernelConfig.gemm must be one of"),
    ("decode_one_wave_programs_per_sm=none", "cannot be None"),
    ("gluon.x=1", "gluon is a bool, it has no fields"),
    ("attention_fp8_lane_max", "give NAME=VALUE"),
])
def test_bad_options_are_one_line(option, needle):
    with pytest.raises(ValueError) as err:
        with_options(KernelConfig(), [option])
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("bench", ["prefill", "decode", "kernels"])
def test_bench_refuses_bad_option_before_anything_else(bench):
    """A bad option is refused first, on any machine (before the GPU check), and with --tp (ranks build the default)."""
    r = CliRunner().invoke(app, ["bench", bench, "--kernel-option", "lane_max=1"])
    assert r.exit_code == 1 and "--kernel-option lane_max: no field 'lane_max'" in r.output, r.output
    if bench == "kernels":  # (one GPU, no --tp)
        return
    r = CliRunner().invoke(app, ["bench", bench, "--kernel-option", "attention_fp8_lane_max=1", "--tp", "2"])
    assert r.exit_code == 1 and "--kernel-option is for the one-GPU bench" in r.output, r.output


def test_bench_kernels_hands_its_options_to_the_suites(monkeypatch, tmp_path):
    """``bench kernels --kernel-option``: each suite times our kernels under the config it names (the GPU and the
    suites stood in for: what is checked is the config they are given and the rows' record of it)."""
    import torch

    from gptoss_fp8.bench import kernels_attention, kernels_gemm
    from gptoss_fp8.kernels import config as kconfig

    got = {}

    def suite(name):
        def bench(tokens, config=None, emit=None, **kw):
            got[name] = config
            rows = [{"case": f"{name} T={tokens[0]}", "ms": 1.0}, {"case": f"{name} decode", "ms": 2.0}]
            if emit is not None:  # (the attention suite: a length's rows printed as they are measured)
                emit(rows[:1])
                print("# attention: between lengths")
            return rows
        return bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kconfig, "kernel_paths", lambda device, cfg: "kernels: stood in")
    monkeypatch.setattr(kernels_gemm, "bench", suite("gemm"))
    monkeypatch.setattr(kernels_attention, "bench", suite("attention"))
    out = tmp_path / "rows.json"
    r = CliRunner().invoke(app, ["bench", "kernels", "--tokens", "64", "--only", "gemm,attention", "--json", str(out),
                                 "--kernel-option", "moe_gluon_wide_gate_up.stages=3",
                                 "--kernel-option", "attention_fp8_lane_max=true"])
    assert r.exit_code == 0, r.output
    assert "# kernel options: moe_gluon_wide_gate_up.stages=3 attention_fp8_lane_max=true" in r.output
    for cfg in got.values():
        assert cfg.moe_gluon_wide_gate_up.stages == 3 and cfg.attention_fp8_lane_max
        assert cfg.moe_gluon_down == KernelConfig().moe_gluon_down  # the rest as shipped
    assert set(got) == {"gemm", "attention"}
    rows = json.loads(out.read_text())
    assert [r["kernel_options"] for r in rows] == [["moe_gluon_wide_gate_up.stages=3", "attention_fp8_lane_max=true"]] * 4
    # every row printed once, the attention suite's first before the suite ends, one header a suite
    lines = r.output.splitlines()
    at = {c: [i for i, ln in enumerate(lines) if f" | {c} | " in ln] for c in ("attention T=64", "attention decode")}
    between = lines.index("# attention: between lengths")
    assert len(at["attention T=64"]) == len(at["attention decode"]) == 1
    assert at["attention T=64"][0] < between < at["attention decode"][0]
    assert sum(ln.startswith("suite | case | ms") for ln in lines) == 2
