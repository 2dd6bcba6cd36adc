"""FlashInfer's sink prefill beside ours (issue 34): one causal sequence of T tokens, 64 query /
8 KV heads, head_dim 64, bf16, per-head sinks, one process, an sm_90 GPU.

FlashInfer 0.7.2's sink prefill on Hopper: ``BatchPrefillWithRaggedKVCacheWrapper`` with ``jit_args``
naming its ``AttentionSink`` variant (jit/attention/variants.py; as its paged
``BatchAttentionWithAttentionSinkWrapper`` does), backend "fa3" (SM90) or "fa2", planned for
qo_indptr = kv_indptr = [0, T], causal, then ``run(q, k, v, sinks, sm_scale)``. The variant adds
exp(sink[h] - m) to each row's denominator (natural-log sink, not scaled by sm_scale): the extra
softmax column of ``spec.attention``, the same function as ours. Each is checked against
``spec.attention`` in fp32 on 64-row chunks (first, middle, last), then timed with do_bench
(median), passes interleaved; FLOPs = 4 x T(T+1)/2 x 64 x 64 heads. If FlashInfer does not import
or build, one line says why and only ours is timed (exit 0). From the repository root on the GPU
machine, .fi/ (the slim FlashInfer tree; its bin/ has a spare ninja) carried:
    PATH=$PATH:$PWD/.fi/bin PYTHONPATH=$PWD:$PWD/.fi python3 benchmarks/flashinfer_peer.py
        [--tokens 8192,32768] [--backend fa3[,fa2]] [--passes 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from gptoss_fp8 import spec
from gptoss_fp8.kernels.attention import attention_prefill

D, HQ, HKV = 64, 64, 8
SM_SCALE = D ** -0.5
# read at import: FlashInfer's JIT cache in /tmp/.cache/flashinfer; tvm_ffi builds no torch DLPack addon (torch has the API)
os.environ |= {"FLASHINFER_WORKSPACE_BASE": "/tmp", "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1"} | dict(os.environ)


def _inputs(T, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(T, h, D, device="cuda", generator=g).bfloat16() for h in (HQ, HKV, HKV))
    sinks = torch.rand(HQ, device="cuda", generator=g) * 20 - 10  # fp32 in [-10, 10]
    sinks[0], sinks[-1] = -10.0, 10.0
    return q, k, v, sinks


def flashinfer_sink_prefill(backend):
    """(run(q, k, v, sinks) -> out [T, HQ, D], JIT build + load seconds)."""
    import flashinfer
    from flashinfer.jit.attention.variants import attention_sink_decl
    from flashinfer.jit.cpp_ext import get_cuda_path
    if not os.path.exists(os.path.join(get_cuda_path(), "include", "curand_kernel.h")):  # cutlass's tensor_fill.h wants it
        import nvidia  # then the headers of pip's nvidia-curand (cu13), searched after the toolkit's
        inc = [p for d in nvidia.__path__ if os.path.exists(p := os.path.join(d, "cu13", "include", "curand_kernel.h"))]
        os.environ.setdefault("FLASHINFER_EXTRA_CUDAFLAGS", f"-isystem {os.path.dirname(inc[0])}" if inc else "")
    # the module of kernels/flashinfer_attention.py without a window (same name and arguments: one JIT build for both)
    jit_args = [f"gptoss_fp8_sink_bf16_d{D}_swa0_{backend}", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32,
                D, D, ["sink"], ["float"], ["sm_scale"], ["double"], "AttentionSink", attention_sink_decl[backend]]
    jit_kwargs = {"use_sliding_window": False, "paged_kv_stride_mode": "independent" if backend == "fa2" else "runtime"}
    t0 = time.time()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    # builds the module with ninja (JIT cache under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer), loads it
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend, jit_args=jit_args, jit_kwargs=jit_kwargs)
    jit_s = time.time() - t0
    planned = [None]  # the length plan() was last called for

    def run(q, k, v, sinks):
        if planned[0] != q.shape[0]:
            indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32, device="cuda")
            w.plan(indptr, indptr, HQ, HKV, D, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            planned[0] = q.shape[0]
        return w.run(q, k, v, sinks, SM_SCALE)
    return run, jit_s


def _fail(res, key, what, e):  # keep the error in res; print one line: its lines with "error" (nvcc's), else its tail
    text = res["errors"][key] = f"{type(e).__name__}: {e}"[-20000:]
    errs = [ln.strip() for ln in text.splitlines() if "error" in ln.lower()][:3]
    print(f"{key}: {what} ({' | '.join(errs)[:600] if errs else ' '.join(text.split())[-600:]})", flush=True)


def check(out, q, k, v, sinks):
    """(relative error norm, max abs error) of out against spec.attention in fp32, sampled chunks."""
    T, num, den, worst = q.shape[0], 0.0, 0.0, 0.0
    for r0 in sorted({0, (T // 2) // 64 * 64, max(T - 64, 0)}):
        r1 = min(r0 + 64, T)
        ref = spec.attention(q[r0:r1], k[:r1], v[:r1], sinks, SM_SCALE, 0, q_offset=r0, dtype=torch.float32).float()
        diff = out[r0:r1].float() - ref
        num, den = num + diff.square().sum().item(), den + ref.square().sum().item()
        worst = max(worst, diff.abs().max().item())
    return (num / den) ** 0.5, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--backend", default="fa3", help="FlashInfer backend(s): fa3, fa2 or fa3,fa2")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write compile times, errors and timings here")
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    res: dict = {"compile_s": {}, "errors": {}, "timing": {}}
    impls = {"ours": lambda q, k, v, s: attention_prefill(q, k, v, s)}
    for b in args.backend.split(","):
        try:
            q, k, v, sinks = _inputs(256, 0)
            fn, jit_s = flashinfer_sink_prefill(b)
            fn(q, k, v, sinks)
            torch.cuda.synchronize()
            impls[f"flashinfer-{b}"] = fn
            res["compile_s"][f"flashinfer-{b}"] = jit_s
            print(f"flashinfer-{b}: JIT build + load {jit_s:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - a peer that does not import or build is a result too
            _fail(res, f"flashinfer-{b}", "UNAVAILABLE", e)
    for T in [int(t) for t in args.tokens.split(",")]:
        q, k, v, sinks = _inputs(T, 1234 + T)
        flops = 4 * T * (T + 1) // 2 * HQ * D
        row = res["timing"].setdefault(str(T), {})
        for n, fn in list(impls.items()):
            t0 = time.time()
            try:
                out = fn(q, k, v, sinks)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - the peer failing at a length: drop it, time the rest
                if n == "ours":
                    raise
                _fail(res, f"{n} T={T}", "FAILED", e)
                del impls[n]
                continue
            first_s = time.time() - t0
            rel, err = check(out, q, k, v, sinks)
            row[n] = {"ms": [], "first_call_s": first_s, "rel_err": rel, "max_abs_err": err}
            print(f"T={T} {n}: rel err {rel:.2e}, max abs {err:.2e}, first call {first_s:.1f} s", flush=True)
        rep = 300 if T <= 8192 else 600
        for p in range(args.passes):
            for n, fn in impls.items():
                ms = do_bench(lambda fn=fn: fn(q, k, v, sinks), warmup=rep // 3, rep=rep, return_mode="median")
                row[n]["ms"].append(ms)
                print(f"T={T} pass {p} {n}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
        for n in impls:
            row[n]["tflops"] = flops / min(row[n]["ms"]) / 1e9
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    for T, row in res["timing"].items():
        print(f"T={T}: " + ", ".join(f"{n} {min(r['ms']):.3f} ms ({r['tflops']:.0f} TFLOP/s, rel err {r['rel_err']:.1e})"
                                     for n, r in row.items()), flush=True)

if __name__ == "__main__":
    main()
