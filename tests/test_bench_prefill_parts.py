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
