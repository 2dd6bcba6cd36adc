"""``gptoss-fp8 generate``: prefill a prompt, then decode token by token through the KV cache.

Greedy at temperature 0 (the argmax of each step's logits), else sampling from softmax(logits / T)
with a seeded ``torch.Generator`` (same seed, same tokens). Generation stops after
``max_new_tokens`` or at a Harmony stop token: ``<|return|>`` (the reply is done), ``<|call|>`` (a
tool call), or ``<|end|>`` closing a message on any channel but ``analysis`` (in Harmony the model
ends its reasoning with ``<|end|>`` and goes on with the final answer, so that one does not stop
it). The ids are the released vocabulary's (``openai_harmony``); a synthetic checkpoint with a
smaller vocabulary has ``config.special_token_ids``' stand-ins for ``<|return|>`` and ``<|call|>``
(its last ids) and no text: its tokens are shown as ids.

Text: the offline o200k_harmony tokenizer that ``--prompt`` uses (verify/prompt.py), streamed as
tokens arrive (held back while a UTF-8 character is incomplete); at the end the reply is parsed
into its Harmony messages (channel ``analysis`` / ``final`` / ``commentary``, and their text).

A checkpoint converted for tp > 1 runs the same loop on every rank (verify/generate_sharded.py
starts the ranks, or is one of torchrun's): ``chooser`` has rank 0 pick each token and decide the
stop, and broadcasts both.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gptoss_fp8.config import GptOssConfig, special_token_ids
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.verify.prompt import HARMONY_VOCAB

# o200k_harmony's special tokens (openai_harmony; the released checkpoints' vocabulary)
CHANNEL, START, END, MESSAGE, RETURN, CALL = 200005, 200006, 200007, 200008, 200002, 200012
ANALYSIS = (35644,)  # "analysis", the channel name's tokens


def stop_tokens(vocab_size: int, tokenizer=None) -> dict[int, str]:
    """Token id -> name of the tokens that can end a reply, for a vocabulary of ``vocab_size``
    (``tokenizer``: a byte-level one, gptoss_fp8/tokenizer.py, whose eos ends it)."""
    if tokenizer is not None:
        return {tokenizer.eos: "</s>"}
    ids = special_token_ids(vocab_size)
    out = {ids["eos"]: "<|return|>", ids["call"]: "<|call|>"}
    if vocab_size >= HARMONY_VOCAB:
        out[END] = "<|end|>"
    return out


def stops_here(generated: list[int], stops: dict[int, str]) -> str | None:
    """Whether the last generated token ends the reply: its name, or None. ``<|end|>`` ends it
    unless it closes an ``analysis`` message (the header: ``<|channel|>analysis<|message|>``)."""
    tok = generated[-1]
    name = stops.get(tok)
    if name != "<|end|>":
        return name
    head = [i for i, t in enumerate(generated[:-1]) if t == MESSAGE]
    if not head:
        return name
    opening = generated[:head[-1]]
    ch = max((i for i, t in enumerate(opening) if t == CHANNEL), default=None)
    if ch is not None and tuple(opening[ch + 1:]) == ANALYSIS:
        return None
    return name


def context_of(cfg: GptOssConfig) -> int:
    """The model's context in tokens: the initial context times the YaRN factor (131072 for gpt-oss)."""
    return int(cfg.initial_context_length * float(cfg.rope_scaling.get("factor", 1.0)))


@dataclass
class Generation:
    """A finished generation: prompt and generated ids, why it stopped, and its timings."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    stop: str = "max-new-tokens"  # or the stop token's name
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # the decode steps (one per generated token after the first)

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt) / self.prefill_seconds if self.prefill_seconds > 0 else math.inf

    @property
    def decode_tokens_per_s(self) -> float | None:
        steps = len(self.tokens) - 1
        if steps < 1:
            return None
        return steps / self.decode_seconds if self.decode_seconds > 0 else math.inf


def check_request(cfg: GptOssConfig, prompt: list[int], max_new_tokens: int, temperature: float) -> None:
    """Bad requests as one line each, before any model runs."""
    if not prompt:
        raise GptOssFp8Error("the prompt is empty; give at least one token")
    if max_new_tokens < 1:
        raise GptOssFp8Error(f"--max-new-tokens {max_new_tokens}: give at least 1")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise GptOssFp8Error(f"--temperature {temperature}: give a finite number >= 0 (0: greedy)")
    bad = next((t for t in prompt if not 0 <= t < cfg.vocab_size), None)
    if bad is not None:
        raise GptOssFp8Error(f"prompt token id {bad} is outside the vocabulary (vocab_size {cfg.vocab_size})")
    ctx = context_of(cfg)
    if len(prompt) + max_new_tokens > ctx:
        raise GptOssFp8Error(f"--max-new-tokens {max_new_tokens}: the {len(prompt)}-token prompt plus that many "
                             f"exceed the model's context of {ctx} tokens; ask for at most {max(0, ctx - len(prompt))}")


def pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    """The next token from one row of logits [1, V] (or [V]): argmax at temperature 0, else a sample."""
    row = logits.reshape(-1).float()
    if temperature == 0:
        return int(row.argmax())
    probs = torch.softmax(row / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


# The token choice of one step: (that step's logits [1, V], the tokens generated so far) -> appends
# the next token to the list, returns why the reply ends after it (a stop token's name,
# "max-new-tokens") or None.
Choose = Callable[[torch.Tensor, list[int]], str | None]


def chooser(model, *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> Choose:
    """``generate``'s token choice for ``model``: ``pick`` (the seeded sampler at temperature > 0),
    then ``stops_here`` and the ``max_new_tokens`` limit. A sharded model (``model.par.world > 1``,
    one process per rank; the model's all-reduces and all-gather leave the logits replicated on
    every rank): rank 0 chooses, its generator the only one, and broadcasts the token and the
    verdict, so every rank feeds the same token and runs the same number of steps (each holds
    collectives)."""
    dev = model.model.embed_tokens.weight.device
    stops = stop_tokens(model.cfg.vocab_size, getattr(model, "tokenizer", None))
    gen = None
    par = model.par
    if temperature > 0 and par.rank == 0:
        gen = torch.Generator(device=dev).manual_seed(seed)

    def choose(logits: torch.Tensor, tokens: list[int]) -> str | None:
        tokens.append(pick(logits, temperature, gen))
        name = stops_here(tokens, stops)
        return name if name is not None or len(tokens) < max_new_tokens else "max-new-tokens"

    if par.world == 1:
        return choose
    import torch.distributed as dist

    verdicts = [None, "max-new-tokens", *stops.values()]  # the same list on every rank: sent as an index
    where = dev if dist.get_backend(par.group) == "nccl" else torch.device("cpu")  # gloo: host tensors

    def shared(logits: torch.Tensor, tokens: list[int]) -> str | None:
        if par.rank == 0:
            name = choose(logits, tokens)
            msg = torch.tensor([tokens[-1], verdicts.index(name)], dtype=torch.long, device=where)
        else:  # the logits are rank 0's too; nothing of them is read here
            msg = torch.empty(2, dtype=torch.long, device=where)
        dist.broadcast(msg, 0, group=par.group)
        tok, verdict = msg.tolist()
        if par.rank != 0:
            tokens.append(tok)
        return verdicts[verdict]

    return shared


def generate(model, prompt: list[int], ops, *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
             on_token: Callable[[int], None] | None = None, cuda_graph: bool | None = None) -> Generation:
    """Prefill ``prompt`` (token ids) with ``ops``, then decode one token at a time until a stop
    token (``stops_here``) or ``max_new_tokens``; ``on_token`` is called with each new id as it
    comes. One request through the serving runtime's engine (runtime/: the one decode loop), on a
    one-slot KV cache of exactly prompt + max_new_tokens positions, the prompt in one chunk.
    ``cuda_graph``: each decode step as a replayed CUDA graph (model/graph.py; the same logits bit
    for bit); None: on a GPU with the triton backend, whose step has no host synchronisation
    (sharded: over NCCL, one GPU per rank; gloo steps run eager). A sharded model runs this on
    every rank, together (``chooser``: rank 0 chooses each token); every rank returns the same
    tokens."""
    from gptoss_fp8.runtime.engine import Engine
    from gptoss_fp8.runtime.runner import ModelRunner
    from gptoss_fp8.runtime.sampling import SamplingParams

    cfg = model.cfg
    check_request(cfg, prompt, max_new_tokens, temperature)
    dev = model.model.embed_tokens.weight.device
    choose = chooser(model, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

    def sampler(logits: torch.Tensor, seqs: list) -> tuple[list[int], None]:
        (seq,) = seqs
        tokens = list(seq.tokens)
        choose(logits, tokens)  # its verdict is the engine's stop rule and max_tokens, on every rank alike
        return [tokens[-1]], None

    stops = stop_tokens(cfg.vocab_size, getattr(model, "tokenizer", None))
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed,
                            stop_rule=lambda tokens: stops_here(tokens, stops))
    runner = ModelRunner(model, ops, 1, len(prompt) + max_new_tokens, cuda_graph=cuda_graph)
    engine = Engine(runner, chunk=len(prompt), max_waiting=1, sampler=sampler, log_errors=False)

    def on_event(seq, new: list[int]) -> None:
        if on_token is not None:
            for t in new:
                on_token(t)

    t0 = time.perf_counter()
    seq = engine.add(list(prompt), params, on_event)
    engine.run_until_done()
    _sync(dev)
    t1 = time.perf_counter()
    if seq.exception is not None:
        raise seq.exception
    out = Generation(list(prompt), list(seq.tokens), seq.stop if seq.finish == "stop" else "max-new-tokens")
    out.prefill_seconds = seq.first_token_at - t0
    out.decode_seconds = t1 - seq.first_token_at
    return out


# ----------------------------------------------------------------------------------------------
# Text (the offline tokenizer of --prompt)


def _encoding():
    from gptoss_fp8.verify.prompt import INSTALL, ensure_o200k

    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(ensure_o200k())
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    except ImportError:
        raise GptOssFp8Error(f"text needs openai-harmony; run: {INSTALL}") from None
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _text(ids: list[int]) -> str:
    return _encoding().decode(ids) if ids else ""


def has_text(vocab_size: int) -> bool:
    """Whether this vocabulary is the tokenizer's (synthetic checkpoints usually have a smaller one)."""
    return vocab_size == HARMONY_VOCAB


class TextStream:
    """Turns generated ids into text pieces as they come: the decoded text's new suffix, held back
    while it ends in an incomplete UTF-8 character (shown as U+FFFD until its last byte arrives).
    ``tokenizer``: a byte-level one (gptoss_fp8/tokenizer.py) instead of Harmony's o200k."""

    def __init__(self, tokenizer=None) -> None:
        self.enc = _encoding() if tokenizer is None else tokenizer
        self.ids: list[int] = []
        self.shown = 0

    def push(self, tok: int) -> str:
        self.ids.append(tok)
        text = self.enc.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[self.shown:], len(text)
        return piece

    def flush(self) -> str:
        text = self.enc.decode(self.ids)
        piece, self.shown = text[self.shown:], len(text)
        return piece


def parse_reply(tokens: list[int]) -> tuple[list[tuple[str, str]], str | None]:
    """The reply's Harmony messages as (channel, text) pairs, and why it does not parse (None when
    it does): the generated tokens after the prompt's ``<|start|>assistant``."""
    from openai_harmony import HarmonyError, Role

    enc = _encoding()
    ids = list(tokens)
    if ids and ids[-1] not in (RETURN, CALL, END):
        ids.append(END)  # stopped by max-new-tokens: close the last message so it is shown
    try:
        msgs = enc.parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
    except HarmonyError as e:  # the model's output, not ours: say so, do not fail
        return [], f"the reply is not well-formed Harmony ({e})"
    out = []
    for m in msgs:
        text = "".join(getattr(c, "text", "") for c in m.content)
        out.append((m.channel or "(none)", text))
    return out, None


# ----------------------------------------------------------------------------------------------
# The command (cli/generate.py parses; this runs and prints)


def run(ckpt, prompt: list[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
        device: str = "cpu", mode: str = "auto", echo: Callable[..., None] = print,
        attention: str = "bf16") -> Generation:
    """Load ``ckpt`` (an opened Checkpoint), generate from the prompt ids with the ``mode``'s ops
    backend (verify-logits' modes; auto: kernels on cuda, weights on cpu), stream the reply through
    ``echo`` (text, or ids for a vocabulary that is not the tokenizer's), then its Harmony channels
    and the prefill / decode tokens per second. One process: a checkpoint converted for tp > 1 runs
    through verify/generate_sharded.py ``run`` (which calls this one for tp 1). ``attention``: the
    prefill attention's numerics, "bf16" or "fp8" (``ReferenceOps.with_attention``)."""
    from gptoss_fp8.model.load import load_model
    from gptoss_fp8.parallel import Parallel, device_for
    from gptoss_fp8.verify.backends import ops_for

    cfg = ckpt.config
    check_request(cfg, prompt, max_new_tokens, temperature)
    mode = resolve_mode(mode, device)
    model = load_model(ckpt, Parallel(), device_for(device, 0))
    where = f"mode {mode}, {device}" + (f", {attention.upper()} prefill attention" if attention != "bf16" else "")
    return stream_reply(model, prompt, ops_for(mode, attention=attention), where, max_new_tokens=max_new_tokens,
                        temperature=temperature, seed=seed, echo=echo)


def resolve_mode(mode: str, device: str) -> str:
    """``--mode`` -> the one mode that runs (auto: kernels on cuda, else weights); one line if it
    cannot run on ``device``."""
    from gptoss_fp8.verify.backends import resolve_modes

    auto = "kernels" if device.startswith("cuda") else "weights"
    (mode,) = resolve_modes([auto if mode == "auto" else mode], device)
    return mode


def stream_reply(model, prompt: list[int], ops, where: str, *, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, echo: Callable[..., None] | None = print) -> Generation:
    """``generate`` with its output: a header (``where``: the mode and the device), the reply
    streamed through ``echo`` as it comes, then why it stopped, its Harmony channels and the
    speeds. ``echo`` None: nothing is printed (the ranks of a sharded run but rank 0)."""
    tok = getattr(model, "tokenizer", None)
    text = tok is not None or has_text(model.cfg.vocab_size)
    on_token = None
    if echo is not None:
        if text:
            stream = TextStream(tok)
            on_token = lambda t: echo(stream.push(t), nl=False)  # noqa: E731
        else:
            echo(f"vocab_size {model.cfg.vocab_size} is not the o200k_harmony tokenizer's {HARMONY_VOCAB} (a "
                 "synthetic checkpoint?): the reply is shown as token ids, without text or channels")
            on_token = lambda t: echo(f"{t} ", nl=False)  # noqa: E731
        echo(f"[{len(prompt)} prompt tokens, {where}, "
             + ("greedy" if temperature == 0 else f"temperature {temperature:g}, seed {seed}") + "]")
        if tok is not None:  # a byte-level model continues its prompt: the prompt, then what follows
            echo(tok.decode(prompt), nl=False)
    g = generate(model, prompt, ops, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                 on_token=on_token)
    if echo is None:
        return g
    if text:
        echo(stream.flush(), nl=False)
    echo("")
    echo(f"stopped: {g.stop} after {len(g.tokens)} new tokens")
    if text and tok is None:
        msgs, why = parse_reply(g.tokens)
        for channel, body in msgs:
            echo(f"[{channel}] {body}")
        if why:
            echo(f"channels: {why}")
    dec = g.decode_tokens_per_s
    echo(f"prefill: {len(prompt)} tokens in {g.prefill_seconds:.3f} s ({g.prefill_tokens_per_s:.1f} tokens/s); "
         + (f"decode: {len(g.tokens) - 1} tokens in {g.decode_seconds:.3f} s ({dec:.1f} tokens/s)" if dec is not None
            else "decode: no steps (one token, from the prefill)"))
    return g
