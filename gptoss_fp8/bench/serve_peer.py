"""What ``gptoss-fp8 bench serve --peer transformers`` needs to load transformers' own server
(``transformers serve --continuous-batching``) the way it loads ours.

transformers' ``/v1/completions`` takes a prompt of text only (token ids: 400), refuses fields
outside OpenAI's schema (``ignore_eos``: 422) and reads ``stream_options`` as nothing (its last
chunk carries ``usage`` anyway). So against it the load generator sends text prompts of exactly
the prompt length in the server's own tokenizer (``text_prompts``: checked there by encoding them,
and by the server's ``usage.prompt_tokens`` in every reply), and forces the output length through
the request's ``generation_config`` (a JSON string transformers reads as the whole generation
config): ``max_new_tokens`` = the output length, greedy, ``eos_token_id`` -1, which its continuous
batching reads as no end-of-sequence token at all (generation/continuous_batching/requests.py:
only ids >= 0 stop a request), the same as ``ignore_eos``.

A synthetic source (``gptoss-fp8 synth``) ships no tokenizer, and transformers' server needs one
(its streamer decodes every token with the Rust tokenizer): ``write_peer_tokenizer`` writes one
over the model's whole vocabulary: a word level tokenizer, every id a distinct lowercase word
split at whitespace (so a prompt of N random words is N tokens, and every generated token decodes
to text of its own: one streamed chunk per token, as a real vocabulary mostly gives), the
checkpoint's special ids (generation_config.json's eos / pad / bos, config.json's) special tokens.

``python -m gptoss_fp8.bench.serve_peer tokenizer SRC`` writes it into SRC.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

# the servers bench serve speaks to: ours, and transformers' own
PEERS = ("gptoss", "transformers")


def peer_body(prompt: str, output_len: int, model: str | None) -> dict:
    """The streamed ``/v1/completions`` body for transformers' server: ``output_len`` tokens
    exactly, greedy (module docstring; ``generation_config``: a JSON string that transformers
    reads as the whole GenerationConfig, cli/serving/utils.py BaseHandler._build_generation_config)."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "generation_config": json.dumps({"max_new_tokens": output_len, "do_sample": False,
                                             "eos_token_id": -1})}
    if model is not None:
        body["model"] = model
    return body


def _words(n: int) -> list[str]:
    """``n`` distinct lowercase words of three letters or more ("baa", "bab", ...: base 26)."""
    out = []
    k = 26 * 26
    while len(out) < n:
        s, x = "", k
        while x:
            x, r = divmod(x, 26)
            s = chr(97 + r) + s
        out.append(s)
        k += 1
    return out


def write_peer_tokenizer(src: Path) -> Path:
    """tokenizer.json + tokenizer_config.json for ``src``'s vocabulary (module docstring) ->
    the tokenizer.json written. Refuses a checkpoint that ships a tokenizer.json already."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from gptoss_fp8.checkpoint.outputs import write_atomic
    from gptoss_fp8.config import read_config_json
    from gptoss_fp8.errors import GptOssFp8Error

    src = Path(src)
    cfg = read_config_json(src / "config.json")
    vocab_size = cfg.get("vocab_size")
    if not isinstance(vocab_size, int) or not 8 <= vocab_size <= 1 << 23:
        raise GptOssFp8Error(f"{src}/config.json: vocab_size {vocab_size!r} is not a vocabulary size (8 to 2**23)")
    if (src / "tokenizer.json").exists():
        raise GptOssFp8Error(f"{src}/tokenizer.json exists: this checkpoint has a tokenizer of its own")
    special: dict[int, str] = {}
    gen = read_config_json(src / "generation_config.json") if (src / "generation_config.json").exists() else {}
    named = (("eos_token_id", "<|return|>"), ("pad_token_id", "<|endoftext|>"), ("bos_token_id", "<|startoftext|>"))
    for first in (True, False):  # the first id of each key its name, then the rest (eos lists) as <|special_N|>
        for key, name in named:
            for d in (gen, cfg):
                ids = d.get(key)
                ids = ids if isinstance(ids, list) else [ids]
                for tid in ids[:1] if first else ids[1:]:
                    if isinstance(tid, int) and 0 <= tid < vocab_size and tid not in special:
                        special[tid] = name if first and name not in special.values() else f"<|special_{tid}|>"
    if not any(v == "<|return|>" for v in special.values()):
        raise GptOssFp8Error(f"{src}: no eos_token_id in generation_config.json / config.json")
    words = iter(_words(vocab_size))
    vocab = {special.get(i) or next(words): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=next(w for w, i in vocab.items() if i == 0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in special.values()])
    out = src / "tokenizer.json"
    write_atomic(out, tok.to_str())
    names = {v: k for k, v in special.items()}
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072,
          "eos_token": "<|return|>", "clean_up_tokenization_spaces": False,
          "note": "gptoss-fp8 bench serve's peer tokenizer: one word per id"}
    if "<|endoftext|>" in names:
        tc["pad_token"] = "<|endoftext|>"
    if "<|startoftext|>" in names:
        tc["bos_token"] = "<|startoftext|>"
    write_atomic(src / "tokenizer_config.json", json.dumps(tc, indent=1) + "\n", overwrite=True)
    return out


def load_tokenizer(path: Path):
    """The Rust tokenizer of a checkpoint directory (its tokenizer.json) or of a tokenizer.json."""
    from tokenizers import Tokenizer

    from gptoss_fp8.errors import GptOssFp8Error

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type
        raise GptOssFp8Error(f"{file}: no tokenizer to build text prompts with ({e}); a synthetic source needs "
                             "`python -m gptoss_fp8.bench.serve_peer tokenizer SRC`") from None


def text_prompts(tokenizer, n: int, length: int, seed: int) -> list[str]:
    """``n`` random texts that the tokenizer encodes (as transformers' server does: special
    tokens added) to exactly ``length`` tokens each: random ids decoded, the text re-encoded and cut
    or lengthened until it holds (a fixpoint; refused when 20 rounds do not reach it)."""
    from gptoss_fp8.errors import GptOssFp8Error

    rng = random.Random(seed)
    specials = {v for v in tokenizer.get_added_tokens_decoder()} if hasattr(tokenizer, "get_added_tokens_decoder") \
        else set()
    vocab = tokenizer.get_vocab_size()
    pool = [i for i in range(vocab) if i not in specials]
    out = []
    for _ in range(n):
        ids = [rng.choice(pool) for _ in range(length)]
        for _round in range(20):
            text = tokenizer.decode(ids)
            got = tokenizer.encode(text).ids
            if len(got) == length:
                out.append(text)
                break
            ids = got[:length] if len(got) > length else got + [rng.choice(pool) for _ in range(length - len(got))]
        else:
            raise GptOssFp8Error(f"the tokenizer gives no text of exactly {length} tokens from random ids in 20 rounds")
    return out


def main(argv: list[str]) -> None:
    from gptoss_fp8.errors import GptOssFp8Error

    if len(argv) != 2 or argv[0] != "tokenizer":
        print("usage: python -m gptoss_fp8.bench.serve_peer tokenizer SRC", file=sys.stderr)
        raise SystemExit(2)
    try:
        print(write_peer_tokenizer(Path(argv[1])))
    except GptOssFp8Error as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
