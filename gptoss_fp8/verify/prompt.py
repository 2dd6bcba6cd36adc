"""--prompt TEXT -> token ids: ``encode_prompt`` is the one place a text prompt becomes token ids
(generate, verify-logits). For the released vocabulary it renders the Harmony chat format, offline;
a model whose vocabulary is not that tokenizer's is told so before anything is imported.

openai-harmony downloads ``o200k_base.tiktoken`` unless ``TIKTOKEN_ENCODINGS_BASE`` points at a
folder holding it; the PyPI package ``bpe-openai`` ships that file gzipped, so we unpack it once
into a cache folder (checked by sha256) and point harmony there.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path

from gptoss_fp8.config import GptOssConfig
from gptoss_fp8.errors import GptOssFp8Error

HARMONY_VOCAB = 201088  # o200k_harmony's vocabulary: the released checkpoints'
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
INSTALL = "pip install openai-harmony bpe-openai"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gptoss-fp8" / "tiktoken"


def ensure_o200k() -> Path:
    """A folder holding o200k_base.tiktoken (unpacked from bpe-openai), for TIKTOKEN_ENCODINGS_BASE."""
    folder = _cache_dir()
    target = folder / "o200k_base.tiktoken"
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == O200K_SHA256:
        return folder
    try:
        import bpe_openai
    except ImportError:
        raise GptOssFp8Error(f"--prompt needs the tokenizer files of bpe-openai; run: {INSTALL} (or pass --tokens)") from None
    gz = Path(bpe_openai.__file__).parent / "data" / "o200k_base.tiktoken.gz"
    if not gz.is_file():
        raise GptOssFp8Error(f"{gz}: missing from the installed bpe-openai; reinstall it ({INSTALL})")
    data = gzip.decompress(gz.read_bytes())
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        raise GptOssFp8Error(f"{gz}: o200k_base.tiktoken has an unexpected sha256; reinstall bpe-openai")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    return folder


def render_prompt(text: str) -> list[int]:
    """Token ids of a one-user-message Harmony conversation, ready for the assistant's reply."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(ensure_o200k())
    try:
        from openai_harmony import Conversation, HarmonyEncodingName, Message, Role, load_harmony_encoding
    except ImportError:
        raise GptOssFp8Error(f"--prompt needs openai-harmony; run: {INSTALL} (or pass --tokens)") from None
    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    convo = Conversation.from_messages([Message.from_role_and_content(Role.USER, text)])
    return list(enc.render_conversation_for_completion(convo, Role.ASSISTANT))


def encode_prompt(text: str, cfg: GptOssConfig, where: str = "--prompt", ckpt: Path | None = None) -> list[int]:
    """The token ids of a text prompt for a model of config ``cfg`` (checkpoint folder ``ckpt``):
    its bytes when the checkpoint declares a byte-level tokenizer (gptoss_fp8/tokenizer.py: the
    trained fixture); a one-user-message Harmony conversation (``render_prompt``) for a model with
    the released vocabulary. Any other vocabulary is refused first, in one line, before
    openai-harmony is imported or asked for."""
    if ckpt is not None:
        from gptoss_fp8.tokenizer import byte_tokenizer_of

        tok = byte_tokenizer_of(ckpt)
        if tok is not None:
            if not text:
                raise GptOssFp8Error(f"{where}: the prompt is empty; give some text")
            return tok.encode(text)
    if cfg.vocab_size < HARMONY_VOCAB:
        raise GptOssFp8Error(
            f"{where}: this model's vocabulary has {cfg.vocab_size} tokens, not the Harmony tokenizer's "
            f"{HARMONY_VOCAB} (a synthetic checkpoint?), so text cannot be encoded for it; pass --tokens FILE "
            "(a JSON list of token ids)"
        )
    return render_prompt(text)
