"""gptoss-fp8 bench serve --peer transformers: the peer tokenizer of a synthetic source, text
prompts of exact token counts, and (slow: transformers' server takes ~10 s to start on CPU) the
load against a real `transformers serve --continuous-batching` on loopback."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from gptoss_fp8.bench import serve_peer as sp
from gptoss_fp8.convert.synth import write_synthetic
from gptoss_fp8.errors import GptOssFp8Error

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("peer") / "src"
    write_synthetic(src, "tiny", layout="hf", seed=5)
    sp.write_peer_tokenizer(src)
    return src


def test_peer_tokenizer_and_prompts(tiny_src, tmp_path):
    tok = sp.load_tokenizer(tiny_src)
    assert tok.get_vocab_size() == 503
    # the synthetic's special ids (the last four of a small vocabulary) are special tokens, eos named
    added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
    gen = json.loads((tiny_src / "generation_config.json").read_text())
    assert added[gen["eos_token_id"][0]] == "<|return|>" and added[gen["pad_token_id"]] == "<|endoftext|>"
    assert set(added) == {*gen["eos_token_id"], gen["pad_token_id"], gen["bos_token_id"]}
    # every other id decodes to a word of its own, one streamed piece per token
    words = [tok.decode([i]) for i in range(499)]
    assert len(set(words)) == 499 and all(w.isalpha() for w in words)
    texts = sp.text_prompts(tok, 5, 37, seed=1)
    assert len(set(texts)) == 5 and all(len(tok.encode(t).ids) == 37 for t in texts)
    assert sp.text_prompts(tok, 5, 37, seed=1) == texts and sp.text_prompts(tok, 5, 37, seed=2) != texts
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_src))  # as transformers' server loads it
    assert [len(hf(t)["input_ids"]) for t in texts] == [37] * 5 and hf.eos_token_id == gen["eos_token_id"][0]
    with pytest.raises(GptOssFp8Error, match="has a tokenizer of its own"):
        sp.write_peer_tokenizer(tiny_src)
    with pytest.raises(GptOssFp8Error, match="no tokenizer to build text prompts"):
        sp.load_tokenizer(tmp_path)
    body = sp.peer_body("a b", 7, None)
    assert "model" not in body and "ignore_eos" not in body and body["max_tokens"] == 7
    assert json.loads(body["generation_config"]) == {"max_new_tokens": 7, "do_sample": False, "eos_token_id": -1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# transformers serve's own command (cli/serve.py Serve) through typer, as benchmarks/gpu_suite.sh
# starts it: the `transformers` CLI module also imports cli/chat.py, which needs `requests`
SERVE = "import typer; from transformers.cli.serve import Serve; a = typer.Typer(); a.command()(Serve); a()"


@pytest.mark.slow
def test_bench_against_transformers_serve(tiny_src, tmp_path):
    pytest.importorskip("accelerate")  # from_pretrained(device_map=...)
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        pytest.skip("transformers serve needs fastapi, uvicorn, pydantic and openai")
    from gptoss_fp8.bench import serve as bs

    port = _free_port()
    # no network; an empty hub cache: its /v1/models (a scan of the cache) fails as on the GPU machine
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "no-cache")}
    cmd = [sys.executable, "-c", SERVE, str(tiny_src), "--continuous-batching", "--host", "127.0.0.1", "--port",
           str(port), "--device", "cpu", "--dtype", "bfloat16", "--cb-num-blocks", "64", "--cb-block-size", "32",
           "--cb-max-batch-tokens", "512"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        for _ in range(240):
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited: {proc.stdout.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("transformers serve not healthy in 120 s")
        # our own request (token ids, ignore_eos) is not one it takes: the bench says where to go
        with pytest.raises(GptOssFp8Error, match="--peer transformers"):
            bs.bench(url, model=None, concurrency=[1], prompt_lens=[8], output_len=2, requests=1, echo=lambda _: None)
        lines = []
        rows = bs.bench(url, model=None, concurrency=[1, 4], prompt_lens=[32], output_len=16, requests=None,
                        peer="transformers", tokenizer=tiny_src, echo=lines.append)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert lines[0].startswith("warm-up: 4 requests at once, 32 + 16 tokens") and "errors" not in lines[0]
    for row, c in zip(rows, (1, 4), strict=True):
        # every reply's usage said 32 prompt tokens and 16 output tokens (else the request counts as failed)
        assert row["concurrency"] == c and row["requests"] == 8 and row["failed"] == 0, row
        assert row["output_tokens"] == 8 * 16 and row["tokens_per_s"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
