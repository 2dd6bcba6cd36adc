"""Compile every Gluon kernel of gptoss_fp8/kernels/moe_ws.py for sm_90 (no GPU) in every
configuration its launchers / tests pass, and save each variant's PTX with debug info stripped
plus ptxas's register / spill report, the debug labels and the SASS: the check that a refactor of
these measured kernels changes nothing the GPU runs, without a GPU (the fifteenth session's fold
of the two consumer partitions was accepted on it: all 36 variants identical). Stripped PTX alone
is not enough: ptxas treats each inlined function's debug label as a block boundary, so a change
of the labels alone reorders the SASS.

  python benchmarks/moe_ws_compile_check.py OUTDIR [-j N]     # compile all variants into OUTDIR
  python benchmarks/moe_ws_compile_check.py --compare DIR_A DIR_B
  MOE_WS_FILE=/path/to/moe_ws.py python benchmarks/moe_ws_compile_check.py OUTDIR   # a copy outside the repo
  ... --only REGEX   # only the variants whose name matches

Run from the repository root with the venv active. Each variant compiles in its own child process with a
fresh TRITON_CACHE_DIR (no cache reuse across the two source versions).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAY = ("NVMMASharedLayout(swizzle_byte_width={}, element_bitwidth=8, rank=2, transposed=False, "
       "fp4_padded=False, cga_layout=[])")
GU_CONSTS = dict(ALPHA=1.702, FP8_MAX_C=448.0, EPS=1e-10)  # spec.SWIGLU_ALPHA, fp8.FP8_MAX, fp8.ACT_EPS
# the wide gate_up's out_scale column stride: 1 (row-major, specialized as a launch does) unless the down reads it
# MN-major (GluonTile.stage_scales)
WIDE_CONSTS = dict(GU_CONSTS, stride_osn=1)
L1 = ("NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1, transposed=False, fp4_padded=False, "
      "cga_layout=[])")
SC_TYPES = {"sa_desc": f"tensordesc<fp32[128],{L1}>", "sb_desc": f"tensordesc<fp32[32],{L1}>"}


def gu_types(block_m):
    return {"a_desc": f"tensordesc<fp8e4nv[{block_m}, 128],{LAY.format(128)}>",
            "b_desc": f"tensordesc<fp8e4nv[256, 128],{LAY.format(128)}>",
            "out_desc": f"tensordesc<fp8e4nv[64, 64],{LAY.format(64)}>",
            "as_ptr": "*fp32", "bs_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*fp8e4nv",
            "out_s_ptr": "*fp32", "slots_ptr": "*i32", "block_expert_ptr": "*i32", "limit": "fp32"}


DOWN_TYPES = {"a_desc": f"tensordesc<fp8e4nv[128, 128],{LAY.format(128)}>",
              "b_desc": f"tensordesc<fp8e4nv[256, 128],{LAY.format(128)}>",
              "as_ptr": "*fp32", "bs_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16",
              "slots_ptr": "*i32", "block_expert_ptr": "*i32"}

# "launch": what a launch at gpt-oss shapes specializes as 16-divisible (pointers from torch
# allocations; gate_up N = 2I = 5760, K = H = 2880, stride_biase = 5760, stride_om = 2880,
# num_experts 32/128; down N = K = 2880, stride_biase = stride_ym = 2880). The scale strides
# (ceil(2880/128) = 23 ...) are not.
GU_DIV16 = ("as_ptr", "bs_ptr", "bias_ptr", "out_ptr", "out_s_ptr", "slots_ptr", "block_expert_ptr", "N", "K",
            "num_experts", "stride_biase", "stride_om")
GU_WIDE_DIV16 = tuple(a for a in GU_DIV16 if a not in ("out_ptr", "stride_om"))
DOWN_DIV16 = ("as_ptr", "bs_ptr", "bias_ptr", "y_ptr", "slots_ptr", "block_expert_ptr", "N", "K", "stride_biase",
              "stride_ym")


def variants():
    v = []
    # the 64 x 256 gate_up: ws_moe_gemm(block_m=64); promote pipelined (SERIAL omitted: the launch's
    # exact signature) or serial; stages 4 (default) / 5 (tests), group_m 8 / 4
    for stages, group_m, serial, spec in itertools.product((4, 5), (8, 4), (None, True), ("plain", "launch")):
        c = dict(STAGES=stages, GROUP_M=group_m, **GU_CONSTS)
        if serial:
            c["SERIAL"] = True
        name = f"gemm_s{stages}_g{group_m}_{'serial' if serial else 'pipelined'}_{spec}"
        v.append((name, "_ws_moe_gemm_kernel", gu_types(64), c, GU_DIV16 if spec == "launch" else ()))
    # SERIAL=False passed explicitly (== default) for completeness
    v.append(("gemm_s4_g8_serialFalse_plain", "_ws_moe_gemm_kernel", gu_types(64),
              dict(STAGES=4, GROUP_M=8, SERIAL=False, **GU_CONSTS), ()))
    # the wide gate_up: ws_moe_gemm(block_m=128); stages 4 (default) / 3, group_m 8 / 4
    for stages, group_m, spec in itertools.product((4, 3), (8, 4), ("plain", "launch")):
        c = dict(STAGES=stages, GROUP_M=group_m, **WIDE_CONSTS)
        v.append((f"wide_s{stages}_g{group_m}_{spec}", "_ws_moe_gemm_wide_kernel", gu_types(128), c,
                  GU_WIDE_DIV16 if spec == "launch" else ()))
    # the down: ws_moe_down; stages 4 / 3, group_m 8 / 4
    for stages, group_m, spec in itertools.product((4, 3), (8, 4), ("plain", "launch")):
        v.append((f"down_s{stages}_g{group_m}_{spec}", "_ws_moe_down_kernel", DOWN_TYPES,
                  dict(STAGES=stages, GROUP_M=group_m), DOWN_DIV16 if spec == "launch" else ()))
    # the consumer warpgroups' turns at the tensor core (GluonTile(turns=True), opt-in since the 27th session)
    v.append(("wide_s4_g16_turn_launch", "_ws_moe_gemm_wide_kernel", gu_types(128),
              dict(STAGES=4, GROUP_M=16, TURN=True, **WIDE_CONSTS), GU_WIDE_DIV16))
    v.append(("down_s4_g16_turn_launch", "_ws_moe_down_kernel", DOWN_TYPES, dict(STAGES=4, GROUP_M=16, TURN=True),
              DOWN_DIV16))
    # the scales through the stages (GluonTile.stage_scales, opt-in since the 28th session), with and without turns;
    # the gate_up writing its out_scale MN-major (the down's A scales then)
    for turn in (False, True):
        t = dict(TURN=True) if turn else {}
        v.append((f"wide_s4_g16_sc{'_turn' if turn else ''}_launch", "_ws_moe_gemm_wide_kernel",
                  gu_types(128) | SC_TYPES, dict(STAGES=4, GROUP_M=16, SC=True, **t, **GU_CONSTS, stride_osm=1),
                  GU_WIDE_DIV16))
        v.append((f"down_s4_g16_sc{'_turn' if turn else ''}_launch", "_ws_moe_down_kernel", DOWN_TYPES | SC_TYPES,
                  dict(STAGES=4, GROUP_M=16, SC=True, **t), DOWN_DIV16))
    # a launch's value-1 specialization (an int arg == 1 becomes a constexpr): one row tile (t = 1)
    v.append(("wide_s4_g8_launch_numm1", "_ws_moe_gemm_wide_kernel", gu_types(128),
              dict(STAGES=4, GROUP_M=8, num_m=1, **WIDE_CONSTS), GU_WIDE_DIV16))
    v.append(("down_s4_g8_launch_numm1", "_ws_moe_down_kernel", DOWN_TYPES,
              dict(STAGES=4, GROUP_M=8, num_m=1), DOWN_DIV16))
    v.append(("gemm_s4_g8_serial_launch_numm1", "_ws_moe_gemm_kernel", gu_types(64),
              dict(STAGES=4, GROUP_M=8, SERIAL=True, num_m=1, **GU_CONSTS), GU_DIV16))
    return v


CHILD = r"""
import importlib.util, json, os, sys
from gptoss_fp8.kernels import _gluon
if os.environ.get("MOE_WS_FILE"):  # a candidate copy of moe_ws.py, loaded under the module's own name
    spec = importlib.util.spec_from_file_location("gptoss_fp8.kernels.moe_ws", os.environ["MOE_WS_FILE"])
    moe_ws = importlib.util.module_from_spec(spec)
    sys.modules["gptoss_fp8.kernels.moe_ws"] = moe_ws
    spec.loader.exec_module(moe_ws)
else:
    from gptoss_fp8.kernels import moe_ws
print("moe_ws from", moe_ws.__file__, file=sys.stderr)
fn, types, consts, div16 = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), tuple(json.loads(sys.argv[4]))
k = _gluon.compile_for_sm90(getattr(moe_ws, fn), types, consts, divisible16=div16)
print(json.dumps(k))
"""


DBG_LABEL = re.compile(r"\$L__(tmp|func_begin|func_end)\d+:")


def sass_of(ptx: str) -> str:
    """ptxas (sm_90a, -lineinfo as triton's own compile) + cuobjdump -sass, line-info and
    address comments dropped: the machine code the launch would load."""
    from triton import knobs

    binp = os.path.dirname(knobs.nvidia.ptxas.path)
    with tempfile.TemporaryDirectory() as d:
        src, cub = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(src, "w").write(ptx)
        subprocess.run([knobs.nvidia.ptxas.path, "-lineinfo", "--gpu-name", "sm_90a", src, "-o", cub],
                       check=True, capture_output=True)
        r = subprocess.run([os.path.join(binp, "cuobjdump"), "-sass", cub], check=True, capture_output=True,
                           text=True)
    out = []
    for line in r.stdout.splitlines():
        s = line.strip()
        if not s or s.startswith("//## File") or s.startswith("Fatbin") or s.startswith("code for") \
                or s.startswith("arch =") or s.startswith("code version") or s.startswith("host =") \
                or s.startswith("compile_size") or s.startswith("identifier") or s.startswith("ptxasOptions"):
            continue
        s = re.sub(r"/\*[0-9a-f]{4,}\*/", "", s).strip()  # instruction addresses
        if s.startswith("/*") and s.endswith("*/"):  # the encoding's second word
            continue
        out.append(s)
    return "\n".join(out) + "\n"


def strip_ptx(ptx: str) -> str:
    """Drop .loc / .file lines and the DWARF sections (.section .debug_* { ... })."""
    out, in_dbg = [], False
    for line in ptx.splitlines():
        s = line.strip()
        if in_dbg:
            if s == "}":
                in_dbg = False
            continue
        if s.startswith(".section") and ".debug" in s:
            in_dbg = not s.endswith("}")
            continue
        if s.startswith(".loc") or s.startswith(".file") or s.startswith("//"):
            continue
        if DBG_LABEL.fullmatch(s):  # debug-scope markers ($L__tmp12:, $L__func_begin0:), no branch target
            continue
        line = line.split("//", 1)[0].rstrip()  # LLVM's block-name comments (// %.loopexit904)
        if not line.strip():
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def compile_one(outdir, var):
    name, fn, types, consts, div16 = var
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        r = subprocess.run([sys.executable, "-c", CHILD, fn, json.dumps(types), json.dumps(consts),
                            json.dumps(list(div16))], env=env, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        with open(os.path.join(outdir, name + ".error"), "w") as f:
            f.write(r.stderr)
        return name, "ERROR"
    k = json.loads(r.stdout.strip().splitlines()[-1])
    with open(os.path.join(outdir, name + ".raw.ptx"), "w") as f:
        f.write(k["ptx"])
    stripped = strip_ptx(k["ptx"])
    with open(os.path.join(outdir, name + ".ptx"), "w") as f:
        f.write(stripped)
    sass = sass_of(k["ptx"])
    with open(os.path.join(outdir, name + ".sass"), "w") as f:
        f.write(sass)
    meta = {key: val for key, val in k.items() if key != "ptx"}
    meta["sass_lines"] = sass.count("\n")
    meta.update(kernel=fn, constexprs=consts, divisible16=list(div16), ptx_lines=stripped.count("\n"))
    with open(os.path.join(outdir, name + ".json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    return name, meta


def strip_keep_debug_labels(raw: str) -> str:
    """strip_ptx but keeping the debug-scope labels ($L__tmpN:): ptxas takes a label as a block
    boundary, so where they fall can change the SASS even when the instructions are the same."""
    global DBG_LABEL
    saved, DBG_LABEL = DBG_LABEL, re.compile(r"(?!)")
    try:
        return strip_ptx(raw)
    finally:
        DBG_LABEL = saved


LABEL = re.compile(r"\$L__[A-Za-z_]+\d+(?:_\d+)?")


def normalize_labels(text: str) -> str:
    """Rename labels ($L__BB0_12 ...) in order of first appearance (for a renumbering-only diff)."""
    names = {}

    def sub(m):
        return names.setdefault(m.group(0), f"$L{len(names)}")

    return LABEL.sub(sub, text)


def compare(a, b):
    names = sorted(f[:-4] for f in os.listdir(a) if f.endswith(".ptx") and not f.endswith(".raw.ptx"))
    names_b = sorted(f[:-4] for f in os.listdir(b) if f.endswith(".ptx") and not f.endswith(".raw.ptx"))
    ok = names == names_b
    if not ok:
        print("variant sets differ:", set(names) ^ set(names_b))
    print(f"{'variant':42s} {'lines':>6s} {'ptx':>9s} {'labels-norm':>11s} {'+dbg-lbl':>9s} {'sass':>9s} {'regs':>9s} "
          f"{'spill st/ld':>11s} {'stack':>5s} {'C7514':>5s} {'shared':>7s}")
    for n in names:
        if n not in names_b:
            continue
        pa, pb = (open(os.path.join(d, n + ".ptx")).read() for d in (a, b))
        ma, mb = (json.load(open(os.path.join(d, n + ".json"))) for d in (a, b))
        same = pa == pb
        norm = normalize_labels(pa) == normalize_labels(pb)
        sa, sb = (open(os.path.join(d, n + ".sass")).read() if os.path.exists(os.path.join(d, n + ".sass"))
                  else None for d in (a, b))
        sass_same = sa is not None and sa == sb
        la, lb = (strip_keep_debug_labels(open(os.path.join(d, n + ".raw.ptx")).read()) for d in (a, b))
        dbg_labels_same = la == lb
        keys = ("regs", "spill_stores", "spill_loads", "stack", "wgmma_serialized", "shared", "num_warps")
        meta_same = all(ma.get(k) == mb.get(k) for k in keys)
        ok &= same and meta_same and sass_same and dbg_labels_same
        print(f"{n:42s} {pa.count(chr(10)):>6d} {'IDENTICAL' if same else 'DIFFERS':>9s} "
              f"{'same' if norm else 'DIFFERS':>11s} {'same' if dbg_labels_same else 'DIFFERS':>9s} "
              f"{'IDENTICAL' if sass_same else 'DIFFERS':>9s} "
              f"{str(ma.get('regs')) + '/' + str(mb.get('regs')):>9s} "
              f"{ma.get('spill_stores')}/{ma.get('spill_loads')}->{mb.get('spill_stores')}/{mb.get('spill_loads'):<3} "
              f"{str(ma.get('stack')) + '/' + str(mb.get('stack')):>5s} "
              f"{'T' if ma.get('wgmma_serialized') else 'F'}/{'T' if mb.get('wgmma_serialized') else 'F':<3s} "
              f"{'=' if ma.get('shared') == mb.get('shared') else 'DIFF':>7s}"
              + ("" if meta_same else "  META DIFFERS"))
    print("ALL IDENTICAL" if ok else "NOT IDENTICAL")
    return 0 if ok else 1


def main():
    if sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    outdir = sys.argv[1]
    jobs = int(sys.argv[sys.argv.index("-j") + 1]) if "-j" in sys.argv else (os.cpu_count() or 2)
    os.makedirs(outdir, exist_ok=True)
    vs = variants()
    if "--only" in sys.argv:
        pat = sys.argv[sys.argv.index("--only") + 1]
        vs = [v for v in vs if re.search(pat, v[0])]
    with ThreadPoolExecutor(jobs) as ex:
        for name, meta in ex.map(lambda v: compile_one(outdir, v), vs):
            if meta == "ERROR":
                print(f"{name}: ERROR (see {name}.error)", flush=True)
            else:
                print(f"{name}: {meta['ptx_lines']} lines, regs {meta.get('regs')}, spills "
                      f"{meta.get('spill_stores')}/{meta.get('spill_loads')}, stack {meta.get('stack')}, "
                      f"C7514 {meta.get('wgmma_serialized')}, shared {meta.get('shared')}", flush=True)


if __name__ == "__main__":
    main()
