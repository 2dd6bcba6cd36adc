"""Programmatic dependent launch (kernels/pdl.py): the launch decision, and the device-side contract
of every decode kernel compiled with PDL for sm_90 (Triton's compiler and ptxas, no GPU needed):
``griddepcontrol.wait`` comes before every global store and atomic, ``launch_dependents`` follows
it, and the weight prefetches (where a kernel has them) come before the wait. The GPU tests of the
decode path (tests/test_decode.py, tests/test_verify_decode.py) run with the default config; the
bit-for-bit comparison of a decode step with and without PDL is ``test_decode_step_pdl_bitwise_gpu``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from gptoss_fp8.kernels.config import KernelConfig
from gptoss_fp8.kernels.pdl import launch_kwargs, pdl_launch


def test_pdl_launch_decision(monkeypatch):
    on = replace(KernelConfig(), pdl_max_rows=64)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl_launch(on, 1, cuda) and pdl_launch(on, 64, cuda)
    assert not pdl_launch(on, 65, cuda)
    assert not pdl_launch(on, 1, cpu)
    assert not pdl_launch(replace(on, pdl_max_rows=None), 1, cuda)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_launch(on, 1, cuda)  # the interpreter has no such launch
    assert launch_kwargs(True) == {"launch_pdl": True} and launch_kwargs(False) == {}


_COMPILE = r"""
import json, re, sys
from gptoss_fp8.kernels import _gluon, act_quant, attention_decode, fp8_gemv, moe_gemv, norm, rope, router

BF, F32, I32, F8 = "*bf16", "*fp32", "*i32", "*fp8e4nv"
SPECS = {
    "norm": (norm._rms_norm_kernel, dict(x_ptr=BF, d_ptr=BF, w_ptr=F32, xo_ptr=BF, y_ptr=BF, q_ptr=F8, s_ptr=F32,
             cw_ptr=BF, eps="fp32"), dict(HAS_DELTA=True, BLOCK_M=1, BLOCK_H=4096, QUANT=True, GROUP=128,
             FP8_MAX_C=448.0, EPS=1e-10, TOP_K=4)),
    "act_quant": (act_quant._act_quant_kernel, dict(x_ptr=BF, q_ptr=F8, s_ptr=F32),
                  dict(BLOCK_M=16, GROUP=128, FP8_MAX_C=448.0, EPS=1e-10)),
    "rope_append": (rope._rope_append_kernel, dict(Q=BF, K=BF, V=BF, QOut=BF, KC=BF, VC=BF, Pos=I32, Slot=I32,
                    Cos=F32, Sin=F32), dict(HALF=32, BLOCK_H=32)),
    "router": (router._router_split_kernel, dict(x_ptr=BF, w_ptr=BF, b_ptr=BF, logits_ptr=BF, ids_ptr=I32,
               wts_ptr=BF, part_ptr=F32, counter_ptr=I32), dict(HAS_BIAS=True, TOP_K=4, KP=4, BLOCK_T=16, BLOCK_E=32,
               BLOCK_K=64, UPCAST=False, EVEN_K=True, CHUNK=192, NUM_SPLITS=15, PF_LINES=4)),
    "fp8_gemv": (fp8_gemv._fp8_gemv_kernel, dict(x_ptr=F8, xs_ptr=F32, w_src=F8, ws_ptr=F32, bias_ptr=BF,
                 out_ptr=BF, part_ptr=F32, counter_ptr=I32), dict(HAS_BIAS=True, TMA=False, BLOCK_M=16, BLOCK_N=64,
                 BLOCK_K=128, SPLIT_K=4, RED_CHUNK=1024, PF_STEPS=16)),
    "moe_gate_up": (moe_gemv._skinny_gate_up_kernel, dict(x_ptr=F8, xs_ptr=F32, ids_ptr=I32, w_ptr=F8, ws_ptr=F32,
                    b_ptr=BF, inter_ptr=F32, act_ptr=F8, acts_ptr=F32, counter_ptr=I32, limit="fp32"),
                    dict(TOP_K=4, K_PAD=4, ROWS=1, MMA_M=16, BLOCK_N=32, BLOCK_K=128, NUM_STAGES=4, ALPHA=1.702,
                         FP8_MAX_C=448.0, EPS=1e-10, K_STEP=2)),
    "moe_down": (moe_gemv._skinny_down_kernel, dict(act_ptr=F8, acts_ptr=F32, ids_ptr=I32, w_ptr=F8, ws_ptr=F32,
                 b_ptr=BF, out_ptr=BF), dict(TOP_K=4, K_PAD=4, MMA_M=16, BLOCK_N=32, BLOCK_K=128, NUM_STAGES=4,
                 ZERO_FOREIGN=True, K_STEP=1)),
    "attention_decode": (attention_decode._attn_decode_kernel, dict(Q=BF, Kc=BF, Vc=BF, Sinks=BF, KvLens=I32, Out=BF,
                         Part=F32, PartM=F32, PartL=F32, Counter=I32, qk_scale="fp32"),
                         dict(NUM_M=1, GROUP=8, HEAD_DIM=64, BLOCK_M=16, BLOCK_N=128, SPLIT=True, FUSED_MERGE=True,
                              MERGE_CHUNK=2, UPCAST=False)),
    "attention_merge": (attention_decode._attn_merge_kernel, dict(Part=F32, PartM=F32, PartL=F32, Out=BF),
                        dict(HEAD_DIM=64, BLOCK_R=2, MERGE_CHUNK=16)),
}
res = {}
for name, (fn, ptrs, consts) in SPECS.items():
    # (as a launch specializes it: the constexprs left out at their defaults, ``_gluon._as_launched``)
    ptx = _gluon.triton_ptx_for_sm90(fn, ptrs, {**consts, "PDL": True}, num_warps=4)
    first = lambda pat: min([m.start() for m in re.finditer(pat, ptx)], default=-1)
    res[name] = dict(wait=first(r"griddepcontrol\.wait"), launch=first(r"griddepcontrol\.launch_dependents"),
                     store=first(r"\bst\.global|\batom\.|\bred\.|cp\.async\.bulk\.global"),
                     prefetch=first(r"prefetch\.global\.L2"),
                     cp_async=first(r"cp\.async\.c[ag]\.shared\.global"), waits=len(re.findall(r"griddepcontrol\.wait", ptx)))
print(json.dumps(res))
"""


def test_decode_kernels_wait_before_any_store_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(res) == {"norm", "act_quant", "rope_append", "router", "fp8_gemv", "moe_gate_up", "moe_down",
                        "attention_decode", "attention_merge"}
    for name, k in res.items():
        assert k["waits"] == 1 and k["wait"] >= 0, (name, k)
        assert k["wait"] < k["launch"], (name, k)
        assert k["store"] > k["wait"], (name, k)  # nothing written before the predecessor is done
        assert k["cp_async"] == -1 or k["cp_async"] > k["wait"], (name, k)  # the pipelined loops start after it
    for name in ("router", "fp8_gemv"):  # the weights' prefetch streams before the wait
        assert 0 <= res[name]["prefetch"] < res[name]["wait"], (name, res[name])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 5])
def test_decode_step_pdl_bitwise_gpu(batch):
    """A decode step of the 20b's first two layers (a full and a sliding layer; a cache past the
    window, so the ring has wrapped) gives the same logits bit for bit with every decode kernel
    launched with PDL as without, eagerly and as a replayed CUDA graph (programmatic edges)."""
    from gptoss_fp8.bench.decode import set_context, synthetic_cache
    from gptoss_fp8.bench.prefill import random_model
    from gptoss_fp8.config import preset_config
    from gptoss_fp8.model.graph import DecodeGraphs
    from gptoss_fp8.model.triton_ops import TritonOps

    cfg = preset_config("20b", 2)
    model = random_model(cfg, "cuda", seed=3)
    context = 700
    cache = synthetic_cache(model, batch, context, context + 1, seed=4)
    tokens = torch.randint(0, cfg.vocab_size, (batch,), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    out = {}
    for pdl in (None, 64):
        ops = TritonOps(config=replace(KernelConfig(), pdl_max_rows=pdl))
        set_context(cache, context)
        eager = model.decode(cache, tokens, ops).clone()
        graphs = DecodeGraphs(model, ops)
        for _ in range(3):  # replays after the capture: the counters are left zeroed every time
            set_context(cache, context)
            graphed = graphs.step(cache, tokens).clone()
        out[pdl] = (eager, graphed)
    assert torch.isfinite(out[None][0].float()).all()
    for a, b in zip(out[None], out[64], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(out[64][0], out[64][1])
