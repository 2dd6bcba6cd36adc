"""``gptoss-fp8 verify-logits``."""

from __future__ import annotations


def verify_logits() -> None:
    """(being written)"""
    raise NotImplementedError
