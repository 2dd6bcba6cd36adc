"""Build one rank's model from an opened checkpoint (checkpoint/checkpoint.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from gptoss_fp8.checkpoint.checkpoint import Checkpoint
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.gptoss import GptOss
from gptoss_fp8.parallel import SINGLE, Parallel
from gptoss_fp8.tokenizer import byte_tokenizer_of


def load_model(ckpt: Checkpoint | str | Path, par: Parallel = SINGLE, device: str | torch.device = "cpu") -> GptOss:
    """This rank's model from a converted checkpoint (an opened ``Checkpoint``, or a path to open),
    loaded by the shard plan's manifest; every tensor's shape and dtype checked. ``par`` gives the
    rank, tp / ep (which must be the checkpoint's) and group; whether the embedding and lm_head
    are vocab-parallel is the checkpoint's layout (``ckpt.vocab_parallel``), set on the model's
    Parallel here (a ``par`` asking for vocab-parallel on a replicated checkpoint is refused)."""
    ckpt = Checkpoint.of(ckpt)
    if (ckpt.tp, ckpt.ep) != (par.tp, par.ep):
        raise GptOssFp8Error(f"{ckpt.path}: converted for tp {ckpt.tp} / ep {ckpt.ep}, not tp {par.tp} / ep {par.ep}; "
                             "convert again with that --tp/--ep")
    if par.vocab_parallel and not ckpt.vocab_parallel:
        raise GptOssFp8Error(f"{ckpt.path}: converted with the embedding and lm_head replicated, asked to run them "
                             "vocab-parallel; convert again with --vocab-parallel")
    par = dataclasses.replace(par, vocab_parallel=ckpt.vocab_parallel)
    model = GptOss(ckpt.config, par, attn_fp8=ckpt.attention_fp8)
    names = list(model.expected()) if ckpt.manifest is None else None
    where = str(ckpt.path) if ckpt.manifest is None else f"{ckpt.path} (rank {par.rank})"
    model.load_tensors(ckpt.rank_tensors(par.rank, names), where, device)
    model.tokenizer = byte_tokenizer_of(ckpt.path)  # a small model's byte-level tokenizer, or None (Harmony's)
    return model
