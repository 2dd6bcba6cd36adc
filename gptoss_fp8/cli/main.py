"""The ``gptoss-fp8`` command line. Commands live one per module; this file wires them and holds
the last-resort handler: whatever escapes a command (or argument parsing) becomes one line on
stderr and an exit status, and Ctrl-C at any moment, imports included, is ``interrupted`` / 130.

Nothing here or in the command modules imports torch at import time, so ``--help`` and argument
errors are fast; the commands import the library when they run."""

from __future__ import annotations

import signal
import sys

from gptoss_fp8 import cli as _package

# Ctrl-C while this module starts up (its imports, then building the app below) is one line too, not a
# traceback: SIGINT is held until the module's last line, which lets a pending one through inside a guard.
# (Guarding the imports alone left the app's construction open: one run in three of
# tests/test_cli_faults.py's 0.1 s case exited by the signal with a traceback.) The program holds it from
# cli/__init__.py on (the loading of this file included): the mask to restore is the one from before that.
_held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if hasattr(signal, "pthread_sigmask") else None
if _package.SIGINT_MASK is not None:
    _held = _package.SIGINT_MASK

try:  # Ctrl-C while starting up is one line too, not a traceback through the imports
    import os

    import typer
    import typer.core

    try:
        from typer._click.exceptions import ClickException, NoArgsIsHelpError  # typer vendors click
    except ImportError:  # older typer: click itself
        from click.exceptions import ClickException, NoArgsIsHelpError

    from gptoss_fp8 import __version__
    from gptoss_fp8.cli import bench, convert, download, generate, golden, plan, serve, synth, verify_logits
    from gptoss_fp8.cli.common import (
        DEBUG_ENV,
        INTERRUPTED,
        TorchCommand,
        ctrl_c_decided,
        ctrl_c_handler,
        debug_enabled,
        mark_process_exit,
        report_failure,
    )
except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    raise SystemExit(130) from None


class _Root(typer.core.TyperGroup):
    """The root command group: runs the command with click's standalone mode off and turns every
    outcome into an exit status here, one line on stderr for anything but success."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        with ctrl_c_handler():
            try:
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
                ctrl_c_decided()  # (the command is over: a Ctrl-C from here on changes nothing)
                # typer returns the exit status of typer.Exit, and turns Ctrl-C into Exit(130)
                code = rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
                if code == INTERRUPTED:
                    code = report_failure(KeyboardInterrupt())
            except NoArgsIsHelpError as e:
                e.show()
                code = e.exit_code
            except ClickException as e:  # usage errors: bad option value, missing argument, ...
                ctx = getattr(e, "ctx", None)
                hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
                message = " ".join(e.format_message().split())
                sys.stderr.write(f"error: {message}{hint}\n")
                code = e.exit_code
            except SystemExit:
                raise
            except BaseException as e:  # the last resort: GptOssFp8Error, OSError, bugs, Ctrl-C
                if debug_enabled():
                    raise
                code = report_failure(e)
            finally:
                ctrl_c_decided()
        if standalone_mode:
            sys.exit(code)
        return code


def _hold_ctrl_c() -> None:
    """The program has finished and its status is decided: a Ctrl-C from here on is ignored, so the
    exit status is the command's. Ignored (SIG_IGN), not blocked: a blocked mask holds for the
    calling thread only, and a SIGINT the kernel hands to another thread (tqdm's monitor, torch's
    pools) after interpreter shutdown has put the default action back (it does so for a Python
    handler, not for SIG_IGN) killed a finished conversion by the signal, exit -2 with nothing on
    stderr (tests/test_cli_faults.py; 8 runs in 30 with Ctrl-C 1-2 s into a tiny convert). Only
    where the process exits (``_App.__call__``, the console script): an ignored SIGINT outlives the
    call and is inherited by child processes, so an in-process caller (typer's CliRunner calls
    ``_Root.main``) would go on unable to be interrupted."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _exit_interrupted() -> None:
    """End an interrupted process now, skipping interpreter shutdown. The command's own clean-up
    (temporary files, writer threads) has run on the way up; what may still run is a worker a
    second Ctrl-C cut loose (Python's Thread.join, interrupted, takes a running thread for ended),
    and torch code on a thread at interpreter shutdown aborts the process ("terminate called
    without an active exception", exit -6, pytorch/pytorch#38228) instead of the status 130."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(INTERRUPTED)


class _App(typer.Typer):
    def __call__(self, *args, **kwargs):
        # The console script: the process ends with the command, so once its status is decided the
        # CLI's Ctrl-C handler (which then ignores it) stays installed until _hold_ctrl_c ignores the
        # signal for good: a Ctrl-C in between met Python's default handler and turned a finished
        # command's status into an interruption.
        mark_process_exit(True)
        try:  # building the click command from the signatures happens here, before _Root.main
            return super().__call__(*args, **kwargs)
        except KeyboardInterrupt:
            report_failure(KeyboardInterrupt())
            _hold_ctrl_c()
            _exit_interrupted()
        except SystemExit as e:  # _Root.main's status: the process ends with it
            _hold_ctrl_c()
            if e.code == INTERRUPTED:
                _exit_interrupted()
            raise
        finally:  # (a caller that catches the SystemExit goes on as before; an interrupted one ends)
            mark_process_exit(False)


app = _App(
    name="gptoss-fp8",
    cls=_Root,
    help="Convert gpt-oss MXFP4 checkpoints to block-FP8 (e4m3, 128x128) for Hopper, and prove the result.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help: option names whole and flags without <bool> at 80 columns
)


def _version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors (or set GPTOSS_FP8_DEBUG=1)."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    if debug:
        os.environ[DEBUG_ENV] = "1"


# TorchCommand: the commands that run torch import it before their function, Ctrl-C held meanwhile
app.command("synth", no_args_is_help=True, cls=TorchCommand)(synth.synth)
app.command("convert", no_args_is_help=True, cls=TorchCommand)(convert.convert)
app.command("download", no_args_is_help=True)(download.download)
app.command("plan", no_args_is_help=True, cls=TorchCommand)(plan.plan)
app.command("verify-logits", no_args_is_help=True, cls=TorchCommand)(verify_logits.verify_logits)
app.command("generate", no_args_is_help=True, cls=TorchCommand)(generate.generate)
app.command("serve", no_args_is_help=True, cls=TorchCommand)(serve.serve)
app.add_typer(golden.app, name="golden")
app.add_typer(bench.app, name="bench")

try:  # the SIGINT held since the top, if one came, raises here (pthread_sigmask checks pending signals)
    if _held is not None and signal.SIGINT not in _held:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    raise SystemExit(130) from None

if __name__ == "__main__":
    app()
