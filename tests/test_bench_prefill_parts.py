"""bench prefill's breakdown on CPU (gptoss_fp8/bench/prefill.py ``TimedOps``, ``format_row``): the figures of a
CPU run mean nothing; what is checked is which calls land in which part."""

import pytest
import torch

from gptoss_fp8.bench.prefill import TimedOps, format_row, prefill_logits, random_model
from gptoss_fp8.config import preset_config
from gptoss_fp8.model.backends import get_ops


def test_prefill_breakdown_splits_attention_by_layer_kind():
    """bench prefill's breakdown (TimedOps) times every prefill attention call and splits the part by layer
    kind: one call a layer, the sliding-window ones apart, adding up to the attention part."""
    cfg = preset_config("tiny")
    model = random_model(cfg, "cpu", 3)
    timed = TimedOps(get_ops("weights"), cfg.num_local_experts, cuda=False)
    prefill_logits(model, torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(5)), timed)
    kinds = timed.attention_by_layer_kind()
    n_window = sum(lt == "sliding_attention" for lt in cfg.layer_types)
    assert 0 < n_window < cfg.num_hidden_layers
    assert (kinds["window"]["calls"], kinds["full"]["calls"]) == (n_window, cfg.num_hidden_layers - n_window)
    assert sum(d["s"] for d in kinds.values()) == pytest.approx(timed.seconds()["attention"])
    parts = timed.seconds()
    row = {"model": "tiny", "tokens": 40, "layers": cfg.num_hidden_layers, "full_layers": cfg.num_hidden_layers,
           "latency_s": 1.0, "est_full_s": 1.0, "usd_per_1m_tokens": 0.0, "seed_s": None, "transformers_issue_s": None,
           "target_s": None, "floor_s": 0.5, "peak_mem_gib": 0.0, "parts_s": parts, "parts_total_s": sum(parts.values()),
           "parts_tflops": {}, "parts_floor_s": {}, "attention_by_kind": kinds}
    line = format_row(row)
    assert f"window {kinds['window']['s'] * 1e3:.2f} ms / {n_window} = " in line and "attention by layer: full " in line
