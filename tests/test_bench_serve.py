"""gptoss-fp8 bench serve, briefly on CPU: against the test server by URL and with --launch."""

import json

import pytest
from serve_util import running_server
from typer.testing import CliRunner

from gptoss_fp8.bench import serve as bs
from gptoss_fp8.cli.main import app
from gptoss_fp8.errors import GptOssFp8Error

pytest.importorskip("openai_harmony")


def test_bench_against_a_running_server(harmony_ckpt, tmp_path):
    decode = [{"model": "20b", "batch": b, "context": 1024, "ms_per_step": 2.0 + b / 8, "tok_s_per_user": 1e3 / (2 + b / 8),
               "usd_per_1m_tokens": 1.0 / b} for b in (1, 2, 4)]
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    with running_server(harmony_ckpt, max_batch=4, max_context=64, chunk=8) as s:
        lines = []
        rows = bs.bench(s.url, model=None, concurrency=[1, 4], prompt_lens=[12], output_len=5, requests=4,
                        echo=lines.append)
        r = CliRunner().invoke(app, ["bench", "serve", s.url, "--concurrency", "2", "--prompt-len", "6",
                                     "--output-len", "3", "--requests", "2", "--json", str(tmp_path / "r.json"),
                                     "--plot", str(tmp_path / "r.png"), "--decode-json", str(tmp_path / "decode.json")])
    assert r.exit_code == 0, r.output
    assert lines[0].startswith("prompt_len | concurrency") and len(lines) == 3
    for row in rows:
        assert row["failed"] == 0 and row["output_tokens"] == 4 * 5, row
        assert row["tokens_per_s"] > 0 and row["tokens_per_s_per_user"] > 0 and row["usd_per_1m_tokens"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
    # $ per 1M output tokens at $3 per GPU-hour from the total rate
    assert rows[0]["usd_per_1m_tokens"] == pytest.approx(3 / 3600 / rows[0]["tokens_per_s"] * 1e6)
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert row["concurrency"] == 2 and row["output_tokens"] == 6 and (tmp_path / "r.png").stat().st_size > 1000


def test_bench_launch_and_bad_arguments(harmony_ckpt, monkeypatch):
    import gptoss_fp8.serve.server as server

    chunks, real_build = [], server.build
    monkeypatch.setattr(server, "build",
                        lambda *a, **kw: chunks.append((kw["chunk"], kw["attention"])) or real_build(*a, **kw))
    r = CliRunner().invoke(app, ["bench", "serve", "--launch", str(harmony_ckpt), "--device", "cpu", "--mode", "weights",
                                 "--concurrency", "2", "--prompt-len", "5", "--output-len", "2", "--requests", "2",
                                 "--prefill-chunk", "2", "--attention", "fp8"])
    assert r.exit_code == 0, r.output
    assert chunks == [(2, "fp8")]  # 5-token prompts in chunks of 2, 2, 1; the launched server's attention
    assert "KV cache: 2 slots x 8 tokens" in r.output and "\n5 | 2 | 2 | 0 | " in r.output
    r = CliRunner().invoke(app, ["bench", "serve"])
    assert r.exit_code != 0
    with pytest.raises(GptOssFp8Error, match="--shared-prefix 8: give fewer tokens than the shortest --prompt-len"):
        bs.bench("http://127.0.0.1:9", model="m", concurrency=[1], prompt_lens=[8, 16], output_len=1, requests=1,
                 shared_prefix=8)
    summary = bs.summarize([bs.Timing(0.0, error="HTTP 429")], 1.0, prompt_len=1, concurrency=1)
    assert summary["failed"] == 1 and summary["tokens_per_s"] == 0


def test_bench_a_shared_prefix_reports_what_the_prefix_cache_reused(harmony_ckpt):
    """--shared-prefix: a case's prompts share their first tokens (the same in every load-generator process), and the
    row's cached_pct is the share of prompt tokens the server reported cached: none without the shared part, some with
    it (the one sliding layer's ring rebuilt from 15 tokens: 90 - 15 of a later prompt's 100)."""
    ps = bs.token_prompts(3, 100, 5000, seed=1, shared=90, shared_seed=7)
    assert len({tuple(p[:90]) for p in ps}) == 1 and len({tuple(p[90:]) for p in ps}) == 3
    assert bs.token_prompts(1, 100, 5000, seed=2, shared=90, shared_seed=7)[0][:90] == ps[0][:90]
    with running_server(harmony_ckpt, max_batch=2, max_context=128, chunk=16) as s:
        rows = [bs.bench(s.url, model=None, concurrency=[1], prompt_lens=[100], output_len=2, requests=4, procs=1,
                         echo=lambda _: None, shared_prefix=n)[0] for n in (0, 90)]
    assert rows[0]["failed"] == rows[1]["failed"] == 0 and rows[0]["cached_pct"] == 0
    # one at a time: the first request prefills the shared part, each later one reuses 75 of its 100 tokens
    assert rows[1]["cached_pct"] == pytest.approx(100 * 3 * 75 / (4 * 100))


def test_bench_serve_synthetic_options(monkeypatch):
    """--synthetic passes --distinct-layers to the random weights (checked against the depth first) and
    --attention to the server; both are refused, one line each, where no server is launched."""
    import gptoss_fp8.bench.prefill as bp
    import gptoss_fp8.serve.server as server

    built, started = [], []
    monkeypatch.setattr(bp, "random_model", lambda cfg, dev, distinct_layers=None, **kw:
                        built.append((cfg.num_hidden_layers, dev.type, distinct_layers)) or "weights")

    def start(model, opts, *a):
        started.append((model, opts["attention"]))
        raise GptOssFp8Error("no server in this test")

    monkeypatch.setattr(server, "start_model", start)
    synth = ["bench", "serve", "--synthetic", "120b", "--device", "cpu", "--concurrency", "1", "--prompt-len", "8",
             "--output-len", "2"]
    r = CliRunner().invoke(app, synth + ["--distinct-layers", "12", "--attention", "fp8-lin"])
    assert r.exit_code == 1 and "no server in this test" in r.output, r.output
    assert built == [(36, "cpu", 12)] and started == [("weights", "fp8-lin")]
    assert "weights of its first 12 layers repeated" in r.output
    r = CliRunner().invoke(app, synth + ["--distinct-layers", "36"])  # every layer its own: no repetition
    assert r.exit_code == 1 and built[-1] == (36, "cpu", None) and started[-1] == ("weights", "bf16")
    r = CliRunner().invoke(app, synth + ["--layers", "4", "--distinct-layers", "5"])
    assert r.exit_code == 1 and "--distinct-layers 5: the model has 4 layers; pass 1 to 4" in r.output
    assert len(built) == 2  # refused before any weights
    for extra, why in ((["--distinct-layers", "2"], "it goes with --synthetic PRESET"),
                       (["--attention", "fp8"], "a server at URL keeps the numerics it was started with")):
        r = CliRunner().invoke(app, ["bench", "serve", "http://127.0.0.1:1", *extra])
        assert r.exit_code == 1 and why in r.output, r.output
    assert len(built) == 2


def test_bench_structured_holds_every_completion_to_a_long_json_string(harmony_ckpt, monkeypatch):
    """--structured: each request's response_format a JSON string that cannot close within the output, so every
    step's token is checked inside a JSON string, masked where refused (the host's cost of structured output under
    load); the row says what share the grammar refused."""
    pytest.importorskip("llguidance")
    fmt = bs.structured_format(5)
    assert fmt["json_schema"]["schema"] == {"type": "string", "minLength": 80}
    with running_server(harmony_ckpt, max_batch=2, max_context=64, chunk=16) as s:
        engine, seen = s.served.engine, []
        real = engine.add
        monkeypatch.setattr(engine, "add", lambda prompt, params, *a, **kw: seen.append(params) or real(prompt, params,
                                                                                                         *a, **kw))
        (row,) = bs.bench(s.url, model=None, concurrency=[2], prompt_lens=[8], output_len=5, requests=2, procs=1,
                          echo=lambda _: None, structured=True)
    assert row["failed"] == 0 and row["output_tokens"] == 2 * 5
    assert 0 <= row["refused_pct"] <= 100  # (the server's own counters over the case: some tokens were checked)
    assert len(seen) == 2 and all(p.constraint is not None and p.stop_token_ids == () for p in seen)
    with pytest.raises(GptOssFp8Error, match="--structured is for our server"):
        bs.bench("http://127.0.0.1:9", model="m", concurrency=[1], prompt_lens=[8], output_len=1, requests=1,
                 peer="transformers", tokenizer="x", structured=True)
