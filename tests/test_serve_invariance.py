"""Batch invariance in the exact (weights) mode on CPU: the greedy replies of 8 concurrent
requests (prompt lengths 3..200, so prompts go in 16-token chunks between other requests' decode
steps, and joining at different steps) equal each one run alone with ``generate``, token for token.

Why this holds bit for bit: the scheduler cuts prompts at fixed multiples of the chunk whatever
else runs, and a prompt prefilled in chunks gives the whole prefill's bits (tests/test_model_chunks.py);
every other op is row-wise, and torch's CPU bf16 GEMMs give each row the same bits whatever the
number of rows (the MoE's expert GEMMs see a different set of rows in a batch; a decode over a
prefix of the slots equals the whole step's rows: test_model_chunks.py again; this test the whole
engine, slots freed and reused in between, with the events delivered one step late as on CUDA)."""

import asyncio

import httpx
import pytest
from serve_util import MODEL, running_server

from gptoss_fp8.model.backends import get_ops
from gptoss_fp8.verify import generate as gen

pytest.importorskip("openai_harmony")

LENGTHS = [200, 3, 57, 9, 120, 17, 33, 80]
NEW = 20


@pytest.fixture(scope="module")
def server(harmony_ckpt):
    with running_server(harmony_ckpt, max_batch=8, max_context=256, chunk=16, mode="weights") as s:
        yield s


def test_concurrent_greedy_replies_equal_each_alone(server, monkeypatch):
    engine, runner = server.served.engine, server.served.engine.runner
    seqs, batches, mixed = [], [], []
    real_add, real_decode, real_schedule = engine.add, runner.decode, engine.scheduler.schedule

    def add(prompt, params, on_event=None, **kw):
        seq = real_add(prompt, params, on_event, **kw)
        seqs.append(seq)
        return seq

    def decode(slots, tokens):
        batches.append(len(slots))
        return real_decode(slots, tokens)

    def schedule():
        step = real_schedule()
        mixed.append(bool(step.decodes and step.prefills))
        return step

    monkeypatch.setattr(engine, "add", add)
    monkeypatch.setattr(engine, "defer_events", True)  # the CUDA default: events delivered one step late
    monkeypatch.setattr(runner, "decode", decode)
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    prompts = [[(7919 * i + 104729 * j) % 200000 for j in range(n)] for i, n in enumerate(LENGTHS)]

    async def one(c, i, prompt):
        await asyncio.sleep(0.03 * i)  # join at different steps
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": NEW,
                                                  "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i, p) for i, p in enumerate(prompts)))

    replies = asyncio.run(main())
    assert max(batches) >= 4 and any(mixed), (batches, mixed)  # they did run together, chunks between decodes
    by_prompt = {tuple(s.prompt): s.tokens for s in seqs}
    model = runner.model
    for prompt, reply in zip(prompts, replies, strict=True):
        alone = gen.generate(model, prompt, get_ops("weights"), max_new_tokens=NEW)
        assert by_prompt[tuple(prompt)] == alone.tokens, len(prompt)
        assert reply["choices"][0]["text"] == gen._encoding().decode(alone.tokens)
