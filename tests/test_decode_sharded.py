"""bench decode --tp / --ep (bench/decode_sharded.py): the mechanics on CPU, ranks as processes over gloo.

The figures of a CPU run mean nothing (every row says so); what is checked: every rank steps behind
a barrier and rank 0's rows come back with the all-reduces in the breakdown, $ per 1M tokens counts
every GPU, the cache holds the rank's own kv heads, the per-rank floor is the one-GPU floor at tp 1
and splits the expert bytes over the ranks, the bench runs under torchrun, and the thing it times,
one sharded decode step, gives the unsharded model's logits on the same weights (the sharded
models sliced from one unsharded random model by the shard plan)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptoss_fp8.bench.decode import cache_bytes, expected_experts, floor_bytes, set_context
from gptoss_fp8.bench.decode_sharded import bench_decode_sharded, floor_bytes_rank, format_row
from gptoss_fp8.bench.prefill import random_model, usd_per_million_tokens
from gptoss_fp8.checkpoint.plan import rank_slice
from gptoss_fp8.config import preset_config
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.gptoss import GptOss
from gptoss_fp8.model.ops import ReferenceOps, W8A8CpuOps
from gptoss_fp8.parallel import SINGLE, Parallel, free_port

HAS_CUDA = torch.cuda.is_available()


# (2, 2, False) under -m slow: tp 2 and ep 2 / vocab-parallel on and off are in the other two
@pytest.mark.parametrize("tp,ep,vocab", [(2, 1, False), pytest.param(2, 2, False, marks=pytest.mark.slow), (2, 2, True)])
def test_sharded_decode_bench_rows(tp, ep, vocab):
    lines = []
    rows = bench_decode_sharded("tiny", [1, 3], [12], tp, ep, runs=2, warmup=1, device="cpu", echo=lines.append,
                                vocab_parallel=vocab)
    cfg = preset_config("tiny")
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 12), (3, 12)]
    assert len(lines) == 3 and lines[0].startswith("# tiny tp 2") and "not a measurement" in lines[0]
    for r, line in zip(rows, lines[1:], strict=True):
        assert (r["tp"], r["ep"], r["gpus"], r["collective"]) == (tp, ep, tp, "gloo")
        assert not r["graph"] and not r["measurement"] and "NOT A MEASUREMENT" in line and line == format_row(r)
        assert r["layers"] == r["full_layers"] == cfg.num_hidden_layers and len(r["runs_s"]) == 2
        step = r["ms_per_step"] / 1e3
        assert step > 0 and r["slowest_rank_ms_per_step"] >= r["ms_per_step"]  # the max over ranks, rank 0's among them
        assert r["tok_s_total"] == pytest.approx(r["batch"] * r["tok_s_per_user"]) and r["tok_s_per_user"] == 1 / step
        assert r["usd_per_1m_tokens"] == pytest.approx(tp * usd_per_million_tokens(step, r["batch"]))
        assert r["vocab_parallel"] == vocab and ("allgather" in r["parts_s"]) == vocab
        par = Parallel(rank=0, tp=tp, ep=ep, vocab_parallel=vocab)
        assert r["floor_bytes"] == floor_bytes_rank(cfg, par, r["batch"], r["context"])
        assert r["floor_ratio"] == pytest.approx(r["floor_ms"] / r["ms_per_step"])
        # the rank's own kv heads: the tiny preset's 2 split over 2 ranks
        assert r["cache_bytes"] == cache_bytes(cfg, r["batch"], r["context"] + 1) // 2
        # one eager step by part on rank 0, the all-reduces as their own part, inside its wall time
        parts = r["parts_s"]
        assert {"attention", "moe", "dense", "norm", "allreduce"} <= set(parts) and parts["allreduce"] > 0, parts
        assert 0 < sum(parts.values()) <= r["eager_step_s"] and "allreduce" in line


def _floor_bytes_tp1(cfg, batch, context):
    """bench/decode.py ``floor_bytes`` as it was before it took ``par`` (the one-GPU reference)."""
    parts = dict.fromkeys(("experts", "attention", "router_norms", "lm_head", "embedding", "kv"), 0.0)
    touched = expected_experts(cfg.num_local_experts, cfg.num_experts_per_tok, batch)
    for name, (shape, dtype) in GptOss(cfg, SINGLE, attn_fp8=True).expected().items():
        n = math.prod(shape) * dtype.itemsize
        if ".mlp.experts." in name:
            parts["experts"] += n / cfg.num_local_experts * touched
        elif ".self_attn." in name:
            parts["attention"] += n
        elif name == "lm_head.weight":
            parts["lm_head"] += n
        elif name == "model.embed_tokens.weight":
            parts["embedding"] += batch * shape[-1] * dtype.itemsize
        else:
            parts["router_norms"] += n
    per_key = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    for kind in cfg.layer_types:
        keys = context + 1
        if kind == "sliding_attention" and cfg.sliding_window > 0:
            keys = min(keys, cfg.sliding_window)
        parts["kv"] += batch * keys * per_key
    parts["total"] = sum(parts.values())
    return parts


@pytest.mark.parametrize("preset", ["tiny", "20b", "120b"])
def test_floor_bytes_rank(preset):
    cfg = preset_config(preset)
    for batch, context in ((1, 12), (8, 8192), (128, 32768)):
        # tp 1: the one-GPU floor, unchanged bit for bit
        one = _floor_bytes_tp1(cfg, batch, context)
        assert floor_bytes(cfg, batch, context) == one
        assert floor_bytes_rank(cfg, SINGLE, batch, context) == one
        for tp, ep in ((2, 2), (4, 4), (2, 1), (4, 2)):
            ranks = [floor_bytes_rank(cfg, Parallel(rank=r, tp=tp, ep=ep), batch, context) for r in range(tp)]
            split = sum(f["experts"] for f in ranks)
            if ep == tp:  # whole experts per rank: the ranks' expert bytes are the unsharded ones, split
                assert split == pytest.approx(one["experts"], rel=1e-12), (tp, ep)
            else:  # intermediate parts: each shard's own FP8 block-scale grid adds a partial edge block or two
                assert one["experts"] <= split <= one["experts"] * 1.002, (tp, ep, split / one["experts"])
            # the kv heads (2 in the tiny preset, 8 in the real ones) split over the ranks
            kv_heads = min(tp, cfg.num_key_value_heads)
            assert sum(f["kv"] for f in ranks) == pytest.approx(one["kv"] * tp / kv_heads, rel=1e-12)
            for f in ranks:  # replicated
                assert (f["lm_head"], f["embedding"], f["router_norms"]) == \
                    (one["lm_head"], one["embedding"], one["router_norms"])
                assert f["attention"] < one["attention"] and f["total"] == pytest.approx(sum(
                    v for k, v in f.items() if k != "total"))
            # vocab-parallel: each rank reads its slice of the lm_head, the embedding rows split too
            vp = [floor_bytes_rank(cfg, Parallel(rank=r, tp=tp, ep=ep, vocab_parallel=True), batch, context)
                  for r in range(tp)]
            for key in ("lm_head", "embedding"):
                assert sum(f[key] for f in vp) == pytest.approx(one[key], rel=1e-12), (tp, ep, key)
            for f, g in zip(vp, ranks, strict=True):
                assert f["total"] < g["total"] and (f["experts"], f["kv"]) == (g["experts"], g["kv"])


# ------------------------------------------------------------------------------------------------
# One sharded decode step == the unsharded one on the same weights (rank processes over gloo)


def _tensor(model: GptOss, name: str) -> torch.Tensor:
    mod, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(mod), attr)


def shard_of(whole: GptOss, par: Parallel) -> GptOss:
    """Rank ``par`` of ``whole``'s weights, sliced by the shard plan (checkpoint/plan.py
    ``rank_slice``). ``random_model`` gives every FP8 tensor one block scale throughout, so each
    shard's own scale grid holds that value and its blocks dequantize to the unsharded values."""
    model = GptOss(whole.cfg, par, attn_fp8=True)
    tensors = {}
    for name, (shape, dtype) in model.expected().items():
        t = _tensor(whole, name)
        if name.endswith("_scale_inv"):
            assert torch.all(t == t.flatten()[0]), name
            tensors[name] = torch.full(shape, t.flatten()[0].item(), dtype=dtype)
        else:
            tensors[name] = t[rank_slice(name, tuple(t.shape), whole.cfg, par).index()].contiguous()
    model.load_tensors(tensors, "sliced from the unsharded model")
    return model


ALIGNED = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
               num_local_experts=4, num_experts_per_tok=2)  # every shard boundary along K a multiple of 128
BATCH, CONTEXT, STEPS = 3, 11, 2  # 11 tokens in the tiny preset's 8-row ring: wrapped


def _decode_ranks(rank: int, tp: int, ep: int, vocab: bool, port: int, out: str) -> None:
    """One rank: the sharded model sliced from the unsharded one and the matching slice of one
    cache (its kv heads), ``STEPS`` decode steps; rank 0 gathers every rank's logits and saves them
    beside the unsharded model's."""
    import torch.distributed as dist

    torch.set_num_threads(2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        par = Parallel(rank=rank, tp=tp, ep=ep, vocab_parallel=vocab)
        got = {}
        # the reference ops (bf16 activations) at the tiny preset's unaligned shards; the bench's
        # CPU backend (w8a8) where the shards align to 128, so its activation groups are the same
        for case, cfg, ops in (("weights", preset_config("tiny"), ReferenceOps()),
                               ("w8a8", preset_config("tiny", **ALIGNED), W8A8CpuOps())):
            whole = random_model(cfg, "cpu", 5)
            model = shard_of(whole, par)
            full = whole.new_cache(CONTEXT + STEPS, batch=BATCH)
            gen = torch.Generator().manual_seed(9)
            for t in (*full.k, *full.v):
                t.normal_(generator=gen)
            cache = model.new_cache(CONTEXT + STEPS, batch=BATCH)
            sl = rank_slice("model.layers.0.self_attn.k_proj.weight", (cfg.num_key_value_heads * cfg.head_dim,
                                                                       cfg.hidden_size), cfg, par)
            (_, a, b), = sl.ranges
            for mine, theirs in zip((*cache.k, *cache.v), (*full.k, *full.v), strict=True):
                mine.copy_(theirs[:, :, a // cfg.head_dim:b // cfg.head_dim])  # [B, rows, kv heads, D]
            set_context(full, CONTEXT)
            set_context(cache, CONTEXT)
            tokens = torch.randint(0, cfg.vocab_size, (STEPS, BATCH), generator=torch.Generator().manual_seed(4))
            dist.broadcast(tokens, 0)
            steps = torch.stack([model.decode(cache, tokens[s], ops).float() for s in range(STEPS)])
            every = [torch.empty_like(steps) for _ in range(tp)]
            dist.all_gather(every, steps)
            if rank == 0:
                want = torch.stack([whole.decode(full, tokens[s], ops).float() for s in range(STEPS)])
                got[case] = (want, torch.stack(every))
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


# (2, 2, False) under -m slow: tp 2 and ep 2 / vocab-parallel on and off are in the other two
@pytest.mark.parametrize("tp,ep,vocab", [(2, 1, False), pytest.param(2, 2, False, marks=pytest.mark.slow), (2, 2, True)])
def test_sharded_decode_step_equals_unsharded(tp, ep, vocab, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "logits.pt"
    mp.spawn(_decode_ranks, args=(tp, ep, vocab, free_port(), str(out)), nprocs=tp, join=True)
    got = torch.load(out)
    for case, (want, ranks) in got.items():  # want [STEPS, B, V], ranks [tp, STEPS, B, V]
        assert ranks.shape == (tp, *want.shape) and torch.isfinite(want).all()
        for r in range(1, tp):  # replicated logits: the same sums on every rank
            assert torch.equal(ranks[r], ranks[0]), (case, r)
        # fp32 partial sums over the ranks, rounded once: the unsharded logits up to summation
        # order (measured: bit-equal, both cases and layouts, |logits| <= 3.9); allowed ~2 bf16
        # ulps of the largest logit. A rank given another rank's kv heads: max |diff| 2.7 .. 3.7.
        err = (ranks[0] - want).abs().max().item()
        assert err <= 2 ** -6 * want.abs().max().item(), (case, err)
        assert torch.equal(ranks[0].argmax(-1), want.argmax(-1)), case


# ------------------------------------------------------------------------------------------------
# torchrun, and bad input


def test_under_torchrun(tmp_path):
    script = tmp_path / "bench.py"
    # each rank's count of returned rows in a file of its own (two processes printing at once interleave)
    script.write_text("import os, sys\nfrom gptoss_fp8.bench.decode_sharded import bench_decode_sharded\n"
                      "rows = bench_decode_sharded('tiny', [2], [12], 2, 2, runs=2, warmup=1, device='cpu')\n"
                      "open(os.path.join(sys.argv[1], 'rows' + os.environ['RANK']), 'w').write(str(len(rows)))\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="2")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout.splitlines()
    # rank 0 prints the header and the row as it goes and returns the row; rank 1 returns none
    assert sum(line.startswith("# tiny tp 2 ep 2 (gloo)") for line in out) == 1, res.stdout
    assert sum(line.startswith("tiny L2 tp 2 ep 2 b=2 ctx=12 (gloo, eager):") for line in out) == 1, res.stdout
    assert [(tmp_path / f"rows{r}").read_text() for r in (0, 1)] == ["1", "0"]


def test_bad_input_is_one_clear_error(monkeypatch):
    with pytest.raises(GptOssFp8Error, match="--tp 3 --ep 1"):
        bench_decode_sharded("tiny", [1], [16], 3, 1, device="cpu")
    with pytest.raises(GptOssFp8Error, match="ep must divide tp"):
        bench_decode_sharded("tiny", [1], [16], 2, 4, device="cpu")
    with pytest.raises(GptOssFp8Error, match="--batch"):
        bench_decode_sharded("tiny", [0], [16], 2, 2, device="cpu")
    with pytest.raises(GptOssFp8Error, match="--context"):
        bench_decode_sharded("tiny", [1], [], 2, 2, device="cpu")
    if not HAS_CUDA:
        with pytest.raises(GptOssFp8Error, match="no CUDA GPU"):
            bench_decode_sharded("tiny", [1], [16], 2, 2, device="cuda")
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun --nproc-per-node 4 sets it
    with pytest.raises(GptOssFp8Error, match="--tp 2 under torchrun with WORLD_SIZE 4"):
        bench_decode_sharded("tiny", [1], [16], 2, 2, device="cpu")


@pytest.mark.gpu
def test_sharded_decode_bench_on_the_gpu_kernels():
    """Two ranks on the triton kernels: NCCL and CUDA-graph replay with a GPU each; gloo through
    host memory and eager steps when they share one (the row then says it is not a measurement)."""
    rows = bench_decode_sharded("tiny", [1, 4], [64], 2, 2, runs=3, warmup=1, device="cuda", echo=lambda s: None)
    shared = torch.cuda.device_count() < 2
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["shared_gpu"] == shared and r["collective"] == ("gloo" if shared else "nccl")
        assert r["graph"] == r["measurement"] == (not shared)
        assert r["ms_per_step"] > 0 and r["slowest_rank_ms_per_step"] >= r["ms_per_step"]
        assert r["parts_s"]["allreduce"] > 0 and r["parts_s"]["moe"] > 0 and r["peak_mem_bytes"] > 0


def test_cli_layout_options():
    """bench decode / bench prefill take --tp / --ep / --vocab-parallel; vocab-parallel needs tp > 1, and
    --distinct-layers one GPU (both checked before the GPU check, so also here)."""
    from typer.testing import CliRunner

    from gptoss_fp8.cli.main import app

    for cmd in ("decode", "prefill"):
        res = CliRunner().invoke(app, ["bench", cmd, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0 and all(o in res.output for o in ("--tp", "--ep", "--vocab-parallel")), cmd
        res = CliRunner().invoke(app, ["bench", cmd, "--vocab-parallel"])
        assert res.exit_code != 0 and "give --tp 2 or more" in res.output, (cmd, res.output)
        assert "--distinct-layers" in CliRunner().invoke(app, ["bench", cmd, "--help"], env={"COLUMNS": "200"}).output
        res = CliRunner().invoke(app, ["bench", cmd, "--tp", "2", "--distinct-layers", "4"])
        assert res.exit_code != 0 and "--distinct-layers is for one GPU" in res.output, (cmd, res.output)
