"""bench prefill --tp / --ep (bench/prefill_sharded.py): the mechanics on CPU, ranks as processes over gloo.

The figures of a CPU run mean nothing; what is checked: every rank runs the sharded forward behind a
barrier, rank 0's rows come back with the all-reduces as their own part, $ per 1M tokens counts every
GPU, the seed's rows are looked up by layout, and the random weights are those of a real layout
(tensors held whole are equal on every rank, shards differ)."""

import pytest
import torch

from gptoss_fp8.bench.prefill import random_model, usd_per_million_tokens
from gptoss_fp8.bench.prefill_sharded import SEED_SHARDED_S, bench_sharded, format_sharded_row
from gptoss_fp8.config import preset_config
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.parallel import Parallel


# (2, 2, False) under -m slow: tp 2 and ep 2 / vocab-parallel on and off are in the other two
@pytest.mark.parametrize("tp,ep,vocab", [(2, 1, False), pytest.param(2, 2, False, marks=pytest.mark.slow), (2, 2, True)])
def test_sharded_bench_runs_every_rank_and_times_the_all_reduces(tp, ep, vocab):
    lines = []
    rows = bench_sharded("tiny", [24, 40], tp, ep, runs=2, warmup=1, device="cpu", echo=lines.append,
                         vocab_parallel=vocab)
    assert [r["tokens"] for r in rows] == [24, 40] and len(lines) == 2
    cfg = preset_config("tiny")
    for r in rows:
        assert (r["tp"], r["ep"], r["gpus"], r["collective"], r["vocab_parallel"]) == (tp, ep, tp, "gloo", vocab)
        # the logits' vocabulary slices gathered (vocab-parallel) are a part of their own
        assert ("allgather" in r["parts_s"]) == vocab and ("vocab-parallel" in format_sharded_row(r)) == vocab
        assert r["layers"] == r["full_layers"] == cfg.num_hidden_layers
        assert r["latency_s"] > 0 and r["slowest_rank_median_s"] >= r["latency_s"] * 0.5
        assert r["parts_s"]["allreduce"] > 0 and r["parts_s"]["moe"] > 0 and r["parts_s"]["attention"] > 0
        assert r["usd_per_1m_tokens"] == pytest.approx(tp * usd_per_million_tokens(r["est_full_s"], r["tokens"]))
        assert r["seed_s"] is None and "allreduce" in format_sharded_row(r)


def test_random_weights_are_a_real_layout():
    cfg = preset_config("tiny")
    r0, r1 = (random_model(cfg, "cpu", 3, Parallel(rank=r, tp=2, ep=2)) for r in (0, 1))
    t0 = {n: getattr(r0.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in r0.expected()}
    t1 = {n: getattr(r1.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in r1.expected()}
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.router.weight"):
        assert torch.equal(t0[name], t1[name]), name
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"):
        assert t0[name].shape == t1[name].shape and not torch.equal(t0[name].float(), t1[name].float()), name


def test_seed_rows_and_bad_layouts():
    assert SEED_SHARDED_S["20b"][(2, 2)][8192] == 0.127 and SEED_SHARDED_S["120b"][(8, 8)][128000] == 5.119
    with pytest.raises(GptOssFp8Error, match="--tp 3 --ep 1"):
        bench_sharded("tiny", [16], 3, 1, device="cpu")
    with pytest.raises(GptOssFp8Error, match="ep must divide tp"):
        bench_sharded("tiny", [16], 2, 4, device="cpu")


@pytest.mark.gpu
def test_sharded_bench_on_the_gpu_kernels():
    """Two ranks on the triton kernels (NCCL with a GPU each; gloo through host memory when they share one)."""
    rows = bench_sharded("tiny", [64], 2, 2, runs=2, warmup=1, device="cuda", echo=lambda s: None)
    (r,) = rows
    assert r["shared_gpu"] == (torch.cuda.device_count() < 2)
    assert r["collective"] == ("gloo" if r["shared_gpu"] else "nccl")
    assert r["latency_s"] > 0 and r["parts_s"]["allreduce"] > 0 and r["parts_s"]["moe"] > 0


def test_cuda_graph_over_gloo_is_a_note_not_a_figure():
    """--cuda-graph with --tp: captured on every rank over NCCL only; over gloo (CPU, ranks sharing
    a GPU) the row says why not instead of a figure."""
    rows = bench_sharded("tiny", [16], 2, 2, runs=1, warmup=1, device="cpu", echo=lambda _: None, cuda_graph=True)
    (r,) = rows
    assert "graph_latency_s" not in r and "gloo" in r["graph_note"] and "cannot capture" in r["graph_note"]
    assert "CUDA graph not run" in format_sharded_row(r)

