"""Vocab-parallel embedding and lm_head (convert --vocab-parallel): the same logits as replicated,
the plan's per-rank saving, the manifest field (absent: replicated), and bad input.

The tiny preset's vocabulary (503) is prime, so at tp 2 the ranks hold 251 / 252 rows: the uneven
split (``Parallel.vocab_rows``) and the padded all-gather are on every path tested here.
"""

import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from typer.testing import CliRunner

from gptoss_fp8.checkpoint.checkpoint import Checkpoint
from gptoss_fp8.checkpoint.manifest import load_rank, reassemble
from gptoss_fp8.checkpoint.plan import plan
from gptoss_fp8.cli.main import app
from gptoss_fp8.config import hf_config_dict, preset_config
from gptoss_fp8.convert.convert import convert_checkpoint
from gptoss_fp8.convert.synth import write_synthetic
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.load import load_model
from gptoss_fp8.parallel import Parallel, check_layout, free_port
from gptoss_fp8.verify.run import compute_outputs

VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
LAYOUTS = [(2, 1), (2, 2)]
# The outputs comparisons at tp 2 ep 1 by default; at tp 2 ep 2 under -m slow (~17 s of rank processes
# on the 2-core box): ep moves experts, not vocabulary rows, and tp 2 ep 2 vocab-parallel equals the
# unsharded decode by default in tests/test_decode_sharded.py::test_sharded_decode_step_equals_unsharded[2-2-True]
OUTPUT_LAYOUTS = [lay if lay == (2, 1) else pytest.param(*lay, marks=pytest.mark.slow) for lay in LAYOUTS]
DECODE = 5
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny source converted unsharded, and at each layout replicated and vocab-parallel; the
    outputs (forward, prefill + DECODE decode steps) of each in both CPU modes, computed at the first
    ask (``outs[(tp, ep, vocab_parallel)]``)."""
    root = tmp_path_factory.mktemp("vocab")
    cfg = write_synthetic(root / "src", "tiny", seed=21, layout="hf")
    tokens = torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(2))
    tokens[:4] = torch.tensor([0, 250, 251, cfg.vocab_size - 1])  # both sides of the tp 2 boundary, both ends
    tokens[-2:] = torch.tensor([251, 250])  # and among the decoded tokens
    convert_checkpoint(root / "src", root / "tp1")
    for tp, ep in LAYOUTS:
        for vp in (False, True):
            convert_checkpoint(root / "src", root / f"tp{tp}ep{ep}{'vp' if vp else ''}", tp=tp, ep=ep, vocab_parallel=vp)

    class Outputs(dict):
        def __missing__(self, key):
            tp, ep, vp = key
            dst = root / ("tp1" if tp == 1 else f"tp{tp}ep{ep}{'vp' if vp else ''}")
            self[key] = compute_outputs(dst, tokens, ["weights", "w8a8"], **({"tp": tp, "ep": ep} if tp > 1 else {}),
                                        decode=DECODE)
            return self[key]

    return root, cfg, tokens, Outputs()


def _same(a, b) -> list[str]:
    """What differs (bit for bit) between two ModeOutputs: logits, captures, decode steps."""
    bad = [] if torch.equal(a.logits, b.logits) else ["logits"]
    bad += [f"hidden {k}" for k in a.hidden if not torch.equal(a.hidden[k], b.hidden[k])]
    bad += [f"decode {k}" for k in a.decode if k != "seconds" and not torch.equal(a.decode[k], b.decode[k])]
    return bad


@pytest.mark.parametrize("tp,ep", OUTPUT_LAYOUTS)
@pytest.mark.parametrize("mode", ["weights", "w8a8"])
def test_vocab_parallel_equals_replicated_bit_for_bit(tiny, tp, ep, mode):
    """Forward logits and captures, the prefill's logits and every decode step's logits and captures:
    the same bits as the replicated layout (the lm_head columns are the same GEMM rows; the
    embedding all-reduce adds -0.0 to each row)."""
    *_, outs = tiny
    rep, vp = outs[(tp, ep, False)][mode], outs[(tp, ep, True)][mode]
    assert vp.logits.shape == rep.logits.shape == (37, 503)
    assert vp.decode["logits"].shape == (DECODE + 1, 503)
    assert _same(rep, vp) == []


@pytest.mark.parametrize("tp,ep", OUTPUT_LAYOUTS)
def test_vocab_parallel_equals_unsharded(tiny, tp, ep):
    """weights mode: bit for bit the unsharded model (as the replicated layout is on these shapes).
    w8a8: the shards' activation groups differ from the unsharded ones (test_model_sharded.py), so
    vocab-parallel is held to what the replicated layout gives, bit for bit above."""
    *_, outs = tiny
    base, vp = outs[(1, 1, False)]["weights"], outs[(tp, ep, True)]["weights"]
    assert _same(base, vp) == []


def test_rank_files_hold_vocab_slices(tiny):
    root, cfg, *_ = tiny
    dst, h = root / "tp2ep1vp", cfg.hidden_size
    ck = Checkpoint.open(dst)
    assert ck.vocab_parallel is True and ck.manifest["vocab_parallel"] is True
    assert Checkpoint.open(root / "tp2ep1").vocab_parallel is False
    assert Checkpoint.open(root / "tp2ep1").manifest["vocab_parallel"] is False
    assert json.loads((dst / "conversion.json").read_text())["layout"] == {"tp": 2, "ep": 1, "vocab_parallel": True}
    full = reassemble(root / "tp1")
    for r, (a, b) in enumerate([(0, 251), (251, 503)]):
        t = load_rank(dst, r)
        sl = ck.manifest["ranks"][r]["tensors"]
        for name in VOCAB:
            assert t[name].shape == (b - a, h) and sl[name]["slices"] == [[0, a, b]], (r, name)
            assert torch.equal(t[name].float(), full[name][a:b]), (r, name)
    got = reassemble(dst)  # coverage: every vocabulary row on exactly one rank
    assert all(torch.equal(got[n], full[n]) for n in full)


def test_load_model_takes_the_layout_from_the_manifest(tiny, tmp_path):
    """load_model builds the Parallel with the checkpoint's vocab_parallel; an older manifest
    without the field loads as replicated; a bad value, or asking vocab-parallel of a replicated
    checkpoint, is one clear error."""
    root, cfg, *_ = tiny
    m = load_model(root / "tp2ep1vp", Parallel(1, 2, 1))  # loading needs no process group
    assert m.par.vocab_parallel and m.lm_head.weight.shape == (252, cfg.hidden_size)
    old = tmp_path / "old"
    shutil.copytree(root / "tp2ep1", old)
    layout = json.loads((old / "layout.json").read_text())
    del layout["vocab_parallel"]  # as written before the option existed
    (old / "layout.json").write_text(json.dumps(layout))
    ck = Checkpoint.open(old)
    assert ck.vocab_parallel is False
    m = load_model(ck, Parallel(1, 2, 1))
    assert not m.par.vocab_parallel and m.model.embed_tokens.weight.shape == (503, cfg.hidden_size)
    with pytest.raises(GptOssFp8Error, match="convert again with --vocab-parallel"):
        load_model(ck, Parallel(0, 2, 1, vocab_parallel=True))
    layout["vocab_parallel"] = "yes"
    (old / "layout.json").write_text(json.dumps(layout))
    with pytest.raises(GptOssFp8Error, match="vocab_parallel is 'yes'"):
        Checkpoint.open(old)


def test_old_manifest_runs_as_replicated(tiny, tmp_path):
    root, _, tokens, outs = tiny
    old = tmp_path / "old"
    shutil.copytree(root / "tp2ep1", old)
    layout = json.loads((old / "layout.json").read_text())
    del layout["vocab_parallel"]
    (old / "layout.json").write_text(json.dumps(layout))
    got = compute_outputs(old, tokens, ["weights"], tp=2, ep=1)["weights"]
    assert torch.equal(got.logits, outs[(2, 1, False)]["weights"].logits)


@pytest.mark.parametrize("preset", ["20b", "120b"])
@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 2), (8, 1), (8, 8)])
def test_plan_saves_tp_minus_one_over_tp_of_the_vocab_tensors(preset, tp, ep):
    cfg = preset_config(preset)
    rep, vp = plan(cfg, tp, ep), plan(cfg, tp, ep, vocab_parallel=True)
    whole = 2 * cfg.vocab_size * cfg.hidden_size * 2  # embedding + lm_head, bf16
    assert cfg.vocab_size % tp == 0
    for r in range(tp):
        a, b = {t.name: t for t in rep[r]}, {t.name: t for t in vp[r]}
        assert a.keys() == b.keys()
        assert all(a[n].shape == b[n].shape for n in a if n not in VOCAB)  # nothing else moves
        saved = sum(t.nbytes for t in rep[r]) - sum(t.nbytes for t in vp[r])
        assert saved == whole * (tp - 1) // tp, (r, saved)
        v0, v1 = cfg.vocab_size * r // tp, cfg.vocab_size * (r + 1) // tp
        assert all(b[n].slice.ranges == ((0, v0, v1),) for n in VOCAB)
    if tp == 8:  # the figure the issue asks for: 2.03 GB per rank at tp 8
        assert round(whole * 7 / 8 / 1e9, 2) == 2.03


def test_plan_splits_an_uneven_vocabulary_contiguously():
    cfg = preset_config("tiny")  # vocab 503
    for tp in (2, 4, 8):
        ranks = plan(cfg, tp, 1, vocab_parallel=True)
        for name in VOCAB:
            cuts = [next(t for t in ts if t.name == name).slice.ranges[0] for ts in ranks]
            assert cuts[0][1] == 0 and cuts[-1][2] == 503
            assert all(x[2] == y[1] for x, y in zip(cuts, cuts[1:], strict=False))  # contiguous, in rank order
            sizes = [b - a for _, a, b in cuts]
            assert max(sizes) - min(sizes) <= 1 and sizes == Parallel(0, tp, 1, vocab_parallel=True).vocab_sizes(503)
    # tp 1: one rank holds the whole vocabulary, the plain layout
    assert [t.shape for t in plan(cfg, 1, 1, vocab_parallel=True)[0]] == [t.shape for t in plan(cfg, 1, 1)[0]]
    assert Parallel(0, 1, 1, vocab_parallel=True) == Parallel()


def test_plan_cli_prints_the_layout_and_the_saving():
    r0 = runner.invoke(app, ["plan", "--preset", "20b", "--tp", "8", "--summary"])
    r1 = runner.invoke(app, ["plan", "--preset", "20b", "--tp", "8", "--summary", "--vocab-parallel"])
    assert r0.exit_code == 0 and r1.exit_code == 0, r0.output + r1.output
    assert "embedding and lm_head replicated" in r0.output and "embedding and lm_head vocab-parallel" in r1.output
    assert "embed/lm_head 2.317 GB" in r0.output and "embed/lm_head 0.290 GB" in r1.output

    def largest(out: str) -> float:
        return float(out.strip().splitlines()[-1].split("largest rank ")[1].split()[0])

    assert round(largest(r0.output) - largest(r1.output), 2) == 2.03


def test_cli_convert_vocab_parallel_then_verify_logits_passes(tiny, tmp_path):
    pytest.importorskip("gpt_oss.torch.model", reason="OpenAI's reference: pip install --no-deps gpt-oss==0.0.9")
    root, _, tokens, _ = tiny
    (tmp_path / "tokens.json").write_text(json.dumps(tokens.tolist()))
    dst = tmp_path / "vp"
    r = runner.invoke(app, ["convert", str(root / "src"), str(dst), "--tp", "2", "--vocab-parallel",
                            "--keep-attention-bf16"])
    assert r.exit_code == 0, r.output
    assert Checkpoint.open(dst).vocab_parallel
    # the layout (vocab-parallel included) comes from the manifest: no flag for verify
    r = runner.invoke(app, ["verify-logits", str(dst), "--reference", str(root / "src"), "--tokens",
                            str(tmp_path / "tokens.json"), "--decode", "3", "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["passed"] is True and rep["parallel"] == {"tp": 2, "ep": 1, "collective": "gloo"}
    assert rep["weights"]["summary"]["top1_agreement"] == 1.0


def test_resume_knows_the_layout(tiny):
    """--resume on a finished vocab-parallel DST is 'already complete'; the other layout is refused."""
    root, *_ = tiny
    dst = root / "tp2ep1vp"
    done = convert_checkpoint(root / "src", dst, tp=2, ep=1, vocab_parallel=True, resume=True)
    assert "already complete" in done["status"]
    with pytest.raises(GptOssFp8Error, match="vocab_parallel True there, False now"):
        convert_checkpoint(root / "src", dst, tp=2, ep=1, resume=True)
    rep = root / "tp2ep1"  # a replicated record has no vocab_parallel key: the same as before the option
    assert "vocab_parallel" not in json.loads((rep / "conversion.json").read_text())["resume_state"]
    assert "already complete" in convert_checkpoint(root / "src", rep, tp=2, ep=1, resume=True)["status"]


def test_vocab_smaller_than_tp_is_one_clear_error(tmp_path):
    cfg = preset_config("tiny", vocab_size=5)
    with pytest.raises(GptOssFp8Error, match=r"--tp 8 --vocab-parallel: vocab_size 5 gives some rank no vocabulary rows"):
        check_layout(cfg, 8, 1, vocab_parallel=True)
    plan(cfg, 8, 1)  # replicated is fine
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    r = runner.invoke(app, ["plan", str(tmp_path), "--tp", "8", "--vocab-parallel"])
    assert r.exit_code == 1
    err = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "drop --vocab-parallel" in err[0], r.output


# ------------------------------------------------------------------------------------------------
# Parallel.all_gather and the embedding's all-reduce, on 2 gloo ranks


def _collectives(rank: int, world: int, port: int, device: str = "cpu", backend: str = "gloo") -> None:
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        par = Parallel(rank, world, 1, vocab_parallel=True)
        sizes = par.vocab_sizes(7)  # [3, 4]
        for dtype in (torch.bfloat16, torch.float32):
            full = (torch.arange(5 * 7, dtype=torch.float32).view(5, 7).to(dtype) - 11).to(device)
            a, b = par.vocab_rows(7)
            got = par.all_gather(full[:, a:b].clone(), sizes)  # last dim, uneven
            assert got.dtype == dtype and torch.equal(got, full), (rank, dtype)
            got = par.all_gather(full.T[a:b].clone(), sizes, dim=0)
            assert torch.equal(got, full.T), (rank, dtype)
        even = torch.full((2, 3), float(rank), dtype=torch.bfloat16, device=device)
        want = torch.tensor([[0.0] * 3 + [1.0] * 3] * 2, dtype=torch.bfloat16, device=device)
        assert torch.equal(par.all_gather(even), want)
        # the embedding's sum: the owner's row plus -0.0 from the others is the row, signed zeros too
        row = torch.tensor([-0.0, 0.0, 1.5, -2.0, float("inf")], dtype=torch.bfloat16, device=device)
        mine = row if rank == 0 else torch.full_like(row, -0.0)
        got = par.all_reduce(mine)
        assert torch.equal(got.view(torch.int16), row.view(torch.int16)), got
    finally:
        dist.destroy_process_group()


def test_all_gather_and_embedding_sum_over_gloo():
    mp.spawn(_collectives, args=(2, free_port()), nprocs=2, join=True)


@pytest.mark.gpu
def test_all_gather_and_embedding_sum_on_the_gpu():
    """On CUDA tensors: NCCL with a GPU per rank, else gloo through host memory (ranks sharing one GPU)."""
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    mp.spawn(_collectives, args=(2, free_port(), "cuda", backend), nprocs=2, join=True)


def test_vocab_parallel_at_tp_1_is_one_clear_error(tiny, tmp_path):
    """At --tp 1 one rank holds the whole vocabulary: convert and plan refuse the option with one
    line, before anything is written."""
    root, *_ = tiny
    for args in (["convert", str(root / "src"), str(tmp_path / "out"), "--vocab-parallel"],
                 ["plan", "--preset", "tiny", "--vocab-parallel"]):
        r = runner.invoke(app, args)
        err = [line for line in r.output.splitlines() if line.strip()]
        assert r.exit_code != 0 and len(err) == 1 and "give --tp 2 or more" in err[0], (args, r.output)
    assert not (tmp_path / "out").exists()
