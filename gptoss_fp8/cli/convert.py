"""``gptoss-fp8 convert``."""

from __future__ import annotations


def convert() -> None:
    """(being written)"""
    raise NotImplementedError
