"""``gptoss-fp8 bench serve``: a load generator against an OpenAI-compatible server.

For each (prompt length, concurrency) case, ``requests`` streamed ``/v1/completions`` requests
(random token-id prompts of exactly that length, seeded; ``max_tokens`` = the output length with
``ignore_eos``, greedy), at most ``concurrency`` in flight (asyncio + httpx), from processes of
their own (``run_case``: one per 16 streams by default, never the server's process). Per
request: the time to its first token (TTFT) and the gaps between its next SSE chunks
(inter-token latency, ITL; our server sends one chunk per engine step that gave the stream
tokens: one token each while the server keeps up, the tokens of several steps in one chunk when
it is behind, which shows here as fewer, longer gaps; tokens are counted from ``usage``). Per
case: output tokens/s in total (all output tokens over the case's wall time) and per user (median
over requests of tokens after the first / time after the first), TTFT and ITL p50 / p99, $ per
1M output tokens at ``usd_per_gpu_hour`` x ``gpus``, and the server's engine steps per second
with the model's and the host's ms per step (``step_rates``, from our /metrics; nan against
another server), and ``cached_pct``: the share of the prompt tokens the server reported as cached
(``prompt_tokens_details.cached_tokens``; nan where it reports none). Each case's prompts are new (a
prefix cache reuses none of an earlier case's), and with ``shared_prefix`` their first tokens are
the same within the case (a shared system prompt or document).

The gaps are between network reads that carried tokens (SSE events that came in one read count
as one arrival: a server that is behind and writes several events at once shows fewer, longer
gaps, as ours does by putting several steps' tokens in one event). Every reply's ``usage`` is
checked: a reply whose prompt or output token count is not the case's fails (the figures of two
servers compare only at the same lengths).

``peer="transformers"``: transformers' own server (``transformers serve --continuous-batching``),
which takes text prompts only and no ``ignore_eos``: text prompts of exactly the prompt length in
its tokenizer, the output length forced through ``generation_config`` (bench/serve_peer.py), and a
warm-up before the cases (its continuous batching allocates its KV cache and captures its CUDA
graphs at the first requests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

USD_PER_GPU_HOUR = 3.0


@dataclass
class Timing:
    sent: float
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # the usage's prompt_tokens_details.cached_tokens (the server's prefix cache)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _one(client, url: str, model: str | None, prompt: list[int] | str, output_len: int, headers: dict,
               prompt_len: int | None = None, structured: bool = False) -> Timing:
    """One streamed request -> its timing. ``prompt``: token ids (our server: ``ignore_eos``) or
    text (transformers' server: ``serve_peer.peer_body``). ``prompt_len``: the prompt tokens its
    ``usage`` must report (None: len(prompt)). ``structured``: the completion held to a JSON string too long to
    close within ``output_len`` tokens (``structured_format``)."""
    if isinstance(prompt, str):
        from gptoss_fp8.bench.serve_peer import peer_body

        body = peer_body(prompt, output_len, model)
    else:
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if structured:
            body["response_format"] = structured_format(output_len)
    prompt_len = len(prompt) if prompt_len is None else prompt_len
    t = Timing(time.perf_counter())
    chunks = 0
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            t.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return t
        pending = ""
        async for text in r.aiter_text():  # one network read: its events arrived together
            now = time.perf_counter()
            *lines, pending = (pending + text).split("\n")
            got = False
            for line in lines:
                line = line.rstrip("\r")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    err = msg["error"]
                    t.error = err.get("message", "error") if isinstance(err, dict) else str(err)
                    return t
                if msg.get("usage"):
                    usage = msg["usage"]
                if msg.get("choices") and msg["choices"][0].get("finish_reason") is None:
                    got = True
            if got:
                if t.first is None:
                    t.first = now
                else:
                    t.gaps.append(now - t.last)
                t.last = now
                chunks += 1
    if usage is None:
        t.tokens = chunks
        return t
    t.tokens, t.prompt_tokens = usage.get("completion_tokens", chunks), usage.get("prompt_tokens")
    t.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if t.prompt_tokens is not None and t.prompt_tokens != prompt_len:
        t.error = f"the server read {t.prompt_tokens} prompt tokens, not {prompt_len}"
    elif t.tokens != output_len:
        t.error = f"the server gave {t.tokens} output tokens, not {output_len}"
    return t


def structured_format(output_len: int) -> dict:
    """``--structured``'s response_format: a JSON string of at least 16 characters a token asked for, so that it does
    not close within the output and every step is inside a JSON string (llguidance's costliest state here, where a
    refused token's mask is made: BENCHMARKS.md "Structured output's host cost per step")."""
    return {"type": "json_schema", "json_schema": {"name": "long", "schema": {"type": "string",
                                                                             "minLength": 16 * output_len}}}


def token_prompts(n: int, prompt_len: int, vocab: int, seed: int, shared: int = 0, shared_seed: int = 0) -> list[list[int]]:
    """n random prompts of ``prompt_len`` token ids (from ``seed``), their first ``shared`` the same in all of them
    (from ``shared_seed``: the same in every load-generator process of a case)."""
    # ids clear of a large vocabulary's special ones at both ends; a byte-level one's bytes (its specials are 0-2)
    lo, hi = (1000, vocab - 1000) if vocab > 4000 else (3, vocab)
    head = random.Random(shared_seed)
    common = [head.randrange(lo, hi) for _ in range(shared)]
    rng = random.Random(seed)
    return [common + [rng.randrange(lo, hi) for _ in range(prompt_len - shared)] for _ in range(n)]


async def _case(url: str, model: str | None, prompt_len: int, concurrency: int, n: int, output_len: int, vocab: int,
                seed: int, api_key: str | None, texts: list[str] | None = None,
                go=None, shared: int = 0, shared_seed: int = 0, structured: bool = False
                ) -> tuple[list[Timing], float, float]:
    """n requests, ``concurrency`` at a time -> their timings, and when the first was sent and the
    last ended (perf_counter). ``texts``: the prompts as text (n of them, each ``prompt_len``
    tokens in the server's tokenizer) instead of random token ids (``token_prompts``, their first ``shared``
    ids common). ``go``: called once the requests are ready, before the clock starts."""
    import httpx

    if texts is not None:
        prompts = texts[:n]
    else:
        prompts = token_prompts(n, prompt_len, vocab, seed, shared, shared_seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def one(p):
            async with sem:
                return await _one(client, url, model, p, output_len, headers, prompt_len, structured)

        if go is not None:
            go()
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(p) for p in prompts))
        return out, t0, time.perf_counter()


def client_procs(concurrency: int) -> int:
    """How many load-generator processes by default: one per 16 streams, at most a quarter of
    this machine's CPUs (one process parsing 64 streams' SSE events can be the bound itself)."""
    return max(1, min(-(-concurrency // 16), (os.cpu_count() or 1) // 4))


def run_case(url: str, model: str | None, prompt_len: int, concurrency: int, n: int, output_len: int, vocab: int,
             seed: int, api_key: str | None, procs: int = 1,
             texts: list[str] | None = None, shared: int = 0, structured: bool = False) -> tuple[list[Timing], float]:
    """``_case`` in ``procs`` processes of their own (``python -m gptoss_fp8.bench.serve``: the job
    as a JSON line on stdin, "ready" back once loaded, then a line on stdin starts all of them
    together; the timings as JSON on stdout), the streams and requests split between them: the
    load generator's own Python (httpx, a JSON parse per SSE event) never shares a GIL with a
    server launched in this process, as a real client never does. -> (timings, wall seconds from
    the first request sent to the last one ended). ``texts``: text prompts (``_case``), split
    between the processes. ``shared``: the token-id prompts' first ``shared`` ids common to all of them."""
    from gptoss_fp8.errors import GptOssFp8Error

    k = max(1, min(procs, concurrency, n))
    root = str(Path(__file__).resolve().parents[2])  # the directory holding gptoss_fp8
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    children = []
    try:
        start = 0
        for i in range(k):
            share = n // k + (i < n % k)
            job = {"url": url, "model": model, "prompt_len": prompt_len, "concurrency": concurrency // k + (i < concurrency % k),
                   "n": share, "output_len": output_len, "vocab": vocab, "seed": seed + i,
                   "api_key": api_key, "texts": None if texts is None else texts[start:start + share],
                   "shared": shared, "shared_seed": seed, "structured": structured}
            start += share
            c = subprocess.Popen([sys.executable, "-m", "gptoss_fp8.bench.serve"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            c.stdin.write(json.dumps(job) + "\n")
            c.stdin.flush()
            children.append(c)
        for c in children:
            if c.stdout.readline().strip() != "ready":
                raise GptOssFp8Error(f"bench serve: a load generator's process failed ({_last_line(c)})")
        for c in children:
            c.stdin.write("go\n")
            c.stdin.close()
        outs = []
        for c in children:
            text = c.stdout.read()
            if c.wait() != 0:
                raise GptOssFp8Error(f"bench serve: a load generator's process failed ({_last_line(c)})")
            outs.append(json.loads(text))
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    timings = [Timing(**t) for o in outs for t in o["timings"]]
    return timings, max(o["t1"] for o in outs) - min(o["t0"] for o in outs)


def _last_line(c: subprocess.Popen) -> str:
    if c.poll() is None:
        c.kill()
    return (c.stderr.read().strip().splitlines() or ["no output"])[-1]


def _child() -> None:
    job = json.loads(sys.stdin.readline())

    def go():
        print("ready", flush=True)
        sys.stdin.readline()

    timings, t0, t1 = asyncio.run(_case(**job, go=go))
    json.dump({"timings": [dataclasses.asdict(t) for t in timings], "t0": t0, "t1": t1}, sys.stdout)


def summarize(timings: list[Timing], wall: float, *, prompt_len: int, concurrency: int, gpus: int = 1,
              usd_per_gpu_hour: float = USD_PER_GPU_HOUR) -> dict:
    """One case's row (module docstring)."""
    ok = [t for t in timings if t.error is None and t.first is not None]
    tokens = sum(t.tokens for t in ok)
    total = tokens / wall if wall > 0 else 0.0
    per_user = [(t.tokens - 1) / (t.last - t.first) for t in ok if t.tokens > 1 and t.last > t.first]
    gaps = [g for t in ok for g in t.gaps]
    ttft = [t.first - t.sent for t in ok]
    usd = usd_per_gpu_hour * gpus / 3600 / total * 1e6 if total > 0 else float("nan")
    told = [t for t in ok if t.prompt_tokens and t.cached_tokens is not None]
    cached = (100 * sum(t.cached_tokens for t in told) / sum(t.prompt_tokens for t in told)) if told else float("nan")
    return {"prompt_len": prompt_len, "concurrency": concurrency, "requests": len(timings),
            "failed": len(timings) - len(ok), "cached_pct": cached, "output_tokens": tokens, "seconds": wall,
            "tokens_per_s": total, "tokens_per_s_per_user": statistics.median(per_user) if per_user else float("nan"),
            "ttft_p50_ms": 1e3 * _pct(ttft, 0.5), "ttft_p99_ms": 1e3 * _pct(ttft, 0.99),
            "itl_p50_ms": 1e3 * _pct(gaps, 0.5), "itl_p99_ms": 1e3 * _pct(gaps, 0.99),
            "usd_per_1m_tokens": usd,
            "errors": sorted({t.error for t in timings if t.error})[:3]}


COLUMNS = ("prompt_len", "concurrency", "requests", "failed", "cached_pct", "tokens_per_s", "tokens_per_s_per_user",
           "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "usd_per_1m_tokens", "steps_per_s",
           "model_ms_per_step", "host_ms_per_step")


_COUNTERS = ("gptoss_engine_steps_total", "gptoss_engine_model_seconds_total", "gptoss_structured_checked_tokens_total",
             "gptoss_structured_refused_tokens_total")


def engine_counters(url: str, headers: dict) -> tuple[float, ...] | None:
    """The server's engine steps so far, their seconds in the model, and structured output's tokens checked and refused
    (our /metrics' ``_COUNTERS``; None elsewhere)."""
    import httpx

    try:
        r = httpx.get(url + "/metrics", headers=headers, timeout=30)
    except httpx.HTTPError:
        return None
    found = {}
    for line in r.text.splitlines() if r.status_code == 200 else ():
        name, _, value = line.partition(" ")
        if name in _COUNTERS:
            found[name] = float(value)
    if len(found) != len(_COUNTERS):
        return None
    return tuple(found[k] for k in _COUNTERS)


def step_rates(before: tuple[float, ...] | None, after: tuple[float, ...] | None, wall: float) -> dict:
    """The engine's steps per second over a case, the model's ms per step (its calls and the
    sampler: on a GPU the steps and their waits) and the host's (the rest of the wall time per
    step: the engine's own work and the HTTP side's that did not overlap the model, and any idle
    time: at a concurrency the server keeps busy, the host's cost per step), and the share of structured output's
    checked tokens that their grammar refused (``refused_pct``; nan without structured output); nan against a server
    without our /metrics."""
    nan = float("nan")
    if before is None or after is None or after[0] <= before[0] or wall <= 0:
        return {"steps_per_s": nan, "model_ms_per_step": nan, "host_ms_per_step": nan, "refused_pct": nan}
    steps, model, checked, refused = (a - b for a, b in zip(after, before, strict=True))
    return {"steps_per_s": steps / wall, "model_ms_per_step": 1e3 * model / steps,
            "host_ms_per_step": 1e3 * (wall - model) / steps, "refused_pct": 100 * refused / checked if checked else nan}


def bench(url: str, *, model: str | None, concurrency: list[int], prompt_lens: list[int], output_len: int,
          requests: int | None, api_key: str | None = None, vocab: int = 201088, gpus: int = 1, seed: int = 0,
          procs: int | None = None, peer: str = "gptoss", tokenizer=None, warmup: int | None = None,
          echo: Callable[[str], None] = print, shared_prefix: int = 0, structured: bool = False) -> list[dict]:
    """Every (prompt length, concurrency) case against the server at ``url`` -> rows (printed as
    they come). ``model``: the id to send (None: the server's first /v1/models entry; against
    transformers' server, which may list none, none sent: it serves the model it was started on);
    ``requests``: per case (None: 2 x concurrency, at least 8); ``procs``: load-generator processes
    (None: ``client_procs``). ``peer``: "gptoss" (token-id prompts, ``ignore_eos``) or
    "transformers" (module docstring), with ``tokenizer`` its tokenizer (a checkpoint directory
    or a tokenizer.json: the text prompts). ``warmup``: requests sent at once before the cases,
    unmeasured (the first prompt length, up to 16 output tokens; None: the largest concurrency
    against transformers, none against ours), then one request alone per prompt length. ``shared_prefix``: every
    case's prompts start with the same that many token ids (new at each case), the rest their own: a system prompt
    or a document many requests share, for a server's prefix cache (the rows' ``cached_pct``: the prompt tokens
    the server reported cached). ``structured``: every completion held to a JSON string (``structured_format``:
    structured output's host cost under load; our server only)."""
    import httpx

    from gptoss_fp8.bench.serve_peer import PEERS, load_tokenizer, text_prompts
    from gptoss_fp8.errors import GptOssFp8Error

    if peer not in PEERS:
        raise GptOssFp8Error(f"--peer {peer!r}: choose from {', '.join(PEERS)}")
    text = peer == "transformers"
    if shared_prefix and (text or shared_prefix >= min(prompt_lens)):
        raise GptOssFp8Error(f"--shared-prefix {shared_prefix}: give fewer tokens than the shortest --prompt-len "
                             f"({min(prompt_lens)})" if not text else
                             "--shared-prefix is for token-id prompts; --peer transformers sends text")
    if structured and text:
        raise GptOssFp8Error("--structured is for our server (response_format on completions); --peer transformers "
                             "has none")
    if text and tokenizer is None:
        raise GptOssFp8Error("--peer transformers needs --tokenizer (the checkpoint directory the server loaded)")
    tok = load_tokenizer(tokenizer) if text else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if text:  # its /v1/models lists the hub cache's models (an error where there is none), not the one it serves
            r = httpx.get(url + "/health", headers=headers, timeout=30)
            if r.status_code != 200:
                raise GptOssFp8Error(f"{url}/health: HTTP {r.status_code} {r.text[:200]!r}")
            listed = []
        else:
            listed = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        hint = "" if text else "; transformers serve answers --peer transformers"
        raise GptOssFp8Error(f"{url}/v1/models: no OpenAI-compatible server answers there ({e}){hint}") from None
    if model is None and listed:
        model = listed[0]["id"]
    elif model is None and not text:
        raise GptOssFp8Error(f"{url}/v1/models lists no model; name one with --model-name")
    mine = next((m for m in listed if m.get("id") == model), {})
    if isinstance(mine.get("vocab_size"), int):  # (our server lists its vocabulary: the random ids stay in it)
        vocab = mine["vocab_size"]

    def prompts(p: int, n: int, salt: int) -> list[str] | None:
        return text_prompts(tok, n, p, seed + 7919 * salt + p) if text else None

    warm = (max(concurrency) if text else 0) if warmup is None else warmup
    if warm:
        p, out = prompt_lens[0], min(output_len, 16)
        timings, wall = run_case(url, model, p, warm, warm, out, vocab, seed + 1, api_key, client_procs(warm),
                                 prompts(p, warm, 1))
        # and one request alone per prompt length: a lone prompt's forward has other GEMM shapes (their JIT)
        for q in prompt_lens:
            alone, w1 = run_case(url, model, q, 1, 1, out, vocab, seed + 2 + q, api_key, 1, prompts(q, 1, 2))
            timings, wall = timings + alone, wall + w1
        bad = sorted({t.error for t in timings if t.error})
        echo(f"warm-up: {warm} requests at once, {p} + {out} tokens, then one alone per prompt length, {wall:.1f} s"
             + (f"; errors: {bad[:3]}" if bad else ""))
    rows = []
    echo(" | ".join(COLUMNS))
    for p in prompt_lens:
        for c in concurrency:
            n = requests or max(8, 2 * c)
            before = engine_counters(url, headers)
            k = client_procs(c) if procs is None else procs
            # prompts new at every case: transformers' paged cache shares the blocks of a prefix it saw, and our
            # prefix cache reuses a prompt seen whole (runtime/prefix.py)
            timings, wall = run_case(url, model, p, c, n, output_len, vocab, seed + 7919 * (c + 1) + p, api_key, k,
                                     prompts(p, n, c + 1), shared_prefix, structured)
            row = summarize(timings, wall, prompt_len=p, concurrency=c, gpus=gpus)
            row.update(step_rates(before, engine_counters(url, headers) if before is not None else None, wall))
            rows.append(row)
            echo(" | ".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in COLUMNS)
                 + (f"  refused: {row['refused_pct']:.3g}% of checked tokens" if structured else "")
                 + (f"  errors: {row['errors']}" if row["errors"] else ""))
    return rows


def plot(rows: list[dict], path, title: str = "gptoss-fp8 serve", decode_rows: list[dict] | None = None) -> None:
    """PNG: output tokens/s per user against $ per 1M output tokens (one line per prompt length,
    points labelled by concurrency), and inter-token latency p50 / p99 against concurrency.
    ``decode_rows`` (``bench decode --json``'s rows): its step times beside them, per context
    (dashed: tokens/s per user and $ per 1M tokens of one replayed step per batch; ms per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for p in sorted({r["prompt_len"] for r in rows}):
        rs = sorted((r for r in rows if r["prompt_len"] == p), key=lambda r: r["concurrency"])
        a.plot([r["tokens_per_s_per_user"] for r in rs], [r["usd_per_1m_tokens"] for r in rs], "o-", label=f"prompt {p}")
        for r in rs:
            a.annotate(str(r["concurrency"]), (r["tokens_per_s_per_user"], r["usd_per_1m_tokens"]), fontsize=7)
        b.plot([r["concurrency"] for r in rs], [r["itl_p50_ms"] for r in rs], "o-", label=f"prompt {p} p50")
        b.plot([r["concurrency"] for r in rs], [r["itl_p99_ms"] for r in rs], "x--", label=f"prompt {p} p99")
    for ctx in sorted({r["context"] for r in decode_rows or [] if not r.get("skipped")}):
        ds = sorted((r for r in decode_rows if r["context"] == ctx and not r.get("skipped")), key=lambda r: r["batch"])
        a.plot([r["tok_s_per_user"] for r in ds], [r["usd_per_1m_tokens"] for r in ds], "s:", alpha=0.6,
               label=f"bench decode, context {ctx}")
        b.plot([r["batch"] for r in ds], [r["ms_per_step"] for r in ds], "s:", alpha=0.6,
               label=f"bench decode step, context {ctx}")
    a.set(xlabel="output tokens/s per user", ylabel="$ per 1M output tokens", yscale="log", title=title)
    b.set(xlabel="concurrency", ylabel="inter-token latency (ms)", xscale="log", title="inter-token latency")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_synthetic(preset: str, *, layers: int | None = None, device: str = "cuda", mode: str = "auto",
                    max_batch: int = 8, max_context: int | None = None, chunk: int | None = None,
                    max_waiting: int | None = None, api_key: str | None = None,
                    echo=print, attention: str = "bf16", distinct_layers: int | None = None):
    """The server over random FP8 weights at a preset's real shapes (``bench.prefill.random_model``,
    as ``bench prefill`` / ``bench decode`` time them; first ``layers`` layers), built on the device
    with no checkpoint on disk: ``bench serve --synthetic``. -> serve.server's Served. The replies are noise; the speed is the
    model's. ``distinct_layers``: only the first N layers' weights, repeated through the rest (``random_model``), so
    that a model larger than the GPU serves every layer (the 120b on an 80 GB card); on CUDA the weights are checked
    against the free memory first (one line, ``check_fits``)."""
    from types import SimpleNamespace

    import torch

    from gptoss_fp8.bench.prefill import check_distinct_layers, check_fits, distinct_text, random_model
    from gptoss_fp8.config import preset_config
    from gptoss_fp8.serve.server import check_options, start_model

    cfg = preset_config(preset, layers=layers)
    name = f"synthetic-{preset}" + (f"-{layers}l" if layers else "")
    opts = check_options(SimpleNamespace(config=cfg, path=name), device=device, mode=mode, max_batch=max_batch,
                         max_context=max_context, chunk=chunk, attention=attention)
    distinct_layers = check_distinct_layers(distinct_layers, cfg)
    dev = torch.device(device)
    if dev.type == "cuda":
        check_fits(cfg, f"{name} with {cfg.num_hidden_layers} layers", device, distinct_layers=distinct_layers)
    t0 = time.perf_counter()
    model = random_model(cfg, dev, distinct_layers=distinct_layers)
    echo(f"built {name} ({cfg.num_hidden_layers} layers, random weights{distinct_text(distinct_layers)}) on {dev} in "
         f"{time.perf_counter() - t0:.1f} s, mode {opts['mode']}"
         + (f", {attention.upper()} prefill attention" if attention != "bf16" else ""))
    return start_model(model, opts, max_waiting, api_key, name, echo)


if __name__ == "__main__":
    _child()
