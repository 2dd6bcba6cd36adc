"""What verify-logits runs when given no ``--tokens`` / ``--prompt``: a built-in sample.

A checkpoint with a byte-level tokenizer (the trained fixture, gptoss_fp8/tokenizer.py) gets a few
lines of Python, its training domain; any other gets ``RANDOM_TOKENS`` token ids drawn with a fixed
seed (the verdict is taken part by part, so any ids exercise every op; pass ``--prompt`` for text).
"""

from __future__ import annotations

from pathlib import Path

import torch

from gptoss_fp8.tokenizer import byte_tokenizer_of

PYTHON_SAMPLE = '''import os


def read_lines(path):
    """Return the stripped lines of a text file."""
    with open(path) as f:
        return [line.strip() for line in f]


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
'''
RANDOM_TOKENS = 64


def default_tokens(ckpt: Path, vocab_size: int) -> tuple[list[int], str]:
    """(token ids, where they come from) for a checkpoint when the user gave none."""
    tok = byte_tokenizer_of(ckpt)
    if tok is not None:
        return tok.encode(PYTHON_SAMPLE), f"built-in Python sample ({len(PYTHON_SAMPLE)} bytes)"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (RANDOM_TOKENS,), generator=g).tolist()
    return ids, f"{RANDOM_TOKENS} built-in token ids (seed 0; pass --tokens or --prompt for your own)"
