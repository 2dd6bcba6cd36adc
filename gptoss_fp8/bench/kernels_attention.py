"""Attention-with-sinks benchmark: our Triton kernels beside peers measured in the same run.

Rows (``bench(tokens)``; ``gptoss-fp8 bench kernels --only attention`` prints them):
- prefill causal at T tokens: vs FlexAttention with the sinks folded in through its LSE
  (``o * sigmoid(lse - sink)``), and vs SDPA causal WITHOUT sinks (the best of enable_gqa and
  pre-expanded K/V); window-128 at T: vs FlexAttention + sinks with a sliding-window block mask;
- decode (1 new token, 32768 cached tokens, batch 1..64; window 128; 64 new tokens): vs the
  memory-bandwidth floor = KV bytes read / 4.26 TB/s (the device copy rate measured on the H200);
  ratio = floor time / our time (1.0 = at the floor; the target is >= 0.83, within 20%). Timed as
  CUDA-graph replays over several KV caches in turn (>= 256 MB, so reads come from HBM, and no
  host launch gaps: a decode step is captured in a graph in serving); ``ms_eager_do_bench`` is the
  plain do_bench figure of one call, host launch overhead included;
- rope (q and k, one launch) at T tokens: vs the same formula in eager torch; the case names its
  share of the causal attention time at T; then rope + attention with q rotated inside the
  attention kernel (k by the rope kernel alone) vs the rope kernel on q and k + attention.
- with ``attention="fp8"`` (``--attention fp8``): prefill causal / window-128 at T with the FP8
  kernels (``attention_prefill(fp8=True)``: causal on sm_90 the Gluon e4m3 kernel, the window the Triton
  one; Q, K, V quantized inside the call by the fused kernels of kernels/attn_quant.py, timed with it;
  ``quant_ms`` is that quantization alone) vs our bf16 kernel, its error vs the bf16 output; and a row
  ``fp8 quantize q,k,v``: that quantization (as the causal launch runs it) vs quant/attn_fp8.py's torch
  ops, with the floor of one bf16 read and one e4m3 write at the copy rate;
- with FlashInfer importable (required by ``attention_backend="flashinfer"``): prefill causal /
  window-128 at T, ours beside FlashInfer's sink prefill (kernels/flashinfer_attention.py; its
  first call per module JIT-builds it, minutes, untimed), its error vs our output;
Shapes: 64 q / 8 kv heads, head_dim 64, bf16. FLOPs = 4 * visible query-key pairs * 64 * 64 heads.
Times: triton.testing.do_bench, median (it flushes L2 between repetitions).
``python -m gptoss_fp8.bench.kernels_attention sweep`` times the tile configurations instead
(``sweep_quick``: a few at 32768 tokens and decode at batch 1; ``quick``: default tiles only;
``decode_b1``: decode tiles, splits and merge chunks at batch 1).
"""

from __future__ import annotations

import sys

import torch

HQ, HKV, D, WINDOW = 64, 8, 64, 128
COPY_BW = 4.26e12  # bytes/s, device-to-device copy measured on the H200 (platform-notes.md)
DECODE_KV = 32768
DEV = "cuda"  # the bench is for GPUs; a CPU dry run (interpreter) may set it to "cpu"


def _ms(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _ms_graph(fns, reps: int = 30) -> float:
    """Median ms per call of fns (called in turn) replayed as one CUDA graph: no launch gaps from
    the host. Rotating among several input sets larger than L2 together keeps each read cold."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2] / len(fns)


def _decode_inputs(B: int, nq: int, L: int, gen) -> list[tuple]:
    """Enough KV caches of [B, L, 8, 64] to rotate through >= 256 MB (5x the H200's 50 MB L2)."""
    per_cache = 2 * B * L * HKV * D * 2
    n = max(1, min(8, -(-256 * 2**20 // per_cache)))
    sets = []
    for _ in range(n):
        q = torch.randn(B, nq, HQ, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        kc = torch.randn(B, L, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        vc = torch.randn(B, L, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        sets.append((q, kc, vc))
    return sets


def _visible_pairs(n_q: int, q_first: int, window: int) -> int:
    """Visible (query, key) pairs for n_q queries at positions q_first.. of one sequence."""
    total = 0
    for i in range(q_first, q_first + n_q):
        total += min(i + 1, window) if window else i + 1
    return total


def _tflops(pairs: int, ms: float) -> float:
    return 4 * pairs * D * HQ / (ms * 1e-3) / 1e12


def _row(case: str, ms: float, tflops: float | None, peer: str, peer_ms: float, peer_tflops: float | None, ratio: float,
         **extra) -> dict:
    return {"case": case, "ms": ms, "tflops": tflops, "peer": peer, "peer_ms": peer_ms, "peer_tflops": peer_tflops,
            "ratio": ratio, **extra}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _prefill_inputs(T: int, seed: int):
    """Fresh random q [T, HQ, D], k, v [T, HKV, D] (bf16) and sinks in [-10, 10] from a generator
    seeded with ``seed``; the generator is returned for further inputs."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(T, HQ, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(T, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(T, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    sinks = (torch.rand(HQ, device=DEV, generator=gen) * 20 - 10).to(torch.bfloat16)
    return q, k, v, sinks, gen


def _flex_with_sinks(T: int, window: int):
    """FlexAttention (compiled) with sinks folded in through its LSE; [1, H, T, D] layout."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if window:
        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (qi - ki < window)
    else:
        def mask_mod(b, h, qi, ki):
            return qi >= ki
    block_mask = create_block_mask(mask_mod, None, None, T, T, device=DEV)
    # A fresh compile per (length, mask): past dynamo's recompile limit (8) flex_attention silently
    # falls back to eager, which materializes the T x T scores (out of memory from 16384 tokens).
    torch.compiler.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    import torch.nn.attention.flex_attention as fa

    aux_request = fa.AuxRequest(lse=True) if hasattr(fa, "AuxRequest") else None  # torch >= 2.9

    def run(q4, k4, v4, sinks):
        if aux_request is not None:
            o, aux = flex(q4, k4, v4, block_mask=block_mask, enable_gqa=True, return_aux=aux_request)
            lse = aux.lse
        else:
            o, lse = flex(q4, k4, v4, block_mask=block_mask, enable_gqa=True, return_lse=True)
        # natural-log LSE over the keys; the sink's share of the softmax is sigmoid(sink - lse)
        return o * torch.sigmoid(lse - sinks.float()[None, :, None]).unsqueeze(-1).to(o.dtype)

    return run


def _fp8_rows(T: int, bf16_ms: dict[int, float], config=None, p_code: str = "e4m3") -> list[dict]:
    """``--attention fp8`` / ``fp8-lin`` (p_code "lin"): the FP8 prefill kernel at T beside our bf16 one (``bf16_ms``:
    window -> ms)."""
    from gptoss_fp8.kernels.attention import attention_prefill

    q, k, v, sinks, _ = _prefill_inputs(T, T)
    rows = [_fp8_quant_row(T, q, k, v)]
    quant = rows[0]["ms"]
    for window in (0, WINDOW):
        name = f"prefill fp8{'-lin' if p_code == 'lin' else ''} {'causal' if not window else f'window{window}'} T={T}"
        pairs = _visible_pairs(T, 0, window)
        ours = _ms(lambda: attention_prefill(q, k, v, sinks, sliding_window=window, fp8=True, config=config,
                                             p_code=p_code))
        err = _rel(attention_prefill(q, k, v, sinks, sliding_window=window, fp8=True, config=config, p_code=p_code),
                   attention_prefill(q, k, v, sinks, sliding_window=window, config=config))
        peer = bf16_ms[window]
        rows.append(_row(name, ours, _tflops(pairs, ours), "ours bf16", peer, _tflops(pairs, peer), peer / ours,
                         rel_err_vs_peer=err, quant_ms=quant, pairs_per_s=pairs / (ours * 1e-3)))
    return rows


def _flashinfer_rows(T: int, ours_ms: dict[int, float], config=None) -> list[dict]:
    """Our bf16 prefill at T (``ours_ms``: window -> ms) beside FlashInfer's sink prefill."""
    from gptoss_fp8.kernels import flashinfer_attention as fi
    from gptoss_fp8.kernels.attention import attention_prefill

    q, k, v, sinks, _ = _prefill_inputs(T, T)
    label = f"flashinfer sink prefill ({fi.backend_for(q.device)})"
    rows = []
    for window in (0, WINDOW):
        err = _rel(fi.prefill(q, k, v, sinks, window=window),
                   attention_prefill(q, k, v, sinks, sliding_window=window, config=config))
        peer = _ms(lambda: fi.prefill(q, k, v, sinks, window=window))
        pairs, ours = _visible_pairs(T, 0, window), ours_ms[window]
        name = f"prefill {'causal' if not window else f'window{window}'} T={T}"
        rows.append(_row(name, ours, _tflops(pairs, ours), label, peer, _tflops(pairs, peer), peer / ours,
                         rel_err_vs_peer=err))
    return rows


def _fp8_quant_row(T: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """Q, K, V to e4m3 at T: the fused kernels as the causal FP8 launch runs them (``fp8_operands``:
    kernels/attn_quant.py, V in key order) vs quant/attn_fp8.py's torch ops (plain layout: the launch
    used to pad and reorder V with more torch ops); the floor reads the bf16 once and writes e4m3."""
    from gptoss_fp8.kernels.attention_ws_fp8 import fp8_operands
    from gptoss_fp8.quant import attn_fp8

    fused = _ms(lambda: fp8_operands(q, k, v, 0.125))
    torch_ms = _ms(lambda: (attn_fp8.quantize_qk(q), attn_fp8.quantize_qk(k), attn_fp8.quantize_v(v)))
    floor = (q.numel() + k.numel() + v.numel()) * 3 / COPY_BW * 1e3
    return _row(f"fp8 quantize q,k,v T={T} (floor {floor:.3g} ms)", fused, None, "torch ops (quant/attn_fp8.py)",
                torch_ms, None, torch_ms / fused, floor_ms=floor)


def _prefill_rows(T: int, config=None) -> list[dict]:
    import torch.nn.functional as F

    from gptoss_fp8.kernels.attention import attention_prefill

    q, k, v, sinks, gen = _prefill_inputs(T, T)
    # peers' preferred layout [1, H, T, D], contiguous (the transposes are not timed)
    q4, k4, v4 = (t.transpose(0, 1).contiguous()[None] for t in (q, k, v))
    rows = []
    for window in (0, WINDOW):
        name = f"prefill {'causal' if not window else f'window{window}'} T={T}"
        pairs = _visible_pairs(T, 0, window)
        ours = _ms(lambda: attention_prefill(q, k, v, sinks, sliding_window=window, config=config))
        out = attention_prefill(q, k, v, sinks, sliding_window=window, config=config)
        try:
            flex = _flex_with_sinks(T, window)
            ref = flex(q4, k4, v4, sinks)[0].transpose(0, 1)
            err = _rel(out, ref)
            peer = _ms(lambda: flex(q4, k4, v4, sinks))
            label = "flex+sinks"
        except Exception as e:  # a peer that fails to build must not hide our figures
            peer, err, label = float("nan"), float("nan"), f"flex+sinks failed: {type(e).__name__}: {str(e)[:80]}"
        rows.append(_row(name, ours, _tflops(pairs, ours), label, peer, _tflops(pairs, peer), peer / ours, rel_err_vs_peer=err))
        if not window:
            sd_gqa = _ms(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True))
            k4x, v4x = k4.repeat_interleave(HQ // HKV, 1), v4.repeat_interleave(HQ // HKV, 1)
            sd_exp = _ms(lambda: F.scaled_dot_product_attention(q4, k4x, v4x, is_causal=True))
            del k4x, v4x
            sd = min(sd_gqa, sd_exp)
            label = f"sdpa causal no sinks ({'enable_gqa' if sd == sd_gqa else 'expanded kv'})"
            rows.append(_row(name, ours, _tflops(pairs, ours), label, sd, _tflops(pairs, sd), sd / ours))
    return rows


def _decode_rows(config=None) -> list[dict]:
    from gptoss_fp8.kernels.attention_decode import attention_decode

    rows = []
    L = DECODE_KV
    for B, nq, window in ((1, 1, 0), (8, 1, 0), (32, 1, 0), (64, 1, 0), (1, 64, 0), (64, 1, WINDOW)):
        gen = torch.Generator(device=DEV).manual_seed(B * 100 + nq + window)
        sets = _decode_inputs(B, nq, L, gen)
        sinks = (torch.rand(HQ, device=DEV, generator=gen) * 20 - 10).to(torch.bfloat16)
        kl = torch.full((B,), L, dtype=torch.int32, device=DEV)
        fns = [lambda q=q, kc=kc, vc=vc: attention_decode(q, kc, vc, kl, sinks, sliding_window=window, config=config)
               for q, kc, vc in sets]
        ms = _ms_graph(fns)
        ms_eager = _ms(fns[0])
        keys_read = min(L, window + nq - 1) if window else L
        nbytes = 2 * B * keys_read * HKV * D * 2 + 2 * sets[0][0].numel() * 2  # K and V once, q in, out
        floor = nbytes / COPY_BW * 1e3
        pairs = B * _visible_pairs(nq, L - nq, window)
        name = f"decode B={B} new={nq} kv={L}" + (f" window{window}" if window else "") + " (graph)"
        rows.append(_row(name, ms, _tflops(pairs, ms), "HBM floor 4.26TB/s", floor, _tflops(pairs, floor), floor / ms,
                         achieved_tbs=nbytes / (ms * 1e-3) / 1e12, ms_eager_do_bench=ms_eager))
        del sets, fns
    return rows


def _rope_rows(T: int, causal_ms: float | None, config=None) -> list[dict]:
    from gptoss_fp8 import spec
    from gptoss_fp8.kernels.attention import attention_prefill
    from gptoss_fp8.kernels.rope import rope_qk

    q, k, v, sinks, gen = _prefill_inputs(T, T + 1)
    cos, sin = spec.rope_table(T, D, device=DEV)
    pos = torch.arange(T, device=DEV, dtype=torch.int32)

    def eager():  # gpt-oss's _apply_rotary_emb on q and k (bf16 cos/sin)
        c, s = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)
        outs = []
        for x in (q, k):
            x1, x2 = x.chunk(2, dim=-1)
            outs.append(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        return outs

    ms = _ms(lambda: rope_qk(q, k, pos, cos, sin))
    peer = _ms(eager)
    nbytes = 2 * (q.numel() + k.numel()) * 2
    share = f", {100 * ms / causal_ms:.1f}% of causal attention" if causal_ms else ""
    name = f"rope q+k T={T} ({nbytes / (ms * 1e-3) / 1e12:.2f} TB/s{share})"
    rows = [_row(name, ms, None, "torch eager rope", peer, None, peer / ms)]

    # Fused vs separate: q rotated inside the attention kernel (k alone by rope_qk), against
    # rope_qk on q and k followed by the attention kernel.
    def separate(window):
        q_r, k_r = rope_qk(q, k, pos, cos, sin)
        return attention_prefill(q_r, k_r, v, sinks, sliding_window=window, config=config)

    def fused(window):
        _, k_r = rope_qk(None, k, pos, cos, sin)
        return attention_prefill(q, k_r, v, sinks, sliding_window=window, rope=(cos, sin), config=config)

    for window in (0, WINDOW):
        err = _rel(fused(window), separate(window))
        ms_f = _ms(lambda: fused(window))
        ms_s = _ms(lambda: separate(window))
        pairs = _visible_pairs(T, 0, window)
        name = f"rope+prefill {'causal' if not window else f'window{window}'} T={T}, q-rope fused"
        rows.append(_row(name, ms_f, _tflops(pairs, ms_f), "rope_qk kernel + prefill", ms_s, _tflops(pairs, ms_s), ms_s / ms_f,
                         rel_err_vs_peer=err))
    return rows


def bench(tokens: list[int], attention: str = "bf16", attention_backend: str = "ours", config=None,
          emit=None) -> list[dict]:
    """Rows of {case, ms, tflops, peer, peer_ms, peer_tflops, ratio (ours vs peer throughput)};
    ``attention`` "fp8": the FP8 prefill rows too (``_fp8_rows``). FlashInfer rows when flashinfer
    is importable; ``attention_backend="flashinfer"``: they are required (GptOssFp8Error, one line).
    ``config``: our kernels' ``KernelConfig`` (None: the default; ``bench kernels --kernel-option``).
    ``emit``: called with each length's rows, then the decode rows, as they are measured (a long run cut short
    still shows what it measured)."""
    from gptoss_fp8.kernels import flashinfer_attention as fi

    if attention_backend == "flashinfer":
        fi.require()
    with_fi = fi.available()
    if not with_fi:
        print(f"# FlashInfer rows skipped: flashinfer is not importable ({' '.join(fi._load()[1].split())[:200]})")
    rows: list[dict] = []
    for T in tokens:
        first = len(rows)
        pre = _prefill_rows(T, config)
        rows += pre
        if with_fi:
            rows += _flashinfer_rows(T, {0: next(r["ms"] for r in pre if r["case"].startswith("prefill causal")),
                                         WINDOW: next(r["ms"] for r in pre if r["case"].startswith("prefill window"))},
                                     config)
        if attention != "bf16":
            causal = next(r["ms"] for r in pre if r["case"].startswith("prefill causal"))
            window = next(r["ms"] for r in pre if r["case"].startswith("prefill window"))
            rows += _fp8_rows(T, {0: causal, WINDOW: window}, config, "lin" if attention == "fp8-lin" else "e4m3")
        causal_ms = next(r["ms"] for r in pre if r["case"].startswith("prefill causal"))
        rows += _rope_rows(T, causal_ms, config)
        torch.cuda.empty_cache()
        if emit is not None:
            emit(rows[first:])
    decode = _decode_rows(config)
    if emit is not None:
        emit(decode)
    return rows + decode


# ----------------------------------------------------------------------------- tile sweep
PREFILL_SWEEP = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg); TMA K/V loads lost everywhere and were removed
    (128, 64, 4, 3, None), (128, 64, 8, 3, 128), (128, 64, 8, 3, None),
    (64, 64, 4, 3, None), (64, 64, 4, 3, 128), (64, 64, 4, 2, None),
    (128, 32, 4, 3, None), (64, 32, 4, 3, None),
    (128, 128, 8, 2, None), (32, 32, 4, 2, None),
]
DECODE_SWEEP = [(128, 4, 3), (64, 4, 3), (128, 4, 2)]  # (BLOCK_N, num_warps, num_stages)


def _ptile(cfg: tuple | None):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg[, pack]]) -> PrefillTile (None: the default)."""
    from gptoss_fp8.kernels.config import PrefillTile

    return None if cfg is None else PrefillTile(*cfg)


def _dtile(cfg: tuple | None):
    """(BLOCK_N, num_warps, num_stages) -> DecodeTile (None: the default)."""
    from gptoss_fp8.kernels.config import DecodeTile

    return None if cfg is None else DecodeTile(*cfg)


def sweep(T: int = 8192) -> list[dict]:
    """Time every PREFILL_SWEEP tile config (causal and window at T) and DECODE_SWEEP x split counts."""
    from gptoss_fp8.kernels.attention import attention_prefill
    from gptoss_fp8.kernels.attention_decode import attention_decode

    out = []
    q, k, v, sinks, gen = _prefill_inputs(T, 0)
    for cfg in PREFILL_SWEEP:
        for window in (0, WINDOW):
            try:
                ms = _ms(lambda a=(q, k, v, sinks): attention_prefill(*a, sliding_window=window, tile=_ptile(cfg)))
            except Exception as e:  # e.g. out of shared memory for a large tile
                print(f"prefill {cfg} window={window}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            r = {"kind": "prefill", "cfg": cfg, "window": window, "ms": ms, "tflops": _tflops(_visible_pairs(T, 0, window), ms)}
            print(r, flush=True)
            out.append(r)
    del q, k, v
    L = DECODE_KV
    for B, nq in ((1, 1), (8, 1), (64, 1), (1, 64)):
        sets = _decode_inputs(B, nq, L, gen)
        kl = torch.full((B,), L, dtype=torch.int32, device=DEV)
        floor = 2 * B * L * HKV * D * 2 / COPY_BW * 1e3
        split_list = (None, 8, 16, 32) if B * nq == 1 else (None, 2, 4, 8)
        for cfg in DECODE_SWEEP:
            for splits in split_list:
                for fused in ((True, False) if splits is None else (True,)):
                    fns = [lambda qd=qd, kc=kc, vc=vc: attention_decode(
                        qd, kc, vc, kl, sinks, num_splits=splits, tile=_dtile(cfg), fused_merge=fused) for qd, kc, vc in sets]
                    try:
                        ms = _ms_graph(fns)
                    except Exception as e:
                        print(f"decode {cfg} B={B} splits={splits}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
                        continue
                    r = {"kind": "decode", "B": B, "nq": nq, "cfg": cfg, "splits": splits, "fused": fused, "ms": ms,
                         "floor_ratio": floor / ms}
                    print(r, flush=True)
                    out.append(r)
        del sets
    return out


def sweep_quick() -> list[dict]:
    """A few prefill tiles at 32768 tokens and decode split counts at batch 1 (follow-up to sweep)."""
    from gptoss_fp8.kernels.attention import attention_prefill
    from gptoss_fp8.kernels.attention_decode import attention_decode

    out = []
    T = 32768
    q, k, v, sinks, gen = _prefill_inputs(T, 1)
    for window, cfgs in ((0, [(128, 64, 8, 3, 128), (64, 64, 4, 3, None), (128, 64, 4, 3, None),
                              (64, 64, 4, 3, 128)]),
                         (WINDOW, [(64, 64, 4, 2, None), (64, 64, 4, 3, None)])):
        for cfg in cfgs:
            ms = _ms(lambda a=(q, k, v, sinks): attention_prefill(*a, sliding_window=window, tile=_ptile(cfg)))
            r = {"kind": "prefill", "T": T, "cfg": cfg, "window": window, "ms": ms,
                 "tflops": _tflops(_visible_pairs(T, 0, window), ms)}
            print(r, flush=True)
            out.append(r)
    del q, k, v
    L = DECODE_KV
    for B in (1, 64):
        sets = _decode_inputs(B, 1, L, gen)
        kl = torch.full((B,), L, dtype=torch.int32, device=DEV)
        floor = 2 * B * L * HKV * D * 2 / COPY_BW * 1e3
        for cfg, splits, fused in (((128, 4, 3), None, True), ((128, 4, 3), None, False), ((128, 4, 3), 16, True),
                                   ((128, 4, 3), 32, True), ((64, 4, 3), 32, True), ((128, 4, 4), None, True)):
            if B > 1 and splits:
                continue
            fns = [lambda qd=qd, kc=kc, vc=vc: attention_decode(
                qd, kc, vc, kl, sinks, num_splits=splits, tile=_dtile(cfg), fused_merge=fused) for qd, kc, vc in sets]
            ms = _ms_graph(fns)
            r = {"kind": "decode", "B": B, "cfg": cfg, "splits": splits, "fused": fused, "ms": ms, "floor_ratio": floor / ms}
            print(r, flush=True)
            out.append(r)
        del sets
    return out


TILE_VARIANTS = {  # name -> (causal config, window config); None: that case is not timed
    "default": (None, None),
    "pack 2, 128x64 8 warps 3 stages": ((128, 64, 8, 3, 128, 2), (128, 64, 8, 2, 128, 2)),
    "pack 2, 128x64 8 warps 4 stages": ((128, 64, 8, 4, 128, 2), (128, 64, 8, 3, 128, 2)),
    "pack 2, 128x64 4 warps 3 stages": ((128, 64, 4, 3, None, 2), (64, 32, 4, 2, 128, 2)),
    "pack 4, 128x32 8 warps 3 stages": ((128, 32, 8, 3, 128, 4), None),
}


def variants(tokens: tuple[int, ...] = (8192, 32768)) -> list[dict]:
    """TILE_VARIANTS side by side with the default tiles, interleaved per length so clock drift hits
    all alike; each output is also compared with the default's."""
    from gptoss_fp8.kernels.attention import attention_prefill

    out = []
    for T in tokens:
        q, k, v, sinks, gen = _prefill_inputs(T, T + 5)
        for wi, window in enumerate((0, WINDOW)):
            base = attention_prefill(q, k, v, sinks, sliding_window=window)
            for rep in range(2):  # two passes: a variant that wins both is not clock noise
                for name, cfgs in TILE_VARIANTS.items():
                    if name != "default" and cfgs[wi] is None:
                        continue
                    fn = lambda cfg=cfgs[wi], a=(q, k, v, sinks): attention_prefill(*a, sliding_window=window, tile=_ptile(cfg))  # noqa: E731
                    ms = _ms(fn)
                    r = {"T": T, "window": window, "variant": name, "pass": rep, "ms": ms,
                         "tflops": _tflops(_visible_pairs(T, 0, window), ms), "rel_vs_default": _rel(fn(), base)}
                    print(r, flush=True)
                    out.append(r)
        del q, k, v
    return out


DECODE1_CONFIGS = [(128, 4, 3), (128, 4, 4), (256, 4, 3), (256, 8, 3), (128, 8, 4), (64, 4, 4)]


def decode_b1(L: int = DECODE_KV, B: int = 1, splits_list=(None, 8, 32), configs=None, chunks=(2, None),
              fused_list=(True,)) -> list[dict]:
    """Decode at batch B (default 1; one new token, L cached): configs (DECODE1_CONFIGS) x split counts x
    fused-merge chunk (2 splits per step, the old default, against the default) x fused / separate
    merge, graph-timed, beside a plain read of the same KV bytes by torch (sum of K and V) in the same
    graphs' conditions."""
    from gptoss_fp8.kernels.attention_decode import attention_decode

    gen = torch.Generator(device=DEV).manual_seed(11)
    sets = _decode_inputs(B, 1, L, gen)
    sinks = (torch.rand(HQ, device=DEV, generator=gen) * 20 - 10).to(torch.bfloat16)
    kl = torch.full((B,), L, dtype=torch.int32, device=DEV)
    floor = 2 * B * L * HKV * D * 2 / COPY_BW * 1e3
    ref = attention_decode(*sets[0], kl, sinks, merge_chunk=2)
    out = []
    read_ms = _ms_graph([lambda kc=kc, vc=vc: (kc.sum(), vc.sum()) for _, kc, vc in sets])
    print({"case": f"torch sum of K and V, B={B}", "ms": read_ms, "floor_ratio": floor / read_ms}, flush=True)
    runs = [(cfg, splits, chunk, fused) for cfg in configs or DECODE1_CONFIGS for splits in splits_list
            for chunk in chunks for fused in fused_list]
    for cfg, splits, chunk, fused in runs:
        fns = [lambda qd=qd, kc=kc, vc=vc: attention_decode(
            qd, kc, vc, kl, sinks, num_splits=splits, tile=_dtile(cfg), merge_chunk=chunk, fused_merge=fused)
            for qd, kc, vc in sets]
        try:
            ms = _ms_graph(fns)
            err = _rel(fns[0](), ref)
        except Exception as e:  # e.g. out of shared memory
            print(f"decode {cfg} splits={splits} chunk={chunk}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        r = {"B": B, "cfg": cfg, "splits": splits, "chunk": chunk, "fused": fused, "ms": ms,
             "floor_ratio": floor / ms, "rel_vs_default": err}
        print(r, flush=True)
        out.append(r)
    return out


def quick(T: int = 8192) -> list[dict]:
    """Default-tile prefill timings at T (causal, window 128), no peers: a cheap re-check."""
    from gptoss_fp8.kernels.attention import attention_prefill

    q, k, v, sinks, gen = _prefill_inputs(T, T)
    out = []
    for window in (0, WINDOW):
        fn = lambda: attention_prefill(q, k, v, sinks, sliding_window=window)  # noqa: E731
        ms, ms_graph = _ms(fn), _ms_graph([fn])
        r = {"case": f"prefill {'causal' if not window else f'window{window}'} T={T}", "ms": ms, "ms_graph": ms_graph,
             "tflops": _tflops(_visible_pairs(T, 0, window), ms)}
        print(r, flush=True)
        out.append(r)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["quick"]:
        quick()
    elif sys.argv[1:2] == ["decode_b1"]:
        decode_b1()
    elif sys.argv[1:2] == ["decode_merge"]:  # the unfused merge spread over the SMs, by split count
        for b in (1, 8):
            decode_b1(B=b, splits_list=(None, 16, 32, 64, 128), configs=[(128, 4, 3), (64, 4, 4)], chunks=(None,),
                      fused_list=(True, False))
    elif sys.argv[1:2] == ["decode_splits"]:  # many programs per SM (the read probe's best, ninth session)
        for b in (1, 8):
            decode_b1(B=b, splits_list=(None, 32, 64, 128) if b == 1 else (None, 8, 16, 32),
                      configs=[(128, 4, 3), (64, 4, 3), (64, 4, 4), (128, 8, 3), (64, 8, 2)], chunks=(None, 8))
    elif sys.argv[1:2] == ["variants"]:
        variants(tuple(int(t) for t in sys.argv[2].split(",")) if len(sys.argv) > 2 else (8192, 32768))
    elif sys.argv[1:2] == ["sweep_quick"]:
        sweep_quick()
    elif sys.argv[1:2] == ["sweep"]:
        res = sweep()
        best = {}
        for r in res:
            key = (r["kind"], r.get("window"), r.get("B"), r.get("nq"))
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
        print("BEST:")
        for r in best.values():
            print(r)
    else:
        toks = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "8192,32768").split(",")]
        for r in bench(toks):
            print(r)
