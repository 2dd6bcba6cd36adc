"""gptoss-fp8 serve as a command: it starts, prints its KV cache, binds loopback, answers, and
stops on Ctrl-C; what it refuses is one line."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from serve_util import running_server

pytest.importorskip("openai_harmony")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Command:
    """``gptoss-fp8 serve ...`` in a session of its own (Ctrl-C reaches all its processes, as from a terminal)."""

    def __init__(self, args, port):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.url = f"http://127.0.0.1:{port}"
        self.p = subprocess.Popen([sys.executable, "-m", "gptoss_fp8.cli.main", "serve", *args, "--port", str(port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                  start_new_session=True)

    def wait_healthy(self, timeout=120):
        t0 = time.time()
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.p.poll() is None, self.p.communicate()
            assert time.time() - t0 < timeout, "the server did not start"
            time.sleep(0.2)

    def ctrl_c(self):
        os.killpg(self.p.pid, signal.SIGINT)
        try:
            return self.p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            out, err = self.p.communicate()
            raise AssertionError(f"no exit 120 s after Ctrl-C:\n{out}\n{err}") from None


def _greedy(url, prompts, n=6):
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json={"model": "m", "prompt": p, "max_tokens": n,
                                                                        "temperature": 0, "ignore_eos": True,
                                                                        "logprobs": 0}) for p in prompts))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [(r.json()["choices"][0]["text"], r.json()["choices"][0]["logprobs"]["token_logprobs"],
                 r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]) for r in rs]

    return asyncio.run(main())


PROMPTS = [[1, 2, 3], list(range(100, 130)), list(range(5000, 5011))]


def test_serve_command_starts_answers_and_stops(harmony_ckpt):
    port = _free_port()
    cmd = _Command([str(harmony_ckpt), "--max-batch", "2", "--max-context", "64", "--model-name", "m",
                    "--no-prefix-cache"], port)
    try:
        cmd.wait_healthy()
        replies = _greedy(cmd.url, PROMPTS) + _greedy(cmd.url, [PROMPTS[1] + [4]])
    finally:
        out, err = cmd.ctrl_c()
    assert "KV cache: 2 slots x 64 tokens" in out and f"serving 'm' on http://127.0.0.1:{port}" in out, out + err
    assert "; no prefix cache" in out and replies[-1][2] == 0  # (a whole earlier prompt, not reused)
    assert "Traceback" not in err, err
    assert len({r[0] for r in replies[:3]}) == 3


def test_serve_a_sharded_checkpoint_gives_the_unsharded_replies(harmony_ckpt, tmp_path):
    """tp 2 (one process per rank over gloo, rank 0 leading the steps) in the weights mode: the
    same greedy tokens, and log-probabilities, as the one-rank checkpoint; the prefix cache's restores (a whole
    prompt, and a shared part whose ring is rebuilt) on every rank."""
    from gptoss_fp8.convert.convert import convert_checkpoint

    convert_checkpoint(harmony_ckpt.parent / "src", tmp_path / "tp2", tp=2)
    port = _free_port()
    cmd = _Command([str(tmp_path / "tp2"), "--max-batch", "2", "--max-context", "128", "--model-name", "m",
                    "--prefill-chunk", "16"], port)
    alone = list(range(700, 790))

    def turns(url):  # (a prompt alone, then one that starts with it, then one that shares 85 of its tokens)
        return (_greedy(url, PROMPTS) + _greedy(url, [alone]) + _greedy(url, [alone + [7, 8, 9]])
                + _greedy(url, [alone[:85] + [5, 6]]))

    try:
        cmd.wait_healthy()
        sharded = turns(cmd.url)
    finally:
        out, err = cmd.ctrl_c()
    assert "KV cache: 2 slots per rank x 128 tokens" in out and "tp 2 ep 1 over gloo" in out, out + err
    assert sharded[-2][2] == len(alone) and sharded[-1][2] == 85 - 15  # (the ring of window 16 rebuilt)
    with running_server(harmony_ckpt, max_batch=2, max_context=128, chunk=16, model_name="m") as s:
        assert turns(s.url) == sharded


def _one_line_error(args):
    p = subprocess.run([sys.executable, "-m", "gptoss_fp8.cli.main", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    return p.stderr


def test_what_serve_refuses(tmp_path, harmony_ckpt):
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic

    write_synthetic(tmp_path / "src", "tiny", layers=1, seed=1, layout="hf")
    convert_checkpoint(tmp_path / "src", tmp_path / "small")
    err = _one_line_error(["serve", str(tmp_path / "small")])
    assert "vocab_size 503 is neither the o200k_harmony tokenizer's 201088 nor a declared byte-level one" in err
    assert "gptoss-fp8 synth DIR --vocab-size 201088" in err  # the way it names exists (test_cli.py: test_synth_vocab_size)
    assert "--max-context 1000000: give 2..131072" in _one_line_error(
        ["serve", str(harmony_ckpt), "--max-context", "1000000"])
    assert str(tmp_path / "nope") in _one_line_error(["serve", str(tmp_path / "nope")])
    with socket.socket() as taken:  # a port another process listens on: one line, before the weights load
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"--port {port}: cannot listen there" in _one_line_error(["serve", str(harmony_ckpt), "--port", str(port)])
