"""The torch side runs without Triton: the model, its CPU spec backends and verify import no Triton,
and the CLI's plan, convert and verify-logits (weights and w8a8 modes) work with Triton made
unimportable. Each check runs in a fresh interpreter, so nothing imported by other tests counts."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Installed first in a child interpreter: any import of triton (or triton.*) raises ImportError
# and is recorded, so code that swallows the error is still caught.
BLOCK_TRITON = textwrap.dedent("""
    import importlib.abc, os, sys

    class _NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                with open(os.environ["NO_TRITON_LOG"], "a") as f:
                    f.write(name + "\\n")
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by tests/test_no_triton.py)", name=name)
            return None

    sys.meta_path.insert(0, _NoTriton())
""")


def _python(code: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    env_log = tmp_path / "triton_imports.log"
    script = tmp_path / "run.py"
    script.write_text(BLOCK_TRITON + textwrap.dedent(code))
    env = {**os.environ, "NO_TRITON_LOG": str(env_log)}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=600)


def _attempts(tmp_path) -> list[str]:
    log = tmp_path / "triton_imports.log"
    return log.read_text().split() if log.is_file() else []


def test_torch_modules_import_no_triton(tmp_path):
    """Imported in a plain interpreter (Triton importable), the model, the ops backends, the loader,
    the spec and verify leave triton out of sys.modules."""
    code = ("import sys\n"
            "import gptoss_fp8.spec, gptoss_fp8.model.ops, gptoss_fp8.model.gptoss, gptoss_fp8.model.load, "
            "gptoss_fp8.verify.run, gptoss_fp8.verify.backends\n"
            "from gptoss_fp8.model.backends import get_ops\n"
            "get_ops('weights'); get_ops('w8a8')\n"
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_blocker_blocks(tmp_path):
    """The check below can fail: importing the triton backend under the blocker is refused and logged."""
    proc = _python("import gptoss_fp8.model.triton_ops\n", tmp_path)
    assert proc.returncode != 0 and "blocked by tests/test_no_triton.py" in proc.stderr, proc.stderr
    assert _attempts(tmp_path) == ["triton"]


CLI = """
    import sys, runpy
    sys.argv = ["gptoss-fp8", *sys.argv[1:]]
    runpy.run_module("gptoss_fp8.cli.main", run_name="__main__")
"""


def test_cli_without_triton(tmp_path):
    """synth, plan, convert (CPU) and verify-logits --mode weights / --mode w8a8 on the tiny synthetic
    checkpoint, each in an interpreter where Triton cannot be imported: all succeed, none tries it."""
    pytest.importorskip("gpt_oss.torch.model", reason="OpenAI's reference: pip install --no-deps gpt-oss==0.0.9")
    src, out = tmp_path / "src", tmp_path / "fp8"
    (tmp_path / "tokens.json").write_text(json.dumps([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]))

    def cli(*args: str) -> subprocess.CompletedProcess:
        proc = _python(CLI, tmp_path, *args)
        assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}"
        assert _attempts(tmp_path) == [], (args, _attempts(tmp_path))
        return proc

    cli("synth", str(src), "--preset", "tiny", "--seed", "2", "--layout", "hf")
    plan = cli("plan", str(src), "--tp", "2", "--summary")
    assert "rank" in plan.stdout.lower(), plan.stdout
    cli("convert", str(src), str(out))
    assert (out / "config.json").is_file()
    # both modes in one run (one process fewer: ~6 s on the 2-core box)
    report = tmp_path / "both.json"
    proc = cli("verify-logits", str(out), "--reference", str(src), "--tokens", str(tmp_path / "tokens.json"),
               "--mode", "weights", "--mode", "w8a8", "--device", "cpu", "--json", str(report))
    rep = json.loads(report.read_text())
    assert rep["passed"] is True and rep["modes"] == ["weights", "w8a8"], proc.stdout
    for mode in ("weights", "w8a8"):
        assert rep[mode]["backend"] == {"weights": "reference", "w8a8": "w8a8-cpu"}[mode]
        assert "spec_fallbacks" not in rep[mode]
