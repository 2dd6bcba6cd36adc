"""Helpers of the serve tests: a real uvicorn server on a free loopback port over a small
checkpoint with the tokenizer's 201088-token vocabulary (tests/conftest.py ``harmony_ckpt``)."""

from __future__ import annotations

import contextlib

HARMONY_VOCAB = 201088
MODEL = "tiny-harmony"


def make_harmony_checkpoint(root):
    """A 2-layer synthetic gpt-oss (one sliding layer, window 16, one full) with the real
    vocabulary and tiny dims, converted to FP8 -> its directory."""
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic

    write_synthetic(root / "src", "tiny", layers=2, seed=3, layout="hf", vocab_size=HARMONY_VOCAB, hidden_size=64,
                    intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=16)
    convert_checkpoint(root / "src", root / "fp8")
    return root / "fp8"


@contextlib.contextmanager
def running_server(ckpt, **kw):
    """``serve.server.build`` + ``Server`` on 127.0.0.1, a free port; yields the Server."""
    from gptoss_fp8.serve.server import Server, build

    kw.setdefault("model_name", MODEL)
    served = build(ckpt, echo=lambda *_: None, **kw)
    server = Server(served).start()
    try:
        yield server
    finally:
        server.stop()


def metric(text: str, name: str) -> float:
    """One sample's value from Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)
