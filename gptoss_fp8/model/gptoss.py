"""The gpt-oss forward pass over FP8 (or bf16) checkpoints, unsharded or tensor/expert parallel.

Buffer names are the checkpoint's tensor names (``model.layers.3.self_attn.q_proj.weight``...), so
loading is one loop over ``named_buffers()`` with a shape and dtype check per tensor. Numerics
follow OpenAI's ``gpt_oss/torch/model.py`` op for op (each op written once in gptoss_fp8/spec.py;
model/ops.py picks them per backend):
RMSNorm in fp32, YaRN RoPE with concentration, sinks as an extra softmax column, sliding window
on ``sliding_attention`` layers, router top-k (sorted) + softmax over the selected logits in bf16,
clamped SwiGLU with +1 on the interleaved linear half, expert biases, bf16 residual stream.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gptoss_fp8.config import GptOssConfig
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.kernels import device_ints
from gptoss_fp8.model.cache import ChunkRows, DecodeStep, KVCache, decode_tokens
from gptoss_fp8.model.ops import ChunkKeys, Normed, QuantQ, ReferenceOps
from gptoss_fp8.parallel import SINGLE, Parallel, check_layout
from gptoss_fp8.quant.fp8 import FP8_DTYPE, scale_grid
from gptoss_fp8.spec import rope_cos_sin

BF16, F32 = torch.bfloat16, torch.float32

# A long prefill's MoE runs in chunks of tokens (``moe_chunk``: it bounds the activations' memory): multiples of
# MOE_CHUNK_STEP, enough that each expert gets MOE_CHUNK_EXPERT_ROWS rows a chunk on average (default_moe_chunk).
MOE_CHUNK_STEP = 32768
MOE_CHUNK_EXPERT_ROWS = 4096


def default_moe_chunk(cfg: GptOssConfig) -> int:
    """Tokens per MoE call in a long prefill: the multiple of 32768 that gives each expert 4096 rows a chunk on
    average, so that padding its rows to the GEMMs' 128-row tiles costs ~1.6% of its work or less: 32768 on
    the 20b (32 experts, 4 a token), 131072 on the 120b (128). Measured on the H200 (thirty-seventh session, `bench
    prefill --attention fp8` at 128000 tokens): the 120b 5.138 s in one chunk against 5.189 s in chunks of 32768
    (~1024 rows an expert a chunk; peak memory 121.4 against 116.2 GiB); the 20b 3.265 s in chunks of 32768 against
    3.312 s in one."""
    rows = MOE_CHUNK_EXPERT_ROWS * cfg.num_local_experts / cfg.num_experts_per_tok
    return MOE_CHUNK_STEP * max(1, math.ceil(rows / MOE_CHUNK_STEP))


def _spec(module: nn.Module, name: str, shape: tuple[int, ...] | None, dtype: torch.dtype) -> None:
    """Declare a tensor the checkpoint must provide (shape None: absent on this rank)."""
    module.register_buffer(name, None if shape is None else torch.empty(shape, dtype=dtype, device="meta"))


class Linear(nn.Module):
    def __init__(self, n: int, k: int, *, fp8: bool, bias: bool = True):
        super().__init__()
        _spec(self, "weight", (n, k), FP8_DTYPE if fp8 else BF16)
        _spec(self, "weight_scale_inv", scale_grid(n, k) if fp8 else None, F32)
        _spec(self, "bias", (n,) if bias else None, BF16)


class RMSNorm(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        _spec(self, "weight", (h,), F32)  # the reference holds norm scales in fp32


class Attention(nn.Module):
    def __init__(self, cfg: GptOssConfig, par: Parallel, fp8: bool):
        super().__init__()
        d, h = cfg.head_dim, cfg.hidden_size
        self.n_heads, self.n_kv = local_heads(cfg, par)
        self.q_proj = Linear(self.n_heads * d, h, fp8=fp8)
        self.k_proj = Linear(self.n_kv * d, h, fp8=fp8)
        self.v_proj = Linear(self.n_kv * d, h, fp8=fp8)
        self.o_proj = Linear(h, self.n_heads * d, fp8=fp8, bias=par.owns_row_bias)  # bias once: rank 0
        _spec(self, "sinks", (self.n_heads,), BF16)


class Experts(nn.Module):
    def __init__(self, cfg: GptOssConfig, par: Parallel):
        super().__init__()
        e, i, h = local_experts(cfg, par)
        _spec(self, "gate_up_proj", (e, 2 * i, h), FP8_DTYPE)
        _spec(self, "gate_up_proj_scale_inv", (e, *scale_grid(2 * i, h)), F32)
        _spec(self, "gate_up_proj_bias", (e, 2 * i), BF16)
        _spec(self, "down_proj", (e, h, i), FP8_DTYPE)
        _spec(self, "down_proj_scale_inv", (e, *scale_grid(h, i)), F32)
        _spec(self, "down_proj_bias", (e, h) if par.owns_expert_bias else None, BF16)
        self.first_expert = par.expert_group * e


class MLP(nn.Module):
    def __init__(self, cfg: GptOssConfig, par: Parallel):
        super().__init__()
        self.router = Linear(cfg.num_local_experts, cfg.hidden_size, fp8=False)
        self.experts = Experts(cfg, par)


class Layer(nn.Module):
    def __init__(self, cfg: GptOssConfig, par: Parallel, idx: int, attn_fp8: bool):
        super().__init__()
        self.idx = idx
        self.window = cfg.sliding_window if cfg.layer_types[idx] == "sliding_attention" else 0
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg, par, attn_fp8)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = MLP(cfg, par)


class Embedding(nn.Module):
    def __init__(self, v: int, h: int):
        super().__init__()
        _spec(self, "weight", (v, h), BF16)


class Body(nn.Module):
    def __init__(self, cfg: GptOssConfig, par: Parallel, attn_fp8: bool):
        super().__init__()
        self.embed_tokens = Embedding(local_vocab(cfg, par), cfg.hidden_size)
        self.layers = nn.ModuleList([Layer(cfg, par, i, attn_fp8) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size)


def local_heads(cfg: GptOssConfig, par: Parallel) -> tuple[int, int]:
    """(q heads, kv heads) held by one rank; kv heads are replicated when tp > kv heads."""
    return cfg.num_attention_heads // par.tp, max(1, cfg.num_key_value_heads // par.tp)


def local_vocab(cfg: GptOssConfig, par: Parallel) -> int:
    """Embedding / lm_head rows held by one rank: all of them, or its vocab-parallel slice."""
    a, b = par.vocab_rows(cfg.vocab_size)
    return b - a


def local_experts(cfg: GptOssConfig, par: Parallel) -> tuple[int, int, int]:
    """(experts, intermediate size, hidden) held by one rank."""
    return cfg.num_local_experts // par.ep, cfg.intermediate_size // par.parts, cfg.hidden_size


def _check_chunk(cache: KVCache, row: int, n: int, start: int) -> None:
    """One line unless n prompt tokens at positions start.. fit sequence ``row`` of ``cache`` (a
    chunk after the first continues where the sequence ends)."""
    if not 0 <= row < cache.batch:
        raise GptOssFp8Error(f"prefill row {row}: the cache holds sequences 0..{cache.batch - 1}")
    if not (n >= 1 and start + n <= cache.max_len):
        raise GptOssFp8Error(f"prefill of {n} tokens at position {start} into a KV cache of max_len {cache.max_len}; "
                             "give 1..max_len prompt tokens (or a larger max_len)")
    if start and cache.host_lengths[row] != start:
        raise GptOssFp8Error(f"prefill at start {start}: sequence {row} holds {cache.host_lengths[row]} tokens; "
                             "a chunk continues where the sequence ends")


class GptOss(nn.Module):
    """gpt-oss causal LM for one rank. ``forward(tokens) -> logits`` (bf16 [T, V], replicated).

    With ``par.vocab_parallel`` the rank holds rows ``par.vocab_rows(V)`` of the embedding and of
    lm_head: ``embed`` looks up the tokens in its slice and all-reduces the rows, the logits of
    each slice are all-gathered; every rank returns the full [T, V]."""

    # A prefill returns the logits of one row per sequence (its last), so past its K / V (which the
    # cache keeps) the last layer's work on every other row feeds nothing: its attention, o_proj,
    # MoE and norms run on the returned rows only (``_run``; a full layer's one query by the decode
    # attention, bf16 under ``--attention fp8`` too, as decode steps are). False: every row, as
    # ``forward`` without ``last_only`` (bench prefill ``--full-last-layer`` measures the difference).
    prune_last_layer: bool = True

    def __init__(self, cfg: GptOssConfig, par: Parallel = SINGLE, *, attn_fp8: bool = True):
        super().__init__()
        check_layout(cfg, par.tp, par.ep, par.vocab_parallel)
        self.cfg, self.par, self.attn_fp8 = cfg, par, attn_fp8
        self.model = Body(cfg, par, attn_fp8)
        self.lm_head = Linear(local_vocab(cfg, par), cfg.hidden_size, fp8=False, bias=False)

    # ------------------------------------------------------------------------------------------
    def expected(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor this rank needs: name -> (shape, dtype)."""
        return {n: (tuple(b.shape), b.dtype) for n, b in self.named_buffers()}

    def load_tensors(self, tensors: dict[str, torch.Tensor], where: str, device: str | torch.device = "cpu") -> None:
        """Fill the buffers from ``tensors`` (checkpoint names), checking shapes and dtypes."""
        for name, (shape, dtype) in self.expected().items():
            t = tensors.get(name)
            if t is None:
                raise GptOssFp8Error(f"{where}: tensor {name} is missing{_layer_of(name)}; re-run the conversion")
            if tuple(t.shape) != shape:
                raise GptOssFp8Error(
                    f"{where}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} for this config"
                    f"{'' if self.par.world == 1 else f' (rank {self.par.rank} of tp {self.par.tp}, ep {self.par.ep})'}"
                    "; is config.json the one the weights were converted with?"
                )
            if (dtype == FP8_DTYPE) != (t.dtype == FP8_DTYPE) or (dtype == F32 and name.endswith("scale_inv") and t.dtype != F32):
                raise GptOssFp8Error(f"{where}: tensor {name} is {t.dtype}, expected {dtype}; re-run the conversion")
            mod_name, _, attr = name.rpartition(".")
            setattr(self.get_submodule(mod_name), attr, t.to(device=device, dtype=dtype))

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, ops: ReferenceOps | None = None,
                capture: dict[str, torch.Tensor] | None = None, *, last_only: bool = False,
                moe_chunk: int | None = None) -> torch.Tensor:
        """tokens int [T] -> logits bf16 [T, V] ([1, V] of the last position with ``last_only``: a
        prefill's first-token logits). ``capture`` (if given) receives the residual stream after each
        layer's attention (``"{i}.attn"``) and MLP (``"{i}.mlp"``), bf16 [T, H], and the router
        logits (``"{i}.router"``, bf16 [T, E]). ``moe_chunk`` runs the MoE blocks over at most that
        many tokens at a time (bounds the [T * top_k, ...] expert activations; the MoE is per
        token, so only the summation order of GEMMs given fewer rows may change)."""
        ops = ops or ReferenceOps()
        cos, sin = rope_cos_sin(self.cfg, tokens.shape[0], self.model.embed_tokens.weight.device)
        return self._run(tokens, ops, cos, sin, capture, last_only=last_only, moe_chunk=moe_chunk)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, ops: ReferenceOps | None = None, *, max_len: int | None = None,
                moe_chunk: int | None = None, cache: KVCache | None = None,
                row: int = 0, start: int = 0, kept: int = 0) -> tuple[KVCache, torch.Tensor]:
        """Run the prompt tokens int [T] (positions 0..T-1) as ``forward`` does, keeping every
        layer's K and V -> (a cache for up to ``max_len`` tokens, default T + 1024, holding T;
        bf16 logits [1, V] of the last position: the first generated token's).

        A batch of prompts: B prefills into the rows of one cache, ``cache = model.new_cache(L,
        batch=B)``, then ``model.prefill(prompt_b, ops, cache=cache, row=b)`` for each b (the
        sequence's old contents are replaced; max_len is the cache's).

        A prompt in chunks (runtime/: a long prompt interleaved with other sequences' decode
        steps): ``start`` > 0 continues sequence ``row``, which holds exactly ``start`` tokens: the
        chunk sits at positions start..start + T - 1, its queries attend to the cached keys and to
        the chunk's own (``ops.attention_chunk``), and the sequence then holds start + T tokens. ``kept`` > start:
        the full layers' rows of positions start..kept - 1 already hold their keys (the prefix cache's ring rebuild,
        runtime/prefix.py): the full layers write the chunk's rows from kept on only, and attend to the kept ones."""
        ops = ops or ReferenceOps()
        n = tokens.shape[0]
        if cache is None:
            if start:
                raise GptOssFp8Error(f"prefill at start {start} continues a sequence: pass its cache")
            cache = self.new_cache(max_len or n + 1024)
        _check_chunk(cache, row, n, start)
        cos, sin = cache.rope_rows(start, n)
        if kept and not start:
            raise GptOssFp8Error("prefill: kept full-layer rows are for a chunk after cached keys (start > 0)")
        kept = max(kept, start)
        logits = self._run(tokens, ops, cos, sin, None, last_only=True, moe_chunk=moe_chunk, cache=cache, row=row,
                           start=start, kept=kept)
        cache.set_length(row, start + n)
        return cache, logits

    @torch.inference_mode()
    def prefill_many(self, chunks: list[tuple[int, torch.Tensor, int]], ops: ReferenceOps, cache: KVCache,
                     kept: dict[int, int] | None = None) -> torch.Tensor:
        """Several sequences' prompt chunks in one forward: ``chunks`` (row, tokens int [T_i], start)
        as ``prefill(tokens, ops, cache=cache, row=row, start=start)`` would take each -> bf16 logits
        [len(chunks), V], each chunk's last position. The rows of every chunk go through the
        projections, the norms and the MoE together (one GEMM per weight for all of them: the
        serving engine's prompts of one step); the attention runs per chunk on its own sequence's
        keys. Each row's arithmetic is the one-chunk prefill's wherever an op's result for a row does
        not depend on the other rows (the CPU reference ops: bit for bit, tests/test_model_chunks.py). ``kept``: row
        -> ``prefill``'s ``kept`` of its chunk."""
        if not chunks:
            raise GptOssFp8Error("prefill_many: no chunks")
        rows = [row for row, _, _ in chunks]
        if len(set(rows)) != len(rows):
            raise GptOssFp8Error(f"prefill_many: sequences {rows} repeat; one chunk per sequence")
        segs = _Segments()
        segs.kept = dict(kept or {})
        for row, tokens, start in chunks:
            n = tokens.shape[0]
            _check_chunk(cache, row, n, start)
            if segs.kept.get(row) and not start:
                raise GptOssFp8Error(f"prefill_many: sequence {row}'s kept rows are for a chunk after cached keys")
            segs.append((row, start, n))
        tokens = torch.cat([t for _, t, _ in chunks])
        cos, sin = (torch.cat(parts) for parts in zip(*(cache.rope_rows(start, n) for _, start, n in segs),
                                                      strict=True))
        logits = self._run(tokens, ops, cos, sin, None, last_only=False, cache=cache, segments=segs)
        cache.set_lengths([row for row, _, _ in segs], [start + n for _, start, n in segs])
        return logits

    @torch.inference_mode()
    def decode(self, cache: KVCache, token: torch.Tensor | int, ops: ReferenceOps | None = None, *,
               capture: dict | None = None, force: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """One new token per sequence: ``token`` an int or one-element tensor (batch-1 cache), or
        int [B] (a cache of B sequences), sequence b's at position ``cache.lengths[b]``. Its K and
        V are appended to the cache, its attention reads the cached keys (the layer's window, the
        sinks once) -> bf16 logits [B, V]; every length advances by one. ``capture`` (if given)
        receives the step's per-layer states as ``forward``'s does, one row per sequence ([B, H],
        [B, E]). ``force`` (teacher forcing, verify/decode.py) replaces the stream entering each
        layer's attention (``"{i}.in"``) and its MoE (``"{i}.attn"``) by the given rows [B, H] and
        the MoE's routing by (``"{i}.ids"``, ``"{i}.weights"``), so each part runs on given inputs;
        the captures then also hold each layer's own routing (``"{i}.ids"``, ``"{i}.weights"``)."""
        ops = ops or ReferenceOps()
        t = decode_tokens(cache, token, self.model.embed_tokens.weight.device)
        cache.check_room(1)
        logits = self.decode_step(cache, t, ops, capture=capture, force=force)
        cache.advance_host()
        return logits

    @torch.inference_mode()
    def decode_step(self, cache: KVCache, tokens: torch.Tensor, ops: ReferenceOps, *,
                    capture: dict | None = None, force: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``decode``'s device work: tokens int [B] on the cache's device -> logits bf16 [B, V];
        the device lengths advance by one, the host mirror does not (the caller's: ``decode``, or
        model/graph.py after a replay). Positions come from ``cache.lengths`` as tensors (RoPE rows
        gathered, cache rows written by index, kernel lengths on the device): on the triton
        backend no host synchronisation, so it can be captured as a CUDA graph. The caller checks
        room (``cache.check_room``)."""
        step = cache.step()
        cos, sin = self._rope_at(cache, step.pos)
        logits = self._run(tokens, ops, cos, sin, capture, last_only=False, cache=cache, step=step, force=force)
        cache.lengths.add_(1)
        return logits

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """An empty KV cache of this rank's kv heads for ``batch`` sequences of up to ``max_len`` tokens."""
        dev = self.model.embed_tokens.weight.device
        windows = [layer.window for layer in self.model.layers]
        return KVCache.empty(windows, self.model.layers[0].self_attn.n_kv, self.cfg.head_dim, max_len,
                             rope_cos_sin(self.cfg, max_len, dev), dev, batch=batch)

    def _rope_at(self, cache: KVCache, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (cos, sin) [B, D/2] of a decode step's tokens: rows of their positions (int [B],
        on the device: a gather, no host read)."""
        return cache.cos[pos], cache.sin[pos]

    def _run(self, tokens: torch.Tensor, ops: ReferenceOps, cos, sin, capture: dict | None, *,
             last_only: bool, moe_chunk: int | None = None, cache: KVCache | None = None,
             row: int = 0, step: DecodeStep | None = None, start: int = 0,
             force: dict[str, torch.Tensor] | None = None,
             segments: list[tuple[int, int, int]] | None = None, kept: int = 0) -> torch.Tensor:
        """The one forward pass (cos / sin: the tokens' RoPE rows). Without ``step``: tokens [T] of
        one sequence at positions start..start + T - 1 (start > 0: a prompt chunk after the
        cached ones), with a cache written to its sequence ``row``. With a
        decode ``step``: tokens [B], one per sequence of the cache at the step's positions, their
        K / V appended and the attention reading the cached keys. ``force``: see ``decode``.
        ``segments`` (row, start, n): tokens are several sequences' chunks one after another
        (``prefill_many``); the logits are each chunk's last row's. ``kept``: ``prefill``'s."""
        eps = self.cfg.rms_norm_eps
        x = self.embed(tokens, ops)  # [T, H] bf16
        layers = self.model.layers
        # the rows whose logits are returned (None: all; one sequence's last: a slice, no tensor made from
        # host values, which a CUDA graph may capture); with ``prune_last_layer`` the last layer computes
        # only those past its K / V (the other rows' outputs of it would feed nothing)
        ends = None
        if segments is not None:
            ends = device_ints([n for _, _, n in segments], x.device).cumsum(0) - 1
        elif last_only:
            ends = slice(x.shape[0] - 1, x.shape[0])
        prune = (ends is not None and self.prune_last_layer and step is None and capture is None
                 and force is None)
        h = ops.rms_norm(x, layers[0].input_layernorm.weight, eps)  # Normed: rows (+ their FP8 quantization)
        for i, layer in enumerate(layers):
            if force is not None and i > 0:  # teacher forcing: the given stream enters the layer
                x = force[f"{i}.in"].to(device=x.device, dtype=x.dtype)
                h = ops.rms_norm(x, layer.input_layernorm.weight, eps)
            last_rows = prune and i == len(layers) - 1
            # (the post-attention norm's bf16 rows only where the MoE reads them: ``ops.moe_needs_rows``)
            x, h = self._attention(layer, h, cos, sin, ops, cache, row, step, start, segments,
                                   last_rows=ends if last_rows else None, kept=kept,
                                   post=(_take(x, ends) if last_rows else x, layer.post_attention_layernorm.weight,
                                         force is not None or self._moe_rows(layer, ops)))
            if capture is not None:
                capture[f"{layer.idx}.attn"] = x
            routing = None
            if force is not None:
                x = force[f"{i}.attn"].to(device=x.device, dtype=x.dtype)
                h = ops.rms_norm(x, layer.post_attention_layernorm.weight, eps)
                routing = (force[f"{i}.ids"], force[f"{i}.weights"])
            # the next layer's input norm: its bf16 rows only where the q / k / v projections read them (a backend
            # whose GEMMs take the norm's FP8 rows leaves them unwritten: ``ops.needs_rows``)
            rows = i + 1 == len(layers) or ops.needs_rows(self._qkv_projs(layers[i + 1]))
            if moe_chunk and h.n > moe_chunk and routing is None:
                x, h = self._moe_chunked(layer, x, h, ops, capture, moe_chunk, self._next_norm(i), rows)
            else:
                y, weights = self._moe(layer, h, ops, capture, routing, route_keys=capture is not None)
                x, h = ops.moe_combine_add_rms_norm(x, y, weights, self._next_norm(i), eps, rows=rows)
            if capture is not None:
                capture[f"{layer.idx}.mlp"] = x
        if prune or ends is None:  # (pruned: h holds the returned rows only)
            return self._logits(h.y, ops)
        return self._logits(_take(h.y, ends), ops)

    def embed(self, tokens: torch.Tensor, ops: ReferenceOps | None = None) -> torch.Tensor:
        """tokens int [T] (ids in 0..V-1, checked by the callers) -> their embedding rows, bf16
        [T, H], the same on every rank. Vocab-parallel: each rank takes the rows of the tokens in
        its slice and -0.0 for the others, and the rows are all-reduced; x + (-0.0) == x for every
        x (signed zeros included) in any summation order, so the sum is the row bit for bit.
        Masking, not indexing by a mask: no data-dependent shape, no host sync (decode is captured
        as a CUDA graph)."""
        w = self.model.embed_tokens.weight
        if not self.par.vocab_parallel:
            return w[tokens.long()]
        ops = ops or ReferenceOps()
        v0, v1 = self.par.vocab_rows(self.cfg.vocab_size)
        local = tokens.long() - v0
        mine = (local >= 0) & (local < v1 - v0)
        rows = w[local.clamp(0, v1 - v0 - 1)]  # [T, H]
        rows = torch.where(mine[:, None], rows, -0.0)
        return ops.all_reduce(rows, self.par)

    def _logits(self, h: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        """The lm_head on the final normed rows h bf16 [T, H] -> logits bf16 [T, V] (vocab-parallel:
        this rank's vocabulary columns, then all-gathered; each column is the same GEMM row as
        unsharded)."""
        logits = ops.linear(h, self.lm_head.weight, None, None)  # [T, V] or [T, V_rank]
        if not self.par.vocab_parallel:
            return logits
        return ops.all_gather(logits, self.par, self.par.vocab_sizes(self.cfg.vocab_size))

    def _moe_chunked(self, layer: Layer, x: torch.Tensor, t: Normed, ops: ReferenceOps, capture: dict | None,
                     chunk: int, norm_weight: torch.Tensor, rows: bool) -> tuple[torch.Tensor, Normed]:
        """The MoE block on the normed stream t (rows [T, H]) in chunks of at most ``chunk`` rows, each chunk's
        combine, residual add onto x's rows and the next norm (``norm_weight``, ``rows`` as
        ``moe_combine_add_rms_norm``'s) written straight into that chunk's rows of the layer's results (``ops.norm_out``:
        no [T, H] combine written and read back) -> (new x, Normed). Per token the same arithmetic as unchunked."""
        if chunk < 1:
            raise GptOssFp8Error(f"moe_chunk must be a positive number of tokens, got {chunk}")
        eps = self.cfg.rms_norm_eps
        xo, ho = ops.norm_out(x, rows)
        got: dict[str, list[torch.Tensor]] = {"router": [], "ids": [], "weights": []}
        for s in range(0, t.n, chunk):
            e = min(s + chunk, t.n)
            part: dict | None = {} if capture is not None else None
            y, weights = self._moe(layer, t.rows(s, e), ops, part, route_keys=part is not None)
            ops.moe_combine_add_rms_norm(x[s:e], y, weights, norm_weight, eps, rows=rows, out=(xo[s:e], ho.rows(s, e)))
            if part is not None:
                for key, v in got.items():
                    v.append(part[f"{layer.idx}.{key}"])
        if capture is not None:
            capture |= {f"{layer.idx}.{key}": torch.cat(v) for key, v in got.items()}
        return xo, ho

    @staticmethod
    def _qkv_projs(layer: Layer) -> list[tuple]:
        """Layer's q / k / v projections as (weight, scale_inv, bias), the ``linears`` form."""
        a = layer.self_attn
        return [(p.weight, p.weight_scale_inv, p.bias) for p in (a.q_proj, a.k_proj, a.v_proj)]

    def _next_norm(self, i: int) -> torch.Tensor:
        """The norm scale applied after layer i's MLP residual: layer i + 1's input norm, or the final norm."""
        layers = self.model.layers
        return layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.norm.weight

    def _attention(self, layer: Layer, t: Normed, cos, sin, ops: ReferenceOps, cache: KVCache | None = None,
                   row: int = 0, step: DecodeStep | None = None, start: int = 0,
                   segments: list[tuple[int, int, int]] | None = None,
                   last_rows: slice | torch.Tensor | None = None,
                   post: tuple[torch.Tensor, torch.Tensor, bool] | None = None, kept: int = 0,
                   ) -> torch.Tensor | tuple[torch.Tensor, Normed]:
        """Attention block on the normed stream t (rows [T, H]; cos / sin their RoPE rows) -> its
        residual delta (bf16, or float32 partial sums over ranks reduced here: the caller rounds
        once); with ``post`` = (the stream x, the post-attention norm's weight, whether its bf16 rows are
        needed): (x + delta, its norm), the ``add_rms_norm`` after it, or (one rank) o_proj's GEMM adding x in its
        epilogue and the norm reading the new stream alone (``ops.linear_add``, where the backend has it). Without
        ``step`` the rows are one sequence at positions 0..T - 1 (written to the cache's sequence ``row`` if a
        cache is given) and the attention is the prefill's over them;
        with a decode ``step`` row b is sequence b's new token: its K / V are appended to the cache
        and it attends to the cached keys (``ops.attention_cached``). ``start`` > 0: the rows are a
        prompt chunk at positions start.., attending to the sequence's cached keys before them and
        to their own (``ops.attention_chunk``). ``segments``: the rows are several sequences' chunks
        (``prefill_many``), each attending as one chunk of its sequence would. ``last_rows`` (a
        prefill's last layer, ``prune_last_layer``: each sequence's last row, a slice or int rows):
        every row's K / V as without it, but the queries, the attention and o_proj of those rows only
        -> [sequences, H]. ``kept``: ``prefill``'s."""
        a, d = layer.self_attn, self.cfg.head_dim
        n = t.n
        projs = self._qkv_projs(layer)  # (t.y is None where ops.needs_rows(projs) said so: the GEMMs take t.quant)
        if last_rows is not None:  # K / V of every row (one GEMM), Q of each sequence's last row
            k, v = ops.linears(t.y, projs[1:], xq=t.quant)
            qn = t.rows(last_rows.start, last_rows.stop) if isinstance(last_rows, slice) else t.select(last_rows)
            q = ops.linear(qn.y, *projs[0], xq=qn.quant)
        else:  # (a whole prompt: Q may come rotated and quantized for the FP8 attention, ``QuantQ``)
            qkv = (ops.linears_q8(t.y, projs, (cos, sin), layer.window, xq=t.quant)
                   if step is None and segments is None and not start else None)
            q, k, v = qkv if qkv is not None else ops.linears(t.y, projs, xq=t.quant)
        # q [T, Hl * D] ([sequences, Hl * D] with last_rows; a QuantQ from linears_q8), k / v [T, KVl * D]
        v = v.view(n, a.n_kv, d)
        if step is not None:  # decode: k / v [B, KVl, D], one new token per sequence, into the cache
            q = ops.rope_append(q.view(n, a.n_heads, d), k.view(n, a.n_kv, d), v, cos, sin, cache, layer.idx, step)
            o = ops.attention_cached(q.view(n, a.n_kv, a.n_heads // a.n_kv, d), cache.k[layer.idx],
                                     cache.v[layer.idx], step.n, a.sinks, 1 / math.sqrt(d), layer.window)  # [B, Hl * D]
        else:
            # q is rotated by the attention (``ops.attention``'s rope: a backend may do it in a pass it makes
            # anyway), k here (the cache holds it rotated)
            if not isinstance(q, QuantQ):
                q = q.view(q.shape[0], a.n_kv, a.n_heads // a.n_kv, d)
            k = ops.rope(k.view(n, a.n_kv, d), cos, sin)
            last = last_rows is not None
            if segments is None:  # (a Normed: o_proj may read its quantization alone, ``attention_out``)
                o = self._prefill_attention(layer, q, k, v, ops, cache, row, start, (cos, sin), last,
                                            ops.needs_rows([(a.o_proj.weight, a.o_proj.weight_scale_inv, None)]), kept)
            elif not last:  # each sequence's chunk on its own keys, one ``ops.attention_segments``
                o = self._segments_attention(layer, q, k, v, ops, cache, segments, (cos, sin))
            else:  # the last layer's: each sequence's last row, as a decode step over the cache
                o = self._segments_last_rows(layer, q, k, v, ops, cache, segments,
                                             (cos.index_select(0, last_rows), sin.index_select(0, last_rows)))
        # o_proj input is split by heads: a partial sum over ranks, kept in fp32 and rounded once
        o = o if isinstance(o, Normed) else Normed(o)
        proj, eps = (a.o_proj.weight, a.o_proj.weight_scale_inv, a.o_proj.bias), self.cfg.rms_norm_eps
        if post is not None and self.par.world == 1:
            xo = ops.linear_add(o.y, *proj, post[0], xq=o.quant)
            if xo is not None:
                return xo, ops.rms_norm(xo, post[1], eps, rows=post[2])
        delta = ops.all_reduce(ops.linear(o.y, *proj, self._partial_dtype(), xq=o.quant), self.par)
        return delta if post is None else ops.add_rms_norm(post[0], delta, post[1], eps, rows=post[2])

    @staticmethod
    def _moe_rows(layer: Layer, ops: ReferenceOps) -> bool:
        """Whether layer's MoE block reads its norm's bf16 rows (``ops.moe_needs_rows``)."""
        return ops.moe_needs_rows(layer.mlp.experts, layer.mlp.router.weight)

    def _prefill_attention(self, layer: Layer, q, k, v, ops: ReferenceOps, cache: KVCache | None, row: int,
                           start: int, rope: tuple[torch.Tensor, torch.Tensor], last_row: bool = False,
                           rows: bool = True, kept: int = 0) -> torch.Tensor | Normed:
        """One sequence's prompt rows (q [T, KV, M, D] before RoPE, or at start 0 a ``QuantQ`` from ``linears_q8``;
        k / v [T, KV, D], k after it) at
        positions start.. (rope: their cos / sin rows): written to the cache's sequence ``row`` (if a
        cache is given) -> attention [T, Hl * D]. ``last_row``: q is the last row's alone ([1, KV, M, D])
        -> its attention over every key, [1, Hl * D] (a full layer's: the decode attention, split over the
        keys, ``ops.attention_cached`` on them as a one-sequence cache). A whole prompt's (start 0, not
        ``last_row``): ``ops.attention_out``'s Normed, its rows left out where ``rows`` is False and the backend
        wrote their quantization instead. ``kept`` (a chunk after cached keys, ``prefill``'s): a full layer's rows of
        positions before it already hold their keys: the chunk's rows from there on are written."""
        a, d = layer.self_attn, self.cfg.head_dim
        if start or last_row:
            if start and not cache.is_ring(layer.idx):  # a full layer's rows hold positions in order: the chunk
                # written after the cached keys, all of them are one view (no copy of the cached keys per chunk)
                if kept < start + k.shape[0]:
                    skip = max(0, kept - start)
                    cache.write(layer.idx, row, start + skip, k[skip:], v[skip:])
                ka, va, first = cache.read(layer.idx, row, start + k.shape[0])
            elif start:  # a ring: the keys before the chunk, copied out before the chunk's own overwrite its rows
                pk, pv, first = cache.read(layer.idx, row, start)  # positions first..start - 1 (views)
                ka, va = torch.cat([pk, k.to(pk.dtype)]), torch.cat([pv, v.to(pv.dtype)])
                cache.write(layer.idx, row, start, k, v)
            else:
                ka, va, first = k, v, 0
                if cache is not None:
                    cache.write(layer.idx, row, start, k, v)
            n, kvh, m, _ = q.shape
            cos, sin = (t[-1:] for t in rope) if last_row else rope
            q = ops.rope(q.reshape(n, kvh * m, d), cos, sin).view(n, kvh, m, d)
            if last_row and not layer.window:  # (a fill, not a copy from the host: a CUDA graph may capture it)
                keys = torch.full((1,), ka.shape[0], dtype=torch.int32, device=ka.device)
                return ops.attention_cached(q, ka.unsqueeze(0), va.unsqueeze(0), keys, a.sinks, 1 / math.sqrt(d), 0)
            return ops.attention_chunk(q, ka, va, a.sinks, 1 / math.sqrt(d), layer.window,
                                       ka.shape[0] - n if last_row else start - first)
        if cache is not None:
            cache.write(layer.idx, row, 0, k, v)
        return ops.attention_out(q, k, v, a.sinks, 1 / math.sqrt(d), layer.window, rope=rope, rows=rows)  # [T, Hl * D]

    def _segments_attention(self, layer: Layer, q, k, v, ops: ReferenceOps, cache: KVCache, segments: _Segments,
                            rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Several sequences' prompt chunks (``prefill_many``: q [T, KV, M, D] before RoPE, k / v [T, KV, D], k
        after it; rope: the rows' cos / sin): written to their sequences' cache rows and attended in one
        ``ops.attention_segments`` -> [T, Hl * D], with a few launches a layer however many chunks
        (``KVCache.chunk_rows``, made once a forward for each kind of layer). A full layer's keys are the cache
        itself (sequence b's at rows b * rows.. of its flat view: no copy); a ring's are each chunk's cached keys
        (gathered before the chunks overwrite them) and its own, packed chunk after chunk. Each chunk's rows as
        ``_prefill_attention`` on it alone (the CPU ops: bit for bit)."""
        a, d = layer.self_attn, self.cfg.head_dim
        i, (n, kvh, m, _) = layer.idx, q.shape
        q = ops.rope(q.reshape(n, kvh * m, d), *rope).view(n, kvh, m, d)
        plan, keys = self._segments_plan(cache, i, segments)
        if plan.packed:  # a ring: its cached keys read before the chunks' rows overwrite them
            ka, va = cache.chunk_keys(i, plan, k, v)
            cache.write_chunks(i, plan, k, v)
        else:
            cache.write_chunks(i, plan, k, v)
            ka, va = cache.chunk_keys(i, plan, k, v)
        return ops.attention_segments(q, ka, va, a.sinks, 1 / math.sqrt(d), layer.window, keys)

    def _segments_last_rows(self, layer: Layer, q, k, v, ops: ReferenceOps, cache: KVCache, segments: _Segments,
                            rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """A pruned last layer's attention in ``prefill_many``: q [chunks, KV, M, D] each chunk's last row before
        RoPE (rope: their cos / sin), k / v [T, KV, D] every row's -> [chunks, Hl * D]. The chunks' K / V written
        (``KVCache.write_chunks``), then each last row is its sequence's newest token: one ``ops.attention_cached``
        (the decode attention, bf16 under ``--attention fp8`` too, as a single prefill's last row) over the cache's
        first sequences, those of no chunk given no keys; the rows of the chunks' sequences taken."""
        a, d = layer.self_attn, self.cfg.head_dim
        i, (n, kvh, m, _) = layer.idx, q.shape
        q = ops.rope(q.reshape(n, kvh * m, d), *rope).view(n, kvh, m, d)
        plan = self._segments_plan(cache, i, segments)[0]
        cache.write_chunks(i, plan, k, v)
        got = segments.keys.get("last")
        if got is None:
            top = max(b for b, _, _ in segments) + 1
            lengths = [0] * top
            for b, pos0, c in segments:
                lengths[b] = pos0 + c
            dev = q.device
            got = segments.keys["last"] = (top, device_ints([b for b, _, _ in segments], dev),
                                           device_ints(lengths, dev, torch.int32))
        top, slots, lengths = got
        qs = q.new_zeros((top, kvh, m, d)).index_copy_(0, slots, q)
        o = ops.attention_cached(qs, cache.k[i][:top], cache.v[i][:top], lengths, a.sinks, 1 / math.sqrt(d),
                                 layer.window)
        return o.index_select(0, slots)

    def _segments_plan(self, cache: KVCache, i: int, segments: _Segments) -> tuple[ChunkRows, ChunkKeys]:
        """Layer i's ``KVCache.chunk_rows`` and the attention's ``ChunkKeys`` of the chunks, made once a forward for
        each kind of layer (a ring by its rows, the full layers as 0)."""
        key = cache.rows(i) if cache.is_ring(i) else 0
        got = segments.keys.get(key)
        if got is None:
            plan = cache.chunk_rows(i, list(segments), segments.kept)
            rows = [0]
            for _, _, c in segments:
                rows.append(rows[-1] + c)
            got = segments.keys[key] = (plan, ChunkKeys(rows, plan.starts, plan.offsets))
        return got

    def _partial_dtype(self) -> torch.dtype:
        return F32 if self.par.world > 1 else BF16

    # ------------------------------------------------------------------------------------------
    # The parts, one at a time on a given input (teacher forcing: verify/parts.py)

    @torch.inference_mode()
    def attention_part(self, i: int, x: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        """Layer i's attention block on the residual stream x (bf16 [T, H], positions 0..T-1): its
        input norm, attention and residual add, as the forward computes them -> bf16 [T, H]."""
        layer, eps = self.model.layers[i], self.cfg.rms_norm_eps
        cos, sin = rope_cos_sin(self.cfg, x.shape[0], x.device)
        h = ops.rms_norm(x, layer.input_layernorm.weight, eps)
        out, _ = ops.add_rms_norm(x, self._attention(layer, h, cos, sin, ops), layer.post_attention_layernorm.weight, eps)
        return out

    @torch.inference_mode()
    def logits_part(self, x: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        """The final norm and lm_head on the residual stream after the last layer, x (bf16 [T, H])
        -> bf16 logits [T, V], as the forward computes them."""
        return self._logits(ops.rms_norm(x, self.model.norm.weight, self.cfg.rms_norm_eps).y, ops)

    @torch.inference_mode()
    def moe_part(self, i: int, x: torch.Tensor, ops: ReferenceOps,
                 routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Layer i's MoE block on the residual stream after its attention, x (bf16 [T, H]): norm,
        router, experts, combine and residual add -> {"out": bf16 [T, H], "router": our router
        logits bf16 [T, E], "ids" [T, k] / "weights" bf16 [T, k]: our own top-k choice and combine
        weights on those logits}. ``routing`` (expert ids [T, k], weights [T, k]) replaces our
        choice in the experts and the combine, so the expert FFN is compared on the reference's
        routing; the router logits and our own choice are returned either way."""
        layer, eps = self.model.layers[i], self.cfg.rms_norm_eps
        h = ops.rms_norm(x, layer.post_attention_layernorm.weight, eps)
        cap: dict[str, torch.Tensor] = {}
        y, weights = self._moe(layer, h, ops, cap, routing, route_keys=True)
        out, _ = ops.moe_combine_add_rms_norm(x, y, weights, self._next_norm(i), eps)
        j = layer.idx
        return {"out": out, "router": cap[f"{j}.router"], "ids": cap[f"{j}.ids"], "weights": cap[f"{j}.weights"]}

    def _moe(self, layer: Layer, t: Normed, ops: ReferenceOps, capture: dict | None = None,
             routing: tuple[torch.Tensor, torch.Tensor] | None = None,
             route_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """MoE block on the normed stream t (rows [T, H]) -> (per-slot expert outputs [T, k, H],
        routing weights bf16 [T, k]); their weighted combine (``ops.moe_combine``) is the residual
        delta. ``routing``: (ids, weights) to use instead of the router's own top-k. ``capture``
        gets the router logits, and our own (ids, weights) too when ``routing`` is given or
        ``route_keys`` (the verdict's combine check)."""
        m = layer.mlp
        # logits [T, E] bf16 (replicated), top-k expert ids [T, k], their softmax weights [T, k] bf16
        if t.y is not None:
            g, ids, weights = ops.route(t.y, m.router.weight, m.router.bias, self.cfg.num_experts_per_tok)
        else:  # (the norm left its rows out, ``moe_needs_rows``: the router remakes them from its source)
            g, ids, weights = ops.route(None, m.router.weight, m.router.bias, self.cfg.num_experts_per_tok, src=t.src)
        if capture is not None and (routing is not None or route_keys):
            capture[f"{layer.idx}.ids"], capture[f"{layer.idx}.weights"] = ids, weights
        if routing is not None:
            ids, weights = routing[0].to(device=ids.device, dtype=ids.dtype), routing[1].to(device=weights.device,
                                                                                           dtype=weights.dtype)
        if capture is not None:
            capture[f"{layer.idx}.router"] = g
        ex = dict(m.experts.named_buffers(recurse=False))
        ex.setdefault("down_proj_bias", None)
        y, yb = ops.expert_ffn(t.y, ids, ex, m.experts.first_expert, self.cfg.swiglu_limit,
                               partial=self.par.parts > 1, xq=t.quant)  # [T, k, H] f32 each
        if yb is None:  # whole experts per rank: each (token, slot) is computed by exactly one rank
            y = ops.all_reduce(y, self.par).to((t.y if t.y is not None else t.src[0]).dtype)
        else:  # intermediate dim split: sum the partial products, round, then add the bias once
            both = ops.all_reduce(torch.stack([y, yb]), self.par)
            y = ops.add_bias_after_sum(both[0], both[1])
        return y, weights


class _Segments(list):
    """``prefill_many``'s chunks (cache row, start, rows), and their cache rows and attention keys made once a
    forward (``keys``)."""

    def __init__(self):
        super().__init__()
        self.keys: dict = {}  # ring rows (0: full) -> (ChunkRows, ChunkKeys); "last": the pruned layer's slots
        self.kept: dict[int, int] = {}  # row -> where its full layers' kept rows end (``prefill``'s kept)


def _take(t: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """Rows of t: a slice (a view) or int indices."""
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def _layer_of(name: str) -> str:
    parts = name.split(".")
    return f" (layer {parts[2]})" if len(parts) > 2 and parts[1] == "layers" else ""
