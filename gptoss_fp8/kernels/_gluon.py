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
    from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: F401 - re-exported
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
                                                              torch.bfloat16: gl.bfloat16,
                                                              torch.float32: gl.float32}[dtype])


def descriptor(t: torch.Tensor, block: list[int]):
    """TMA descriptor over t (fp8 e4m3, bf16 or fp32) in blocks of ``block``, with the default NVMMA
    shared layout for that block. The layout is built once per (block, dtype): building it took
    ~10 us of host time per call (CPU box), three times per GEMM launch."""
    return TensorDescriptor.from_tensor(t, block, _nvmma_layout(tuple(block), t.dtype))


@functools.cache
def _flat_f32_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def scale_descriptor(t: torch.Tensor, box: int):
    """TMA descriptor over a 1-D fp32 tensor of block scales (16-byte aligned), copied ``box`` floats
    at a time (a power of two, 32 to 256: each box fills a row of its own of a [stages, box] shared buffer,
    and a TMA destination must start on a 128-byte boundary) into unswizzled shared memory from offsets
    that are multiples of 4 (a box must start on a 16-byte boundary): ``load_stage_scaled``'s scales
    (``GluonTile.stage_scales``)."""
    assert t.dim() == 1 and t.dtype == torch.float32 and t.data_ptr() % 16 == 0, (t.shape, t.dtype)
    assert 32 <= box <= 256 and box & (box - 1) == 0, box
    return TensorDescriptor.from_tensor(t, [box], _flat_f32_layout())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_programs(tiles: int, sms: int, balance: bool) -> int:
    """Persistent programs for ``tiles`` tiles on ``sms`` SMs: one per SM (at most one per tile), or
    with ``balance`` the fewest that keep the same number of waves (DeepGEMM's ``num_min_sms``:
    every program walks ceil(tiles / sms) or one fewer tiles either way, and the idle SMs cost no
    power or L2 bandwidth, which matters under the H200's power cap)."""
    progs = min(tiles, sms)
    if balance:
        progs = _cdiv(tiles, _cdiv(tiles, progs))
    return progs


PROMOTES = ("pipelined", "serial")


def check_promote(promote: str, wide: bool, what: str) -> None:
    """ValueError unless ``promote`` names a main loop ``what`` has: the base tiles take "pipelined"
    (``block_scaled_mainloop``) or "serial" (``block_scaled_mainloop_serial``); the wide tiles and
    the MoE's Gluon down (``wide``) only "serial" (their in-place accumulation, FP8 wgmma
    accumulating over all of K in limited precision, lost accuracy and was removed)."""
    if promote not in PROMOTES:
        raise ValueError(f"{what}: promote={promote!r}, expected 'pipelined' or 'serial'")
    if wide and promote != "serial":
        raise ValueError(f"{what} runs only the serial promotion loop: use GluonTile(..., promote='serial') "
                         f"(got promote={promote!r})")


def check_stage_scales(stage_scales: bool, ok: bool, what: str) -> None:
    """ValueError for ``GluonTile(stage_scales=True)`` on a tile other than the 128 x 256 ones (``ok``: the
    MoE's 128-row gate_up and Gluon down, the dense block_n=256), whose two products per warpgroup share
    their A rows: only their producers copy the scales into the stages (``load_stage_scaled``)."""
    if stage_scales and not ok:
        raise ValueError(f"GluonTile(stage_scales=True) is for the 128 x 256 tiles (the MoE's gate_up and Gluon down, "
                         f"the dense block_n=256), not {what}")


def check_narrow(narrow: bool, ok: bool, what: str) -> None:
    """ValueError for ``GluonTile(narrow=True)`` on a tile other than the 128 x 256 ones (``ok``: the dense
    block_n=256 and the MoE's Gluon down), whose last column tile it runs as one m64n64 product a warpgroup."""
    if narrow and not ok:
        raise ValueError(f"GluonTile(narrow=True) is for the 128 x 256 tiles (the dense block_n=256, the MoE's Gluon "
                         f"down), not {what}")


def check_thread_release(thread_release: bool, ok: bool, what: str) -> None:
    """ValueError for ``GluonTile(thread_release=True)`` on a tile other than the MoE's 128-row ones (``ok``: the wide
    gate_up and the Gluon down), whose consumers release the stages thread by thread (``release``)."""
    if thread_release and not ok:
        raise ValueError(f"GluonTile(thread_release=True) is for the MoE's 128-row tiles (the wide gate_up, the Gluon "
                         f"down), not {what}")


def stage_scale_args(a_scale: torch.Tensor, w_scale_inv: torch.Tensor, rows: int) -> tuple[dict, torch.Tensor]:
    """``GluonTile.stage_scales``'s launch arguments (``load_stage_scaled``): TMA descriptors over the row
    scales MN-major (K block kk's rows contiguous: a_scale [M, ceil(K/128)] with strides (1, M), as
    ``gather_act_quant(scale_mn_major=True)`` and the wide MoE gate_up write them; else transposed here, a
    copy) in boxes of ``rows`` (the tile's rows), and over the weight scales [..., ceil(K/128)] (a copy
    only where they are not contiguous and 16-byte aligned, e.g. an expert-parallel shard's view), both
    flat, the weight scales' box the power of two past one 128-row block's ceil(K/128) scales and 3 more, at least
    32 (``stage_scale_box``; 32 for K = 2880: a K block's scales of both 128-column blocks of a 256-wide tile in
    one copy, from the 16-byte boundary at or below the first); and the weight scales the kernel's strides must then refer to.
    A tiled TMA box must start on a 16-byte boundary (``benchmarks/tma1d_probe.py``: "illegal instruction"
    otherwise), so the row scales' K blocks are ceil(M / 4) * 4 apart (a padded copy where M is not a multiple
    of 4) and the weight scales' box starts at the boundary below this K block's scale (``load_stage_scaled``)."""
    m, kb = a_scale.shape
    mp = _cdiv(m, 4) * 4  # (each K block's rows start 16-byte aligned: where a TMA box may start)
    if mp == m:
        sa = a_scale.t().contiguous()  # a view when a_scale is MN-major already
    else:
        sa = a_scale.new_zeros(kb, mp)
        sa[:, :m] = a_scale.t()
    args, ws = weight_scale_args(w_scale_inv)
    return dict(sa_desc=scale_descriptor(sa.view(-1), rows), **args), ws


def weight_scale_args(w_scale_inv: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """``stage_scale_args``'s weight-scale half alone (the gathering gate_up copies its row scales itself,
    ``moe_ws._moe_gather_producer``): the descriptor sb_desc, SC, and the weight scales the kernel's strides
    must refer to."""
    ws = w_scale_inv
    if not (ws.is_contiguous() and ws.data_ptr() % 16 == 0):
        ws = ws.clone(memory_format=torch.contiguous_format)
    return dict(sb_desc=scale_descriptor(ws.view(-1), stage_scale_box(ws.shape[-1])), SC=True), ws


def stage_scale_box(k_blocks: int) -> int:
    """The weight scales' TMA box of ``stage_scale_args`` for ceil(K/128) = k_blocks: the power of two
    above k_blocks + 3 (a box starting up to 3 scales early, at a 16-byte boundary), at least 32 floats: each
    stage's box lands in a row of its own of the [STAGES, box] buffer, and a TMA destination must start on a
    128-byte boundary ("misaligned address" otherwise: boxes of 8 and 16 floats, K = 160 and 640, measured on
    the H100, thirty-seventh session)."""
    box = max(32, 1 << (k_blocks + 3).bit_length())
    if box > 256:
        raise ValueError(f"GluonTile(stage_scales=True) takes K up to 255 blocks of 128, not {k_blocks}")
    return box


def check_gather(gather: bool, ok: bool, what: str) -> None:
    """ValueError for ``GluonTile(gather=True)`` on a tile other than the MoE's 128-row gate_up (``ok``): only
    its producer copies A rows by token (``moe_ws._moe_gather_producer``)."""
    if gather and not ok:
        raise ValueError(f"GluonTile(gather=True) is for the MoE's 128 x 256 gate_up, not {what}")


def check_turns(turns: bool, wide: bool, what: str) -> None:
    """ValueError for ``GluonTile(turns=True)`` on a base tile (``what``): turns order the two consumer
    warpgroups of the wide tiles, the MoE's 128-row gate_up and Gluon down and the dense 256 x 128 /
    128 x 256 (``block_scaled_mainloop_serial``'s TURN)."""
    if turns and not wide:
        raise ValueError(f"GluonTile(turns=True) is for the wide tiles' two consumer warpgroups (the MoE's 128-row "
                         f"gate_up and Gluon down, the dense 256 x 128 / 128 x 256), not {what}")


def compile_for_sm90(fn, types: dict[str, str], constexprs: dict, num_warps: int = 4,
                     divisible16: tuple[str, ...] = ()) -> dict:
    """Compile a Gluon kernel for sm_90 with no GPU present (types: argument -> triton type string,
    "i32" for the ones not named, None for those that default to None). Returns {"ptx", "num_warps", "shared"} and ptxas's report
    (``ptxas_resources``: registers, spill bytes, stack). ``divisible16``: arguments to compile as
    a launch specializes them when they are multiples of 16 (pointers 16-byte aligned, strides, sizes:
    what lets row stores vectorize). Runs in a child process
    when this one has Triton's interpreter on (there triton's own jit helpers, which Gluon's
    reductions wrap, are interpreter objects that cannot be compiled)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        code = ("import importlib, json, sys; from gptoss_fp8.kernels import _gluon; "
                "fn = getattr(importlib.import_module(sys.argv[1]), sys.argv[2]); "
                "print(json.dumps(_gluon.compile_for_sm90(fn, *map(json.loads, sys.argv[3:5]), int(sys.argv[5]), "
                "tuple(json.loads(sys.argv[6])))))")
        args = [fn.fn.__module__, fn.fn.__name__, json.dumps(types), json.dumps(constexprs), str(num_warps),
                json.dumps(list(divisible16))]
        r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compiling {fn.fn.__name__} for sm_90 failed:\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, constexprs, attrs = _as_launched(fn, types, constexprs, divisible16)
    k = triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 128),
                       options=dict(num_warps=num_warps, num_stages=1, maxnreg=None))
    return {"ptx": k.asm["ptx"], "num_warps": k.metadata.num_warps, "shared": k.metadata.shared,
            **ptxas_resources(k.asm["ptx"])}


def _as_launched(fn, types: dict[str, str], constexprs: dict, divisible16: tuple[str, ...]) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attributes) of a bare compile of fn as a launch would specialize it: constexprs the
    caller leaves out take their defaults (else a bare compile reads them as run-time ints and compiles both sides of
    their branches); so do arguments defaulting to None that the caller neither types nor passes (a launch leaving
    them out specializes them as None); ``divisible16`` arguments 16-divisible (those compiled as constexprs
    aside)."""
    constexprs = {**{p.name: p.default for p in fn.params if p.has_default
                     and (p.is_constexpr or (p.default is None and p.name not in types))}, **constexprs}
    sig = {a: ("constexpr" if a in constexprs else types.get(a, "i32")) for a in fn.arg_names}
    return sig, constexprs, {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible16
                             if sig[a] != "constexpr"}


def triton_ptx_for_sm90(fn, types: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                        maxnreg: int | None = None, divisible16: tuple[str, ...] = ()) -> str:
    """The PTX of a Triton (not Gluon) kernel compiled for sm_90 with no GPU present, its arguments as in
    ``compile_for_sm90`` (``_as_launched``); read its registers with ``ptxas_resources``. Not under Triton's
    interpreter (its jit functions cannot be compiled there): the CPU tests call it in a child process."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "compile outside Triton's interpreter"
    sig, constexprs, attrs = _as_launched(fn, types, constexprs, divisible16)
    options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options).asm["ptx"]


def ptxas_resources(ptx: str) -> dict:
    """ptxas's report for a PTX kernel assembled for sm_90a: {"regs", "spill_stores", "spill_loads",
    "stack", "wgmma_serialized"} (bytes; regs is the launch count, the partitions' setmaxnreg aside;
    wgmma_serialized: ptxas's C7514, every wgmma waiting for the previous one), {} where triton's
    ptxas cannot be found."""
    import re
    import tempfile

    from triton import knobs

    try:
        ptxas = knobs.nvidia.ptxas.path
    except Exception:  # noqa: BLE001 - a triton without its bundled ptxas: no report
        return {}
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    if r.returncode != 0 or regs is None:
        return {"ptxas_error": log[-2000:]}
    # C7514: ptxas could not prove the accumulators read between wgmma issue and wait to be retired and
    # made every wgmma wait for the previous one (no tensor-core pipelining)
    return {"regs": int(regs.group(1)), "spill_stores": int(spill.group(1)) if spill else 0,
            "spill_loads": int(spill.group(2)) if spill else 0, "stack": int(stack.group(1)) if stack else 0,
            "wgmma_serialized": "C7514" in log}


if HAS_GLUON:
    from gptoss_fp8.kernels.act_quant import BF16_ROUND_ASM

    @gluon.jit
    def bf16_round(x):
        """fp32 values rounded to bf16 (RNE) and kept in fp32, as ``x.to(bfloat16).to(float32)``: one packed
        cvt.rn.bf16x2.f32 and two bit moves for two values, where the compiler makes that pair of casts one unpacked
        F2F a value on the XU pipe (act_quant.bf16_round's Gluon twin; forty-second session)."""
        return gl.inline_asm_elementwise(BF16_ROUND_ASM, "=r,=r,r,r", [x], dtype=gl.float32, is_pure=True, pack=2)

    @gluon.jit
    def halves(x):
        """[R, N] -> its columns [0, N/2) and [N/2, N): in the wgmma accumulator layout the top column
        bit indexes a thread's own registers, so this moves no data."""
        R: gl.constexpr = x.type.shape[0]
        N: gl.constexpr = x.type.shape[1]
        return gl.split(gl.permute(gl.reshape(x, [R, 2, N // 2]), (0, 2, 1)))

    @gluon.jit
    def unhalves(a, b):
        """``halves`` undone: [R, N] and [R, N] (b in a's layout) -> [R, 2N], a's columns first."""
        R: gl.constexpr = a.type.shape[0]
        N: gl.constexpr = a.type.shape[1]
        b = gl.convert_layout(b, a.type.layout, assert_trivial=True)
        return gl.reshape(gl.permute(gl.join(a, b), (0, 2, 1)), [R, 2 * N])

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
    def load_stage_scaled(a_desc, b_desc, sa_desc, sb_desc, empty, ready, a_bufs, b_bufs, sa_bufs, sb_bufs, c,
                          a_coord, b_coord, sa_off, sb_off):
        """``load_stage`` with the K block's scales in the stage too (``GluonTile.stage_scales``, DeepGEMM's
        way): the A tile's row scales (sa_desc: the scales MN-major, flat; sa_off: this K block's first
        row) into sa_bufs[stage], and the weight scales from this K block's scale of the B tile's first
        128-column block on (sb_desc: the weight scales flat, a box longer than one block's row of K
        blocks, so that the second block's scale of this K block is in it too; sb_off: its first
        element) into sb_bufs[stage]; all on the stage's ready barrier. Every destination starts on a
        128-byte boundary (the scale buffers' rows are 512 and at least 128 bytes, ``stage_scale_box``;
        NVMMA allocations 128-byte aligned), as TMA wants. Every box starts on a 16-byte boundary too (an "illegal instruction"
        otherwise, ``benchmarks/tma1d_probe.py``): sa_off is (callers'), the weight scales' box starts at
        the multiple of 4 at or below sb_off (the consumers read from sb_off % 4 on, ``_sb_start``). Past
        the tensor's end TMA writes zeros (never read)."""
        S: gl.constexpr = a_bufs.type.shape[0]
        s = c % S
        mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes
                        + sa_desc.block_type.nbytes + sb_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, a_coord, ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, b_coord, ready.index(s), b_bufs.index(s))
        tma.async_copy_global_to_shared(sa_desc, [sa_off], ready.index(s), sa_bufs.index(s))
        tma.async_copy_global_to_shared(sb_desc, [sb_off - sb_off % 4], ready.index(s), sb_bufs.index(s))
        return c + 1

    @gluon.jit
    def stage_scale_buffers(sa_desc, sb_desc, dummy, STAGES: gl.constexpr, ROWS: gl.constexpr, SC: gl.constexpr):
        """The stages' scale buffers of ``load_stage_scaled`` (row scales [STAGES, ROWS], weight scales
        [STAGES, box]); without SC ``dummy`` twice (any shared-memory descriptor, passed on unused)."""
        if SC:
            # each stage's boxes start on 128-byte boundaries, as TMA's destinations must ("misaligned address")
            gl.static_assert(ROWS % 32 == 0 and sb_desc.block_type.shape[0] % 32 == 0,
                             "stage scales: 128-byte rows of scales a stage")
            sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS], sa_desc.layout)
            sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, sb_desc.block_type.shape[0]], sb_desc.layout)
        else:
            sa_bufs = dummy
            sb_bufs = dummy
        return sa_bufs, sb_bufs

    @gluon.jit
    def _sb_start(b_s_ptr, kk):
        """Where this K block's weight scale (b_s_ptr + kk) lies in its stage's box: the box starts at the
        16-byte boundary at or below it (``load_stage_scaled``; the scale tensor's base is 16-byte aligned)."""
        return ((b_s_ptr.to(gl.int64, bitcast=True) >> 2) + kk) % 4

    @gluon.jit
    def _smem_scalar(bufs, s, off):
        """bufs[s, off] (a [stages, box] fp32 buffer; off a run-time offset) as a scalar: one broadcast load
        (max over one element, so the replicated layout's copies cannot add up)."""
        S: gl.constexpr = bufs.type.shape[0]
        BOX: gl.constexpr = bufs.type.shape[1]
        flat = bufs._reinterpret(gl.float32, [S * BOX, 1], bufs.type.layout)
        return gl.max(flat.index(s * BOX + off).load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), 0)

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

    @gluon.jit
    def release(empty, s, TR: gl.constexpr = False):
        """A consumer warpgroup's release of stage s of the ring: ``mbarrier.arrive`` (one thread, after a barrier of
        the warpgroup's 128 threads, which the compiler puts before it), or TR (``GluonTile.thread_release``) each
        thread's own ``cp.async.mbarrier.arrive.noinc`` (no warpgroup barrier; the arrive-on waits for the thread's
        earlier cp.async copies, which consumers have none of; the empty barrier then counts 128 arrivals a
        warpgroup). A thread's stage reads are done by then: its wgmmas waited for, its scale loads used."""
        if TR:
            async_copy.mbarrier_arrive(empty.index(s), increment_count=False)
        else:
            mbarrier.arrive(empty.index(s), count=1)

    @gluon.jit
    def take_turn(turn, W: gl.constexpr, k, ORDER: gl.constexpr):
        """ORDER: the consumer warpgroups take turns in a fixed rotation, 0, 1, .., NWG - 1, 0, .. (an mbarrier
        per warpgroup): warpgroup W's k-th turn waits for W - 1's. In attention_ws the turn is the MMA issue
        (FlashAttention-3's ping-pong); attention_ws_fp8 rings its exponentials with it; the serial GEMM main
        loop its wgmma issues (``block_scaled_mainloop_serial`` with TURN). Warpgroup 0's first
        wait is on the phase before a fresh barrier's first, which passes."""
        if ORDER:
            if W == 0:
                mbarrier.wait(turn.index(0), (k + 1) & 1)
            else:
                mbarrier.wait(turn.index(W), k & 1)

    @gluon.jit
    def pass_turn(turn, W: gl.constexpr, ORDER: gl.constexpr):
        if ORDER:  # (``turn`` may be None without ORDER)
            NWG: gl.constexpr = turn.type.shape[0]
            mbarrier.arrive(turn.index((W + 1) % NWG), count=1)

    @gluon.jit
    def _scale_prod(as_ptr, a_offs, rmask, b_ptr, MASK_A: gl.constexpr):
        """s_a[rows] * s_b for the serial promotion loop (masked rows, past M, read 0)."""
        if MASK_A:
            sa = gl.load(as_ptr + a_offs, mask=rmask, other=0.0)
        else:
            sa = gl.load(as_ptr + a_offs)
        return sa * gl.load(b_ptr)

    @gluon.jit
    def block_scaled_mainloop_serial(ready, empty, a_bufs, b_bufs, A0: gl.constexpr, A1: gl.constexpr,
                                     AR: gl.constexpr, B0: gl.constexpr, B1: gl.constexpr, BR: gl.constexpr,
                                     as_ptr, a_offs, a_off1, rmask0, rmask1, b_s_ptr, b_off1, c, n_k,
                                     layout: gl.constexpr, MASK_A: gl.constexpr, DO1: gl.constexpr, turn=None,
                                     W: gl.constexpr = 0, TURN: gl.constexpr = False, sa_bufs=None, sb_bufs=None,
                                     SC: gl.constexpr = False, FENCE: gl.constexpr = False, TR: gl.constexpr = False):
        """Two block-scaled FP8 products of one consumer warpgroup over the same stages, with the
        package's promotion numerics: acc0 of A rows A0 .. A0 + AR x B rows B0 .. B0 + BR, acc1 of
        A rows A1 .. x B rows B1 .. (a 128 x 128 or 64 x 256 share of a wide tile as two m64 x n128
        products; with DO1 False one product, the base tiles' ``GluonTile(promote="serial")``).
        Per K block each product's wgmma goes into a fresh temporary, is waited for in full
        (warpgroup_mma_wait(0)) within the same iteration and then added, scaled by
        s_a[row, kb] * s_b[kb], to its fp32 accumulator. The only main loop of the wide tiles and
        of the MoE's Gluon down.

        Hopper's FP8 wgmma accumulates with limited internal precision, so accumulating in place
        over all of K loses accuracy (measured on the H200: dense rel. error 2.09e-3 vs 1.66e-3,
        MoE 1.07e-2 vs 4.2e-3; that variant was removed); the promotion every 128 keeps it at the
        default's. The default loop (``block_scaled_mainloop``) issues block k + 1's wgmma before it
        promotes block k, a group left in flight across the loop's back edge, which ptxas cannot
        order (C7514: it serializes every wgmma). Here no wgmma is in flight at a back edge nor
        while any register it writes is read, so ptxas keeps the tensor cores pipelined within a
        block; the overlap of promotion with tensor-core work comes from the two consumer
        warpgroups being separate partitions (one promotes while the other's wgmmas run). With DO1
        the two products run one after the other through a 64-register temporary (in source order
        product 0's promotion before product 1's issue): accumulators 2 x 64 + the temporary.
        The stage is released once its last product is done.

        Scales addressed by int32 offsets (registers): product 0's row scales at as_ptr + a_offs
        [AR] (masked by rmask0 with MASK_A; masked rows read 0), product 1's at a_offs + a_off1
        (rmask1); weight-scale rows at b_s_ptr and b_s_ptr + b_off1. DO1 False (constexpr; callers
        branch on their run-time condition outside the loop: product 1's columns all past N)
        skips product 1 (its scales are not read: b_s_ptr + b_off1 may lie past the scale array
        then); acc1 is then exact zeros. Returns (acc0, acc1, next c).

        TURN (opt-in, ``GluonTile(turns=True)``; consumer warpgroup W of two, ``turn`` their two turn
        barriers): the two warpgroups issue their wgmmas in turns (``take_turn``), two a K block (the
        second an empty turn without DO1, so that both count 2 * c), so that the tensor core runs one
        warpgroup's product while the other promotes, instead of both in step and both promoting at
        once (DeepGEMM's gate_up keeps its tensor pipe 80% active, ours 65%: BENCHMARKS.md, 27th
        session). Warpgroups that skip a tile's products must take the same turns (``skip_turns``).

        SC (opt-in, ``GluonTile(stage_scales=True)``; products sharing their A rows, A0 == A1): the scales
        come from the stage (``load_stage_scaled``): rows A0 .. A0 + AR of sa_bufs[stage] and the scalars
        sb_bufs[stage, 0] / [stage, b_off1], read from shared memory once the stage is ready, instead of
        global loads issued behind the wgmma (the promotion's multiply waited on them: 21.7% of our
        gate_up's warp samples against DeepGEMM's 8.9%, BENCHMARKS.md, 27th session). The pointer
        arguments are then unused; the products and sums are the same, so the results are the same bits.

        FENCE (the gathered gate_up, ``GluonTile.gather``): the A stage was written by the producer's cp.async
        (the generic proxy), which the wgmma reads through the async proxy: a proxy fence after each ready wait.

        TR (``GluonTile.thread_release``): each thread releases the stage itself (``release``), no warpgroup
        barrier before it; the empty barriers then count 128 arrivals a warpgroup."""
        S: gl.constexpr = a_bufs.type.shape[0]
        if SC:
            gl.static_assert(A0 == A1, "stage scales: both products on the same A rows")
        # t: the temporary. Each wgmma is issued with use_acc=False on the previous (promoted, dead)
        # temporary, whose values it ignores (ptxas's !UPT: no zeros written per block). With DO1,
        # ptxas may still hoist product 1's wgmma above product 0's promotion into a second
        # register set (256 x 128 dense: ~96 bytes of spills); forcing the order (a run-time False
        # use_acc, so the wgmma reads t) spilled ~1 KB.
        t = gl.zeros((AR, BR), gl.float32, layout)
        acc0 = gl.zeros((AR, BR), gl.float32, layout)
        acc1 = gl.zeros((AR, BR), gl.float32, layout)
        for kk in range(n_k):
            s = c % S
            mbarrier.wait(ready.index(s), (c // S) & 1)
            if FENCE:
                fence_async_shared()
            take_turn(turn, W, 2 * c, TURN)
            t = warpgroup_mma(a_bufs.index(s).slice(A0, AR), b_bufs.index(s).slice(B0, BR).permute((1, 0)), t,
                              use_acc=False, is_async=True)
            pass_turn(turn, W, TURN)
            if SC:
                sa = sa_bufs.index(s).slice(A0, AR).load(gl.SliceLayout(1, layout))
                sb_at = _sb_start(b_s_ptr, kk).to(gl.int32)
                sc0 = sa * _smem_scalar(sb_bufs, s, sb_at)
                if DO1:
                    sc1 = sa * _smem_scalar(sb_bufs, s, sb_at + b_off1)
            else:
                sc0 = _scale_prod(as_ptr, a_offs + kk, rmask0, b_s_ptr + kk, MASK_A)  # latency behind the wgmma
                if DO1:  # product 1's scales too: loaded once product 0 is issued
                    sc1 = _scale_prod(as_ptr, a_offs + (a_off1 + kk), rmask1, b_s_ptr + (b_off1 + kk), MASK_A)
            t = warpgroup_mma_wait(num_outstanding=0, deps=(t,))
            if DO1:
                acc0 = acc0 + t * gl.expand_dims(sc0, 1)
                take_turn(turn, W, 2 * c + 1, TURN)
                t = warpgroup_mma(a_bufs.index(s).slice(A1, AR), b_bufs.index(s).slice(B1, BR).permute((1, 0)), t,
                                  use_acc=False, is_async=True)
                pass_turn(turn, W, TURN)
                t = warpgroup_mma_wait(num_outstanding=0, deps=(t,))
                release(empty, s, TR)
                acc1 = acc1 + t * gl.expand_dims(sc1, 1)
            else:
                release(empty, s, TR)
                acc0 = acc0 + t * gl.expand_dims(sc0, 1)
                take_turn(turn, W, 2 * c + 1, TURN)  # product 1's turn, empty: both warpgroups count 2 a block
                pass_turn(turn, W, TURN)
            c += 1
        return acc0, acc1, c

    @gluon.jit
    def block_scaled_mainloop_halves(ready, empty, a_bufs, b_bufs, A0: gl.constexpr, A1: gl.constexpr,
                                     AR: gl.constexpr, B0: gl.constexpr, B1: gl.constexpr, BR: gl.constexpr,
                                     as_ptr, a_offs, a_off1, rmask0, rmask1, b_s_ptr, b_off1, c, n_k,
                                     layout: gl.constexpr, MASK_A: gl.constexpr, second, turn=None,
                                     W: gl.constexpr = 0, TURN: gl.constexpr = False, sa_bufs=None, sb_bufs=None,
                                     SC: gl.constexpr = False, FENCE: gl.constexpr = False, TR: gl.constexpr = False):
        """``block_scaled_mainloop_serial`` of a tile split in two column halves, the second product
        run only where ``second`` (run time: False where the right half lies wholly past N)."""
        if second:
            acc0, acc1, c = block_scaled_mainloop_serial(ready, empty, a_bufs, b_bufs, A0, A1, AR, B0, B1, BR,
                                                         as_ptr, a_offs, a_off1, rmask0, rmask1, b_s_ptr, b_off1,
                                                         c, n_k, layout, MASK_A, True, turn, W, TURN, sa_bufs,
                                                         sb_bufs, SC, FENCE, TR)
        else:
            acc0, acc1, c = block_scaled_mainloop_serial(ready, empty, a_bufs, b_bufs, A0, A1, AR, B0, B1, BR,
                                                         as_ptr, a_offs, a_off1, rmask0, rmask1, b_s_ptr, b_off1,
                                                         c, n_k, layout, MASK_A, False, turn, W, TURN, sa_bufs,
                                                         sb_bufs, SC, FENCE, TR)
        return acc0, acc1, c

    @gluon.jit
    def turn_barriers(dummy, TURN: gl.constexpr):
        """The two consumer warpgroups' turn barriers (``GluonTile.turns``), initialized; without TURN
        ``dummy`` (any shared-memory descriptor: the callers pass it on unused)."""
        if TURN:
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(turn.index(0), count=1)
            mbarrier.init(turn.index(1), count=1)
        else:
            turn = dummy
        return turn

    @gluon.jit
    def skip_turns(turn, W: gl.constexpr, c, TURN: gl.constexpr):
        """Stage c's two turns taken and passed with no wgmma: a warpgroup that skips a tile's products (its
        rows all padding) calls it for each stage it keeps the ring in step on, so that the rotation stays in
        step with the other warpgroup's (taken all at once, the skipping warpgroup would hold stages the other
        one waits for)."""
        if TURN:
            take_turn(turn, W, 2 * c, True)
            pass_turn(turn, W, True)
            take_turn(turn, W, 2 * c + 1, True)
            pass_turn(turn, W, True)
