"""Static SASS counts of the kernels, no GPU needed (issue 34: instructions an exact result does not need).

Compiles for sm_90a with Triton's own compiler and ptxas (``benchmarks/moe_ws_compile_check.py``'s ``sass_of``: ptxas,
then ``cuobjdump -sass``) and counts opcodes:

    python benchmarks/sass_counts.py attention [--opts '{"LMAX": true}']   (fp8-lin's form: '{"FMA": 7, "TURN": 0}')
        the FP8 Gluon attention (kernels/attention_ws_fp8.py, the launcher's default tile plus OPTS): the whole
        kernel's counts, and one consumer warp's 128-key step (consumer 0's loop, its unmasked and masked paths
        followed through the branches; exp_lin 4 / 5, FMA 6 / 7, branch three ways, fast / m raised / exact: the
        "unmasked" path is not their fast one, which "fast step (no rescale)" follows; exp_lin 6, FMA 8: also "dead
        step (PV skipped)")
    python benchmarks/sass_counts.py quant
        the quantizing Triton kernels at the 20b's shapes, as a launch specializes them (whole-kernel totals)

Run from the repository root with the venv active (TRITON_INTERPRET unset: the GPU's code paths). BENCHMARKS.md
("Fewer instructions where the exact result allows") quotes both.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_ws_compile_check import sass_of  # noqa: E402

OPS = ("FFMA", "FMNMX", "MUFU", "F2FP", "PRMT", "SHFL", "QGMMA", "FMUL", "FADD", "BAR", "LDS", "STS")
_OP = re.compile(r"(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)")


def instructions(sass: str) -> list[str]:
    return [line for line in sass.splitlines() if _OP.match(line) and not line.startswith("Function")]


def opcode(line: str) -> str:
    return _OP.match(line).group(2)


def counts(lines: list[str]) -> dict:
    c = collections.Counter(opcode(x) for x in lines)
    return {"instructions": len(lines), **{k: c[k] for k in OPS}, "uniform": sum(v for k, v in c.items()
                                                                                 if k.startswith("U") or k == "R2UR")}


def _target(line: str) -> int | None:
    m = re.search(r"BRA (0x[0-9a-f]+)", line)
    return int(m.group(1), 16) // 16 if m else None  # (16 bytes an instruction)


def _step_loop(ins: list[str]) -> tuple[int, int]:
    """Consumer 0's 128-key step loop: (its first instruction, its back edge), the first backward branch spanning
    > 300 instructions."""
    for i, line in enumerate(ins):
        t = _target(line)
        if t is not None and t < i and i - t > 300:
            return t, i
    raise SystemExit("no step loop found")


def step_paths(ins: list[str]) -> tuple[list[int], list[int]]:
    """Consumer 0's 128-key step loop (``_step_loop``) -> the instruction indices of its two paths: the fall-through
    one (unmasked) and the taken one (masked)."""
    start, back = _step_loop(ins)
    fwd = [(j, _target(ins[j])) for j in range(start, back) if _target(ins[j]) is not None]
    # the branch to the masked path: the first conditional forward branch that lands inside the loop
    split = next((j, t) for j, t in fwd if start < t < back and ins[j].startswith("@"))
    # the unconditional jump over the masked path back to the common tail
    join = next((j, t) for j, t in fwd if j > split[0] and not ins[j].startswith("@") and split[1] <= t <= back)
    head = list(range(start, split[0] + 1))
    tail = list(range(join[1], back + 1))
    return head + list(range(split[0] + 1, join[0] + 1)) + tail, head + list(range(split[1], join[1])) + tail


def walk(ins: list[str], start: int, back: int, taken: list[bool]) -> list[int]:
    """The instruction indices of one pass through the loop [start, back]: from start, each conditional branch within
    the loop taken or not by ``taken`` in turn (then not taken once the list runs out), those out of it (a wait's
    retry) not taken, each unconditional one followed, up to the back edge."""
    path, i, k = [], start, 0
    while i <= back and len(path) <= back - start + 1:
        path.append(i)
        t = _target(ins[i])
        if i == back or t is None:
            i += 1
        elif not ins[i].startswith("@"):
            i = t
        elif not start <= t <= back:  # (out of the loop: a wait's retry; not taken)
            i += 1
        else:
            i = t if k < len(taken) and taken[k] else i + 1
            k += 1
    return path


def fast_step(ins: list[str], dead: bool | None = None) -> list[int]:
    """exp_lin 4 / 5 (FMA 6 / 7): consumer 0's 128-key step down its fast path: past the branch to the masked / exact
    path (not taken), then the branch over the rescale taken (no code passes 126); exp_lin 6 (FMA 8, dead given):
    then its branch to the PV taken (a live step) or not (dead: every code <= 0, the PV skipped)."""
    return walk(ins, *_step_loop(ins), [False, True] + ([] if dead is None else [not dead]))


def attention(opts: dict) -> dict:
    from gptoss_fp8.kernels import _gluon, attention_ws_fp8

    types = attention_ws_fp8.compile_types()
    consts = dict(GROUP=8, STAGES=4, PAIRS=True, ONES=True, TURN=2, REL=2) | opts  # the launcher's default
    k = _gluon.compile_for_sm90(attention_ws_fp8._ws_attention_fp8_kernel, types, consts)
    ins = instructions(sass_of(k["ptx"]))
    unmasked, masked = step_paths(ins)
    fast = {"fast step (no rescale)": counts([ins[i] for i in fast_step(ins)])} if consts.get("FMA") in (6, 7) else {}
    if consts.get("FMA") == 8:
        fast = {"fast step (no rescale)": counts([ins[i] for i in fast_step(ins, dead=False)]),
                "dead step (PV skipped)": counts([ins[i] for i in fast_step(ins, dead=True)])}
    return {"opts": consts, "kernel": counts(ins), "unmasked step": counts([ins[i] for i in unmasked]),
            "masked step": counts([ins[i] for i in masked]), **fast, "spill_stores": k.get("spill_stores")}


def quant() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gptoss_fp8.kernels import _gluon, act_quant, attn_quant, norm

    def total(fn, ptrs, consts, num_warps, div16=()):
        # (as a launch specializes it: the constexprs left out at their defaults)
        sig, consts, attrs = _gluon._as_launched(fn, ptrs, consts, tuple(div16))
        c = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=num_warps))
        return len(instructions(sass_of(c.asm["ptx"])))

    nsig = {"x_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*fp32", "xo_ptr": "*bf16", "y_ptr": "*bf16",
            "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "cw_ptr": "*bf16", "eps": "fp32"}
    ncon = dict(HAS_DELTA=True, BLOCK_M=1, BLOCK_H=4096, QUANT=True, GROUP=128, FP8_MAX_C=448.0, EPS=1e-10, PDL=False)
    qsig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    qcon = dict(BLOCK_T=64, BLOCK_H=2, D=64, FP8_MAX_C=448.0, EPS=1e-10, blk_ptr=None, BLOCKED=False, HEADS_FAST=False)
    return {
        "act_quant (16 rows x 128)": total(act_quant._act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv",
                                           "s_ptr": "*fp32"}, dict(BLOCK_M=16, GROUP=128, FP8_MAX_C=448.0, EPS=1e-10,
                                                                   PDL=False), 4, ("x_ptr", "q_ptr", "stride_xm", "stride_qm")),
        "norm + FP8 rows (one row of 2880)": total(norm._rms_norm_kernel, nsig, ncon | dict(TOP_K=0), 8),
        "norm + FP8 rows, the MoE's combine of 4": total(norm._rms_norm_kernel, nsig, ncon | dict(TOP_K=4), 8),
        "quantize_qk with rope (64 rows x 2 heads)": total(attn_quant._quantize_qk_kernel, qsig, qcon | dict(ROPE=True), 4,
                                                           ("x_ptr", "q_ptr", "stride_xt")),
        "quantize_qk (64 rows x 2 heads)": total(attn_quant._quantize_qk_kernel, qsig, qcon | dict(ROPE=False), 4,
                                                 ("x_ptr", "q_ptr", "stride_xt")),
        "quantize_v (64 keys, key order)": total(attn_quant._quantize_v_kernel, {"v_ptr": "*bf16", "s_ptr": "*fp32",
                                                 "order_ptr": "*i64", "out_ptr": "*fp8e4nv"},
                                                 dict(BLOCK_T=64, KEY_BLOCK=64, D=64, ORDERED=True, FP8_MAX_C=448.0,
                                                      blk_ptr=None, BLOCKED=False), 4, ("v_ptr", "out_ptr", "stride_vt")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("attention", "quant"))
    ap.add_argument("--opts", default="{}", help="attention: constexprs over the launcher's default, JSON")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the counts are of the GPU's code")
    out = attention(json.loads(a.opts)) if a.what == "attention" else quant()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
