"""Faults under load: 200 requests (some of 2 or 3 choices), some cancelled by their clients mid-stream or while waiting,
some with bad bodies, a few too long; afterwards every KV slot is free (read from /metrics), no
request is left running or waiting, and a new request is served with the same reply as before."""

import asyncio
import json
import random
import time

import httpx
import pytest
from serve_util import MODEL, metric, running_server

pytest.importorskip("openai_harmony")

N = 200


@pytest.fixture(scope="module")
def server(harmony_ckpt):
    with running_server(harmony_ckpt, max_batch=6, max_context=128, chunk=16, max_waiting=64) as s:
        yield s


def _reference(c: httpx.Client) -> str:
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 8, "temperature": 0,
                                        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_random_cancellations_and_bad_bodies_leave_every_slot_free(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        before = _reference(c)
    rng = random.Random(0)
    outcomes: dict[str, int] = {}

    def count(k):
        outcomes[k] = outcomes.get(k, 0) + 1

    async def one(c: httpx.AsyncClient, i: int, sem: asyncio.Semaphore):
        kind = rng.choice(["ok", "ok", "stream", "cancel-stream", "cancel-stream", "cancel-wait", "bad", "long"])
        prompt = [rng.randrange(1000, 200000) for _ in range(rng.randrange(1, 40))]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randrange(1, 7), "temperature": rng.choice([0, 0.8]),
                "seed": i, "n": rng.choice([1, 1, 1, 2, 3])}  # (n: that many sequences, cancelled together)
        async with sem:
            if kind == "bad":
                raw = rng.choice([b"{", b"[]", json.dumps({**body, "bogus": 1}).encode(),
                                  json.dumps({**body, "max_tokens": -1}).encode()])
                r = await c.post("/v1/completions", content=raw)
                assert r.status_code == 400 and "\n" not in r.json()["error"]["message"]
            elif kind == "long":
                r = await c.post("/v1/completions", json={**body, "prompt": list(range(1, 140))})
                assert r.status_code == 400
            elif kind == "ok":
                r = await c.post("/v1/completions", json=body)
                assert r.status_code in (200, 429), r.text
                kind = "ok" if r.status_code == 200 else "429"
            elif kind == "cancel-wait":  # the client gives up before the reply: a disconnect while waiting
                try:
                    await c.post("/v1/completions", json={**body, "max_tokens": 16, "ignore_eos": True},
                                 timeout=rng.uniform(0.01, 0.2))
                except httpx.TimeoutException:
                    pass
            else:
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True, "max_tokens": 16,
                                                                      "ignore_eos": kind == "cancel-stream"}) as r:
                    if r.status_code == 429:
                        kind = "429"
                    else:
                        assert r.status_code == 200
                        n = 0
                        async for line in r.aiter_lines():
                            n += line.startswith("data: ")
                            if kind == "cancel-stream" and n >= rng.randrange(1, 6):
                                break  # closing the stream mid-reply
        count(kind)

    async def main():
        sem = asyncio.Semaphore(24)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            await asyncio.gather(*(one(c, i, sem) for i in range(N)))

    t0 = time.time()
    asyncio.run(main())
    print(f"{N} requests in {time.time() - t0:.1f} s: {outcomes}")
    t0 = time.time()
    assert sum(outcomes.values()) == N and outcomes.get("cancel-stream", 0) > 10, outcomes
    m = ""
    while time.time() - t0 < 10:
        m = httpx.get(server.url + "/metrics").text
        if metric(m, "gptoss_kv_slots_used") == 0 and metric(m, "gptoss_requests_running") == 0:
            break
        time.sleep(0.05)
    assert metric(m, "gptoss_kv_slots_used") == 0 and metric(m, "gptoss_kv_slots_total") == 6, m
    assert metric(m, "gptoss_requests_running") == 0 and metric(m, "gptoss_requests_waiting") == 0, m
    assert metric(m, 'gptoss_requests_finished_total{reason="cancelled"}') > 10, m
    engine = server.served.engine
    assert engine.slots.available == 6 and engine.runner.cache.host_lengths == [0] * 6
    assert engine.runner.cache.lengths.tolist() == [0] * 6
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert _reference(c) == before
