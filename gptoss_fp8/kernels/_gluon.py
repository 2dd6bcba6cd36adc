"""Shared pieces of the Gluon (``triton.experimental.gluon``) kernels for Hopper: the imports,
whether a device can run them, the grouped tile order, the block-scaled FP8 main loop of the two
GEMM kernels, and compiling a kernel for sm_90 without a GPU (the CPU tests inspect its PTX).

Gluon is triton's explicit layout / barrier / partition dialect; its Hopper API is that of triton
3.6. Where it is absent (``HAS_GLUON`` False) or the device is not sm_90, the callers keep their
Triton kernels.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import torch

try:  # Gluon's Hopper API as of triton 3.6; absent or renamed elsewhere -> the Triton kernels are used
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401 - re-exported
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 - re-exported

    HAS_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAS_GLUON = False


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def supported(device: torch.device) -> bool:
    """True where the Gluon kernels can run: a CUDA sm_90 device and Gluon's Hopper API importable
    (whether they may is ``KernelConfig.gluon``, kernels/config.py)."""
    if not HAS_GLUON or device.type != "cuda":
        return False
    return _device_ok(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _nvmma_layout(block: tuple[int, ...], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), {torch.float8_e4m3fn: gl.float8e4nv,
                                                              torch.bfloat16: gl.bfloat16}[dtype])


def descriptor(t: torch.Tensor, block: list[int]):
    """TMA descriptor over t (fp8 e4m3 or bf16) in blocks of ``block``, with the default NVMMA
    shared layout for that block. The layout is built once per (block, dtype): building it took
    ~10 us of host time per call (CPU box), three times per GEMM launch."""
    return TensorDescriptor.from_tensor(t, block, _nvmma_layout(tuple(block), t.dtype))


def compile_for_sm90(fn, types: dict[str, str], constexprs: dict, num_warps: int = 4) -> dict:
    """Compile a Gluon kernel for sm_90 with no GPU present (types: argument -> triton type string,
    "i32" for the ones not named). Returns {"ptx", "num_warps", "shared"}. Runs in a child process
    when this one has Triton's interpreter on (there triton's own jit helpers, which Gluon's
    reductions wrap, are interpreter objects that cannot be compiled)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        code = ("import importlib, json, sys; from gptoss_fp8.kernels import _gluon; "
                "fn = getattr(importlib.import_module(sys.argv[1]), sys.argv[2]); "
                "print(json.dumps(_gluon.compile_for_sm90(fn, *map(json.loads, sys.argv[3:5]), int(sys.argv[5]))))")
        args = [fn.fn.__module__, fn.fn.__name__, json.dumps(types), json.dumps(constexprs), str(num_warps)]
        r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compiling {fn.fn.__name__} for sm_90 failed:\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {a: ("constexpr" if a in constexprs else types.get(a, "i32")) for a in fn.arg_names}
    k = triton.compile(GluonASTSource(fn, sig, constexprs, {}), target=GPUTarget("cuda", 90, 128),
                       options=dict(num_warps=num_warps, num_stages=1, maxnreg=None))
    return {"ptx": k.asm["ptx"], "num_warps": k.metadata.num_warps, "shared": k.metadata.shared}


if HAS_GLUON:

    @gluon.jit
    def tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr):
        """Grouped tile order: GROUP_M row tiles sweep the column tiles together (L2 reuse)."""
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        rows_in_group = gl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % rows_in_group, (tile % per_group) // rows_in_group

    @gluon.jit
    def load_stage(a_desc, b_desc, empty, ready, a_bufs, b_bufs, c, a_coord, b_coord):
        """Producer: ring position c (stage c % S, its use c // S) <- the A tile at a_coord and the B
        tile at b_coord, once the stage's readers have released its previous use; returns c + 1."""
        S: gl.constexpr = a_bufs.type.shape[0]
        s = c % S
        mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, a_coord, ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, b_coord, ready.index(s), b_bufs.index(s))
        return c + 1

    @gluon.jit
    def _a_scale(a_s_ptr, rmask, MASK_A: gl.constexpr):
        if MASK_A:
            return gl.load(a_s_ptr, mask=rmask, other=0.0)
        else:
            return gl.load(a_s_ptr)

    @gluon.jit
    def block_scaled_mainloop(ready, empty, a_bufs, b_bufs, A0: gl.constexpr, AR: gl.constexpr, B0: gl.constexpr,
                              BR: gl.constexpr, a_s_ptr, rmask, b_s_ptr, c, n_k, layout: gl.constexpr,
                              MASK_A: gl.constexpr):
        """One consumer warpgroup's block-scaled FP8 product over n_k K blocks of the stage ring:
        A rows A0 .. A0 + AR and B rows B0 .. B0 + BR of each stage, at ring positions c, c + 1, ...
        The wgmma of K block i + 1 is issued before block i's is waited for and scaled into the
        fp32 accumulator by a_s[row, i] * b_s[i] (promotion every 128, the package's numerics);
        each stage is released on ``empty`` once read. a_s_ptr: [AR] row-scale pointers (masked by
        rmask with MASK_A), b_s_ptr: the weight-scale row. Returns (acc [AR, BR], next c)."""
        S: gl.constexpr = a_bufs.type.shape[0]
        zero = gl.zeros((AR, BR), gl.float32, layout)
        acc = gl.zeros((AR, BR), gl.float32, layout)
        scale = _a_scale(a_s_ptr, rmask, MASK_A) * gl.load(b_s_ptr)
        s = c % S
        mbarrier.wait(ready.index(s), (c // S) & 1)
        cur = warpgroup_mma(a_bufs.index(s).slice(A0, AR), b_bufs.index(s).slice(B0, BR).permute((1, 0)), zero,
                            use_acc=False, is_async=True)
        for kk in range(n_k - 1):
            c1 = c + 1
            s1 = c1 % S
            mbarrier.wait(ready.index(s1), (c1 // S) & 1)
            nxt = warpgroup_mma(a_bufs.index(s1).slice(A0, AR), b_bufs.index(s1).slice(B0, BR).permute((1, 0)), zero,
                                use_acc=False, is_async=True)
            # the next block's scales, loaded one step ahead (their latency hides behind this step)
            scale_next = _a_scale(a_s_ptr + kk + 1, rmask, MASK_A) * gl.load(b_s_ptr + kk + 1)
            done = warpgroup_mma_wait(num_outstanding=1, deps=(cur,))
            mbarrier.arrive(empty.index(c % S), count=1)
            acc = acc + done * gl.expand_dims(scale, 1)
            scale = scale_next
            cur = nxt
            c = c1
        done = warpgroup_mma_wait(num_outstanding=0, deps=(cur,))
        mbarrier.arrive(empty.index(c % S), count=1)
        acc = acc + done * gl.expand_dims(scale, 1)
        return acc, c + 1
