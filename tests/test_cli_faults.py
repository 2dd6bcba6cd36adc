"""The CLI under bad input and faults (issue 21, CLI side): every case ends in one line on stderr
naming what failed, a non-zero exit, no traceback, and no file clobbered.

In-process cases run through typer's CliRunner (the same root group and handler as the console
script); Ctrl-C and the import-time cases run the real program in a subprocess."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gptoss_fp8.checkpoint.outputs import atomic_output, check_output_path, write_atomic
from gptoss_fp8.cli.main import app
from gptoss_fp8.errors import GptOssFp8Error

runner = CliRunner()
ROOT_IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def one_line(r, code: int, *needles: str) -> str:
    """The run exited ``code`` with exactly one stderr line holding every needle, and no traceback."""
    assert r.exit_code == code, (r.exit_code, r.output)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(source dir, its FP8 conversion, a tokens file) on the tiny preset."""
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic

    root = tmp_path_factory.mktemp("tiny")
    write_synthetic(root / "src", "tiny", seed=3)
    convert_checkpoint(root / "src", root / "fp8")
    (root / "tokens.json").write_text(json.dumps([1, 5, 9, 200, 42, 7]))
    # the CLI's modules byte-compiled once: on a fresh clone the first import of cli/main.py compiles it (several
    # ms before its first line, where no code of ours runs yet to hold Ctrl-C), a window the 5 ms case landed in
    subprocess.run([sys.executable, "-c", "import gptoss_fp8.cli.main"], check=True, timeout=120)
    return root / "src", root / "fp8", root / "tokens.json"


def _verify(tiny, *extra: str) -> list[str]:
    src, fp8, tokens = tiny
    return ["verify-logits", str(fp8), "--reference", str(src), "--tokens", str(tokens), *extra]


# ------------------------------------------------------------------------------------------------
# 1. the last-resort handler


def _broken_by_ctrl_c() -> RuntimeError:
    """What a Ctrl-C inside a lock's Condition.wait can come out as (cli/common.py _after_ctrl_c)."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        try:
            raise RuntimeError("release unlocked lock")
        except RuntimeError as e:
            return e


@pytest.mark.parametrize("exc,code,needles", [
    (TypeError("unhashable type: 'list'"), 1, ["unexpected TypeError", "unhashable type", "--debug", "GPTOSS_FP8_DEBUG=1"]),
    (KeyError("layer_types"), 1, ["unexpected KeyError", "layer_types", "--debug"]),
    (ValueError(), 1, ["unexpected ValueError", "(no message)"]),
    (AssertionError("shape [2, 3] != [3, 2]"), 1, ["unexpected AssertionError", "[2, 3]"]),
    (RecursionError("maximum recursion depth exceeded"), 1, ["nested too deeply", "RecursionError", "--debug"]),
    (MemoryError(), 1, ["out of memory", "MemoryError"]),
    (PermissionError(errno.EACCES, "Permission denied", "/data/dst/.gptoss-fp8.lock"), 1,
     ["/data/dst/.gptoss-fp8.lock", "permission denied"]),
    (OSError(errno.ENOSPC, "No space left on device", "/data/dst/model-00001.safetensors"), 1,
     ["no space left", "model-00001.safetensors"]),
    (OSError(errno.EROFS, "Read-only file system", "/ro/x"), 1, ["/ro/x", "permission denied", "Read-only"]),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/data/src/model.safetensors"), 1,
     ["/data/src/model.safetensors", "Is a directory", "IsADirectoryError"]),
    (GptOssFp8Error("the thing, and what to do"), 1, ["error: the thing, and what to do"]),
    (KeyboardInterrupt(), 130, ["interrupted"]),
    (_broken_by_ctrl_c(), 130, ["interrupted"]),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None)
@pytest.mark.parametrize("command", ["convert", "synth", "plan"])
def test_unexpected_exceptions_are_one_line(tmp_path, tiny, monkeypatch, command, exc, code, needles):
    """Whatever a command raises becomes one line and an exit status; the traceback only with --debug."""
    import gptoss_fp8.checkpoint.plan
    import gptoss_fp8.convert.convert
    import gptoss_fp8.convert.synth

    def boom(*a, **k):
        raise exc

    target, args = {
        "convert": (gptoss_fp8.convert.convert, ["convert", str(tiny[0]), str(tmp_path / "out")]),
        "synth": (gptoss_fp8.convert.synth, ["synth", str(tmp_path / "s")]),
        "plan": (gptoss_fp8.checkpoint.plan, ["plan", str(tiny[0])]),
    }[command]
    name = {"convert": "convert_checkpoint", "synth": "write_synthetic", "plan": "plan"}[command]
    monkeypatch.setattr(target, name, boom)
    monkeypatch.setenv("GPTOSS_FP8_DEBUG", "0")  # off; and monkeypatch restores the variable afterwards
    line = one_line(runner.invoke(app, args), code, *needles)
    assert line == "interrupted" if code == 130 else line.startswith("error: ")
    if code == 130:
        return
    dbg = runner.invoke(app, ["--debug", *args])  # the real exception comes out (a traceback in a terminal)
    monkeypatch.setenv("GPTOSS_FP8_DEBUG", "0")  # --debug set it to 1 for the process
    assert dbg.exit_code != 0 and type(dbg.exception) is type(exc)
    monkeypatch.setenv("GPTOSS_FP8_DEBUG", "1")
    assert type(runner.invoke(app, args).exception) is type(exc)


# Under -m slow (two processes, ~7 s on the 2-core box): the same real-process path (one line without
# --debug, the traceback with it) runs by default on convert in
# tests/test_cli.py::test_errors_are_one_line_with_nonzero_exit, and --debug / GPTOSS_FP8_DEBUG in
# process, for every command and exception, in test_unexpected_exceptions_are_one_line above.
@pytest.mark.slow
def test_debug_shows_the_traceback_in_a_real_process(tmp_path):
    base = [sys.executable, "-m", "gptoss_fp8.cli.main"]
    p = subprocess.run([*base, "plan", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert "no such directory" in p.stderr
    p = subprocess.run([*base, "--debug", "plan", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "Traceback" in p.stderr and "GptOssFp8Error" in p.stderr


# Ctrl-C at several moments: while the CLI imports typer, while the command imports torch, while it
# converts. The child signals once the interpreter is up and has found the package (before that,
# Python's own start-up owns SIGINT: ~30 ms no code of ours can guard), then imports the CLI at once.
_CHILD = """
import os, sys
sys.argv = ["gptoss-fp8", *sys.argv[1:]]
import gptoss_fp8.cli
os.write(1, b"R")
from gptoss_fp8.cli.main import app
app()
"""


@pytest.mark.parametrize("delay", [0.005, 0.03, 0.1, 0.3, 0.8, 1.5])
def test_ctrl_c_at_any_moment_is_one_line_exit_130(tmp_path, tiny, delay):
    dst = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", _CHILD, "convert", str(tiny[0]), str(dst), "--report", str(tmp_path / "r.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(1) == b"R"
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    if p.returncode == 0:  # a fast machine finished first: then it must have finished for real
        assert (dst / "config.json").is_file() and (tmp_path / "r.json").is_file()
        return
    assert p.returncode == 130, err.decode()
    # one error line; a Ctrl-C after the copy's progress line (100% of the bytes, not committed yet) leaves it above
    lines = err.decode().splitlines()
    assert lines[-1:] == ["interrupted"] and all(line.startswith("convert: ") for line in lines[:-1]), err.decode()
    assert not (tmp_path / "r.json").exists()  # no report for a conversion that did not finish
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


# The child says "N" when numpy starts to be imported: torch's C start-up imports it, and clears an
# exception raised meanwhile, so a KeyboardInterrupt landing there was lost (the conversion then ran
# to the end and exited 0). The CLI holds Ctrl-C while torch is imported and raises it after.
_CHILD_NUMPY = """
import os, sys
sys.argv = ["gptoss-fp8", *sys.argv[1:]]

class Tell:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            os.write(1, b"N")
        return None

sys.meta_path.insert(0, Tell())
from gptoss_fp8.cli.main import app
app()
"""


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_ctrl_c_while_torch_imports_numpy_is_not_lost(tmp_path, tiny, delay):
    dst = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", _CHILD_NUMPY, "convert", str(tiny[0]), str(dst)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(1) == b"N"
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert (p.returncode, err.decode()) == (130, "interrupted\n"), (p.returncode, err.decode(), out.decode())
    assert not dst.exists()  # stopped before the conversion began


def test_in_process_run_leaves_ctrl_c_deliverable(tiny):
    """The CLI blocks SIGINT only where the process exits: an in-process run (CliRunner, a library
    caller) must not leave it blocked, since child processes inherit the mask (every Ctrl-C test
    after the first in-process run then ran children that could not be interrupted)."""
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a run started in the background
    assert runner.invoke(app, ["plan", str(tiny[0]), "--summary"]).exit_code == 0
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.getsignal(signal.SIGINT) is before


# Ctrl-C at every line: a real SIGINT raises KeyboardInterrupt between two bytecodes of the main
# thread, wherever it is; a tracer raising it at the n-th line event reproduces that window by
# window. The writer's hand-off to its thread once used queue.Queue, whose condition variable a
# KeyboardInterrupt inside put() could leave waiting for a wake-up that never came: abort() then
# joined the thread for ever (the real program hung ~1 run in 150 with Ctrl-C 0.2-3.5 s into a tiny
# convert). And a file committed as the Ctrl-C came was no longer in convert's list to abort, so
# its thread ran on into interpreter exit, where torch code on a daemon thread aborts the process
# ("terminate called without an active exception", exit -6: seen once in CI).


class _CtrlCAtLine:
    """sys.settrace hook: KeyboardInterrupt at the n-th line event in the files named (all of them if
    none are; only in the function named ``func`` if one is), once."""

    def __init__(self, n: int, files: tuple[str, ...] = (), func: str | None = None):
        self.left, self.files, self.func, self.fired, self.lines = n, files, func, False, 0

    def __call__(self, frame, event, arg):
        if self.files and not frame.f_code.co_filename.endswith(self.files):
            return None
        if self.func and frame.f_code.co_name != self.func:
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event == "line" and not self.fired:
            self.lines += 1
            self.left -= 1
            if self.left < 0:
                self.fired = True
                raise KeyboardInterrupt
        return self._line

    def run(self, fn) -> None:
        sys.settrace(self)
        try:
            fn()
        except KeyboardInterrupt:
            assert self.fired
            raise
        finally:
            sys.settrace(None)


def _abort_in_time(w) -> None:
    done = threading.Event()
    threading.Thread(target=lambda: (w.abort(), done.set()), daemon=True).start()
    assert done.wait(20), "abort() hung"


def _writer_threads() -> list[str]:
    """StreamingWriter threads still running (given a moment to leave once their code has ended)."""
    ts = [t for t in threading.enumerate() if t.name.startswith("write ")]
    for t in ts:
        t.join(5)
    return [t.name for t in ts if t.is_alive()]


@pytest.mark.parametrize("step", ["open", "write", "commit"])
def test_ctrl_c_at_every_line_of_the_writer_leaves_no_thread_and_no_file(tmp_path, step):
    from gptoss_fp8.checkpoint.st_io import StreamingWriter

    def open_():
        return StreamingWriter(tmp_path / "a.safetensors", [("t", torch.float32, (64, 16)), ("u", torch.float32, (8,))], {})

    n = 0
    while True:
        # every line, queue.py's and threading.py's included; opening, st_io's own (a Ctrl-C inside the stdlib's
        # tempfile between its first call's lock and its try deadlocks every later call: not ours to mend)
        hook = _CtrlCAtLine(n, ("checkpoint/st_io.py",) if step == "open" else ())
        if step == "open":  # (interrupted, the constructor cleans up after itself: there is no writer to abort)
            try:
                hook.run(lambda: setattr(hook, "w", open_()))  # noqa: B023
            except KeyboardInterrupt:
                assert not _writer_threads() and not list(tmp_path.iterdir()), f"Ctrl-C at line {n}"
                n += 1
                continue
            w = hook.w
            w.abort()
            break
        w = open_()
        x = torch.randn(64, 16)
        try:
            if step == "write":
                hook.run(lambda: [w.write("t", x[i * 8 : (i + 1) * 8]) for i in range(8)])
            else:
                for i in range(8):
                    w.write("t", x[i * 8 : (i + 1) * 8])
                w.write("u", torch.randn(8))
                hook.run(w.commit)
        except KeyboardInterrupt:
            _abort_in_time(w)  # what its callers do (convert, synth) on any exception
        if not hook.fired:
            break
        assert w._thread_done and not _writer_threads() and not list(tmp_path.iterdir()), f"Ctrl-C at line {n}"
        n += 1
    assert n > 20  # (the last run went through)
    if step == "write":
        w.abort()
    assert not _writer_threads() and (tmp_path / "a.safetensors").is_file() == (step == "commit")
    assert not [p for p in tmp_path.iterdir() if p.name != "a.safetensors"]


def _ctrl_c_at_lines(tmp_path, run, files: tuple[str, ...], func: str | None, lines) -> int:
    """``run(dst)`` with a Ctrl-C at each of ``lines(count)`` (line events in ``files`` / ``func``):
    each leaves no writer thread, no temporary file, no output that looks whole and is not."""
    from gptoss_fp8.checkpoint.st_io import TMP_SUFFIX

    count = _CtrlCAtLine(10**9, files, func)
    count.run(lambda: run(tmp_path / "whole"))
    assert not _writer_threads()
    for n in lines(count.lines):
        dst = tmp_path / f"at{n}"
        with pytest.raises(KeyboardInterrupt):
            _CtrlCAtLine(n, files, func).run(lambda: run(dst))  # noqa: B023
        assert not _writer_threads(), f"Ctrl-C at line {n} of {count.lines}"
        assert not [p for p in tmp_path.rglob("*") if p.name.endswith(TMP_SUFFIX)], f"Ctrl-C at line {n}"
        if (dst / "config.json").exists():  # (written last: a Ctrl-C after it, the output is whole)
            names = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"].values()
            assert all((dst / f).is_file() for f in names), f"Ctrl-C at line {n}"
    return count.lines


def _convert(src):
    from gptoss_fp8.convert.convert import convert_checkpoint

    return lambda dst: convert_checkpoint(src, dst)


def test_ctrl_c_at_lines_of_convert_and_synth_leaves_no_thread_and_no_temporary_file(tmp_path, tiny):
    """12 lines of convert's own code drawn from the ~7500 it runs, 8 of synth's from its ~3700 (the
    stdlib's windows: above)."""
    from gptoss_fp8.convert.synth import write_synthetic

    files = ("convert/convert.py", "convert/jobs.py", "checkpoint/st_io.py")
    sample = lambda k: lambda total: sorted(random.sample(range(total), k))  # noqa: E731
    assert _ctrl_c_at_lines(tmp_path / "c", _convert(tiny[0]), files, None, sample(12)) > 1000
    synth = lambda dst: write_synthetic(dst, "tiny", seed=1, layout="hf")  # noqa: E731
    assert _ctrl_c_at_lines(tmp_path / "s", synth, ("convert/synth.py", "checkpoint/st_io.py"), None, sample(8)) > 500


# Under -m slow (~40 s): every line of the loop that runs the jobs and commits the files (~320); a
# Ctrl-C as a file was committed once left its thread running into interpreter exit.
@pytest.mark.slow
def test_ctrl_c_at_every_line_of_the_job_loop(tmp_path, tiny):
    assert _ctrl_c_at_lines(tmp_path, _convert(tiny[0]), ("convert/convert.py",), "_run_jobs", range) > 100


# ------------------------------------------------------------------------------------------------
# 3. argument validation: one line each, before any work


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0", "1e-12", "1e300"])
def test_max_shard_size_is_a_sane_number(tmp_path, tiny, value):
    r = runner.invoke(app, ["convert", str(tiny[0]), str(tmp_path / "o"), "--max-shard-size", value])
    one_line(r, 2, "--max-shard-size", "GB")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("device", ["foo", "meta", "mps", "xla", "cuda:x", "cpu:0", "CUDA", ""])
def test_convert_device_choices(tmp_path, tiny, device):
    r = runner.invoke(app, ["convert", str(tiny[0]), str(tmp_path / "o"), "--device", device])
    one_line(r, 2, "--device", "cpu, cuda or cuda:N")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("device", ["foo", "meta", "mps", "cuda:0"])
def test_verify_device_choices(tiny, device):
    one_line(runner.invoke(app, _verify(tiny, "--device", device)), 2, "--device", "'cpu'", "'cuda'")


@pytest.mark.parametrize("option,value,needle", [
    ("--max-kl", "nan", "finite number >= 0"),
    ("--max-kl-mean", "inf", "finite number >= 0"),
    ("--layer-rel-err", "-0.5", "finite number >= 0"),
    ("--min-top1", "1.5", "fraction from 0 to 1"),
    ("--min-top1", "nan", "fraction from 0 to 1"),
])
def test_threshold_overrides_cannot_make_every_check_pass(tiny, option, value, needle):
    one_line(runner.invoke(app, _verify(tiny, option, value)), 2, option, needle)


@pytest.mark.parametrize("content,needle", [
    ("DIR", "is a directory"),
    ("FIFO", "not a regular file"),
    (json.dumps([1, 10**30]), "outside the vocabulary"),
    (json.dumps([1, 2, 503]), "vocab_size 503"),  # the first id past the tiny vocabulary
    (json.dumps([1, 2, 10**6]), "token id 1000000 at position 2"),
    (json.dumps([-1]), "non-negative integer"),
    (json.dumps([1.0, 2.0]), "non-negative integer"),
    (json.dumps([True, 1]), "non-negative integer"),
    (json.dumps([]), "non-empty JSON list"),
    (json.dumps({"ids": [1]}), "non-empty JSON list"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ("[1, 2", "invalid JSON"),
    (b"\xff\xfe[1]", "invalid JSON"),
    ("MISSING", "no such tokens file"),
])
def test_bad_tokens_files(tmp_path, tiny, content, needle):
    path = tmp_path / "tokens.json"
    if content == "DIR":
        path.mkdir()
    elif content == "FIFO":
        os.mkfifo(path)  # reading it would block forever
    elif content != "MISSING":
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    src, fp8, _ = tiny
    r = runner.invoke(app, ["verify-logits", str(fp8), "--reference", str(src), "--tokens", str(path)])
    one_line(r, 1, "--tokens", needle)
    assert "PASS" not in r.stdout


def test_huge_tokens_file_is_refused_unread(tmp_path, tiny):
    from gptoss_fp8.cli.verify_logits import TOKENS_MAX_BYTES

    path = tmp_path / "tokens.json"
    with open(path, "wb") as f:
        f.truncate(TOKENS_MAX_BYTES + 1)  # sparse: no disk used
    src, fp8, _ = tiny
    one_line(runner.invoke(app, ["verify-logits", str(fp8), "--reference", str(src), "--tokens", str(path)]), 1, "MiB")


@pytest.mark.parametrize("command", ["synth", "convert"])
@pytest.mark.parametrize("shape", ["file", "under-a-file"])
def test_dst_that_cannot_be_a_directory(tmp_path, tiny, command, shape):
    f = tmp_path / "a-file"
    f.write_text("keep")
    dst = f if shape == "file" else f / "sub"
    args = ["synth", str(dst)] if command == "synth" else ["convert", str(tiny[0]), str(dst)]
    one_line(runner.invoke(app, args), 1, "DST", str(f), "directory")
    assert f.read_text() == "keep"


@pytest.mark.parametrize("command", ["generate", "verify-logits"])
def test_source_checkpoint_where_a_converted_one_is_needed(tiny, command):
    """The MXFP4 source given as the converted checkpoint: one line saying what it is and the
    command that makes the converted one, not "tensor ... is missing; re-run the conversion"."""
    src, _, tokens = tiny
    args = {"generate": ["generate", str(src), "--tokens", str(tokens)],
            "verify-logits": ["verify-logits", str(src), "--reference", str(src), "--tokens", str(tokens)]}[command]
    one_line(runner.invoke(app, args), 1, f"{src} is an MXFP4 source checkpoint, not a converted FP8 one",
             f"convert it first: gptoss-fp8 convert {src} DST")


def test_source_checkpoint_is_refused_where_checkpoints_are_opened(tmp_path):
    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.convert.synth import write_synthetic

    write_synthetic(tmp_path / "s", "tiny", layout="both")
    with pytest.raises(GptOssFp8Error, match="is an MXFP4 source checkpoint.*gptoss-fp8 convert"):
        Checkpoint.open(tmp_path / "s")
    with pytest.raises(GptOssFp8Error, match="original/ layout, not a converted FP8 one"):
        Checkpoint.open(tmp_path / "s" / "original")
    # convert and plan given original/: which layout it is and where the readable one is (not "model_type is None")
    for cmd in (["convert", str(tmp_path / "s" / "original"), str(tmp_path / "d")], ["plan", str(tmp_path / "s" / "original")]):
        one_line(runner.invoke(app, cmd), 1, "original/config.json: OpenAI's original/ layout",
                 "the directory above original/")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("command", ["generate", "verify-logits"])
def test_prompt_on_a_vocabulary_harmony_cannot_encode_says_so_first(tmp_path, tiny, monkeypatch, command):
    """--prompt on a model whose vocabulary is not Harmony's: that is the one line, before any
    tokenizer is imported or asked to be installed (not "pip install openai-harmony bpe-openai" first)."""
    src, fp8, _ = tiny
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no unpacked o200k file either
    for name in ("openai_harmony", "bpe_openai"):
        monkeypatch.setitem(sys.modules, name, None)  # importing them fails, as when not installed
    args = {"generate": ["generate", str(fp8), "--prompt", "hi"],
            "verify-logits": ["verify-logits", str(fp8), "--reference", str(src), "--prompt", "hi"]}[command]
    line = one_line(runner.invoke(app, args), 1, "vocabulary has 503 tokens", "--tokens FILE")
    assert "pip install" not in line


@pytest.mark.skipif(ROOT_IS_ROOT, reason="root writes anywhere")
@pytest.mark.parametrize("command", ["synth", "convert"])
def test_dst_not_writable(tmp_path, tiny, command):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        for dst in (ro, ro / "new"):
            args = ["synth", str(dst)] if command == "synth" else ["convert", str(tiny[0]), str(dst)]
            one_line(runner.invoke(app, args), 1, "DST", "not writable")
        assert os.listdir(ro) == []  # no lock left behind
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("command", ["synth", "convert"])
def test_dst_not_writable_as_the_os_reports_it(tmp_path, tiny, monkeypatch, command):
    """The same check, root or not: os.access says no (a read-only mount, another user's folder)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p) == ro and mode & os.W_OK else real(p, mode, **k))
    args = ["synth", str(ro)] if command == "synth" else ["convert", str(tiny[0]), str(ro)]
    one_line(runner.invoke(app, args), 1, "DST", str(ro), "not writable")
    assert os.listdir(ro) == []


@pytest.mark.parametrize("shape,needle", [
    ("config-file", "is not a directory"),
    ("other-file", "is not a directory"),
    ("missing", "no such directory"),
    ("empty-dir", "no config.json"),
])
def test_plan_src_shapes(tmp_path, tiny, shape, needle):
    target = {"config-file": tiny[0] / "config.json", "other-file": tiny[0] / "generation_config.json",
              "missing": tmp_path / "nope", "empty-dir": tmp_path}[shape]
    line = one_line(runner.invoke(app, ["plan", str(target)]), 1, str(target), needle)
    assert "config.json/config.json" not in line


def test_plot_without_matplotlib_fails_before_the_run(tiny, tmp_path, monkeypatch):
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    r = runner.invoke(app, _verify(tiny, "--plot", str(tmp_path / "p.png"), "--json", str(tmp_path / "r.json")))
    one_line(r, 1, "--plot", "matplotlib", "pip install")
    assert "PASSED" not in r.stdout and r.stdout == ""  # before the reference and the modes ran
    assert os.listdir(tmp_path) == []


def test_bench_serve_plot_without_matplotlib_fails_before_the_run(tmp_path, monkeypatch):
    """bench serve checks --plot as verify-logits does: before any request (here a URL no server answers, which would
    otherwise be the error), not after the whole load has run."""
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = runner.invoke(app, ["bench", "serve", "http://127.0.0.1:9", "--plot", str(tmp_path / "s.png")])
    one_line(r, 1, "--plot", "matplotlib", "pip install")
    assert r.stdout == "" and os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["p.txt", "p.json", "p.safetensors"])
def test_plot_format_is_checked_before_the_run(tiny, tmp_path, name):
    pytest.importorskip("matplotlib")
    r = runner.invoke(app, _verify(tiny, "--plot", str(tmp_path / name)))
    one_line(r, 1, "--plot", "matplotlib cannot write", ".png")
    assert r.stdout == ""


def test_bench_tokens_are_checked():
    from gptoss_fp8.cli.bench import _lengths

    assert _lengths("1024, 2048,") == [1024, 2048]
    for bad in ("abc", "", ",", "0", "-5", "1e3", str(10**30)):
        with pytest.raises(GptOssFp8Error, match="--tokens"):
            _lengths(bad)


# ------------------------------------------------------------------------------------------------
# 4. user-named output files never clobber


@pytest.mark.parametrize("where", ["src-config", "src-index", "src-dir", "src-new-file", "src-original",
                                   "dst-config", "dst-dir", "dst-sub", "symlink-into-src"])
def test_convert_report_never_inside_a_checkpoint(tmp_path, tiny, where):
    src = tmp_path / "src"
    import shutil

    shutil.copytree(tiny[0], src)
    dst = tmp_path / "dst"
    report = {"src-config": src / "config.json", "src-index": src / "model.safetensors", "src-dir": src,
              "src-new-file": src / "report.json", "src-original": src / "original" / "r.json",
              "dst-config": dst / "config.json", "dst-dir": dst, "dst-sub": dst / "a" / "r.json",
              "symlink-into-src": tmp_path / "link.json"}[where]
    if where == "symlink-into-src":
        report.symlink_to(src / "config.json")
    before = snapshot(src)
    for extra in ([], ["--overwrite-outputs"], ["--overwrite-outputs", "--overwrite"]):
        r = runner.invoke(app, ["convert", str(src), str(dst), "--report", str(report), *extra])
        one_line(r, 1, "--report", "write it elsewhere")
        assert snapshot(src) == before and not dst.exists()  # refused before the conversion started


def test_convert_report_existing_file_is_kept(tmp_path, tiny):
    report = tmp_path / "r.json"
    report.write_text("mine")
    r = runner.invoke(app, ["convert", str(tiny[0]), str(tmp_path / "dst"), "--report", str(report)])
    one_line(r, 1, "--report", str(report), "already exists", "--overwrite-outputs")
    assert report.read_text() == "mine" and not (tmp_path / "dst").exists()
    r = runner.invoke(app, ["convert", str(tiny[0]), str(tmp_path / "dst"), "--report", str(report), "--overwrite-outputs"])
    assert r.exit_code == 0, r.output
    assert json.loads(report.read_text()) == json.loads((tmp_path / "dst" / "conversion.json").read_text())


def test_convert_report_missing_parent_is_created(tmp_path, tiny):
    report = tmp_path / "a" / "b" / "r.json"
    r = runner.invoke(app, ["convert", str(tiny[0]), str(tmp_path / "dst"), "--report", str(report)])
    assert r.exit_code == 0, r.output
    assert json.loads(report.read_text())["exactness"]
    assert sorted(os.listdir(report.parent)) == ["r.json"]  # no temporary file left


@pytest.mark.parametrize("shape,needle", [
    ("parent-is-file", "Not a directory"),
    ("grandparent-is-file", "Not a directory"),
    ("is-dir", "is a directory"),
    ("fifo", "not a regular file"),
    ("dotdot", "not a file name"),
])
def test_convert_report_unwritable_refused_before_the_conversion(tmp_path, tiny, shape, needle):
    f = tmp_path / "f"
    f.write_text("keep")
    report = {"parent-is-file": f / "r.json", "grandparent-is-file": f / "a" / "r.json", "is-dir": tmp_path,
              "fifo": tmp_path / "fifo", "dotdot": tmp_path / "x" / ".."}[shape]
    if shape == "fifo":
        os.mkfifo(report)
    r = runner.invoke(app, ["convert", str(tiny[0]), str(tmp_path / "dst"), "--report", str(report), "--overwrite-outputs"])
    one_line(r, 1, "--report", needle)
    assert not (tmp_path / "dst").exists() and f.read_text() == "keep"


def _verify_outputs(tmp_path: Path) -> dict[str, Path]:
    return {"--json": tmp_path / "r.json", "--dump-logits": tmp_path / "l.safetensors", "--plot": tmp_path / "p.png",
            "--save-reference": tmp_path / "ref.safetensors"}


@pytest.mark.parametrize("option", ["--json", "--dump-logits", "--plot", "--save-reference"])
@pytest.mark.parametrize("where", ["ckpt-config", "ckpt-new", "ckpt-dir", "reference-dir", "tokens-file"])
def test_verify_outputs_never_inside_inputs(tmp_path, tiny, option, where):
    if option == "--plot":
        pytest.importorskip("matplotlib")
    src, fp8, tokens = tiny
    target = {"ckpt-config": fp8 / "config.json", "ckpt-new": fp8 / "x.png", "ckpt-dir": fp8,
              "reference-dir": src / "x.png", "tokens-file": tokens}[where]
    before = snapshot(src.parent)
    r = runner.invoke(app, _verify(tiny, option, str(target), "--overwrite-outputs", "--mode", "weights"))
    one_line(r, 1, option, "write it elsewhere")
    assert snapshot(src.parent) == before and r.stdout == ""


@pytest.mark.parametrize("option", ["--json", "--dump-logits", "--plot", "--save-reference"])
def test_verify_outputs_existing_file_is_kept(tmp_path, tiny, option):
    if option == "--plot":
        pytest.importorskip("matplotlib")
    target = tmp_path / ("out.png" if option == "--plot" else "out.bin")
    target.write_text("mine")
    extra = ["--mode", "weights"] if option == "--dump-logits" else []  # one mode: the dump is FILE itself
    r = runner.invoke(app, _verify(tiny, option, str(target), *extra))
    one_line(r, 1, option, str(target), "already exists", "--overwrite-outputs")
    assert target.read_text() == "mine" and r.stdout == ""


def test_verify_dump_logits_per_mode_files_are_checked(tmp_path, tiny):
    (tmp_path / "l.w8a8.safetensors").write_text("mine")
    r = runner.invoke(app, _verify(tiny, "--dump-logits", str(tmp_path / "l.safetensors")))
    one_line(r, 1, "--dump-logits (w8a8)", "already exists")
    assert (tmp_path / "l.w8a8.safetensors").read_text() == "mine"


@pytest.mark.parametrize("a,b", [("--json", "--save-reference"), ("--json", "--dump-logits"), ("--plot", "--json")])
def test_verify_two_options_one_file(tmp_path, tiny, a, b):
    same = tmp_path / "same.png"
    r = runner.invoke(app, _verify(tiny, a, str(same), b, str(same), "--mode", "weights"))
    one_line(r, 1, "name the same file", str(same))
    assert not same.exists()


def test_verify_outputs_written_atomically_and_replaced_only_on_request(tmp_path, tiny):
    pytest.importorskip("gpt_oss.torch.model", reason="OpenAI's reference: pip install --no-deps gpt-oss==0.0.9")
    outs = _verify_outputs(tmp_path / "new" / "dir")  # missing parents are created
    if importlib.util.find_spec("matplotlib") is None:
        outs.pop("--plot")
    args = _verify(tiny, "--mode", "weights", *[x for o, p in outs.items() for x in (o, str(p))])
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "PASSED" in r.stdout, r.output
    written = {o: p.read_bytes() for o, p in outs.items()}
    assert all(written.values())
    assert sorted(os.listdir(tmp_path / "new" / "dir")) == sorted(p.name for p in outs.values())  # no temporaries
    assert all(oct(p.stat().st_mode & 0o777) == oct(0o666 & ~_umask()) for p in outs.values())
    r = runner.invoke(app, args)  # again: refused, nothing changed
    one_line(r, 1, "already exists")
    assert {o: p.read_bytes() for o, p in outs.items()} == written
    r = runner.invoke(app, [*args, "--overwrite-outputs"])
    assert r.exit_code == 0, r.output


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


# ------------------------------------------------------------------------------------------------
# checkpoint/outputs.py on its own


def test_write_atomic_refuses_and_replaces(tmp_path):
    p = tmp_path / "x.json"
    write_atomic(p, "one")
    with pytest.raises(GptOssFp8Error, match="appeared while this command ran"):
        write_atomic(p, "two")  # a file that appeared after the check is not replaced either
    assert p.read_text() == "one"
    write_atomic(p, b"three", overwrite=True)
    assert p.read_bytes() == b"three" and os.listdir(tmp_path) == ["x.json"]


def test_write_atomic_never_writes_through_a_symlink(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    with pytest.raises(GptOssFp8Error, match="already exists"):
        check_output_path(link, option="--json")
    write_atomic(link, "new", overwrite=True)  # replaces the link itself
    assert target.read_text() == "keep" and not link.is_symlink() and link.read_text() == "new"


def test_planted_temporary_symlinks_are_not_followed(tmp_path, monkeypatch):
    """Temporary names are unique and created exclusively: a planted name is skipped, never opened."""
    import gptoss_fp8.checkpoint.outputs as outputs

    target = tmp_path / "precious"
    target.write_text("keep")
    names = iter(["aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(outputs.secrets, "token_hex", lambda n: next(names))
    (tmp_path / ".r.tmp-aaaaaaaaaaaa.json").symlink_to(target)  # the attacker guessed the first name
    write_atomic(tmp_path / "r.json", "report", overwrite=True)
    assert target.read_text() == "keep" and (tmp_path / "r.json").read_text() == "report"
    assert (tmp_path / ".r.tmp-aaaaaaaaaaaa.json").is_symlink()  # left alone
    assert not (tmp_path / ".r.tmp-bbbbbbbbbbbb.json").exists()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError, OSError])
def test_atomic_output_failure_leaves_the_old_file_and_no_temporary(tmp_path, exc):
    p = tmp_path / "l.safetensors"
    p.write_text("old")
    with pytest.raises(GptOssFp8Error if exc is OSError else exc):
        with atomic_output(p, overwrite=True) as tmp:
            tmp.write_text("half")
            raise exc(errno.ENOSPC, "No space left on device") if exc is OSError else exc()
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["l.safetensors"]


def test_write_atomic_full_disk_is_one_clear_error(tmp_path, monkeypatch):
    import gptoss_fp8.checkpoint.outputs as outputs

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.os, "fsync", full)
    with pytest.raises(GptOssFp8Error, match=r"cannot write .*r\.json: No space left on device; free space"):
        write_atomic(tmp_path / "r.json", "x")
    assert os.listdir(tmp_path) == []


def test_check_output_path_cases(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "in.json").write_text("[1]")
    forbidden = [tmp_path / "ckpt", tmp_path / "in.json"]
    ok = tmp_path / "new" / "deeper" / "r.json"
    assert check_output_path(ok, forbidden=forbidden) == ok and not ok.parent.exists()  # nothing created
    for bad, needle in [(tmp_path / "ckpt" / "r.json", "is inside"), (tmp_path / "ckpt", "is "),
                        (tmp_path / "in.json", "is the input file"), (tmp_path / "ckpt" / ".." / "ckpt" / "x", "is inside")]:
        with pytest.raises(GptOssFp8Error, match=needle):
            check_output_path(bad, overwrite=True, forbidden=forbidden, option="--json")
