"""The CLI: --help everywhere, the main job end to end, one-line errors with non-zero exit."""

import functools
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from gptoss_fp8.cli.main import app

runner = CliRunner()


def _commands(typer_app, prefix=()):
    import typer.main

    group = typer.main.get_command(typer_app)
    out = [prefix]

    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            out.append((*path, name))
            walk(sub, (*path, name))

    walk(group, prefix)
    return out


@pytest.mark.parametrize("path", _commands(app), ids=lambda p: " ".join(p) or "root")
def test_help_everywhere(path):
    r = runner.invoke(app, [*path, "--help"])
    assert r.exit_code == 0, r.output
    assert "Usage" in r.output


def test_synth_convert_cli(tmp_path):
    r = runner.invoke(app, ["synth", str(tmp_path / "src"), "--preset", "tiny", "--seed", "1", "--layout", "both"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "src" / "original" / "model.safetensors").is_file()
    r = runner.invoke(app, ["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--report", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(("exact:", "rounded to FP8:")))
    assert lines[first] == "exact: the experts, 4 tensors, all 1,474,560 values bit for bit", lines
    assert lines[first + 1].startswith("rounded to FP8: the attention projections, 8 tensors, RMS relative error "), lines
    assert lines[-1].startswith("transformers: import gptoss_fp8.hf first, then AutoModelForCausalLM.from_pretrained("), lines
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep == json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert not (tmp_path / "out" / "original").exists()  # original/ is not an input and not copied


def test_errors_are_one_line_with_nonzero_exit(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gptoss_fp8.cli.main", "convert", str(tmp_path / "nope"), str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert "Traceback" not in proc.stderr
    dbg = subprocess.run([sys.executable, "-m", "gptoss_fp8.cli.main", "--debug", "convert",
                          str(tmp_path / "nope"), str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert dbg.returncode != 0 and "Traceback" in dbg.stderr


def test_synth_vocab_size(tmp_path):
    """--vocab-size replaces the preset's (201088 is how serve's refusal of a synthetic vocabulary says to make one);
    out of range: a usage error, nothing written."""
    r = runner.invoke(app, ["synth", str(tmp_path / "s"), "--layers", "1", "--vocab-size", "1031"])
    assert r.exit_code == 0, r.output
    assert "vocabulary 1031" in r.output
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["vocab_size"] == 1031 and cfg["eos_token_id"] < 1031
    from safetensors import safe_open

    names = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(tmp_path / "s" / names["model.embed_tokens.weight"]), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape()[0] == 1031
    r = runner.invoke(app, ["synth", str(tmp_path / "t"), "--vocab-size", "3"])
    assert r.exit_code == 2 and not (tmp_path / "t").exists()


def test_synth_refuses_non_empty_dst(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("1")
    r = runner.invoke(app, ["synth", str(tmp_path / "x")])
    assert r.exit_code == 1 and "not empty" in r.output
    assert (tmp_path / "x" / "keep").read_text() == "1"


_HEAVY = ("torch", "safetensors", "numpy", "triton", "huggingface_hub", "matplotlib")
_PROBE = """
import sys
sys.argv = ["gptoss-fp8", *sys.argv[1:]]
from gptoss_fp8.cli.main import app
try:
    app()
except SystemExit as e:
    code = e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
print("\\nEXIT", code, "HEAVY", ",".join(heavy) or "-")
""".replace("HEAVY)", repr(_HEAVY) + ")")


def _probe(args, env=None):
    p = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=60, env=env)
    last = p.stdout.strip().splitlines()[-1].split()
    return int(last[1]), last[3], p


@functools.cache
def _help(path: tuple[str, ...]):
    """_probe of ``PATH --help`` in an 80-column terminal whose output is not a terminal (a pipe, CI
    logs): one process per command for both help tests below (~0.7 s each on the 2-core box);
    (exit code, heavy modules imported, the help text)."""
    import os

    code, heavy, p = _probe([*path, "--help"], env={**os.environ, "COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert p.stdout.rstrip().endswith(f"EXIT {code} HEAVY {heavy}"), p.stdout
    return code, heavy, p.stdout.rstrip().rsplit("\n", 1)[0], p.stderr


@pytest.mark.parametrize("path", _commands(app), ids=lambda p: " ".join(p) or "root")
def test_help_imports_no_torch(path):
    """`--help` of the app and of every command loads no torch / safetensors / hub: it stays fast."""
    code, heavy, text, err = _help(path)
    assert code == 0 and "Usage" in text, text + err
    assert heavy == "-", f"--help of {' '.join(path) or 'gptoss-fp8'} imported {heavy}"


@pytest.mark.parametrize("args", [
    ["convert", "a", "b", "--device", "mps"],
    ["convert", "a", "b", "--max-shard-size", "nan"],
    ["verify-logits", "c", "--reference", "r", "--device", "meta"],
    ["synth", "x", "--preset", "7b"],
    ["plan", "--tp", "0"],
    ["nosuch"],
], ids=lambda a: " ".join(a))
def test_argument_errors_import_no_torch(args):
    code, heavy, p = _probe(args)
    assert code == 2 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert heavy == "-", f"{args} imported {heavy}"


def test_cli_scale_modes_match_the_codec():
    from gptoss_fp8.cli.common import ScaleModeChoice
    from gptoss_fp8.quant.fp8 import ScaleMode

    assert [m.value for m in ScaleModeChoice] == [m.value for m in ScaleMode]


def _option_names(path) -> list[str]:
    import typer.main

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return [o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]


@pytest.mark.parametrize("path", _commands(app), ids=lambda p: " ".join(p) or "root")
def test_help_fits_80_columns(path):
    """--help in an 80-column terminal, output not a terminal (a pipe, CI logs): every option
    name whole (not cut to ``--keep-attention…``), no ``<bool>`` for flags, no line wider than 80."""
    code, _, text, err = _help(path)
    assert code == 0, err
    words = set(text.replace("/", " ").replace(",", " ").split())
    for opt in _option_names(path):
        assert opt in words, f"{' '.join(path)} --help: option {opt} is not shown whole:\n{text}"
    assert "<bool>" not in text and "…" not in text, text
    assert max(map(len, text.splitlines())) <= 80, text


def test_progress_lines_when_stderr_is_a_pipe(tmp_path):
    """synth and convert piped (CI logs, ``| tee``): plain progress lines on stderr, not silence
    (tqdm hides itself there) and not a bar's carriage returns."""
    base = [sys.executable, "-m", "gptoss_fp8.cli.main"]
    for args, desc in ((["synth", str(tmp_path / "s")], "synth"),
                       (["convert", str(tmp_path / "s"), str(tmp_path / "o")], "convert")):
        p = subprocess.run([*base, *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        lines = p.stderr.splitlines()
        assert lines and lines[-1].startswith(f"{desc}: 100% ("), p.stderr
        assert "\r" not in p.stderr


def test_line_progress_every_few_seconds():
    """LineProgress: a line at most every ``every`` seconds while work is reported, a last one when
    the work is complete, none at the end of a run that failed part-way."""
    from gptoss_fp8.cli.common import LineProgress

    now = [0.0]
    out: list[str] = []
    bar = LineProgress(1000, "convert", every=3.0, clock=lambda: now[0], write=out.append)
    for _ in range(10):  # 100 bytes a second
        now[0] += 1.0
        bar.update(100)
    assert [line.split(" (")[0] for line in out] == ["convert:  30%", "convert:  60%", "convert:  90%"]
    assert out[0] == "convert:  30% (300 B of 1.0 KB, 100 B/s, 7s left)"
    bar.close()
    bar.close()
    assert out[-1] == "convert: 100% (1.0 KB of 1.0 KB, 10s)" and len(out) == 4
    failed = LineProgress(1000, "synth", every=3.0, clock=lambda: now[0], write=out.append)
    failed.update(10)
    failed.close()
    assert len(out) == 4
