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


def scripted(engine, monkeypatch):
    """-> script(text): every request then gets text's ids as its reply (the engine's sampler replaced: the synthetic
    weights give noise, so a test of the Harmony mechanics scripts the model's choices, each token with log-probability
    -0.5 and alternatives t + 1, t + 2 at -1.5, -2.5); it returns the list of the prompts the engine saw, which fills
    as requests come."""
    from gptoss_fp8.serve.harmony import encoding

    def set_script(text: str) -> list[list[int]]:
        ids = encoding().encode(text, allowed_special="all")
        going, prompts = {}, []

        def sampler(logits, seqs):
            out = []
            for s in seqs:
                if s.id not in going:
                    going[s.id] = iter(ids)
                    prompts.append(list(s.prompt))
                out.append(next(going[s.id], 0))
            lps = [-0.5] * len(seqs) if any(s.params.logprobs for s in seqs) else None
            return out, lps, [[(t, -0.5), (t + 1, -1.5), (t + 2, -2.5)] for t in out]  # (each token's alternatives)

        monkeypatch.setattr(engine, "sampler", sampler)
        return prompts

    return set_script


def wait_idle(server, timeout=10.0) -> str:
    """Until no request runs and no KV slot is in use (-> the /metrics text then); AssertionError after ``timeout``."""
    import time

    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        m = httpx.get(server.url + "/metrics").text
        if metric(m, "gptoss_kv_slots_used") == 0 and metric(m, "gptoss_requests_running") == 0:
            return m
        time.sleep(0.05)
    raise AssertionError("KV slots still in use:\n" + m)
