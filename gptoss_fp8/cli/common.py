"""Shared CLI pieces: user-error handling and option types."""

from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

import typer

from gptoss_fp8.errors import GptOssFp8Error

F = TypeVar("F", bound=Callable)

DEBUG_ENV = "GPTOSS_FP8_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def user_errors(fn: F) -> F:
    """Show GptOssFp8Error as one line on stderr and exit 1 (traceback with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GptOssFp8Error as e:
            if debug_enabled():
                raise
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def progress_bar(total: int, desc: str, initial: int = 0):
    """A bytes progress bar with rate and ETA on stderr (hidden when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None, dynamic_ncols=True)
