"""Whole-model prefill A/B in one process: the same random model and tokens, variants of the
forward, runs interleaved (A, B, A, B, ...) so clock drift and machine-to-machine spread hit all
alike.

Usage (GPU machine): python3 benchmarks/ab_prefill.py --model 20b --tokens 8192 --runs 10 \\
    [--variants default,graph,unfused-combine,torch-router]
Config variants (below) combine with "+": "wide-gather+fp8-lanemax" runs both changes at once.
Variants: "default" (the ``triton`` ops backend as shipped), "unfused-combine" (the MoE's weighted
combine as its own kernel before the residual-add + norm, as before 2026-11-29 fifth session),
"graph" (the forward captured as a CUDA graph, bench/prefill.GraphedPrefill), "unfused-rope" (q's rope
as its own pass, not in the FP8 quantization / window kernel: before the twenty-eighth session;
"unfused-window-rope": only before the window layers), "moe-unchunked" (the MoE over all tokens at once, not
in the model's chunks, ``default_moe_chunk``: bench prefill's ``--moe-chunk``), "moe-chunk32768" (in chunks of
32768 tokens: every model's chunk before the thirty-seventh session), "chunk-combine" (the chunked MoE's combine
written as a [T, H] tensor and read back by the next norm: before the thirty-fourth session's ``out=``), "torch-router" (the
router as torch's bf16 linear + topk + softmax instead of kernels/router.py), "norm-rows" (every norm's bf16 rows
written, the input norms' too: before the thirty-third session's ``ops.needs_rows``), and kernel configs
(``dataclasses.replace`` of the default ``KernelConfig``, kernels/config.py): "triton-gemm" (the
dense GEMMs on the Triton kernel at every size: dense_gluon_min_rows=None), "triton-moe" (the
expert GEMMs on the Triton kernels: moe_gluon=False), "triton-attention" (attention_gluon=False),
"triton-all" (gluon=False), "gu-s<stages>-g<GROUP_M>", e.g. "gu-s5-g16" (the Gluon gate_up's ring
depth and tile-order group instead of 4 stages, GROUP_M 8; tenth session), "wide-g<GROUP_M>", e.g. "wide-g16" (the
heavy-load MoE plan's wide gate_up and Gluon down with that tile-order group instead of 16; twenty-seventh session),
"wide-turns" (both with ``GluonTile.turns``: their warpgroups' wgmmas in turns), "dense-turns" (the dense
wide tiles with turns), "all-turns" (both); "wide-scales" (the heavy-load MoE tiles with
``GluonTile.stage_scales``: the scales through the stages, twenty-eighth session), "wide-turns-scales" (both
options on the MoE tiles), "dense-scales" (the dense 128 x 256 tile with them), "all-scales" (MoE and dense),
"all-turns-scales" (both options on both); "fp8-qreg" (the FP8 attention's Q in registers, ``--attention fp8``);
"fp8-lanemax" (its row max with one shuffle pair a step: ``KernelConfig.attention_fp8_lane_max``, thirty-third
session); "fp8-quant-out" (the full layers' FP8 attention writes o_proj's input quantization, two heads a program:
``KernelConfig.attention_fp8_quant_out``, forty-third session, opt-in); "wide-gather" (the heavy-load gate_up's
producer copies A rows from the tokens' own FP8 rows, ``GluonTile.gather``, no ``gather_act_quant``: thirty-fourth
session; since the forty-third its four warps copy the row scales into the stages too, ``stage_scales`` kept;
"wide-gather-nosc": without them);
"gather-by-token" / "gather-sorted" (``gather_act_quant``'s rows written walking the tokens in order,
``KernelConfig.moe_gather_by_token``, forty-fourth session, or the sorted rows); "wide-release" (the heavy-load
MoE tiles' consumer threads release the stages each, ``GluonTile.thread_release``, forty-fourth session);
"norm-one-row" (the post-attention norm one row a program: ``KernelConfig.norm_stream_rows=1``, before the forty-fourth
session);
"window-rows" (the window layers' attention writes bf16 rows and o_proj quantizes
them, ``KernelConfig.attention_quant_out`` off: before the thirty-eighth session); "gemm-residual" (o_proj's GEMM adds
the residual stream in its epilogue, the post-attention norm reads the new stream alone:
``KernelConfig.gemm_residual``, thirty-ninth session, the default since; "o-proj-delta": off, as before) and
"rows-from-stream" (the post-attention norm writes no bf16 rows, the router remakes them from the stream and the
norm's rsqrt factors: ``KernelConfig.moe_rows_from_stream``, the same; "norm-router-rows": off); "narrow" (the 128 x
256 tiles' last column tile, o_proj's and the MoE down's at N = 2880, as one m64n64 product a warpgroup:
``GluonTile.narrow``, thirty-ninth session, opt-in); "q-fused" (the FP8 attention's consumer warpgroups quantize their
own Q tiles, no Q quantization launch: ``KernelConfig.attention_fp8_q_fused``, thirty-ninth session, opt-in); "q-gemm"
(the full layers' q / k / v GEMM rotates and quantizes Q for the FP8 attention in its epilogue, no Q quantization
launch and no bf16 Q: ``KernelConfig.gemm_q_quant``, fortieth session, opt-in); "qk-tile-old" (the FP8 attention's Q /
K quantization on its launch shape before the thirty-eighth session, ``attn_quant.qk_tile``); "wide-no-scales" (the
heavy-load MoE tiles without ``GluonTile.stage_scales``, the default before the thirty-seventh session: "wide-scales"
is the default since); "full-last-layer" (the last layer on every row past its K / V, not only on the last:
``GptOss.prune_last_layer`` off, before the twenty-ninth session); "chunked" (the prompt prefilled into a KV cache in
chunks of 8192, as the serving engine's default feeds a long one: every chunk after the first attends to cached keys)
"attn-fp8-lin" / "attn-fp8" (``--attention fp8-lin`` / ``fp8`` whatever ``--attention`` says: other numerics, logits
not equal; forty-fifth session; "attn-fp8-lin4" / "attn-fp8-lin5" / "attn-fp8-lin6" / "attn-fp8-lin8": fp8-lin on
``KernelConfig.attention_exp_lin`` 4 / 5 / 6 / 8, the forty-sixth, fifty-first and fifty-fourth sessions' forms, the
same spec) and
"chunked-gluon" (the same with those chunks on the Gluon attention kernels,
``KernelConfig.attention_gluon_offset`` / ``attention_gluon_fp8_offset``, twenty-ninth session). ``--attention fp8``:
every variant with the FP8 prefill attention. (Removed with the code they switched: "ws-down", the Gluon down GEMM,
5-10% slower; "gather-quant" / "gather-requant", gate_up's sorted A copied from the norm's FP8 rows now always.)
(Programmatic dependent launch of our kernels was measured here too, fifth session: no gain at 8192, 0.4-0.6% slower
at 32768; removed, see benchmarks/notes/prefill.md.) """

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import fields, replace

import torch

from gptoss_fp8.bench.prefill import GraphedPrefill, check_distinct_layers, prefill_logits, random_model
from gptoss_fp8.config import preset_config
from gptoss_fp8.kernels.config import GluonTile, KernelConfig
from gptoss_fp8.model.ops import ATTENTION_KINDS, ReferenceOps, W8A8CpuOps
from gptoss_fp8.model.triton_ops import TritonOps


class UnfusedCombine(TritonOps):
    """The combine kernel, then the add + norm kernel (the spec's composition on our kernels)."""

    moe_combine_add_rms_norm = ReferenceOps.moe_combine_add_rms_norm


class UnfusedRope(TritonOps):
    """q's rope as its own pass before every prefill attention (as before the twenty-eighth session), not in the
    FP8 quantization / the window kernel (``TritonOps._fused_rope``)."""

    def _fused_rope(self, window, n):
        return False


class UnfusedWindowRope(TritonOps):
    """q's rope in the FP8 quantization of the full layers, its own pass before the window layers' kernel."""

    def _fused_rope(self, window, n):
        return not window and super()._fused_rope(window, n)


class NormRows(TritonOps):
    """Every norm's bf16 rows written (as before the thirty-third session): ``needs_rows`` True everywhere."""

    def needs_rows(self, projs):
        return True


class TorchRouter(TritonOps):
    """The router in torch (the spec's ``route`` on the GPU), everything else as shipped."""

    route = W8A8CpuOps.route


def _config(name: str) -> KernelConfig | None:
    """The KernelConfig of a config variant's name, None for the others; "a+b": config variants a and b together
    (each one's fields that differ from the default)."""
    base = KernelConfig()
    if "+" in name:
        parts = [_config(part) for part in name.split("+")]
        if any(cfg is None for cfg in parts):
            raise SystemExit(f"variant {name!r}: only config variants combine with '+'")
        changed = {f.name: getattr(cfg, f.name) for cfg in parts for f in fields(cfg)
                   if getattr(cfg, f.name) != getattr(base, f.name)}
        return replace(base, **changed)
    fixed = {"triton-gemm": replace(base, dense_gluon_min_rows=None), "triton-moe": replace(base, moe_gluon=False),
             "triton-attention": replace(base, attention_gluon=False), "triton-all": replace(base, gluon=False)}
    if name in fixed:
        return fixed[name]
    if name.startswith("gu-s"):  # gu-s<stages>-g<GROUP_M>: the Gluon gate_up's ring depth and tile order
        st, gr = (int(v) for v in name[4:].split("-g"))
        return replace(base, moe_gluon_gate_up=GluonTile(stages=st, group_m=gr))
    if name == "window-rows":  # the window layers' bf16 rows + act_quant for o_proj (before the 38th session)
        return replace(base, attention_quant_out=False)
    if name == "gemm-residual":  # o_proj's epilogue adds the residual (39th session; the default since)
        return replace(base, gemm_residual=True)
    if name == "rows-from-stream":  # the router remakes the post-attention norm's rows (39th session; the default since)
        return replace(base, moe_rows_from_stream=True)
    if name == "o-proj-delta":  # o_proj writes its delta, the add + norm kernel adds it (before the 39th session)
        return replace(base, gemm_residual=False)
    if name == "norm-router-rows":  # the post-attention norm writes the router's bf16 rows (before the 39th session)
        return replace(base, moe_rows_from_stream=False)
    if name == "fp8-quant-out":  # the full layers' FP8 attention writes o_proj's quantization (43rd session, opt-in)
        return replace(base, attention_fp8_quant_out=True)
    if name == "q-fused":  # the FP8 attention's consumers quantize their own Q tiles (39th session, opt-in)
        return replace(base, attention_fp8_q_fused=True)
    if name == "window-one-loop":  # the window layers' Triton tile with its key blocks in one masked loop (41st)
        return replace(base, prefill_window=replace(base.prefill_window, one_loop=True, num_stages=3))
    if name == "gluon-window":  # the window layers on the warp-specialized Gluon kernel (41st session, opt-in)
        return replace(base, attention_gluon_window=True)
    if name == "gluon-window-pair":  # .. with a step's two heads interleaved in a consumer (42nd session, opt-in)
        return replace(base, attention_gluon_window=True, attention_gluon_window_pair=True)
    if name == "q-gemm":  # the full layers' q / k / v GEMM rotates and quantizes Q in its epilogue (40th session)
        return replace(base, gemm_q_quant=True)
    if name == "narrow":  # the 128 x 256 tiles' last column tile as m64n64 products (o_proj, MoE down; 39th session)
        return replace(base, dense_gluon_wide_tile=replace(base.dense_gluon_wide_tile, narrow=True),
                       moe_gluon_down=replace(base.moe_gluon_down, narrow=True))
    if name == "fp8-qreg":  # the FP8 attention's Q in registers (twenty-eighth session, opt-in)
        return replace(base, attention_fp8_q_registers=True)
    if name == "fp8-lanemax":  # the FP8 attention's row max with one shuffle pair a step (thirty-third session)
        return replace(base, attention_fp8_lane_max=True)
    if name in ("wide-scales", "wide-turns-scales", "dense-scales", "all-scales", "all-turns-scales"):
        # the 128 x 256 tiles' scales through the stages (GluonTile.stage_scales), with turns in the "-turns-" ones
        opts = dict(stage_scales=True, **({"turns": True} if "turns" in name else {}))
        moe = dict(moe_gluon_wide_gate_up=replace(base.moe_gluon_wide_gate_up, **opts),
                   moe_gluon_down=replace(base.moe_gluon_down, **opts))
        dense = dict(dense_gluon_wide_tile=replace(base.dense_gluon_wide_tile, **opts))
        return replace(base, **(moe if name.startswith("wide") else dense if name == "dense-scales" else moe | dense))
    if name in ("wide-turns", "dense-turns", "all-turns"):  # the wide tiles' warpgroups take turns at the tensor core
        moe = dict(moe_gluon_wide_gate_up=replace(base.moe_gluon_wide_gate_up, turns=True),
                   moe_gluon_down=replace(base.moe_gluon_down, turns=True))
        dense = dict(dense_gluon_wide_tile=replace(base.dense_gluon_wide_tile, turns=True))
        return replace(base, **{"wide-turns": moe, "dense-turns": dense, "all-turns": moe | dense}[name])
    if name == "gather-by-token":  # the pre-gathered rows written walking the tokens (44th session)
        return replace(base, moe_gather_by_token=True)
    if name == "wide-release":  # the heavy-load MoE tiles' consumer threads release the stages each (44th session)
        return replace(base, moe_gluon_wide_gate_up=replace(base.moe_gluon_wide_gate_up, thread_release=True),
                       moe_gluon_down=replace(base.moe_gluon_down, thread_release=True))
    if name == "norm-one-row":  # the post-attention norm one row a program (before the 44th session)
        return replace(base, norm_stream_rows=1)
    if name == "gather-sorted":  # ... walking the sorted rows (before the 44th session)
        return replace(base, moe_gather_by_token=False)
    if name == "wide-gather":  # the wide gate_up's A rows (and row scales) copied from the tokens' by its producer
        return replace(base, moe_gluon_wide_gate_up=replace(base.moe_gluon_wide_gate_up, gather=True))
    if name == "wide-gather-nosc":  # the same, its consumers loading the tokens' row scales (34th-37th sessions' form)
        return replace(base, moe_gluon_wide_gate_up=replace(base.moe_gluon_wide_gate_up, gather=True, stage_scales=False))
    if name == "wide-no-scales":  # the heavy-load MoE tiles' scales loaded by the consumers (before the 37th session)
        return replace(base, moe_gluon_wide_gate_up=replace(base.moe_gluon_wide_gate_up, stage_scales=False),
                       moe_gluon_down=replace(base.moe_gluon_down, stage_scales=False))
    if name.startswith("wide-g"):  # wide-g<GROUP_M>: the heavy-load MoE tiles' tile order
        tile = replace(base.moe_gluon_wide_gate_up, group_m=int(name[6:]))
        return replace(base, moe_gluon_wide_gate_up=tile, moe_gluon_down=replace(base.moe_gluon_down, group_m=tile.group_m))
    return None


def _old_qk_tile(model, ops):
    """The FP8 attention's Q / K quantization on its launch before the thirty-eighth session (four heads a program,
    4 warps, row blocks fastest in the grid; ``attn_quant.qk_tile``), for the call only."""
    from gptoss_fp8.kernels import attn_quant
    from gptoss_fp8.quant.fp8 import next_pow2

    def run(t):
        was = attn_quant.qk_tile
        attn_quant.qk_tile = lambda h, d, rope: (min(next_pow2(h), max(1, 256 // d)), 4, False)
        try:
            return prefill_logits(model, t, ops)
        finally:
            attn_quant.qk_tile = was
    return run


def _forward(model, ops):
    """The prefill forward of model on ops, as a function of the tokens (ops built by the caller)."""
    return lambda t: prefill_logits(model, t, ops)


def _full_last_layer(model, ops):
    """The prefill with the last layer on every row (``prune_last_layer`` off for the call only)."""
    def run(t):
        was, model.prune_last_layer = model.prune_last_layer, False
        try:
            return prefill_logits(model, t, ops)
        finally:
            model.prune_last_layer = was
    return run


def _chunk_combine(model, ops):
    """The chunked MoE as before the thirty-fourth session: each chunk's combine into a [T, H] tensor, then one
    residual add + norm over all rows reading it back (not each chunk's combine into the norm's rows, ``out=``)."""
    def old(layer, x, t, ops, capture, chunk, norm_weight, rows):
        out = torch.empty_like(x)
        for s in range(0, t.n, chunk):
            ops.moe_combine(*model._moe(layer, t.rows(s, s + chunk), ops), out=out[s:s + chunk])
        return ops.add_rms_norm(x, out, norm_weight, model.cfg.rms_norm_eps, rows=rows)

    def run(t):
        model._moe_chunked = old  # (an instance attribute over the method, for the call only)
        try:
            return prefill_logits(model, t, ops)
        finally:
            del model._moe_chunked
    return run


def _chunked(model, ops, chunk: int = 8192):
    """The prefill of the prompt in chunks through ``GptOss.prefill`` into one KV cache (the serving engine's
    way): the last chunk's logits."""
    def run(t):
        n = t.shape[0]
        cache = model.new_cache(n + 1)
        for s in range(0, n, chunk):
            _, logits = model.prefill(t[s:s + chunk], ops, cache=cache, start=s)
        return logits
    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="20b")
    p.add_argument("--tokens", default="8192")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--variants", default="default,graph")
    p.add_argument("--attention", choices=ATTENTION_KINDS, default="bf16", help="prefill attention numerics")
    p.add_argument("--distinct-layers", type=int, default=None,
                   help="weights of the first N layers only, repeated through the depth (bench prefill's option)")
    a = p.parse_args()
    cfg_model = preset_config(a.model)
    model = random_model(cfg_model, "cuda", distinct_layers=check_distinct_layers(a.distinct_layers, cfg_model))
    for n in [int(t) for t in a.tokens.split(",")]:
        ops = TritonOps(config=KernelConfig()).with_attention(a.attention)
        make = {
            "default": lambda: (lambda t: prefill_logits(model, t, ops)),
            "unfused-combine": lambda: _forward(model, UnfusedCombine(config=ops.config).with_attention(a.attention)),
            "torch-router": lambda: _forward(model, TorchRouter(config=ops.config).with_attention(a.attention)),
            "norm-rows": lambda: _forward(model, NormRows(config=ops.config).with_attention(a.attention)),
            "unfused-rope": lambda: _forward(model, UnfusedRope(config=ops.config).with_attention(a.attention)),
            "moe-unchunked": lambda: (lambda t: prefill_logits(model, t, ops, moe_chunk=t.shape[0])),
            "moe-chunk32768": lambda: (lambda t: prefill_logits(model, t, ops, moe_chunk=32768)),
            "chunk-combine": lambda: _chunk_combine(model, ops),
            "qk-tile-old": lambda: _old_qk_tile(model, ops),
            "unfused-window-rope": lambda: _forward(model, UnfusedWindowRope(config=ops.config).with_attention(
                a.attention)),
            "graph": lambda: GraphedPrefill(model, n, ops),
            # (other numerics: its logits differ from the first variant's by FP8 noise, not 0)
            "attn-fp8-lin": lambda: _forward(model, TritonOps(config=ops.config).with_attention("fp8-lin")),
            "attn-fp8": lambda: _forward(model, TritonOps(config=ops.config).with_attention("fp8")),
            "attn-fp8-lin4": lambda: _forward(model, TritonOps(config=replace(ops.config, attention_exp_lin=4))
                                              .with_attention("fp8-lin")),
            "attn-fp8-lin5": lambda: _forward(model, TritonOps(config=replace(ops.config, attention_exp_lin=5))
                                              .with_attention("fp8-lin")),
            "attn-fp8-lin6": lambda: _forward(model, TritonOps(config=replace(ops.config, attention_exp_lin=6))
                                              .with_attention("fp8-lin")),
            "attn-fp8-lin8": lambda: _forward(model, TritonOps(config=replace(ops.config, attention_exp_lin=8))
                                              .with_attention("fp8-lin")),
            "full-last-layer": lambda: _full_last_layer(model, ops),
            "chunked": lambda: _chunked(model, ops),
            "chunked-gluon": lambda: _chunked(model, TritonOps(config=replace(
                ops.config, attention_gluon_offset=True, attention_gluon_fp8_offset=True)).with_attention(a.attention)),
        }
        for name in a.variants.split(","):
            cfg = _config(name)
            if cfg is not None:  # the same model, its ops holding another KernelConfig
                make[name] = lambda cfg=cfg: _forward(model, TritonOps(config=cfg).with_attention(a.attention))
        tokens = torch.randint(0, cfg_model.vocab_size, (n,), device="cuda")
        prefill_logits(model, tokens, ops)  # compile before any capture
        variants = {name: make[name]() for name in a.variants.split(",")}
        ref = None
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 3.0:  # warm-up: compile all, let clocks settle
            for name, fn in variants.items():
                try:
                    out = fn(tokens)
                    torch.cuda.synchronize()
                except Exception as err:  # (which variant broke: a kernel fault surfaces at a later launch)
                    raise SystemExit(f"variant {name!r} failed in its warm-up forward: {type(err).__name__}: "
                                     f"{str(err).splitlines()[0] if str(err) else ''}") from err
                ref = out.clone() if ref is None else ref
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.runs):
            for name, fn in variants.items():
                torch.cuda.synchronize()
                s = time.perf_counter()
                fn(tokens)
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - s)
        for name, ts in times.items():
            out = variants[name](tokens)
            diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"{a.model} {n} tokens | {name}: median {statistics.median(ts):.4f} s, "
                  f"min {min(ts):.4f}, max {max(ts):.4f} | logits vs first rel {diff:.2e}", flush=True)
        del variants
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
