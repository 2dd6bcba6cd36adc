"""``gptoss-fp8 download``."""

from __future__ import annotations


def download() -> None:
    """(being written)"""
    raise NotImplementedError
