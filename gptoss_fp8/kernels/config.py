"""Every tuning choice of the kernels, in one frozen ``KernelConfig`` passed to each launcher.

Contract: a launcher called with ``config=None`` uses ``DEFAULT`` (the H200-measured best, the
shipped path); a run is reproduced from its config alone (no module globals, no environment
variables: the environment's Gluon off-switch is read by ``model/triton_ops.TritonOps`` when it
builds its default, not here). Tile heuristics by shape are methods (``dense_tile``, ``moe_plan``,
``prefill_tile``) returning small typed dataclasses; the benchmarks vary a config with
``dataclasses.replace``. Figures behind each default: BENCHMARKS.md and benchmarks/notes/.
What this module does not do: check that a tile fits a GPU (the launchers assert their limits).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace

import torch

from gptoss_fp8.kernels import _gluon


@dataclass(frozen=True)
class TritonTile:
    """One launch of the Triton FP8 block GEMM (dense ``fp8_gemm`` or a grouped expert GEMM)."""

    block_m: int
    block_n: int  # dense / down: <= 128 (one weight-scale block); gate_up: 256 (one SwiGLU output group)
    group_m: int = 8  # row tiles that sweep the column tiles together (L2 reuse)
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = True  # dense: tensor-descriptor loads (pointer loads where operands are not 16-byte aligned)
    persistent: int = 0  # dense: 0 = one program per tile, n = n programs per SM walking the tiles
    flatten: bool = False  # dense, persistent: the tile and K loops fused into one pipelined loop
    split_n: bool = True  # gate_up: 256 columns as two 128-column products (False: one, per-column scales)


@dataclass(frozen=True)
class GluonTile:
    """The warp-specialized Gluon GEMMs: ring depth, tile order, the tile and its main loop.

    block_m / block_n None: the kernel's base tile (dense 128 x 128, MoE gate_up 64 x 256). The wide
    forms hold two 64 x 128 products per consumer warpgroup: dense block_m=256 (256 x 128,
    DeepGEMM's tile for these shapes) or block_n=256 (128 x 256, the default from 8192 rows);
    gate_up block_m=128 (128 x 256 over 128-row segments); the MoE's Gluon down is a 128 x 256 tile
    too (``MoePlan.down``, block_m=128).
    balance: the fewest persistent programs that keep the number of waves (DeepGEMM's num_min_sms).
    promote: the main loop, both with the package's promotion numerics (each 128-wide K block's
    product in a temporary, scaled and added to a separate fp32 accumulator). "pipelined"
    (``_gluon.block_scaled_mainloop``, base tiles only): block k + 1's wgmma issued before block
    k's promotion, which ptxas serializes (its C7514). "serial"
    (``_gluon.block_scaled_mainloop_serial``): every block's wgmmas waited for within their
    iteration (no C7514). The wide forms and the Gluon down have only "serial": their launchers
    raise ValueError for promote="pipelined" (``_gluon.check_promote``), so those tiles are written
    ``GluonTile(block_n=256, promote="serial")`` etc. (The in-place accumulation, FP8 wgmma
    accumulating over all of K in its limited internal precision, lost accuracy on the H200 and
    was removed.)
    turns: the two consumer warpgroups of the wide tiles (the MoE's wide gate_up and Gluon down, the
    dense 256 x 128 / 128 x 256) issue their wgmmas in turns (``_gluon.block_scaled_mainloop_serial``'s
    TURN, FlashAttention-3's ping-pong applied to the promotion loop: one warpgroup's product on the
    tensor core while the other promotes). Opt-in: its GPU tests pass (H100, thirty-sixth session, 78 with the
    wide tiles'), but the whole 20b at 32768 tokens, same process, is no faster (0.3992 against 0.4005 s on the
    H100, inside the runs' spread); the base tiles refuse it.
    stage_scales: the MoE's heavy-load tiles (128-row gate_up, Gluon down) only: the producer copies each
    K block's row scales (MN-major, as ``gather_act_quant(scale_mn_major=True)`` and the wide gate_up
    write them for the next GEMM) and weight scales into the stage with TMA, and the consumers read
    them from shared memory (DeepGEMM's way) instead of global loads the promotion waits on. Same
    bits. Built without a GPU in the twenty-eighth session (``_gluon.load_stage_scaled``). On the GPU
    (thirty-sixth session) its launches stopped with "illegal instruction" at the scale copies: a TMA box
    must start on a 16-byte boundary (``benchmarks/tma1d_probe.py``), and the scale boxes started at any
    element; fixed (the row scales' K blocks 16-byte apart, the weight scales' box from the boundary below),
    and each stage's weight-scale box 128 bytes at least (a TMA destination starts on a 128-byte boundary:
    "misaligned address" at K = 160 / 640 otherwise). Thirty-seventh session, H100: its GPU tests pass (98),
    the whole 20b 1.1% faster at 32768 tokens, 0.5% at 128000, same logits: **on** for the MoE's heavy-load
    tiles (``KernelConfig``); opt-in on the dense 128 x 256 tile (0.75% / 0.6%, inside the runs' spread at
    32768). Other tiles refuse it (``_gluon.check_stage_scales``).
    gather: the MoE's 128-row gate_up only: its producer copies each K block's A rows by cp.async straight from
    the tokens' own FP8 rows (the norm's quantization, row slot // top_k) instead of TMA from rows pre-gathered in
    sorted order by ``gather_act_quant`` (one [T * k, H] FP8 write and read a layer fewer: ~0.25 ms a layer at
    32768 tokens); with stage_scales it copies the K block's row scales too (one 4-byte cp.async a row), else the
    consumers read the tokens' row scales. Same bits. **Slower**: H200, the whole 20b, same process (thirty-fifth
    session): 0.5219 s against 0.3826 at 32768 tokens (the one producer warp recomputed every K block the rows'
    token offsets: 926 instructions a K block, about the tensor core's time for one); with the offsets once a tile
    (399 a K block) 3.5% slower (H100, thirty-seventh session); with four producer warps (8 copies a thread a K
    block; the partition is padded to a warpgroup anyway) and the stage scales (forty-third session, H100): the
    MoE back to back 7.25-7.29 ms against the default's 7.13-7.22 (the gather's own 0.25 ms included there; Nsight
    Compute: the gate_up reads 2.95 GB from DRAM against 2.31, tensor pipe 62% active against 67%), the whole 20b
    0.3920 against 0.3893 s at 32768 and 3.3140 against 3.3004 s at 128000. Opt-in. Other tiles refuse it
    (``_gluon.check_gather``).
    narrow: the 128 x 256 tiles (dense block_n=256, the MoE's Gluon down): the last column tile, where its valid
    columns fit 64 (N % 256 in 1..64: o_proj's and the down's N = 2880), runs one m64n64 product a warpgroup instead
    of an m64n128 one half past N (2.2% of those GEMMs' products at N = 2880). Same bits (each output element the
    same K blocks' products, promoted alike). Built without a GPU in the thirty-ninth session; its GPU tests pass
    (H100), the whole 20b no faster for it (0.3905 against 0.3907 s at 32768 tokens; with the residual and router
    options 3.2782 against 3.2766 s at 128000: inside the spread). Opt-in; other tiles refuse it
    (``_gluon.check_narrow``).
    thread_release: the MoE's 128-row tiles (wide gate_up, Gluon down) only: each consumer thread releases a stage
    itself (``_gluon.release``: ``cp.async.mbarrier.arrive.noinc``, the empty barriers counting 256 arrivals), where
    ``mbarrier.arrive`` is one thread's after a barrier of the warpgroup's 128 threads (every K block: DeepGEMM
    releases per warp, 27th session). Same bits; **slower** (forty-fourth session, H100, same process): the MoE back
    to back 7.24 against 7.08 ms, the whole 20b 0.3894 against 0.3850 s at 32768 tokens and 3.2752 against 3.2602 s
    at 128000 (each thread's arrive on one barrier costs more than the warpgroup's barrier it saves; one barrier a K
    block stays, the compiler's before the ready wait). Opt-in; other tiles refuse it
    (``_gluon.check_thread_release``)."""

    stages: int = 4
    group_m: int = 8
    block_m: int | None = None
    block_n: int | None = None
    balance: bool = False
    promote: str = "pipelined"
    turns: bool = False
    stage_scales: bool = False
    gather: bool = False
    narrow: bool = False
    thread_release: bool = False

    def __post_init__(self):
        if self.promote not in _gluon.PROMOTES:
            raise ValueError(f"GluonTile.promote must be one of {', '.join(_gluon.PROMOTES)}, got {self.promote!r}")


@dataclass(frozen=True)
class MoePlan:
    """The fused MoE's launches: experts' row segments padded to ``align_m`` (each GEMM's BLOCK_M
    divides it); gate_up on the Triton kernel (A gathered by token) or the Gluon one (A
    pre-gathered in sorted order by ``gather_act_quant``, ``align_m`` 64, or 128 for its wide
    form); down on Triton, or on Gluon with ``GluonTile(block_m=128, promote="serial")`` (128 x 256
    tiles, align_m 128; ``KernelConfig.moe_plan`` picks it with the wide gate_up for heavy loads)."""

    align_m: int
    gate_up: TritonTile | GluonTile
    down: TritonTile | GluonTile
    tma: bool = True  # weights (and down's A) through tensor descriptors


@dataclass(frozen=True)
class PrefillTile:
    """One launch of the Triton prefill attention kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # register cap per thread (more programs per SM), None: the compiler's
    pack: int = 1  # query heads of one KV head per program, stacked in the tile's rows (GQA packing)
    # one masked loop over the tile's keys instead of three (window edge masked / whole blocks unmasked / diagonal
    # masked): a 128-key window's 5 blocks of 32 pipelined as one range (issue 34: the window layers' latency)
    one_loop: bool = False


GLUON_EXP_MODES = ("mufu", "fma25", "fma50", "bf16x2")  # how GluonAttentionTile's kernel computes 2^x


@dataclass(frozen=True)
class GluonAttentionTile:
    """The warp-specialized Gluon causal attention (kernels/attention_ws.py; ``ws_attention_prefill``'s
    options: benchmarks/attn_variants.py measures them side by side)."""

    block_n: int = 64
    stages: int = 4
    warpgroups: int = 3
    q_in_registers: bool = True  # Q the register operand of QK^T (+3.0-3.3% on the H200, 8192-128000 tokens)
    deep: bool = False  # blocks in pairs, QK^T of the second under the first one's softmax
    exp: str = "mufu"  # 2^x of the unmasked blocks: "mufu", "fma25" / "fma50" (part by polynomial), "bf16x2"
    rescale_threshold: float = 0.0  # > 0: move the running max only past this growth (log2 units)
    ordered: bool = False  # the consumer warpgroups issue their MMAs in turn (FlashAttention-3's ping-pong)
    tree: bool = False  # row max / sum of a score tile folded as a tree, not one dependent chain
    sync: bool = False  # each block's MMAs waited for within its step (no P carried: 128-key blocks fit 3 wg)

    def __post_init__(self):
        # (kernels/attention_ws.py's timing probes compute wrong values: a tile never names them)
        if self.exp not in GLUON_EXP_MODES:
            raise ValueError(f"GluonAttentionTile: exp={self.exp!r}, expected one of {GLUON_EXP_MODES}")
        # (64-key blocks with sync returned wrong rows on the H200 at T = 1000 and 4099, rel. error 0.58,
        # since the twenty-first session, not located; 128-key blocks pass every GPU test)
        if self.sync and self.block_n != 128:
            raise ValueError(f"GluonAttentionTile: sync=True needs block_n=128 (got {self.block_n}): at 64 keys it "
                             "computes wrong rows")


@dataclass(frozen=True)
class DecodeTile:
    """One launch of the split-KV decode kernel (BLOCK_M follows the rows, NQ * GROUP)."""

    block_n: int
    num_warps: int
    num_stages: int


GEMM_BACKENDS = ("ours", "deep_gemm")
ATTENTION_BACKENDS = ("ours", "flashinfer")

# The interpreter gets small tiles (its cost grows with them): constants, not tuning.
CPU_PREFILL_TILE = PrefillTile(32, 16, 4, 1)
CPU_DECODE_TILE = DecodeTile(16, 4, 1)


@dataclass(frozen=True)
class KernelConfig:
    """The kernels' tuning, defaults = the measured best on the H200 (figures in the comments)."""

    # The Gluon warp-specialized kernels where they can run (sm_90, Gluon's Hopper API); False
    # keeps every call on the Triton kernels.
    gluon: bool = True
    # Which library runs the dense and grouped FP8 GEMMs: "ours" (the kernels of this package, the
    # default) or "deep_gemm" (DeepGEMM when importable, kernels/deepgemm.py; bias, SwiGLU and
    # quantization stay in our neighbouring kernels).
    gemm: str = "ours"
    # Which library runs the bf16 prefill attention of a whole prompt: "ours" (the default) or
    # "flashinfer" (FlashInfer's sink prefill when importable, kernels/flashinfer_attention.py; FP8
    # attention, prompt chunks after cached keys, decode and head dims other than 64/128/256 stay
    # on ours).
    attention_backend: str = "ours"
    # Dense GEMM on Gluon from this many rows; None: never. benchmarks/gemm_sweep.py (H200,
    # 2026-12-01, thirteenth session, one process), 1024 rows: the 128 x 128 tile with serial
    # promotion and balanced grid 826 / 889 TFLOP/s for qkv / 5760 against 723 / 781 (pipelined
    # loop) and 912 / 955 for cuBLAS blockwise without bias.
    dense_gluon_min_rows: int | None = 1024
    dense_gluon_tile: GluonTile = field(
        default_factory=lambda: GluonTile(stages=5, group_m=8, balance=True, promote="serial"))
    # The wide promoted tile (128 x 256, serial promotion, 3 stages) from this many rows, and for
    # narrow outputs (N <= 3072: o_proj) from ``dense_gluon_min_rows``: 4096 rows 990 / 1007 / 965
    # TFLOP/s for qkv / o_proj / 5760 (cuBLAS no bias 988 / 987 / 984, DeepGEMM 960 / 863 / 1099),
    # 1.20-1.25x the 128 x 128 tile; o_proj at 1024 rows 864 against 802 for the Triton tile.
    dense_gluon_wide_min_rows: int | None = 4096
    dense_gluon_wide_tile: GluonTile = field(
        default_factory=lambda: GluonTile(stages=3, group_m=8, block_n=256, promote="serial"))
    # Decode-sized calls: the dense GEMM up to this many rows on kernels/fp8_gemv.py (weights as the
    # MMA's M side, split-K with an in-kernel fixed-order reduction), the routed experts up to this
    # many (token, slot) pairs on kernels/moe_gemv.py (no alignment; each routed expert's weights
    # read once). None: never. Figures: BENCHMARKS.md "Decode".
    dense_skinny_max_rows: int | None = 16
    moe_skinny_max_slots: int | None = 16
    # The decode MoE on 64-row fp8 wgmma tiles (moe_gemv.WGMMA_TILE) instead of its exact 32-row
    # mma.sync default: 35.8 against 39.5 us a layer at one token, 3.3e-3 .. 5.2e-3 from the w8a8
    # spec against 1e-5 .. 7e-5 (H200, moe_gemv.moe_skinny_tile's docstring).
    moe_skinny_wgmma: bool = False
    # Programmatic dependent launch (kernels/pdl.py) for the kernels of calls of at most this many
    # token rows (decode steps): each may start while its predecessor drains, weights prefetched
    # into L2 before its wait. 20b decode at 8192 cached tokens, one process (benchmarks/ab_decode.py,
    # H200, fourteenth session): batch 1 2194 -> 2151 us, batch 4 3997 -> 3882, batch 8 and 64
    # within 0.1%; logits bit-identical. None: never.
    pdl_max_rows: int | None = 64
    # MoE gate_up on Gluon where segments are 64-row aligned: 3-11% faster (BENCHMARKS.md, 7th
    # session); ring depth / tile order within 0.6% of each other (10th session): 4 stages, GROUP_M 8.
    moe_gluon: bool = True
    # gate_up 64 x 256 with serial promotion: the whole FFN 1.02-1.18x the pipelined loop's at 8192
    # tokens, 32 / 128 experts, same numerics (benchmarks/gemm_sweep.py --quick, H200, 2026-12-01).
    moe_gluon_gate_up: GluonTile = field(default_factory=lambda: GluonTile(promote="serial"))
    # Heavier loads (at least this many rows per expert and ``moe_wide_min_tokens`` tokens): the
    # wide gate_up (128 x 256 over 128-row segments) and the Gluon down, both serial: the whole
    # FFN 1.25 / 1.10x the 64 x 256 gate_up at 8192 tokens and 1.24 / 1.14x at 32768 for 32 / 128
    # experts; at 2048 tokens 0.97 / 0.95x, hence the limits (benchmarks/gemm_sweep.py, H200,
    # 2026-12-01, thirteenth session). None: never. Their tile order in groups of 16 M tiles, not 8:
    # the MoE back to back at the 700 W cap 7.365 ms against 7.46-7.54 (32768 tokens, 32 experts), the
    # whole 20b 0.4187 s against 0.4236 at 32768 tokens, 3.594 against 3.602 s at 128000 (same
    # process, bit-identical; benchmarks/moe_parts.py --plans, ab_prefill.py wide-g16, 27th session).
    moe_wide_min_rows_per_expert: int | None = 256
    moe_wide_min_tokens: int = 4096
    # GluonTile.stage_scales on both (thirty-seventh session, H100, same process, same logits): the 20b 1.1% faster
    # at 32768 tokens (0.3986 against 0.4030 s), 0.5% at 128000 (3.3731 against 3.3898 s).
    moe_gluon_wide_gate_up: GluonTile = field(
        default_factory=lambda: GluonTile(4, 16, block_m=128, promote="serial", stage_scales=True))
    moe_gluon_down: GluonTile = field(
        default_factory=lambda: GluonTile(4, 16, block_m=128, promote="serial", stage_scales=True))
    # The wide gate_up's pre-gathered A rows (``gather_act_quant`` from the norm's FP8 rows) written walking the
    # tokens in order (``moe_align_rows``' slot -> row map): each token's row read once and stored into its k rows,
    # where the sorted walk reads it k times from wherever it lies (the 20b's 94 MB of FP8 rows at 32768 tokens do
    # not stay in L2: ~0.75 GB moved a layer instead of ~0.47). Same bytes out. Forty-fourth session, H100, same
    # process: the gather 208.5 against 303.0 us at 32768 tokens, the MoE back to back 6.99-7.00 against 7.08 ms, the
    # whole 20b 0.3842 against 0.3850 s at 32768 (7 runs) and 3.2434 against 3.2602 s at 128000 (3 runs), logits equal.
    moe_gather_by_token: bool = True
    # One-sequence causal attention with head_dim 64 on Gluon: 460-463 vs 431-439 TFLOP/s at
    # 32768 / 131072 tokens (notes/kernels_attention.md, 7th session).
    attention_gluon: bool = True
    attention_gluon_tile: GluonAttentionTile = field(default_factory=GluonAttentionTile)
    # ... and a later prompt chunk's (q_offset > 0: the serving engine's chunks after the first) on it too, not on
    # the Triton kernel (Gluon 460-463 against 431-439 TFLOP/s on whole prompts, above). Opt-in: built without a
    # GPU in the twenty-ninth session; on once its GPU tests pass (tests/kernels/test_attention.py "offset")
    attention_gluon_offset: bool = False
    # ``--attention fp8`` on one causal sequence: the Gluon e4m3 kernel (kernels/attention_ws_fp8.py)
    # instead of the Triton kernel's FP8 path (issue 34, BENCHMARKS.md)
    attention_gluon_fp8: bool = True
    # ... and a later prompt chunk's (q_offset > 0: the serving engine's chunks after the first, a prefill's
    # pruned last row in a window layer) on it too, not on the Triton kernel's FP8 path (1.86x the Gluon
    # kernel's time for a whole 128000-token prompt, eighteenth / twenty-third sessions). Opt-in: built without
    # a GPU in the twenty-ninth session; on once its GPU tests pass (tests/kernels/test_attention.py "offset")
    attention_gluon_fp8_offset: bool = False
    # Several sequences' prompt chunks of a serving step (``GptOss.prefill_many``, bf16) in one launch of the Triton
    # prefill kernel per layer (kernels/attention.py k_starts / q_offsets: keys where the cache holds them), not a
    # launch per chunk (the Gluon kernel on first chunks, the Triton one after). Thirtieth session, no device: the
    # CPU tests (interpreter) pass; the GPU test and the served A/B wait (gpu_suite.sh segments)
    attention_segments: bool = True
    # ... on the bf16 Gluon kernel where it applies (full causal layers, head_dim 64, sm_90: ``ws_attention_prefill(
    # segments=)``, each sequence's rows stored under a mask), not the Triton one (1.07x the Gluon kernel's time on a
    # long prompt, issue 34 tables). Opt-in: built without a GPU in the thirtieth session; on once its GPU tests pass
    # (tests/kernels/test_attention.py "gluon_segments")
    attention_gluon_segments: bool = False
    # its QK^T's A operand (Q) from registers, loaded once (``ws_attention_prefill_fp8(q_in_registers=)``): opt-in,
    # rebuilt without a GPU in the twenty-eighth session (the bf16 kernel's 3% win), not knowing that the twenty-
    # fourth had timed the same option on the FP8 kernel of then (``q_regs``, b092d9f): equal (216.9 / 215.8 against
    # 216.2 / 215.9 ms at 128000, 14.51 against 14.40 at 32768). One A/B on today's kernel; removed unless it wins
    attention_fp8_q_registers: bool = False
    # The FP8 Gluon kernel's row max with one reduction across the quad's lanes a 128-key step (each block's
    # maxima folded within the threads and scaled there, then one pair of shuffles; the same m bit for bit): 4 SHFL
    # and 4 FMNMX fewer a thread and step (~2% of its instructions; static SASS, thirty-third session, no device).
    # Timed (H200, whole 20b at 32768, same process, thirty-fifth session): 0.3823 against 0.3826 s, within the
    # runs' spread (0.3798-0.3850), the same logits: no measurable gain, so it stays opt-in
    attention_fp8_lane_max: bool = False
    # Which of the FP8 Gluon kernel's ``exp_lin`` forms ``--attention fp8-lin`` launches (``ws_attention_prefill_fp8``;
    # every form computes ``spec.attention_fp8(p_code="lin")``): 5 (forty-sixth session) the codes against the running
    # max first, their row maxima on packed 16-bit halves, m raised and the accumulators rescaled only in the steps
    # that need it, the 16-bit codes' bound from Q's and K's row norms (one a Q tile, ``lin_bounds``). H100, 64 / 8
    # heads at 128000: 181.2 ms alone on random inputs, 177.9 ms on Q / K at a trained model's amax (x7), against
    # form 2's (the forty-fifth session's: fp32 row max first, the bound from amax) 187.4 / 207.1 (its 16-bit fast
    # path lost to the float clamp) and form 4's (5 with 2's bound) 185.3 / 342.8; the whole 20b in one process
    # 2.9393 s (5) against 2.9805 (2), 2.9897 (4), 3.2432 with ``--attention fp8``. 1 / 3: measurement forms. 6
    # (fifty-first session, opt-in): 5 with the fast steps whose codes are all <= 0 for the warpgroup (P8 = 0: scores
    # ~17 log2 units under the running max) skipping their PV and row-sum MMAs, the same bytes. H100, alone at 128000:
    # 188.6 ms against 5's 179.6 on random inputs (no such steps: the branch costs 5%), 157.2 against 180.0 on Q / K
    # at a trained model's amax (-13%); the whole random 20b 3.0348 s against 2.9800. A trained model's long prompts
    # lie between; not yet measured. (Those timings had the stages' release after the adds; it is now back where 5
    # has it, among them: 4-7% slower than 5 on random inputs, 11% faster at x7, fifty-fourth session.) 8 (fifty-fourth
    # session, the default): 5 with the fast step's rescale made every step by d = 0 where none is needed, so no
    # warpgroup-wide maximum of the rows' codes and no branch (``_lin_cmax``'s NOBRANCH; 362 SASS instructions a
    # step, the rescale fused into the PV adds), the same bytes as 5 (GPU test; the whole models' logits equal). H100,
    # same process: alone at 128000 179.3 against 180.4 ms on random inputs, 172.0 against 178.3 at x7; the whole 20b
    # 2.8948 against 2.9610 s at 128000, 0.3586 against 0.3694 at 32768; the 120b (12 layers' weights) 4.5378
    # against 4.6389 s
    attention_exp_lin: int = 8
    # The FP8 Gluon kernel's consumer warpgroups quantize their own Q tiles from q's bf16 rows (rotated first), no Q
    # quantization launch (``ws_attention_prefill_fp8(q_fused=True)``: attn_quant's bytes and scales; ~0.27 GB a full
    # layer at 32768 tokens not written and read back). Built without a GPU in the thirty-ninth session; its GPU tests
    # pass (bit-equal), but **slower**: the whole 20b on the H100, same process, 0.3928 against 0.3907 s at 32768
    # tokens, 3.3137 against 3.2842 s at 128000 (each program's Q loads and quantization before its first product,
    # where the producer's TMA copy of the e4m3 tile overlapped). Opt-in
    attention_fp8_q_fused: bool = False
    # The FP8 Gluon kernel of a full layer writes o_proj's input quantization (act_quant's bytes) in place of its bf16
    # rows where o_proj reads only that (``TritonOps.attention_out``; ``ws_attention_prefill_fp8(quant_out=True)``:
    # two heads, one 128-column group, a program, a pass over the keys for each): one [T, Hq * D] bf16 write and read
    # and an act_quant launch fewer a full layer (~1.7 ms of a 20b prefill at 32768 tokens by the thirty-eighth
    # session's deletion probe). Forty-third session, H100: its GPU tests pass (act_quant's bytes); the kernel 0.6%
    # under the rows + act_quant at 32768 tokens and 0.4% over at 128000 (medians of 7 rotated rounds), the whole 20b
    # the same within the spread at 32768 and 0.6% slower at 128000 (3.3187 against 3.2984 s; BENCHMARKS.md "Two byte
    # cuts tried again"). Opt-in
    attention_fp8_quant_out: bool = False
    # A window layer's Triton prefill kernel writes o_proj's input quantization (act_quant's bytes) in place of its
    # bf16 rows where o_proj reads only that (``TritonOps.attention_out``, ``attention_prefill(quant_out=True)``):
    # one [T, Hq * D] bf16 write and read and an act_quant launch fewer a window layer (thirty-eighth session)
    attention_quant_out: bool = True
    # One sequence's sliding-window layers (from position 0, head_dim 64, query heads in pairs, bf16) on the
    # warp-specialized Gluon kernel (kernels/attention_window_ws.py: Q and the ring of key blocks by TMA, each block
    # loaded once a program, the rope and o_proj's quantization fused), not the Triton one (2.4-3x its bytes floor,
    # 0.48 ms a layer in the 20b at 32768 tokens on the H200). Built without a GPU in the forty-first session; on the
    # H100 its GPU tests pass against the spec (bf16 rows; the model's form: o_proj's input bit-equal to act_quant's;
    # two option faults, refused now, their tests not rerun) and it is not faster yet (0.483 against 0.461 ms at
    # 32768, 1.745-1.804 against 1.751 at 128000; latency-bound, BENCHMARKS.md "The window layers"): opt-in
    # (gpu_suite.sh window-gluon)
    attention_gluon_window: bool = False
    # With it, a step's two heads interleaved in each consumer warpgroup (``window_attention_prefill(pair=True)``:
    # head 1's rotation under head 0's QK^T, its softmax under head 0's PV; the same bytes). Forty-second session, H100:
    # the kernel level with the Triton one at 32768 tokens (0.446 against 0.442 ms), 6-7% under it at 128000 (1.675
    # against 1.706; 1.592 with 16 steps a program and a 5-deep ring); the whole 20b the same (0.3896 against 0.3890 s
    # at 32768, 3.3068 against 3.3076 at 128000, same process): opt-in
    attention_gluon_window_pair: bool = False
    # o_proj's GEMM adds the residual stream in its epilogue (``fp8_gemm(residual=)``, ``TritonOps.linear_add``): the
    # post-attention norm then reads the new stream alone, not the stream and o_proj's delta, and writes no new
    # stream: one [T, H] bf16 write and read fewer a layer (~189 MB at 32768 tokens; the skip probe's norms ran at
    # their bytes floor; the Gluon wide tiles' residual lands by TMA in their store buffers during the tile before's
    # products). And the post-attention norm leaves its bf16 rows out and writes each row's rsqrt factor; the router
    # remakes the rows from the new stream as it reads them (kernels/router.py ``norm``: the same bits) and the
    # expert GEMMs read the norm's quantization (``TritonOps.moe_needs_rows``): one [T, H] bf16 write a layer fewer.
    # Both built without a GPU (thirty-ninth session), then on H100s, the whole 20b, same process, logits equal, a
    # small gain or none: at 32768 tokens -1.1 ms (0.3975 against 0.3986 s, 21 runs, a second machine), -1.5 ms
    # with the narrow tile too (0.3901 against 0.3916, 21 runs), -0.7 ms (15 runs, inside the spread); at 128000
    # -8.6 ms (3.2766 against 3.2852 s, 6 runs; -7.0 with the narrow tile, twice) and 0.0 on the second machine
    # (3.3389 against 3.3391 s, 6 runs). Never slower, fewer bytes: on by default.
    gemm_residual: bool = True
    moe_rows_from_stream: bool = True
    # Rows a program of a norm of the stream alone (no delta: the post-attention norm once o_proj added the residual),
    # ``norm.norm_tile``: 2 (122 against 146 us at 32768 tokens, H100, benchmarks/norm_sweep.py, forty-fourth
    # session; the same layout for each row, so the same bits). 1: before.
    norm_stream_rows: int = 2
    # Under ``--attention fp8`` a full layer's q / k / v GEMM rotates and quantizes Q in its epilogue (the Gluon 128 x
    # 256 tile, ``fp8_gemm.fp8_gemm_q8``, ``TritonOps.linears_q8``): attn_quant.quantize_qk(rope=)'s bytes and scales,
    # Q's bf16 columns never written nor read back by a quantization launch (~0.8 GB of traffic a full layer at 32768
    # tokens; the skip probe: the Q / K quantization launches 3.9 ms of a 32768 prefill). Fortieth session: the whole
    # 20b's logits equal with it (H100, same process), but **slower**: 0.3968 against 0.3949 s at 32768 (medians of 7;
    # the epilogue's rotation, per-head amax and IEEE quotients hold both consumer warpgroups off the tensor core on
    # 80% of the GEMM's tiles, more than the separate memory-bound pass costs). Opt-in.
    gemm_q_quant: bool = False
    # Triton prefill tiles, 8192 tokens: causal 1.30 ms (uncapped 8 warps 1.71). Window-128: four query heads a
    # program, 32 positions each (the 160 keys of a 32-position window span read once for four heads): 0.099 / 0.361 /
    # 1.401 ms at 8192 / 32768 / 128000 tokens against 0.113 / 0.417 / 1.625 for two heads of 32 (64 x 32, pack 2),
    # 64 q / 8 kv heads, H200 (benchmarks/window_sweep.py, twenty-sixth session; 2.4x its bytes floor).
    prefill_causal: PrefillTile = field(default_factory=lambda: PrefillTile(128, 64, 8, 3, maxnreg=128))
    prefill_window: PrefillTile = field(default_factory=lambda: PrefillTile(128, 32, 4, 2, maxnreg=128, pack=4))
    # for query-head groups that prefill_window's pack does not divide: two heads a program, else one
    prefill_window_pack2: PrefillTile = field(default_factory=lambda: PrefillTile(64, 32, 4, 2, maxnreg=128, pack=2))
    prefill_window_unpacked: PrefillTile = field(default_factory=lambda: PrefillTile(64, 64, 4, 2, maxnreg=128))
    # Decode: 128-key blocks, ~4 splits per tile best at batch 8 and 64 (32768 cached tokens).
    decode: DecodeTile = field(default_factory=lambda: DecodeTile(128, 4, 3))
    # A one-wave call (batch 1) against a long full-causal cache: 64-key blocks, ~2 programs per SM,
    # the separate merge: 23.5-24.9 vs 26.2 us (BENCHMARKS.md, 9th session).
    decode_one_wave: DecodeTile = field(default_factory=lambda: DecodeTile(64, 4, 4))
    decode_one_wave_programs_per_sm: int = 2

    def __post_init__(self):
        if self.gemm not in GEMM_BACKENDS:
            raise ValueError(f"KernelConfig.gemm must be one of {', '.join(GEMM_BACKENDS)}, got {self.gemm!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"KernelConfig.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.attention_exp_lin not in (1, 2, 3, 4, 5, 6, 8):
            raise ValueError(f"KernelConfig.attention_exp_lin must be 1 to 6 or 8 (the FP8 kernel's exp_lin forms), got "
                             f"{self.attention_exp_lin!r}")

    def gluon_on(self, device: torch.device) -> bool:
        """Whether the Gluon kernels may run on ``device``: allowed here and supported there."""
        return self.gluon and _gluon.supported(device)

    # --- shape heuristics --------------------------------------------------------------------
    def dense_tile(self, m: int, n: int, k: int, gluon_ok: bool = False) -> TritonTile | GluonTile:
        """The dense GEMM's launch by problem size. ``gluon_ok``: the Gluon kernel can take this
        call (``fp8_gemm`` decides). H200 (notes/kernels_gemm.md, 4th session, CUDA-graph device time
        beside blockwise ``_scaled_mm``): persistent flattened programs lead from 1024 rows on:
        64x128 tiles, 4 warps, 2 programs per SM up to 2048 rows and for narrow outputs (o_proj's
        N = 2880) up to 8192 rows; 128x128 tiles, 8 warps, 3 stages, one program per SM beyond.
        Below 512 rows (not re-measured) the one-program-per-tile 64x128 tile stays. Where the
        Gluon kernel can run, from ``dense_gluon_min_rows`` rows: its 128 x 128 tile, or the wide
        128 x 256 one from ``dense_gluon_wide_min_rows`` rows and for N <= 3072 (the field comments
        have the figures)."""
        lo = self.dense_gluon_min_rows
        if gluon_ok and lo is not None and m >= lo:
            wide = self.dense_gluon_wide_min_rows
            return self.dense_gluon_wide_tile if wide is not None and (m >= wide or n <= 3072) else self.dense_gluon_tile
        if m <= 16:
            return TritonTile(16, 64, group_m=1, num_warps=4, num_stages=4)
        if m <= 64:
            return TritonTile(64, 64, group_m=1, num_warps=4, num_stages=4)
        if m <= 512:
            return TritonTile(64, 128, group_m=8, num_warps=4, num_stages=5)
        if m <= 1024 and n <= 3072:
            # o_proj (2880 x 4096) at 1024 rows: one program per tile, 3 stages, 30.5 us against
            # 35.2 for the persistent tile (benchmarks/oproj_small.py, 8th session)
            return TritonTile(64, 128, group_m=8, num_warps=4, num_stages=3)
        if m <= 2048 or (n <= 3072 and m <= 8192):
            return TritonTile(64, 128, group_m=8, num_warps=4, num_stages=4, persistent=2, flatten=True)
        return TritonTile(128, 128, group_m=8, num_warps=8, num_stages=3, persistent=1, flatten=True)

    def moe_plan(self, num_tokens: int, top_k: int, num_experts: int, gluon_ok: bool = False) -> MoePlan:
        """The fused MoE's tiles by load (H200 sweeps, notes/kernels_gemm.md). ALIGN_M pads each
        expert's rows (padding waste vs tile efficiency). gate_up's 256 columns: one product per K
        step at ALIGN 64 (2-5% faster whole FFN, 3rd session), two 128-column halves at 16.
        ``gluon_ok``: the Gluon gate_up can run here (an sm_90 GPU); from
        ``moe_wide_min_rows_per_expert`` rows per expert and ``moe_wide_min_tokens`` tokens the
        wide gate_up and the Gluon down over 128-row segments."""
        rows_per_expert = num_tokens * top_k / max(num_experts, 1)
        align = 64 if rows_per_expert >= 48 else 16
        down = TritonTile(align, 128, group_m=8, num_warps=4, num_stages=4)
        if gluon_ok and align == 64 and self.moe_gluon:
            wide = self.moe_wide_min_rows_per_expert
            if wide is not None and rows_per_expert >= wide and num_tokens >= self.moe_wide_min_tokens:
                # 128-row segments: the wide gate_up's rows; the Gluon down's 128 x 256 tiles
                return MoePlan(128, self.moe_gluon_wide_gate_up, self.moe_gluon_down)
            # the wide gate_up (block_m 128) pads the experts' segments to its 128 rows
            return MoePlan(self.moe_gluon_gate_up.block_m or 64, self.moe_gluon_gate_up, down)
        gate_up = TritonTile(align, 256, group_m=8, num_warps=8 if align == 64 else 4, num_stages=4,
                             split_n=align != 64)
        return MoePlan(align, gate_up, down)

    def prefill_tile(self, on_gpu: bool, windowed: bool, group: int) -> PrefillTile:
        """The Triton prefill tile for a causal / sliding-window call with ``group`` query heads per KV head."""
        if not on_gpu:
            return CPU_PREFILL_TILE
        tile = self.prefill_window if windowed else self.prefill_causal
        if group % tile.pack == 0:
            return tile
        if windowed:
            pack2 = self.prefill_window_pack2
            return pack2 if group % pack2.pack == 0 else self.prefill_window_unpacked
        return PrefillTile(tile.block_m, tile.block_n, tile.num_warps, tile.num_stages, tile.maxnreg)


DEFAULT = KernelConfig()

_TRUE, _FALSE = ("true", "1", "on", "yes"), ("false", "0", "off", "no")


def _parse_value(text: str, current: object, annotation: str, name: str):
    """VALUE of NAME=VALUE, by the field's type: bool (true / false / 1 / 0 / on / off), int, float, str; "none"
    where the field's annotation allows None."""
    low = text.strip().lower()
    if low == "none":
        if "None" not in annotation:
            raise ValueError(f"{name}=none: {name} cannot be None ({annotation})")
        return None
    if isinstance(current, bool) or annotation == "bool":
        if low not in _TRUE + _FALSE:
            raise ValueError(f"{name}={text}: give true or false")
        return low in _TRUE
    if is_dataclass(current):
        fieldnames = ", ".join(f.name for f in fields(current))
        raise ValueError(f"{name}={text}: {name} is a {type(current).__name__}; set one of its fields as "
                         f"{name}.FIELD=VALUE ({fieldnames})")
    for kind in (int, float):
        if isinstance(current, kind) or annotation.split(" |")[0] == kind.__name__:
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{name}={text}: give {'an' if kind is int else 'a'} {kind.__name__}") from None
    return text.strip()


def _set(obj, path: list[str], text: str, name: str):
    """obj (a frozen dataclass) with the field at path set from text, checked by the dataclass's own __post_init__."""
    by_name = {f.name: f for f in fields(obj)}
    f = by_name.get(path[0])
    if f is None:
        near = sorted(n for n in by_name if path[0] in n or n in path[0])[:4]
        hint = f" (did you mean {', '.join(near)}?)" if near else f"; {type(obj).__name__} has {', '.join(by_name)}"
        raise ValueError(f"{name}: no field {path[0]!r} in {type(obj).__name__}{hint}")
    current = getattr(obj, f.name)
    if len(path) > 1:
        if not is_dataclass(current):
            raise ValueError(f"{name}: {path[0]} is a {type(current).__name__}, it has no fields")
        value = _set(current, path[1:], text, name)
    else:
        value = _parse_value(text, current, str(f.type), name)
    try:
        return replace(obj, **{f.name: value})
    except (ValueError, AssertionError, TypeError) as err:
        raise ValueError(f"{name}={text}: {err}") from None


def with_options(config: KernelConfig, options: list[str]) -> KernelConfig:
    """config with each "NAME=VALUE" applied in turn (``bench prefill --kernel-option``): NAME a KernelConfig
    field (``attention_fp8_lane_max=true``) or a tile's field (``moe_gluon_wide_gate_up.stages=3``); VALUE by the
    field's type. ValueError, one line naming the option, on an unknown name or a value the field refuses."""
    for option in options:
        name, eq, text = option.partition("=")
        name = name.strip()
        if not eq or not name:
            raise ValueError(f"kernel option {option!r}: give NAME=VALUE, e.g. attention_fp8_lane_max=true")
        config = _set(config, name.split("."), text, name)
    return config


def kernel_paths(device: torch.device, config: KernelConfig | None = None) -> str:
    """One line naming the kernels the ``triton`` ops backend runs on ``device`` with ``config``
    (and the GEMM library when it is DeepGEMM, the prefill attention's when it is FlashInfer)."""
    cfg = config or DEFAULT
    gemm = "; dense and grouped FP8 GEMMs on DeepGEMM (kernels/deepgemm.py)" if cfg.gemm == "deep_gemm" else ""
    attn = ("; bf16 prefill attention on FlashInfer (kernels/flashinfer_attention.py)"
            if cfg.attention_backend == "flashinfer" else "")
    if device.type != "cuda":
        return "kernels: Triton (interpreter on CPU)" + gemm + attn
    if not cfg.gluon_on(device):
        why = ("Gluon switched off (KernelConfig.gluon=False)" if not cfg.gluon
               else "no Gluon Hopper API in this triton" if not _gluon.HAS_GLUON else "not an sm_90 GPU")
        return f"kernels: Triton ({why})" + gemm + attn
    parts = [f"dense GEMM from {cfg.dense_gluon_min_rows} rows" if cfg.dense_gluon_min_rows is not None and not gemm
             else None,
             "MoE gate_up" if cfg.moe_gluon and not gemm else None,
             "one-sequence causal attention" if cfg.attention_gluon else None]
    gluon_parts = ", ".join(p for p in parts if p)
    return (f"kernels: Gluon warp-specialized ({gluon_parts}), Triton for the rest" if gluon_parts
            else "kernels: Triton") + gemm + attn
