"""Shared CLI pieces: the last-resort error handler, shared option types and argument checks.

Imports nothing heavy (no torch, no safetensors): ``--help`` and argument errors must stay fast,
so command modules import the library inside their functions.
"""

from __future__ import annotations

import enum
import errno
import math
import os
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
import typer.core

from gptoss_fp8.errors import GptOssFp8Error

DEBUG_ENV = "GPTOSS_FP8_DEBUG"
DEBUG_HINT = "rerun with --debug (or GPTOSS_FP8_DEBUG=1) for the traceback"
INTERRUPTED = 130  # the shell's code for "killed by SIGINT"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _os_error_line(e: OSError) -> str:
    names = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    where = f"{names}: " if names else ""
    what = e.strerror or str(e) or type(e).__name__
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{where}no space left on the device ({what}); free space and run the command again"
    if isinstance(e, PermissionError) or e.errno == errno.EROFS:
        return f"{where}permission denied ({what}); choose a location you can write (or read), or fix its permissions"
    if e.errno == errno.EMFILE:
        return f"{where}too many open files ({what}); raise the limit (ulimit -n) and run the command again"
    return f"{where}{what} ({type(e).__name__}); check the path, or {DEBUG_HINT}"


def failure_line(e: BaseException) -> str:
    """The one line shown for an exception that reached the CLI (without the ``error: `` prefix)."""
    if isinstance(e, GptOssFp8Error):
        return _one_line(str(e), limit=4000)  # our own messages: whole, on one line
    if isinstance(e, RecursionError):
        return ("input nested too deeply to read (RecursionError): a JSON file (config.json, the index or a "
                f"safetensors header) is malformed or hostile; {DEBUG_HINT}")
    if isinstance(e, MemoryError):
        return ("out of memory (MemoryError): an input declares sizes larger than this machine holds "
                f"(a corrupt config or header?), or use a machine with more RAM; {DEBUG_HINT}")
    if isinstance(e, OSError):
        return _one_line(_os_error_line(e))
    return _one_line(f"unexpected {type(e).__name__}: {str(e) or '(no message)'}. This is a bug, or an input "
                     f"gptoss-fp8 does not check yet; {DEBUG_HINT}", limit=600)


def _after_ctrl_c(e: BaseException) -> bool:
    """``e`` is a Ctrl-C, or was raised while one was on its way up: Python's locks are not safe
    against a KeyboardInterrupt raised inside them (3.11: Condition.wait cut between releasing its
    lock and its try leaves ``with cond:`` releasing an unlocked lock), so a Ctrl-C can come out as
    ``RuntimeError: release unlocked lock`` with the KeyboardInterrupt as its context."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        if isinstance(x, KeyboardInterrupt):
            return True
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return False


def report_failure(e: BaseException) -> int:
    """Show ``e`` as one line on stderr; return the exit status (130 for Ctrl-C, or an error a
    Ctrl-C caused; 1 otherwise). With --debug / GPTOSS_FP8_DEBUG=1 the caller re-raises instead
    (the traceback)."""
    if _after_ctrl_c(e):
        _stderr_line("interrupted")
        return INTERRUPTED
    _stderr_line(f"error: {failure_line(e)}")
    return 1


# ------------------------------------------------------------------------------------------------
# Ctrl-C: raised where it lands, except inside ``ctrl_c_deferred`` (importing torch), where it waits
# for the block's end. torch's C start-up imports numpy and clears any exception raised meanwhile,
# so a KeyboardInterrupt raised there (a Ctrl-C about 1 s into convert on a small machine) was
# lost and the command ran to the end with exit 0.


class _CtrlC:
    received = False  # a SIGINT came while deferred, not raised yet
    deferred = 0  # depth of ctrl_c_deferred blocks
    decided = False  # the command's exit status is decided: a Ctrl-C from then on is ignored
    process_exit = False  # the process ends with this command (the console script): keep the handler to the end


def _on_sigint(signum, frame) -> None:
    if _CtrlC.decided:
        return
    if _CtrlC.deferred:
        _CtrlC.received = True
        return
    raise KeyboardInterrupt


@contextmanager
def ctrl_c_handler() -> Iterator[None]:
    """Python's SIGINT behaviour (KeyboardInterrupt where the main thread is), plus deferral in
    ``ctrl_c_deferred`` blocks, while the command runs, and nothing once its status is decided
    (``ctrl_c_decided``); the previous handler put back after, except where the process ends with
    the command (``_CtrlC.process_exit``): there a Ctrl-C between here and the exit would otherwise
    meet Python's default handler and kill a finished command by the signal."""
    _CtrlC.decided = False
    try:
        previous = signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main thread (an embedding caller): leave signals alone
        yield
        return
    try:
        yield
    finally:
        if not (_CtrlC.decided and _CtrlC.process_exit):
            signal.signal(signal.SIGINT, previous)


def mark_process_exit(on: bool) -> None:
    """Whether the process ends with the command about to run (the console script, not an in-process
    caller): then ``ctrl_c_handler`` keeps its handler installed once the status is decided."""
    _CtrlC.process_exit = on


def ctrl_c_decided() -> None:
    """The command's exit status is decided: a Ctrl-C from here on changes nothing."""
    _CtrlC.decided = True


@contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """A Ctrl-C inside the block is raised as KeyboardInterrupt when the block ends (so code that
    swallows exceptions, like torch's C start-up, cannot lose it)."""
    _CtrlC.deferred += 1
    try:
        yield
    finally:
        _CtrlC.deferred -= 1
    if _CtrlC.received and not _CtrlC.deferred:
        _CtrlC.received = False
        raise KeyboardInterrupt


class TorchCommand(typer.core.TyperCommand):
    """A command that runs torch: torch is imported once its arguments are parsed (never for
    --help or a usage error), with Ctrl-C deferred until the import is over."""

    def invoke(self, ctx):
        with ctrl_c_deferred():
            import torch  # noqa: F401
        return super().invoke(ctx)


def _stderr_line(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: nothing more to say
        pass


# ------------------------------------------------------------------------------------------------
# Shared option types and checks (no torch: these are read when --help is built)


class ScaleModeChoice(str, enum.Enum):
    """The CLI's copy of quant.fp8.ScaleMode (that module imports torch); tests keep them equal."""

    pow2 = "pow2"
    amax = "amax"


class Gemm(str, enum.Enum):
    ours = "ours"
    deep_gemm = "deep_gemm"


# --gemm: KernelConfig.gemm of the run's kernels (verify-logits, bench prefill, bench kernels)
GemmOption = Annotated[Gemm, typer.Option(
    help="The library of the kernels' dense and grouped FP8 GEMMs: ours, or deep_gemm (DeepGEMM, when "
         "importable; bias, SwiGLU and quantization stay in our kernels).")]


class AttentionBackend(str, enum.Enum):
    """The CLI's copy of kernels.config.ATTENTION_BACKENDS (that module imports torch)."""

    ours = "ours"
    flashinfer = "flashinfer"


# --kernel-option: a KernelConfig field for one run (kernels.config.with_options), one GPU
KernelOptionOption = Annotated[list[str] | None, typer.Option(
    help="NAME=VALUE: a KernelConfig field for this run's kernels (repeatable), e.g. attention_fp8_lane_max=true or "
         "moe_gluon_wide_gate_up.stages=3 (kernels/config.py); recorded in --json. One GPU only.")]


# --attention-backend: KernelConfig.attention_backend of the run's kernels (where --gemm is)
AttentionBackendOption = Annotated[AttentionBackend, typer.Option(
    help="The library of the kernels' bf16 prefill attention of a whole prompt: ours, or flashinfer "
         "(FlashInfer's sink prefill, when importable; JIT-compiled by nvcc at first use, minutes, then cached). "
         "FP8 attention, prompt chunks after cached keys and decode stay on ours.")]


class Attention(str, enum.Enum):
    """The CLI's copy of model.ops.ATTENTION_KINDS (that module imports torch)."""

    bf16 = "bf16"
    fp8 = "fp8"
    fp8_lin = "fp8-lin"


# --attention: the prefill attention's numerics (verify-logits, bench, generate, serve)
AttentionOption = Annotated[Attention, typer.Option(
    help="Prefill attention numerics: bf16 (the reference's), or fp8 (the full-attention layers' Q, K, V and P in "
         "e4m3 with block scales, spec.attention_fp8; the FP8 kernels on the GPU), or fp8-lin (fp8 with P's e4m3 "
         "codes made from the scores without exponentials: ~12% faster full layers, a further approximation the "
         "verdict measures; docs/verify.md). Sliding-window layers and decode attention stay bf16.")]


class Preset(str, enum.Enum):
    """Synthetic shapes (config.preset_config)."""

    tiny = "tiny"
    b20 = "20b"
    b120 = "120b"


# bench prefill / bench decode --tp / --ep / --vocab-parallel (random weights at a layout of these)
TpOption = Annotated[int, typer.Option(min=1, max=64, help=(
    "Tensor-parallel ranks, one process per GPU (started here, or run under torchrun --nproc-per-node TP); "
    "NCCL all-reduces."))]
EpOption = Annotated[int, typer.Option(min=1, max=64, help="Expert-parallel groups (must divide --tp).")]
DistinctLayersOption = Annotated[int | None, typer.Option(min=1, help=(
    "One GPU, random weights: only the first N layers get weights of their own, the rest repeat them (no copy), "
    "so every layer of a model too large for the GPU runs (the 120b on an 80 GB card: 12, say), each reading its "
    "weights from memory as the whole model's would. Timing only: the logits are not a model's."))]
BenchVocabParallel = Annotated[bool, typer.Option(
    help="With --tp: the embedding and lm_head split by vocabulary rows over the ranks (of random weights; "
         "a bench prefill --checkpoint's own layout decides for it).")]


def check_one_gpu_distinct_layers(distinct_layers: int | None, tp: int, ep: int) -> None:
    """--distinct-layers repeats one GPU's layers: one line, before any work, with --tp / --ep."""
    if distinct_layers is not None and (tp > 1 or ep > 1):
        raise GptOssFp8Error("--distinct-layers is for one GPU; with --tp / --ep each rank holds its own shard of "
                             "every layer (pass --layers N to build fewer)")


def check_vocab_parallel(vocab_parallel: bool, tp: int) -> None:
    """--vocab-parallel asks for a split over --tp ranks: one line, before any work, at tp 1 (where
    it would mean nothing)."""
    if vocab_parallel and tp < 2:
        raise GptOssFp8Error("--vocab-parallel splits the vocabulary over --tp ranks; give --tp 2 or more")


OverwriteOutputs = Annotated[bool, typer.Option(
    "--overwrite-outputs",
    help="Replace existing files named by the output options (--report, --json, ...); never a checkpoint's files.")]

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(value: str) -> str:
    """--device of convert: cpu, cuda or cuda:N (torch parses it later; meta, mps, ... cannot run it)."""
    if not _DEVICE.fullmatch(value):
        raise typer.BadParameter(f"{value!r} is not a device the converter runs on; choose cpu, cuda or cuda:N")
    return value


def check_shard_size(value: float) -> float:
    """--max-shard-size in GB: a number from 1e-6 (1 KB) to 1e6 (1 PB)."""
    if not (math.isfinite(value) and 1e-6 <= value <= 1e6):
        raise typer.BadParameter(f"{value:g} GB; give a size in GB from 1e-6 to 1e6 (e.g. 5, or 0.5)")
    return value


def check_threshold(value: float | None) -> float | None:
    """A threshold override: a finite number >= 0 (NaN would make every comparison pass)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise typer.BadParameter(f"{value:g}; give a finite number >= 0")
    return value


def check_fraction(value: float | None) -> float | None:
    """A fraction override (top-1 agreement): from 0 to 1."""
    if value is not None and not (math.isfinite(value) and 0 <= value <= 1):
        raise typer.BadParameter(f"{value:g}; give a fraction from 0 to 1")
    return value


def check_new_dir(path: Path, what: str) -> Path:
    """A directory a command creates or fills: not an existing file, and under a directory (not a
    file) that can be written. The library checks emptiness and locks it."""
    if path.exists() and not path.is_dir():
        raise GptOssFp8Error(f"{what} {path}: exists and is not a directory; give a new or empty directory")
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise GptOssFp8Error(f"{what} {path}: {p} is a file, not a directory; give a new or empty directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise GptOssFp8Error(f"{what} {path}: {p} is not writable; choose a directory you can write")
    return path


def check_distinct(outputs: dict[str, Path | None]) -> None:
    """No two options name the same output file."""
    seen: dict[Path, str] = {}
    for option, p in outputs.items():
        if p is None:
            continue
        key = Path(p).resolve()
        if key in seen:
            raise GptOssFp8Error(f"{option} and {seen[key]} name the same file {p}; give each its own")
        seen[key] = option


def progress_bar(total: int, desc: str, initial: int = 0):
    """Bytes progress on stderr: a tqdm bar with rate and ETA in a terminal; when stderr is not a
    terminal (a pipe, ``| tee``, CI logs), ``LineProgress``'s plain lines instead."""
    if not _stderr_is_terminal():
        return LineProgress(total, desc, initial)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None, dynamic_ncols=True)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class LineProgress:
    """Progress for a stderr that is not a terminal: one plain line, ``convert: 37% (4.8 GB of
    12.9 GB, 85.2 MB/s, 1m35s left)``, at most every ``every`` seconds while work is reported
    (``update``), and one at the end of a run that completed (``close``); a run shorter than
    ``every`` prints only that last line, a failed one prints no last line (its error says why).
    The tqdm bar's interface (update, close, a context manager), so the commands use either."""

    def __init__(self, total: int, desc: str, initial: int = 0, every: float = 3.0, clock=None, write=None):
        import time

        self.total, self.desc, self.done, self.every = max(int(total), 0), desc, int(initial), every
        self.clock = clock or time.monotonic
        self.write = write or _stderr_line
        self.start = self.last = self.clock()
        self.start_done = self.done
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.write(self.line(now))

    def line(self, now: float) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        elapsed = now - self.start
        rate = (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0
        text = f"{self.desc}: {pct:3.0f}% ({_bytes(self.done)} of {_bytes(self.total)}"
        if self.done >= self.total:
            return text + f", {_duration(elapsed)})"
        left = f", {_duration((self.total - self.done) / rate)} left" if rate > 0 else ""
        return text + f", {_bytes(rate)}/s{left})"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.done >= self.total:
            self.write(self.line(self.clock()))

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plot_ready(plot: Path) -> None:
    """--plot: matplotlib importable and the file suffix a format it writes, checked before any model runs."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise GptOssFp8Error(f"--plot {plot}: needs matplotlib; run: pip install matplotlib (or drop --plot)") from None
    fmt = plot.suffix.lower().removeprefix(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if fmt and fmt not in formats:
        raise GptOssFp8Error(f"--plot {plot}: matplotlib cannot write .{fmt} files; use one of "
                             + ", ".join(f".{f}" for f in sorted(formats)))
