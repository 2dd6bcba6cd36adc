"""gptoss-fp8 serve as a command: it starts, prints its KV cache, binds loopback, answers, and
stops on Ctrl-C; what it refuses is one line."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("openai_harmony")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_starts_answers_and_stops(harmony_ckpt):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "gptoss_fp8.cli.main", "serve", str(harmony_ckpt), "--port", str(port),
                          "--max-batch", "2", "--max-context", "64", "--model-name", "m"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, t0 = f"http://127.0.0.1:{port}", time.time()
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert p.poll() is None and time.time() - t0 < 90, p.stderr.read() if p.poll() is not None else "slow"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 3,
                                                     "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    assert "KV cache: 2 slots x 64 tokens" in out and f"serving 'm' on http://127.0.0.1:{port}" in out, out + err
    assert "Traceback" not in err, err


def _one_line_error(args):
    p = subprocess.run([sys.executable, "-m", "gptoss_fp8.cli.main", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    return p.stderr


def test_what_serve_refuses(tmp_path, harmony_ckpt):
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic

    write_synthetic(tmp_path / "src", "tiny", layers=1, seed=1, layout="hf")
    convert_checkpoint(tmp_path / "src", tmp_path / "tp2", tp=2)
    convert_checkpoint(tmp_path / "src", tmp_path / "small")
    assert "converted for tp 2 / ep 1; serve runs one-rank checkpoints only" in _one_line_error(
        ["serve", str(tmp_path / "tp2")])
    assert "vocab_size 503 is not the o200k_harmony tokenizer's 201088" in _one_line_error(
        ["serve", str(tmp_path / "small")])
    assert "--max-context 1000000: give 2..131072" in _one_line_error(
        ["serve", str(harmony_ckpt), "--max-context", "1000000"])
    assert str(tmp_path / "nope") in _one_line_error(["serve", str(tmp_path / "nope")])
