"""``gptoss-fp8 synth``."""

from __future__ import annotations


def synth() -> None:
    """(being written)"""
    raise NotImplementedError
