"""gptoss-fp8 generate on a checkpoint converted for tp 2 (CPU, gloo, two rank processes): the same
token ids as the unsharded checkpoint's generate on the same weights, greedy and sampled (rank 0
chooses on replicated logits, and decides the stop); rank 0's stream reaches the caller once, as it
is printed; under torchrun each process is one rank; a WORLD_SIZE that is not the checkpoint's tp
is one line.

The mode is generate's CPU default, ``weights``: there the sharded logits are the unsharded ones
bit for bit on these shapes (tests/test_vocab_parallel.py), so sampling at the same seed draws the
same ids. ``w8a8`` is not compared: the shards' activation quantization groups differ from the
unsharded ones, so its logits differ in the last bits and a sample can differ (observed: the 12th
sampled token of one prompt)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from gptoss_fp8.checkpoint.checkpoint import Checkpoint
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.parallel import launch_ranks
from gptoss_fp8.verify import generate as gen
from gptoss_fp8.verify.backends import ops_for
from gptoss_fp8.verify.generate_sharded import run as run_any  # the command: one process or the ranks

LAYOUTS = {"tp2ep1": {"tp": 2, "ep": 1}, "tp2ep2": {"tp": 2, "ep": 2},
           "tp2vp": {"tp": 2, "ep": 1, "vocab_parallel": True}}
GREEDY_NEW = 10
SAMPLED_NEW, TEMPERATURE = 48, 3.0


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This process's model runs on one thread, as each rank does on the 2-core CPU box (two threads
    beside the rank processes, or a busy machine, are many times slower: OpenMP waits spin)."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    """The tiny source converted unsharded and at each layout; a prompt; the unsharded generate's
    greedy reply and a seed whose sampled reply ends at a stop token before the limit."""
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic
    from gptoss_fp8.model.load import load_model

    root = tmp_path_factory.mktemp("generate-sharded")
    cfg = write_synthetic(root / "src", "tiny", seed=7, layout="hf")
    convert_checkpoint(root / "src", root / "tp1")
    for name, layout in LAYOUTS.items():
        convert_checkpoint(root / "src", root / name, **layout)
    prompt = torch.randint(0, cfg.vocab_size - 8, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    model, ops = load_model(root / "tp1"), ops_for("weights")
    greedy = gen.generate(model, prompt, ops, max_new_tokens=GREEDY_NEW)
    for seed in range(64):  # about one seed in six stops early at this temperature
        sampled = gen.generate(model, prompt, ops, max_new_tokens=SAMPLED_NEW, temperature=TEMPERATURE, seed=seed)
        if sampled.stop != "max-new-tokens":
            break
    else:
        pytest.fail("no seed in 0..63 gives a sampled reply that ends at a stop token")
    (root / "prompt.json").write_text(json.dumps(prompt))
    return root, prompt, greedy, seed, sampled


class Echo:
    """typer.echo's signature, into a string."""

    def __init__(self) -> None:
        self.text = ""

    def __call__(self, text: str = "", nl: bool = True) -> None:
        self.text += text + ("\n" if nl else "")


def _ids(tokens) -> str:
    """The streamed ids line: each id and a space."""
    return "".join(f"{t} " for t in tokens)


# By default tp2vp (tp 2 ep 1 with the vocabulary split too). Under -m slow: tp2ep2 (its sampled reply
# equals the unsharded one by default: test_cli_prints_the_stream_once) and tp2ep1 (tp 2 ep 1 is
# tp2vp's layout but for the vocabulary; its sampled text equals the unsharded one by default:
# test_text_reply_comes_through_the_pipe_as_printed; ~15 s on the 2-core box).
DEFAULT_LAYOUTS = ("tp2vp",)


@pytest.mark.parametrize("layout", [lay if lay in DEFAULT_LAYOUTS else pytest.param(lay, marks=pytest.mark.slow)
                                    for lay in LAYOUTS])
def test_sharded_generate_equals_unsharded(tiny, layout):
    """Greedy (stopped by --max-new-tokens) and sampled (stopped by a stop token) on two ranks: the
    unsharded ids, the same stop; rank 0's lines come back through echo once, in the one-process
    format (the header names the layout)."""
    root, prompt, greedy, seed, sampled = tiny
    one, two = Echo(), Echo()
    run_any(Checkpoint.open(root / "tp1"), prompt, max_new_tokens=GREEDY_NEW, echo=one)
    g = run_any(Checkpoint.open(root / layout), prompt, max_new_tokens=GREEDY_NEW, echo=two)
    assert g.tokens == greedy.tokens and g.stop == greedy.stop, (g.tokens, greedy.tokens)
    assert g.prompt == prompt and g.prefill_seconds > 0 and g.decode_seconds > 0
    ep, vp = LAYOUTS[layout]["ep"], " vocab-parallel" if LAYOUTS[layout].get("vocab_parallel") else ""
    a, b = one.text.splitlines(), two.text.splitlines()
    assert len(a) == len(b) == 5, two.text
    assert b[1] == f"[9 prompt tokens, mode weights, cpu, tp 2 ep {ep}{vp} over gloo, greedy]"
    assert b[0] == a[0] and b[2] == a[2] == _ids(greedy.tokens) and b[3] == a[3]
    assert b[4].startswith("prefill: 9 tokens in ") and f"decode: {GREEDY_NEW - 1} tokens in " in b[4]

    s = run_any(Checkpoint.open(root / layout), prompt, max_new_tokens=SAMPLED_NEW, temperature=TEMPERATURE,
                seed=seed, echo=Echo())
    assert s.tokens == sampled.tokens and s.stop == sampled.stop, (s.tokens, sampled.tokens)
    assert len(s.tokens) < SAMPLED_NEW


def test_text_reply_comes_through_the_pipe_as_printed(tmp_path):
    """The tokenizer's vocabulary, so text and channels (on synthetic weights the text is noise, in
    many scripts): the sharded run's text, through rank 0's pipe in arbitrary UTF-8 pieces, is the
    unsharded run's, character for character."""
    pytest.importorskip("openai_harmony", reason="--prompt needs openai-harmony")
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic
    from gptoss_fp8.verify.prompt import render_prompt

    write_synthetic(tmp_path / "src", "tiny", layers=1, seed=3, layout="hf", vocab_size=gen.HARMONY_VOCAB,
                    hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                    num_local_experts=2, num_experts_per_tok=1)
    convert_checkpoint(tmp_path / "src", tmp_path / "tp1")
    convert_checkpoint(tmp_path / "src", tmp_path / "tp2", tp=2, ep=1)
    prompt = render_prompt("What is 2+2?")
    one, two = Echo(), Echo()
    for name, echo in (("tp1", one), ("tp2", two)):
        run_any(Checkpoint.open(tmp_path / name), prompt, max_new_tokens=24, temperature=1.0, seed=2, echo=echo)
    a, b = one.text.split("\n"), two.text.split("\n")
    assert b[0] == f"[{len(prompt)} prompt tokens, mode weights, cpu, tp 2 ep 1 over gloo, temperature 1, seed 2]"
    assert len(a) == len(b) and b[1:-2] == a[1:-2], (one.text, two.text)  # the text, the stop, the channels
    assert any(ord(c) > 0x7FF for c in "".join(b[1:-3])), two.text  # characters of three UTF-8 bytes and more came through
    assert b[-2].startswith("prefill: ") and b[-1] == ""


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def test_cli_prints_the_stream_once(tiny):
    """The command as a user runs it: rank 0's lines once (rank 1 prints nothing), the sampled ids."""
    root, _, _, seed, sampled = tiny
    p = subprocess.run([sys.executable, "-m", "gptoss_fp8.cli.main", "generate", str(root / "tp2ep2"),
                        "--tokens", str(root / "prompt.json"), "--max-new-tokens", str(SAMPLED_NEW),
                        "--temperature", str(TEMPERATURE), "--seed", str(seed)],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert len(out) == 5, p.stdout
    assert out[0].startswith("vocab_size 503 is not the o200k_harmony tokenizer's")
    assert out[1] == f"[9 prompt tokens, mode weights, cpu, tp 2 ep 2 over gloo, temperature 3, seed {seed}]"
    assert out[2] == _ids(sampled.tokens)
    assert out[3] == f"stopped: {sampled.stop} after {len(sampled.tokens)} new tokens"
    assert out[4].startswith("prefill: 9 tokens in ")


def test_under_torchrun(tiny):
    """torchrun --nproc-per-node 2: each process one rank; rank 0 prints, once; the greedy ids."""
    root, _, greedy, _, _ = tiny
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "gptoss_fp8.cli.main", "generate", str(root / "tp2vp"), "--tokens", str(root / "prompt.json"),
                        "--max-new-tokens", str(GREEDY_NEW)],
                       env=_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout.splitlines()
    assert len(out) == 5, p.stdout
    assert out[1] == "[9 prompt tokens, mode weights, cpu, tp 2 ep 1 vocab-parallel over gloo, greedy]"
    assert out[2] == _ids(greedy.tokens)
    assert out[3] == f"stopped: {greedy.stop} after {len(greedy.tokens)} new tokens"


def test_world_size_not_the_checkpoints_tp_is_one_line(tiny, monkeypatch):
    root, prompt, *_ = tiny
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun --nproc-per-node 4 sets it
    with pytest.raises(GptOssFp8Error, match="converted for tp 2 / ep 1, torchrun started WORLD_SIZE 4 processes; "
                                             "give --nproc-per-node 2$"):
        run_any(Checkpoint.open(root / "tp2ep1"), prompt, max_new_tokens=2, echo=Echo())
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(GptOssFp8Error, match="converted for tp 1 / ep 1, .* give --nproc-per-node 1 or run without"):
        run_any(Checkpoint.open(root / "tp1"), prompt, max_new_tokens=2, echo=Echo())
    # the command: one line on stderr, no traceback (one rank's process, as torchrun starts it)
    p = subprocess.run([sys.executable, "-m", "gptoss_fp8.cli.main", "generate", str(root / "tp2ep2"),
                        "--tokens", str(root / "prompt.json")],
                       env=dict(_env(), WORLD_SIZE="3", RANK="0", LOCAL_RANK="0"), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and p.stdout == "", p.stdout
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert "converted for tp 2 / ep 2, torchrun started WORLD_SIZE 3 processes; give --nproc-per-node 2" in p.stderr


TALKER = """import os, pathlib, sys, time
job = pathlib.Path(sys.argv[1])
print("first", flush=True)
deadline = time.monotonic() + 30
while not (job.parent / "seen").exists():  # the parent has rank 0's first line before the rank ends
    if time.monotonic() > deadline:
        sys.exit("the first line never reached the parent")
    time.sleep(0.01)
sys.stdout.write("second \\u2713 ")
print("rank", os.environ["RANK"])
"""


def test_launch_ranks_hands_rank0_stdout_over_as_it_comes(tmp_path, monkeypatch):
    """launch_ranks(output=...): rank 0's stdout reaches the callback while the rank still runs
    (the rank waits for the parent to have seen its first line), UTF-8 intact; rank 1's is dropped."""
    (tmp_path / "talker.py").write_text(TALKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    job = tmp_path / "job.json"
    job.write_text("{}")
    got = []

    def output(text: str) -> None:
        got.append(text)
        if "first" in "".join(got):
            (tmp_path / "seen").touch()

    launch_ranks("talker", job, 2, "talker", timeout_s=60, output=output)
    assert "".join(got) == "first\nsecond \u2713 rank 0\n"
    launch_ranks("talker", job, 1, "talker", timeout_s=60)  # without output: as before, stdout dropped
