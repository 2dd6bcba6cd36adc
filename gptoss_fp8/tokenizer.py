"""The byte-level tokenizer of small models (the trained fixture): ByT5's convention.

ids: 0 pad, 1 eos, 2 unk, byte b -> b + 3 (259 ids, no extra ids). A checkpoint declares it with
``tokenizer_config.json`` ``{"tokenizer_class": "ByT5Tokenizer", "extra_ids": 0}``, which is also
what transformers' ``AutoTokenizer`` reads, so the same folder works there. Checkpoints with the
released vocabulary use Harmony's o200k tokenizer instead (verify/prompt.py).
"""

from __future__ import annotations

import json
from pathlib import Path

BYT5_IDS = {"pad": 0, "eos": 1, "unk": 2, "offset": 3}
BYT5_FILES = {
    "tokenizer_config.json": {"tokenizer_class": "ByT5Tokenizer", "extra_ids": 0, "eos_token": "</s>",
                              "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 4096},
    "special_tokens_map.json": {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"},
}


class ByteTokenizer:
    """UTF-8 bytes <-> ids (ByT5). ``decode`` drops the special ids and incomplete UTF-8 tails."""

    vocab_size = 256 + BYT5_IDS["offset"]
    eos = BYT5_IDS["eos"]

    def encode(self, text: str) -> list[int]:
        return [b + BYT5_IDS["offset"] for b in text.encode("utf-8")]

    def decode_bytes(self, ids: list[int]) -> bytes:
        off = BYT5_IDS["offset"]
        return bytes(i - off for i in ids if off <= i < off + 256)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def byte_tokenizer_of(ckpt: Path) -> ByteTokenizer | None:
    """The checkpoint's byte-level tokenizer, if its tokenizer_config.json declares ByT5's; else None."""
    p = Path(ckpt) / "tokenizer_config.json"
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(d, dict) and d.get("tokenizer_class") == "ByT5Tokenizer" and not d.get("extra_ids"):
        return ByteTokenizer()
    return None
