"""bench prefill's breakdown on CPU (gptoss_fp8/bench/prefill.py ``TimedOps``, ``format_row``): the figures of a
CPU run mean nothing; what is checked is which calls land in which part."""

import pytest
import torch

from gptoss_fp8.bench.prefill import TimedOps, format_row, last_layer_rows, part_flops, prefill_logits, random_model
from gptoss_fp8.config import preset_config
from gptoss_fp8.model.backends import get_ops


@pytest.mark.parametrize("full_last_layer", [False, True])
def test_prefill_breakdown_splits_attention_by_layer_kind(full_last_layer):
    """bench prefill's breakdown (TimedOps) times every prefill attention call and splits the part by layer
    kind: one call a layer, the sliding-window ones apart, the pruned last layer's one query apart
    (``last_layer_rows``; every row with ``--full-last-layer``), adding up to the attention part."""
    cfg = preset_config("tiny", 4)
    model = random_model(cfg, "cpu", 3)
    assert last_layer_rows(model, full_last_layer, True) == ("every row" if full_last_layer else "last row")
    timed = TimedOps(get_ops("weights"), cfg.num_local_experts, cuda=False)
    prefill_logits(model, torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(5)), timed)
    kinds = timed.attention_by_layer_kind()
    n_window = sum(lt == "sliding_attention" for lt in cfg.layer_types)
    assert 0 < n_window < cfg.num_hidden_layers and cfg.layer_types[-1] == "full_attention"
    n_full = cfg.num_hidden_layers - n_window - (not full_last_layer)
    assert (kinds["window"]["calls"], kinds["full"]["calls"]) == (n_window, n_full)
    assert kinds.get("last row", {"calls": 0})["calls"] == (not full_last_layer)
    assert sum(d["s"] for d in kinds.values()) == pytest.approx(timed.seconds()["attention"])
    flops, pruned = part_flops(cfg, 40), part_flops(cfg, 40, True)
    assert pruned["attention"] == flops["attention"] - 4 * (40 * 41 / 2 - 40) * cfg.num_attention_heads * cfg.head_dim
    assert pruned["moe"] == pytest.approx(flops["moe"] * (1 - 39 / 40 / cfg.num_hidden_layers))
    parts = timed.seconds()
    row = {"model": "tiny", "tokens": 40, "layers": cfg.num_hidden_layers, "full_layers": cfg.num_hidden_layers,
           "latency_s": 1.0, "est_full_s": 1.0, "usd_per_1m_tokens": 0.0, "seed_s": None, "transformers_issue_s": None,
           "target_s": None, "floor_s": 0.5, "peak_mem_gib": 0.0, "parts_s": parts, "parts_total_s": sum(parts.values()),
           "parts_tflops": {}, "parts_floor_s": {}, "attention_by_kind": kinds}
    line = format_row(row)
    assert f"window {kinds['window']['s'] * 1e3:.2f} ms / {n_window} = " in line and "attention by layer: full " in line
    assert ("last row " in line) == (not full_last_layer)


def test_cut_model_estimate_takes_off_the_pruned_last_layer():
    """``bench prefill --layers N`` runs a cut model's every layer on every row, while the whole model prunes its last
    layer: the full-depth estimate takes off one attention call of the last layer's kind, one layer's MoE, o_proj's
    share of its dense GEMMs and half its norms (``pruned_layer_saving``; the 120b cut to 14 layers on an H100, 47th
    session: 4.837 s scaled, ~4.61 s less the saving). The row says so."""
    import dataclasses

    from gptoss_fp8.bench.prefill import full_depth_estimate, pruned_layer_saving

    cfg = preset_config("120b")
    assert cfg.layer_types[-1] == "full_attention"
    parts = {"attention": 1.3545, "moe": 0.3847, "dense": 0.0977, "norm": 0.0292, "other": 0.0033}
    kinds = {"full": {"s": 1.3395, "calls": 7}, "window": {"s": 0.0150, "calls": 7}}
    rest = 0.3847 / 14 + 64 / (2 * 64 + 2 * 8) * 0.0977 / 14 + 0.5 * 0.0292 / 14
    got = pruned_layer_saving(cfg, parts, kinds, 14)
    assert got == pytest.approx(1.3395 / 7 + rest)
    windowed = dataclasses.replace(cfg, layer_types=cfg.layer_types[:-1] + ("sliding_attention",))
    assert pruned_layer_saving(windowed, parts, kinds, 14) == pytest.approx(0.0150 / 7 + rest)
    lat, total = 1.8811, sum(parts.values())
    est, saving = full_depth_estimate(lat, total, parts, kinds, 14, cfg, False)
    assert saving == pytest.approx(got * lat / total) and est == pytest.approx(lat * 36 / 14 - saving)
    assert 4.60 < est < 4.62  # (against 4.837 scaled linearly)
    # --full-last-layer: the whole model keeps every row too; an uncut model is its own figure
    assert full_depth_estimate(lat, total, parts, kinds, 14, cfg, True) == (pytest.approx(lat * 36 / 14), 0.0)
    assert full_depth_estimate(lat, total, parts, kinds, 36, cfg, False) == (lat, 0.0)
    row = {"model": "120b", "tokens": 128000, "layers": 14, "full_layers": 36, "latency_s": lat, "est_full_s": est,
           "est_pruned_saving_s": got * lat / total, "usd_per_1m_tokens": 0.0, "seed_s": 23.9,
           "transformers_issue_s": None, "target_s": None, "floor_s": 1.0, "peak_mem_gib": 0.0, "parts_s": parts,
           "parts_total_s": total, "parts_tflops": {}, "parts_floor_s": {}, "attention_by_kind": kinds}
    assert f"full-model est {est:.4f} s (less the pruned last layer's {got * lat / total:.3f} s)" in format_row(row)
    # bench prefill --tp / --ep's rows take it off the same way and say so
    from gptoss_fp8.bench.prefill_sharded import format_sharded_row

    srow = {"model": "120b", "tp": 2, "ep": 2, "collective": "nccl", "tokens": 128000, "layers": 14, "full_layers": 36,
            "latency_s": lat, "slowest_rank_median_s": lat, "est_full_s": est, "est_pruned_saving_s": saving,
            "usd_per_1m_tokens": 0.0, "gpus": 2, "seed_s": None, "vs_seed": None, "target_s": None, "shared_gpu": False,
            "parts_s": parts, "parts_total_s": total}
    assert f"full-model est {est:.4f} s (less the pruned last layer's {saving:.3f} s)" in format_sharded_row(srow)


def test_repeated_layers_hold_their_sources_tensors_and_compute_as_copies():
    """``random_model(distinct_layers=N)`` (``bench prefill / decode --distinct-layers``): layer i >= N holds layer
    i mod N's tensors themselves (no bytes of its own, as ``weight_bytes`` counts them), and the model computes
    exactly as one whose layers hold copies of them; every layer still runs. N out of range is one clear error."""
    from gptoss_fp8.bench.prefill import check_distinct_layers, repeated_layer, weight_bytes
    from gptoss_fp8.errors import GptOssFp8Error

    cfg = preset_config("tiny", 5)
    rep = random_model(cfg, "cpu", 3, distinct_layers=2)
    layers = rep.model.layers
    for i in range(2, cfg.num_hidden_layers):
        src = dict(layers[i % 2].named_buffers())
        assert all(t is src[name] for name, t in layers[i].named_buffers()), i
    assert layers[0].mlp.experts.gate_up_proj is not layers[1].mlp.experts.gate_up_proj
    assert repeated_layer("model.layers.4.mlp.router.weight", 2) == "model.layers.0.mlp.router.weight"
    assert repeated_layer("model.layers.1.mlp.router.weight", 2) is None
    assert repeated_layer("model.embed_tokens.weight", 2) is None and repeated_layer("model.layers.4.x", None) is None
    unique = {t.data_ptr(): t.numel() * t.element_size() for _, t in rep.named_buffers()}
    assert weight_bytes(cfg, distinct_layers=2) == sum(unique.values()) < weight_bytes(cfg)
    # the same model with copies: its first two layers are the same seeded tensors; the rest, its own random ones
    # until they are replaced by clones of the repeated model's
    full = random_model(cfg, "cpu", 3)
    w = "mlp.experts.gate_up_proj"
    same = [torch.equal(full.model.layers[i].get_buffer(w).float(), layers[i].get_buffer(w).float()) for i in range(5)]
    assert same == [True, True, False, False, False]
    for i in range(cfg.num_hidden_layers):
        for name, t in layers[i].named_buffers():
            mod_name, _, attr = name.rpartition(".")
            setattr(full.model.layers[i].get_submodule(mod_name), attr, t.clone())
    tokens = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(6))
    timed = TimedOps(get_ops("weights"), cfg.num_local_experts, cuda=False)
    got = prefill_logits(rep, tokens, timed)
    assert torch.equal(got, prefill_logits(full, tokens, get_ops("weights")))
    assert sum(d["calls"] for d in timed.attention_by_layer_kind().values()) == cfg.num_hidden_layers
    assert check_distinct_layers(None, cfg) is None and check_distinct_layers(5, cfg) is None
    assert check_distinct_layers(3, cfg) == 3
    for bad in (0, 6):
        with pytest.raises(GptOssFp8Error, match=f"--distinct-layers {bad}: the model has 5 layers; pass 1 to 5"):
            check_distinct_layers(bad, cfg)
