"""The CLI: --help everywhere, the main job end to end, one-line errors with non-zero exit."""

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
    assert "exactness:" in r.output and "experts  : 4 tensors, 100.0000% exact" in r.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep == json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert not (tmp_path / "out" / "original").exists()  # original/ is not an input and not copied


def test_errors_are_one_line_with_nonzero_exit(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gptoss_fp8.cli.main", "convert", str(tmp_path / "nope"), str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert "Traceback" not in proc.stderr
    dbg = subprocess.run([sys.executable, "-m", "gptoss_fp8.cli.main", "--debug", "convert", str(tmp_path / "nope"), str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert dbg.returncode != 0 and "Traceback" in dbg.stderr


def test_synth_refuses_non_empty_dst(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("1")
    r = runner.invoke(app, ["synth", str(tmp_path / "x")])
    assert r.exit_code == 1 and "not empty" in r.output
    assert (tmp_path / "x" / "keep").read_text() == "1"
