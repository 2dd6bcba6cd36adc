"""The byte-level tokenizer (ByT5's ids) of the trained fixture: text <-> ids, and which checkpoints
declare it."""

import json
import random
from pathlib import Path

from gptoss_fp8.tokenizer import BYT5_FILES, BYT5_IDS, ByteTokenizer, byte_tokenizer_of

TRAINED = Path(__file__).resolve().parents[1] / "golden" / "trained"


def _random_text(r: random.Random, n: int) -> str:
    """ASCII, Latin-1, CJK and astral code points (1 to 4 UTF-8 bytes), no surrogates."""
    pools = [(0x20, 0x7E), (0xA0, 0x2FF), (0x4E00, 0x9FFF), (0x1F300, 0x1F6FF)]
    return "".join(chr(r.randint(*r.choice(pools))) for _ in range(n)) + "\n\tdef f(x): return x\n"


def test_encode_decode_round_trip():
    seed = random.randrange(10**6)
    r = random.Random(seed)
    tok = ByteTokenizer()
    for _ in range(20):
        text = _random_text(r, r.randint(0, 60))
        ids = tok.encode(text)
        assert ids == [b + 3 for b in text.encode("utf-8")], seed  # ByT5: byte b -> id b + 3
        assert all(BYT5_IDS["offset"] <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text and tok.decode_bytes(ids) == text.encode("utf-8"), seed
    assert tok.vocab_size == 259 and tok.eos == 1 and tok.encode("") == []


def test_decode_drops_special_ids_and_survives_a_cut_character():
    tok = ByteTokenizer()
    ids = tok.encode("a = 1")
    special = [BYT5_IDS["pad"], BYT5_IDS["eos"], BYT5_IDS["unk"]]
    assert tok.decode(special[:1] + ids[:2] + special + ids[2:] + special[1:2]) == "a = 1"
    assert tok.decode([tok.vocab_size, 10**6, -1] + ids) == "a = 1"  # ids outside the vocabulary too
    cut = tok.encode("é€")[:-1]  # the euro sign's last byte missing: no exception, a replacement mark
    assert tok.decode(cut) == "é\ufffd"


def test_byte_tokenizer_of_checkpoints(tmp_path):
    assert isinstance(byte_tokenizer_of(TRAINED), ByteTokenizer)
    cfg = json.loads((TRAINED / "config.json").read_text())
    assert cfg["vocab_size"] == ByteTokenizer.vocab_size and cfg["eos_token_id"] == ByteTokenizer.eos
    assert json.loads((TRAINED / "tokenizer_config.json").read_text()) == BYT5_FILES["tokenizer_config.json"]
    assert byte_tokenizer_of(tmp_path) is None  # no tokenizer_config.json
    p = tmp_path / "tokenizer_config.json"
    for content, want in [("{not json", None), ('["a list"]', None),
                          (json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}), None),
                          (json.dumps({"tokenizer_class": "ByT5Tokenizer", "extra_ids": 100}), None),  # ids shift
                          (json.dumps({"tokenizer_class": "ByT5Tokenizer"}), ByteTokenizer)]:
        p.write_text(content)
        got = byte_tokenizer_of(tmp_path)
        assert (got is None) if want is None else isinstance(got, want), content


def test_a_synthetic_checkpoint_has_no_byte_tokenizer(tmp_path):
    from gptoss_fp8.convert.synth import write_synthetic

    write_synthetic(tmp_path / "s", "tiny", layers=1, seed=0, layout="hf")
    assert byte_tokenizer_of(tmp_path / "s") is None
