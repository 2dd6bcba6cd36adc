"""Does the FP8 attention kernel's time depend on its inputs' values (through the power cap)? Issue 34.

Run on the GPU machine from the repository root (optionally under benchmarks/clock_watch.py):
    PYTHONPATH=$PWD python3 benchmarks/attn_datadep.py
Times ws_attention_prefill_fp8 (quantization included) at 128000 tokens, 64 q / 8 kv heads, on six input
sets drawn from one randn projection output (Q / K scaled, V scaled, half of Q / K zeroed), three passes
interleaved; prints ms per launch of each pass. The H200's answer (2026-12-04): 210.3-213.6 ms over all six.
"""
import torch

from gptoss_fp8.kernels.attention_ws_fp8 import ws_attention_prefill_fp8

T, HQ, HKV, D = 128000, 64, 8, 64


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(T, (HQ + 2 * HKV) * D, device="cuda", generator=g)
    sinks = torch.rand(HQ, device="cuda", generator=g) * 20 - 10
    out = torch.empty(T, HQ, D, device="cuda", dtype=torch.bfloat16)
    qk = (HQ + HKV) * D  # Q's and K's columns of the projection output

    def make(scale_qk, scale_v=1.0, zero_frac=0.0):
        f = base.clone()
        f[:, :qk] *= scale_qk
        f[:, qk:] *= scale_v
        if zero_frac:
            f[:, :qk] *= torch.rand(T, qk, device="cuda", generator=g) > zero_frac
        return [t.view(T, -1, D) for t in f.bfloat16().split([HQ * D, HKV * D, HKV * D], dim=1)]

    cases = {"randn": make(1.0), "qk x0.25": make(0.25), "qk x3": make(3.0), "qk x6 (sharp)": make(6.0),
             "v x0.01": make(1.0, 0.01), "qk half zeros": make(1.0, 1.0, 0.5)}

    def run(c):
        ws_attention_prefill_fp8(*c, sinks, out, D ** -0.5)

    for c in cases.values():
        run(c)
    torch.cuda.synchronize()
    res = {n: [] for n in cases}
    for _ in range(3):
        for n, c in cases.items():
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record()
            run(c)
            run(c)
            e1.record()
            torch.cuda.synchronize()
            res[n].append(e0.elapsed_time(e1) / 2)
    for n, v in res.items():
        print(f"{n:16s} " + " / ".join(f"{x:.1f}" for x in v) + " ms")


if __name__ == "__main__":
    main()
