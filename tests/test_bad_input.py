"""Issue 21, the file side: false success on --resume, clobbering through planted names, corrupt
input the reader must refuse, hangs on hostile configs or special files, misleading messages.

Every case asserts the exact failure: a GptOssFp8Error on one line naming the file or tensor,
nothing clobbered, no lock left behind, and (for would-be hangs) a bound on the time.
"""

import errno
import hashlib
import json
import os
import shutil
import struct
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from conftest import fail_writes_with_enospc
from safetensors import safe_open
from safetensors.torch import save_file

from gptoss_fp8.checkpoint.format import INDEX_NAME, REPORT_NAME
from gptoss_fp8.checkpoint.st_io import TMP_SUFFIX, StreamingWriter, create_temp, read_header
from gptoss_fp8.config import GptOssConfig, preset_config
from gptoss_fp8.convert import writer as writer_mod
from gptoss_fp8.convert.convert import LOCK_NAME, PARTIAL_DIR, convert_checkpoint
from gptoss_fp8.convert.synth import write_synthetic
from gptoss_fp8.errors import GptOssFp8Error

SHARD = 150_000  # several output files for the tiny preset
L0 = "model.layers.0."


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("src") / "tiny"
    write_synthetic(d, "tiny", seed=3, layout="hf")
    return d


@pytest.fixture(scope="module")
def other_src(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("src") / "other"
    write_synthetic(d, "tiny", seed=4, layout="hf")
    return d


@pytest.fixture(scope="module")
def reference(tiny_src, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ref") / "out"
    convert_checkpoint(tiny_src, d, shard_bytes=SHARD)
    return d


def tree(root: Path) -> dict[str, str]:
    """Every file under root (relative path -> sha256), symlinks as 'link -> target'."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link -> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def one_line_error(ei, *must: str) -> str:
    msg = str(ei.value)
    assert "\n" not in msg and len(msg) < 500, msg
    for m in must:
        assert m in msg, (m, msg)
    return msg


def no_lock(dst: Path) -> None:
    assert not (dst / LOCK_NAME).exists() and not (dst / LOCK_NAME).is_symlink()


def _stop_after(nbytes):
    seen = [0]

    def progress(n):
        seen[0] += n
        if seen[0] >= nbytes:
            raise KeyboardInterrupt

    return progress


def interrupted(src: Path, dst: Path, cut: int = 600_000, **kw) -> Path:
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, dst, shard_bytes=SHARD, progress=_stop_after(cut), **kw)
    no_lock(dst)
    assert (dst / PARTIAL_DIR / "plan.json").is_file()
    return dst


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def first_shard(root: Path) -> Path:
    return sorted(root.glob("model-*.safetensors"))[0]


# ---------------------------------------------------------------------------------------------
# 1. False success on --resume


def test_resume_on_finished_dst_is_a_verified_no_op(tiny_src, tmp_path):
    dst = tmp_path / "o"
    convert_checkpoint(tiny_src, dst, shard_bytes=SHARD)
    before, times = tree(dst), mtimes(dst)
    seen = []
    rep = convert_checkpoint(tiny_src, dst, shard_bytes=SHARD, resume=True, on_plan=lambda t, d: seen.append((t, d)))
    assert rep["status"].startswith("already complete") and "nothing was rewritten" in rep["status"]
    assert rep["layout"] == {"tp": 1, "ep": 1} and rep["exactness"]["tensors"]
    assert tree(dst) == before and mtimes(dst) == times  # not rewritten
    assert seen and seen[0][0] == seen[0][1]
    no_lock(dst)


# (kwargs of the second run, a fragment of the message naming what differs)
DIFFERENCES = {
    "scale mode": (dict(scale_mode="amax"), "scale_mode 'pow2' there, 'amax' now"),
    "attention bf16": (dict(keep_attention_bf16=True), "keep_attention_bf16 False there, True now"),
    "both": (dict(scale_mode="amax", keep_attention_bf16=True), "scale_mode 'pow2' there, 'amax' now; keep_attention_bf16"),
    "tp": (dict(tp=2), "tp 1 there, 2 now"),
    "tp ep": (dict(tp=4, ep=2), "tp 1 there, 4 now; ep 1 there, 2 now"),
    "shard size": (dict(shard_bytes=SHARD + 1), f"shard_bytes {SHARD} there, {SHARD + 1} now"),
}


@pytest.mark.parametrize("case", sorted(DIFFERENCES))
def test_resume_on_finished_dst_with_other_options_is_refused(tiny_src, tmp_path, case):
    kw, what = DIFFERENCES[case]
    dst = tmp_path / "o"
    convert_checkpoint(tiny_src, dst, shard_bytes=SHARD)
    before = tree(dst)
    kw = {"shard_bytes": SHARD, **kw}
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, dst, resume=True, **kw)
    one_line_error(ei, str(dst), "finished conversion made with other options", what, "--overwrite")
    assert tree(dst) == before
    no_lock(dst)
    convert_checkpoint(tiny_src, dst, overwrite=True, **kw)  # the offered way out works
    no_lock(dst)


def _edit_config(root: Path) -> str:
    c = json.loads((root / "config.json").read_text())
    c["rope_theta"] = 10000.0
    (root / "config.json").write_text(json.dumps(c))
    return "source config.json differs"


def _reformat_index(root: Path) -> str:
    idx = json.loads((root / INDEX_NAME).read_text())
    (root / INDEX_NAME).write_text(json.dumps(idx))  # same content, other bytes: not the recorded index
    return f"source {INDEX_NAME} differs"


def _retag_header(root: Path) -> str:
    f = sorted(root.glob("model-*.safetensors"))[1]
    with safe_open(str(f), "pt") as fh:
        d = {k: fh.get_tensor(k) for k in fh.keys()}
        meta = fh.metadata()
    save_file(d, str(f), metadata={**meta, "seed": "99"})
    return f"source {f.name}"  # its header differs (and with it the size)


SOURCE_CHANGES = {"config": _edit_config, "index": _reformat_index, "header": _retag_header}


@pytest.mark.parametrize("change", sorted(SOURCE_CHANGES))
def test_resume_with_a_changed_source_is_refused(tiny_src, tmp_path, change):
    src = copy(tiny_src, tmp_path / "src")
    dst = tmp_path / "o"
    convert_checkpoint(src, dst, shard_bytes=SHARD)
    half = interrupted(src, tmp_path / "half")
    what = SOURCE_CHANGES[change](src)
    for d, kind in ((dst, "finished conversion made with another source"),
                    (half, "interrupted conversion there used another source")):
        before = tree(d)
        with pytest.raises(GptOssFp8Error) as ei:
            convert_checkpoint(src, d, shard_bytes=SHARD, resume=True)
        one_line_error(ei, kind, what, "--overwrite")
        assert tree(d) == before
        no_lock(d)


def test_resume_with_another_source_is_refused(tiny_src, other_src, tmp_path):
    dst = tmp_path / "o"
    convert_checkpoint(tiny_src, dst, shard_bytes=SHARD)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(other_src, dst, shard_bytes=SHARD, resume=True)
    one_line_error(ei, "another source", "headers of 4 source files differ")
    no_lock(dst)


@pytest.mark.parametrize("case", sorted(DIFFERENCES))
def test_resume_of_interrupted_run_with_other_options_is_refused(tiny_src, reference, tmp_path, case):
    kw, what = DIFFERENCES[case]
    dst = interrupted(tiny_src, tmp_path / "o")
    before = tree(dst)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, dst, resume=True, **{"shard_bytes": SHARD, **kw})
    one_line_error(ei, "interrupted conversion there used other options", what, "--overwrite")
    assert tree(dst) == before
    no_lock(dst)
    convert_checkpoint(tiny_src, dst, shard_bytes=SHARD, resume=True)  # the same options still resume
    assert tree(dst) == tree(reference)


def _truncate(f: Path):
    f.write_bytes(f.read_bytes()[:-10])


def _flip(f: Path):  # same size, other bytes
    b = bytearray(f.read_bytes())
    b[-5] ^= 0x01
    f.write_bytes(bytes(b))


def _empty(f: Path):
    f.write_bytes(b"")


DAMAGE = {"truncated": (_truncate, "bytes, the manifest says"), "flipped byte": (_flip, "sha256 does not match"),
          "emptied": (_empty, "bytes, the manifest says")}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("which", [0, -1])
def test_resume_detects_a_damaged_finished_shard(tiny_src, reference, tmp_path, damage, which):
    fn, msg = DAMAGE[damage]
    # an interrupted run: the damaged shard is converted again, the result byte-identical
    dst = interrupted(tiny_src, tmp_path / "half")
    done = sorted(dst.glob("model-*.safetensors"))
    assert len(done) >= 2
    fn(done[which])
    convert_checkpoint(tiny_src, dst, shard_bytes=SHARD, resume=True)
    assert tree(dst) == tree(reference)
    no_lock(dst)
    # a finished DST: the damage is named, nothing is rewritten, --overwrite offered
    fin = copy(reference, tmp_path / "fin")
    f = sorted(fin.glob("model-*.safetensors"))[which]
    fn(f)
    before = tree(fin)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, fin, shard_bytes=SHARD, resume=True)
    one_line_error(ei, f.name, msg, "--overwrite")
    assert tree(fin) == before
    no_lock(fin)


def test_resume_finished_sharded_detects_damage(tiny_src, tmp_path):
    dst = tmp_path / "o"
    convert_checkpoint(tiny_src, dst, tp=2, ep=2)
    assert convert_checkpoint(tiny_src, dst, tp=2, ep=2, resume=True)["status"].startswith("already complete")
    f = dst / "rank-00001" / "model-00001-of-00001.safetensors"
    _truncate(f)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, dst, tp=2, ep=2, resume=True)
    one_line_error(ei, "rank-00001/model-00001-of-00001.safetensors", "damaged", "--overwrite")
    no_lock(dst)


def test_resume_missing_index_or_missing_layout_is_damage(tiny_src, reference, tmp_path):
    for name in (INDEX_NAME, "layout.json"):
        fin = copy(reference, tmp_path / name)
        (fin / name).unlink()
        with pytest.raises(GptOssFp8Error) as ei:
            convert_checkpoint(tiny_src, fin, shard_bytes=SHARD, resume=True)
        one_line_error(ei, "--overwrite")
        no_lock(fin)


@pytest.mark.parametrize("garbage", ["{oops", "[[[", "", '{"bytes": "12", "sha256": 5, "stats": {}}', "[" * 5000])
def test_corrupt_resume_record_is_redone(tiny_src, reference, tmp_path, garbage):
    dst = interrupted(tiny_src, tmp_path / "o")
    recs = sorted((dst / PARTIAL_DIR).glob("model-*.json"))
    assert recs
    recs[0].write_text(garbage)
    convert_checkpoint(tiny_src, dst, shard_bytes=SHARD, resume=True)
    assert tree(dst) == tree(reference)


@pytest.mark.parametrize("garbage", ["{oops", "[1, 2]", "", "[" * 100_000 + "]" * 100_000])
def test_corrupt_plan_record_is_one_line(tiny_src, tmp_path, garbage):
    dst = interrupted(tiny_src, tmp_path / "o")
    (dst / PARTIAL_DIR / "plan.json").write_text(garbage)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, dst, shard_bytes=SHARD, resume=True)
    one_line_error(ei, "plan.json", "--overwrite")
    no_lock(dst)


def test_finished_dst_without_resume_record_is_refused(tiny_src, reference, tmp_path):
    fin = copy(reference, tmp_path / "fin")
    rec = json.loads((fin / REPORT_NAME).read_text())
    del rec["resume_state"]  # as an older gptoss-fp8 wrote it
    (fin / REPORT_NAME).write_text(json.dumps(rec))
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, fin, shard_bytes=SHARD, resume=True)
    one_line_error(ei, "without a resume record", "--overwrite")
    (fin / REPORT_NAME).write_text("[" * 100_000)
    with pytest.raises(GptOssFp8Error, match="without a resume record"):
        convert_checkpoint(tiny_src, fin, shard_bytes=SHARD, resume=True)
    no_lock(fin)


def test_no_lock_after_finished_refused_or_interrupted(tiny_src, tmp_path):
    dst = tmp_path / "o"
    convert_checkpoint(tiny_src, dst)
    no_lock(dst)
    with pytest.raises(GptOssFp8Error, match="not empty"):
        convert_checkpoint(tiny_src, dst)
    no_lock(dst)
    interrupted(tiny_src, tmp_path / "i")


def test_a_held_lock_is_left_to_its_holder(tiny_src, tmp_path):
    import fcntl

    dst = tmp_path / "o"
    dst.mkdir()
    fd = os.open(dst / LOCK_NAME, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(GptOssFp8Error, match="another gptoss-fp8 convert"):
            convert_checkpoint(tiny_src, dst)
        assert (dst / LOCK_NAME).exists()  # not ours to remove
        assert os.listdir(dst) == [LOCK_NAME]
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# 2. Clobbering: unique temporary names, created exclusively, never through a symlink


PLANTED = ["config.json.tmp", "layout.json.tmp", "conversion.json.tmp", f"{INDEX_NAME}.tmp",
           "model-00001-of-00014.safetensors.tmp", "tokenizer_config.json.tmp"]


@pytest.mark.parametrize("name", PLANTED)
def test_planted_tmp_symlink_is_not_written_through(tiny_src, tmp_path, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    dst = tmp_path / "o"
    convert_checkpoint(tiny_src, dst, shard_bytes=SHARD)
    (dst / name).symlink_to(victim)
    convert_checkpoint(tiny_src, dst, shard_bytes=SHARD, overwrite=True)
    assert victim.read_text() == "precious"
    assert not (dst / "config.json").is_symlink() and json.loads((dst / "config.json").read_text())["quantization_config"]
    assert not list(dst.glob(f"*{TMP_SUFFIX}"))


@pytest.mark.parametrize("name", ["config.json", "layout.json", INDEX_NAME, "model-00001-of-00014.safetensors"])
def test_planted_output_symlink_is_replaced_not_followed(tiny_src, tmp_path, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    dst = tmp_path / "o"
    dst.mkdir()
    (dst / name).symlink_to(victim)
    convert_checkpoint(tiny_src, dst, shard_bytes=SHARD, overwrite=True)
    assert victim.read_text() == "precious" and not (dst / name).is_symlink()


def test_planted_directory_symlinks_are_not_written_into(tiny_src, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("keep")
    dst = tmp_path / "o"
    dst.mkdir()
    (dst / "rank-00000").symlink_to(elsewhere, target_is_directory=True)
    convert_checkpoint(tiny_src, dst, tp=2, overwrite=True)
    assert os.listdir(elsewhere) == ["keep"] and not (dst / "rank-00000").is_symlink()
    dst2 = tmp_path / "o2"
    dst2.mkdir()
    (dst2 / PARTIAL_DIR).symlink_to(elsewhere, target_is_directory=True)
    convert_checkpoint(tiny_src, dst2, overwrite=True)
    assert os.listdir(elsewhere) == ["keep"] and not (dst2 / PARTIAL_DIR).exists()
    # without --overwrite, a planted folder symlink stops --resume with one line
    half = interrupted(tiny_src, tmp_path / "half", tp=2)
    shutil.rmtree(half / "rank-00001")
    (half / "rank-00001").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, half, shard_bytes=SHARD, tp=2, resume=True)
    one_line_error(ei, "rank-00001", "symlink")
    assert os.listdir(elsewhere) == ["keep"]
    no_lock(half)


def test_dst_may_be_a_symlink_to_a_directory(tiny_src, tmp_path):
    """DST a symlink to a directory (an empty one, then one holding a conversion): written inside
    it; the link stays a link; --overwrite replaces only our outputs there."""
    disk = tmp_path / "disk"
    disk.mkdir()
    dst = tmp_path / "dst"
    dst.symlink_to(disk, target_is_directory=True)
    convert_checkpoint(tiny_src, dst, shard_bytes=SHARD)
    assert dst.is_symlink() and json.loads((disk / "config.json").read_text())["quantization_config"]
    first = sorted(p.name for p in disk.glob("*.safetensors"))
    (disk / "notes.txt").write_text("mine")
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, dst, shard_bytes=SHARD)
    one_line_error(ei, "not empty", "--overwrite")
    assert convert_checkpoint(tiny_src, dst, shard_bytes=SHARD, resume=True)["status"].startswith("already complete")
    convert_checkpoint(tiny_src, dst, tp=2, overwrite=True)
    assert dst.is_symlink() and (disk / "rank-00001").is_dir() and (disk / "notes.txt").read_text() == "mine"
    assert first and not list(disk.glob("*.safetensors"))  # the tp 1 shards were ours: replaced
    no_lock(disk)


def test_planted_lock_symlink_is_refused(tiny_src, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    dst = tmp_path / "o"
    dst.mkdir()
    (dst / LOCK_NAME).symlink_to(victim)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, dst)
    one_line_error(ei, LOCK_NAME)
    assert victim.read_text() == "precious"


def test_temporary_names_are_unique_and_exclusive(tmp_path):
    target = tmp_path / "x.json"
    (tmp_path / "x.json.tmp").symlink_to(tmp_path / "victim")
    fds = [create_temp(target) for _ in range(20)]
    names = {p.name for _, p in fds}
    assert len(names) == 20 and all(n.startswith(".x.json.") and n.endswith(TMP_SUFFIX) for n in names)
    for fd, p in fds:
        assert not p.is_symlink() and oct(p.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
        os.close(fd)
    assert not (tmp_path / "victim").exists()
    w = StreamingWriter(tmp_path / "a.safetensors", [("t", torch.float32, (2,))], {})
    assert w.tmp.name != "a.safetensors.tmp" and w.tmp.parent == tmp_path
    w.write("t", torch.ones(2))
    w.commit()
    assert read_header(tmp_path / "a.safetensors")[0]["t"].shape == (2,)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_synth_does_not_write_through_planted_symlinks(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    dst = tmp_path / "s"
    dst.mkdir()
    for name in ("config.json.tmp", "config.json", "model-00001-of-00004.safetensors.tmp"):
        (dst / name).symlink_to(victim)
    write_synthetic(dst, "tiny", layout="hf", overwrite=True)
    assert victim.read_text() == "precious"
    assert GptOssConfig.from_file(dst / "config.json").hidden_size == 192


# ---------------------------------------------------------------------------------------------
# 3. Corrupt input: the safetensors reader validates what the format promises


def write_raw(f: Path, header: dict | bytes | str, data: bytes) -> Path:
    raw = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return f


def _e(dtype="F32", shape=(2,), offs=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offs)}


# (header, data length, message fragment)
HEADERS = {
    "overlap": ({"a": _e(offs=(0, 8)), "b": _e(offs=(4, 12))}, 12, "overlaps tensor 'a'"),
    "same bytes": ({"a": _e(offs=(0, 8)), "b": _e(offs=(0, 8))}, 8, "overlaps"),
    "overlap, other order": ({"z": _e(shape=(4,), offs=(8, 24)), "y": _e(shape=(3,), offs=(0, 12))}, 24, "overlaps"),
    "hole": ({"a": _e(offs=(0, 8)), "b": _e(offs=(12, 20))}, 20, "belong to no tensor"),
    "not from 0": ({"a": _e(offs=(4, 12))}, 12, "belong to no tensor"),
    "trailing bytes": ({"a": _e(offs=(0, 8))}, 9, "after the last tensor"),
    "reversed offsets": ({"a": _e(offs=(8, 0))}, 8, "bad data_offsets"),
    "negative offset": ({"a": _e(offs=(-8, 0))}, 8, "bad data_offsets"),
    "string offsets": ({"a": _e(offs=("0", "8"))}, 8, "bad data_offsets"),
    "float offsets": ({"a": _e(offs=(0.0, 8.0))}, 8, "bad data_offsets"),
    "bool offsets": ({"a": _e(offs=(False, True))}, 8, "bad data_offsets"),
    "three offsets": ({"a": {**_e(), "data_offsets": [0, 4, 8]}}, 8, "bad data_offsets"),
    "offsets not a list": ({"a": {**_e(), "data_offsets": 8}}, 8, "bad data_offsets"),
    "wrong byte count": ({"a": _e(shape=(3,), offs=(0, 8))}, 8, "has 8 bytes for shape [3] F32"),
    "dtype x shape": ({"a": _e(dtype="BF16", shape=(2,), offs=(0, 8))}, 8, "for shape [2] BF16"),
    "negative dim": ({"a": _e(shape=(-2,), offs=(0, 8))}, 8, "bad shape"),
    "bool dim": ({"a": _e(shape=(True, 2), offs=(0, 8))}, 8, "bad shape"),
    "shape not a list": ({"a": {**_e(), "shape": 2}}, 8, "bad shape"),
    "huge rank": ({"a": _e(shape=[1] * 40 + [2], offs=(0, 8))}, 8, "bad shape"),
    "unknown dtype": ({"a": _e(dtype="F4", offs=(0, 8))}, 8, "unknown dtype 'F4'"),
    "dtype not a string": ({"a": _e(dtype=["F32"], offs=(0, 8))}, 8, "unknown dtype"),
    "entry not an object": ({"a": [1, 2]}, 8, "bad header entry for tensor 'a'"),
    "missing key": ({"a": {"dtype": "F32", "shape": [2]}}, 8, "bad header entry for tensor 'a'"),
    "metadata not strings": ({"__metadata__": {"x": 1}, "a": _e()}, 8, "__metadata__"),
    "metadata a list": ({"__metadata__": ["x"], "a": _e()}, 8, "__metadata__"),
    "header a list": ([1, 2], 0, "not a JSON object"),
    "duplicate name": ('{"a": ' + json.dumps(_e()) + ', "a": ' + json.dumps(_e()) + "}", 8, "appears twice"),
    "deep nesting": ('{"__metadata__": {"x": ' + "[" * 200 + "]" * 200 + "}}", 0, "nested more than"),
    "very deep nesting": ('{"a": ' + "[" * 200_000 + "]" * 200_000 + "}", 0, "nested more than"),
    "not utf-8": (b"\xff\xfe\x00{}", 0, "header is not JSON"),
    "truncated data": ({"a": _e(shape=(4,), offs=(0, 16))}, 8, "truncated"),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_reader_refuses_corrupt_header(tmp_path, case):
    header, n, msg = HEADERS[case]
    f = write_raw(tmp_path / "x.safetensors", header, bytes(n))
    with pytest.raises(GptOssFp8Error) as ei:
        read_header(f)
    one_line_error(ei, str(f), msg)


@pytest.mark.parametrize("n", [0, 1, 7])
def test_reader_refuses_header_lengths_out_of_bounds(tmp_path, n):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", n) + b"{}" + bytes(8))
    with pytest.raises(GptOssFp8Error) as ei:
        read_header(f)
    one_line_error(ei, str(f))
    f.write_bytes(struct.pack("<Q", 2**64 - 1) + b"{}")
    with pytest.raises(GptOssFp8Error, match="does not fit"):
        read_header(f)


def test_reader_accepts_what_safetensors_writes(tmp_path):
    f = tmp_path / "ok.safetensors"
    t = {"a": torch.ones(3, 5, dtype=torch.bfloat16), "z": torch.zeros(0, 4), "b": torch.arange(7, dtype=torch.int64),
         "s": torch.tensor(2.0)}
    save_file(t, str(f), metadata={"k": "v"})
    infos, meta = read_header(f)
    assert meta == {"k": "v"} and {k: v.shape for k, v in infos.items()} == {k: tuple(v.shape) for k, v in t.items()}


def _rewrite_header(f: Path, edit) -> None:
    """Apply edit(header dict) to a real file's header, keeping its data bytes."""
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    write_raw(f, header, raw[8 + n :])


def _shard_with(root: Path, name: str) -> Path:
    return root / json.loads((root / INDEX_NAME).read_text())["weight_map"][name]


def _overlap(victim: str, donor: str):
    def edit(h):
        h[victim]["data_offsets"] = list(h[donor]["data_offsets"])
    return edit


SOURCE_HEADER_EDITS = {
    # two tensors sharing bytes: before, one silently held the other's values
    "overlap biases": (L0 + "mlp.router.bias", _overlap(L0 + "mlp.router.bias", L0 + "self_attn.sinks"), "overlaps"),
    "overlap norm": (L0 + "input_layernorm.weight",
                     _overlap(L0 + "input_layernorm.weight", L0 + "post_attention_layernorm.weight"), "overlaps"),
    "shifted by 2": (L0 + "mlp.router.bias", lambda h: h[L0 + "mlp.router.bias"].update(
        data_offsets=[x + 2 for x in h[L0 + "mlp.router.bias"]["data_offsets"]]), "model.layers.0.mlp.router.bias"),
    "dtype lie": (L0 + "self_attn.sinks", lambda h: h[L0 + "self_attn.sinks"].update(dtype="F32"), "self_attn.sinks"),
}


@pytest.mark.parametrize("case", sorted(SOURCE_HEADER_EDITS))
def test_corrupt_source_header_refused_by_convert(tiny_src, tmp_path, case):
    name, edit, msg = SOURCE_HEADER_EDITS[case]
    src = copy(tiny_src, tmp_path / "src")
    f = _shard_with(src, name)
    _rewrite_header(f, edit)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(src, tmp_path / "out")
    one_line_error(ei, f.name, msg)
    assert not (tmp_path / "out").exists()


def _retype(name: str, dtype: torch.dtype):
    def edit(root: Path):
        f = _shard_with(root, name)
        with safe_open(str(f), "pt") as fh:
            d = {k: fh.get_tensor(k) for k in fh.keys()}
        d[name] = d[name].float().to(dtype)
        save_file(d, str(f))
    return edit


DTYPE_CASES = {
    "q_proj float8_e4m3fn": (L0 + "self_attn.q_proj.weight", torch.float8_e4m3fn, "already an FP8 checkpoint"),
    "lm_head float8_e5m2": ("lm_head.weight", torch.float8_e5m2, "already an FP8 checkpoint"),
    "router float8_e4m3fn": (L0 + "mlp.router.weight", torch.float8_e4m3fn, "dtype float8_e4m3fn"),
    "norm float64": ("model.norm.weight", torch.float64, "dtype float64"),
    "sinks int8": (L0 + "self_attn.sinks", torch.int8, "dtype int8"),
    "blocks float8": (L0 + "mlp.experts.down_proj_blocks", torch.float8_e4m3fn, "expected uint8"),
    "scales int8": (L0 + "mlp.experts.gate_up_proj_scales", torch.int8, "expected uint8"),
}


@pytest.mark.parametrize("case", sorted(DTYPE_CASES))
def test_unexpected_dtype_in_mxfp4_source_is_refused(tiny_src, tmp_path, case):
    name, dtype, msg = DTYPE_CASES[case]
    src = copy(tiny_src, tmp_path / "src")
    _retype(name, dtype)(src)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(src, tmp_path / "out")
    one_line_error(ei, name, msg)
    assert not (tmp_path / "out").exists()


def _weight_map_value(value):
    def edit(root: Path):
        idx = json.loads((root / INDEX_NAME).read_text())
        idx["weight_map"][L0 + "self_attn.sinks"] = value
        (root / INDEX_NAME).write_text(json.dumps(idx))
    return edit


def _index_text(text: str):
    return lambda root: (root / INDEX_NAME).write_text(text)


def _move_in_index(root: Path):
    idx = json.loads((root / INDEX_NAME).read_text())
    wm = idx["weight_map"]
    wm["lm_head.weight"] = wm["model.embed_tokens.weight"] if wm["lm_head.weight"] != wm["model.embed_tokens.weight"] else \
        next(v for v in wm.values() if v != wm["lm_head.weight"])
    (root / INDEX_NAME).write_text(json.dumps(idx))


def _drop_from_index(root: Path):
    idx = json.loads((root / INDEX_NAME).read_text())
    del idx["weight_map"]["model.norm.weight"]
    (root / INDEX_NAME).write_text(json.dumps(idx))


INDEX_CASES = {
    "value a list": (_weight_map_value(["model-00001-of-00004.safetensors"]),
                     "weight_map value for tensor model.layers.0.self_attn.sinks is list"),
    "value a number": (_weight_map_value(3), "is int 3, not a file name"),
    "value null": (_weight_map_value(None), "is NoneType None, not a file name"),
    "value an object": (_weight_map_value({"f": "x"}), "not a file name"),
    "weight_map a list": (_index_text('{"weight_map": ["a"]}'), "no weight_map object"),
    "index a list": (_index_text("[1]"), "no weight_map object"),
    "index deep": (_index_text('{"weight_map": {}, "metadata": ' + "[" * 300 + "]" * 300 + "}"), "nested more than"),
    "index very deep": (_index_text("[" * 200_000 + "]" * 200_000), "nested more than"),
    "index not json": (_index_text("{oops"), "invalid index JSON"),
    "empty weight_map": (_index_text('{"weight_map": {}}'), "weight_map is empty"),
    "tensor in another file": (_move_in_index, "weight_map lists tensor lm_head.weight in"),
    "tensor not in index": (_drop_from_index, "model.norm.weight is not in"),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_bad_index_is_one_line(tiny_src, tmp_path, case):
    edit, msg = INDEX_CASES[case]
    src = copy(tiny_src, tmp_path / "src")
    edit(src)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(src, tmp_path / "out")
    one_line_error(ei, msg)
    assert not (tmp_path / "out").exists()


def _config_edit(**kv):
    def edit(root: Path):
        c = json.loads((root / "config.json").read_text())
        for k, v in kv.items():
            if v is ...:
                c.pop(k, None)
            else:
                c[k] = v
        (root / "config.json").write_text(json.dumps(c))
    return edit


CONFIG_CASES = {
    "layer_types 5": (_config_edit(layer_types=5), "layer_types must be a list of strings"),
    "layer_types a string": (_config_edit(layer_types="full_attention"), "layer_types must be a list of strings"),
    "layer_types numbers": (_config_edit(layer_types=[1, 2]), "layer_types must be a list of strings"),
    "layer_types nested": (_config_edit(layer_types=[["full_attention"], ["full_attention"]]), "layer_types must be a list"),
    "layer_types short": (_config_edit(layer_types=["full_attention"]), "layer_types has 1 entries for 2 layers"),
    "layer_types unknown": (_config_edit(layer_types=["full_attention", "local"]), "unknown layer_types"),
    "layers 1e9": (_config_edit(num_hidden_layers=10**9, layer_types=...), "num_hidden_layers is 1000000000, above the limit"),
    "layers 1e9 with list": (_config_edit(num_hidden_layers=10**9), "num_hidden_layers is 1000000000"),
    "experts huge": (_config_edit(num_local_experts=10**8), "num_local_experts is 100000000"),
    "hidden huge": (_config_edit(hidden_size=2**40), "hidden_size is"),
    "vocab huge": (_config_edit(vocab_size=10**12), "vocab_size is"),
    "intermediate huge": (_config_edit(intermediate_size=2**31), "intermediate_size is"),
    "heads huge": (_config_edit(num_attention_heads=10**7), "num_attention_heads is"),
    "head_dim huge": (_config_edit(head_dim=10**6), "head_dim is"),
    "layers a float": (_config_edit(num_hidden_layers=2.0), "num_hidden_layers must be a positive integer"),
    "layers a string": (_config_edit(num_hidden_layers="2"), "num_hidden_layers must be a positive integer"),
    "layers negative": (_config_edit(num_hidden_layers=-1), "num_hidden_layers must be a positive integer"),
    "rope_theta NaN": (_config_edit(rope_theta=float("nan")), "rope_theta must be a positive finite number"),
    "rope_theta string": (_config_edit(rope_theta="1e4"), "rope_theta must be"),
    "rope_scaling a list": (_config_edit(rope_scaling=[1]), "rope_scaling must be an object"),
    "deep nesting": (_config_edit(extra=json.loads("[" * 100 + "]" * 100)), "nested more than"),
    "very deep nesting": (lambda r: (r / "config.json").write_text('{"a": ' + "[" * 200_000 + "]" * 200_000 + "}"),
                          "nested more than"),
    "config a list": (lambda r: (r / "config.json").write_text("[]"), "expected a JSON object"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_is_one_line_and_fast(tiny_src, tmp_path, case):
    edit, msg = CONFIG_CASES[case]
    src = copy(tiny_src, tmp_path / "src")
    edit(src)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(src, tmp_path / "out")
    one_line_error(ei, "config.json", msg)
    assert not (tmp_path / "out").exists()
    with pytest.raises(GptOssFp8Error, match="config.json"):  # what `plan SRC` does
        GptOssConfig.from_file(src / "config.json")


# ---------------------------------------------------------------------------------------------
# 5. Hangs: special files and huge configs fail fast


@pytest.mark.timeout(30)
def test_fifo_named_safetensors_does_not_hang(tiny_src, tmp_path):
    src = copy(tiny_src, tmp_path / "src")
    (src / INDEX_NAME).unlink()  # the glob path: every *.safetensors in SRC
    os.mkfifo(src / "model-00005-of-00005.safetensors")
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(src, tmp_path / "out")
    one_line_error(ei, "model-00005-of-00005.safetensors", "is a FIFO")
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(30)
def test_fifo_behind_the_index_does_not_hang(tiny_src, tmp_path):
    src = copy(tiny_src, tmp_path / "src")
    f = first_shard(src)
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(src, tmp_path / "out")
    one_line_error(ei, f.name, "is a FIFO")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", [INDEX_NAME, "config.json"])
def test_fifo_as_index_or_config_does_not_hang(tiny_src, tmp_path, name):
    src = copy(tiny_src, tmp_path / "src")
    (src / name).unlink()
    os.mkfifo(src / name)
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(src, tmp_path / "out")
    one_line_error(ei, name, "not a regular file" if name == "config.json" else "is a FIFO")


@pytest.mark.parametrize("indexed", [False, True])
def test_directory_named_safetensors(tiny_src, tmp_path, indexed):
    src = copy(tiny_src, tmp_path / "src")
    if indexed:
        f = first_shard(src)
        f.unlink()
        f.mkdir()
    else:
        (src / INDEX_NAME).unlink()
        f = src / "model-00000-of-00004.safetensors"
        f.mkdir()
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(src, tmp_path / "out")
    one_line_error(ei, f.name, "is a directory")


def test_config_json_a_directory(tiny_src, tmp_path):
    src = copy(tiny_src, tmp_path / "src")
    (src / "config.json").unlink()
    (src / "config.json").mkdir()
    with pytest.raises(GptOssFp8Error, match="is a directory"):
        convert_checkpoint(src, tmp_path / "out")


@pytest.mark.timeout(30)
def test_huge_layer_count_fails_fast_everywhere(tmp_path):
    with pytest.raises(GptOssFp8Error, match="--layers must be"):
        preset_config("tiny", layers=10**9)
    with pytest.raises(GptOssFp8Error, match="--layers must be"):
        write_synthetic(tmp_path / "s", "tiny", layers=10**9)
    assert not (tmp_path / "s").exists()
    with pytest.raises(GptOssFp8Error, match="num_hidden_layers is 1000000000"):
        GptOssConfig(**_fields(num_hidden_layers=10**9))


def _fields(**kw):
    from dataclasses import fields

    base = preset_config("tiny")
    d = {f.name: getattr(base, f.name) for f in fields(base)}
    d.update(kw, layer_types=())
    return d


@pytest.mark.timeout(30)
def test_plan_cli_on_huge_config_fails_fast(tiny_src, tmp_path):
    from typer.testing import CliRunner

    from gptoss_fp8.cli.main import app

    src = copy(tiny_src, tmp_path / "src")
    _config_edit(num_hidden_layers=10**9, layer_types=...)(src)
    r = CliRunner().invoke(app, ["plan", str(src)])
    assert r.exit_code != 0 and "num_hidden_layers" in r.output and "Traceback" not in r.output


# ---------------------------------------------------------------------------------------------
# 6. Messages that mislead, and arguments the library must refuse itself


def _full_disk(free: int):
    usage = namedtuple("usage", "total used free")
    return lambda p: usage(10**12, 10**12 - free, free)


def test_free_space_is_checked_before_anything_is_created(tiny_src, tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod.shutil, "disk_usage", _full_disk(1000))
    dst = tmp_path / "new" / "deeper"
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, dst)
    msg = one_line_error(ei, "GB free", "nothing was written")
    assert "0.00 GB" not in msg and "0.000001 GB free" in msg
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "mine.txt").write_text("x")
    with pytest.raises(GptOssFp8Error, match="GB free"):
        convert_checkpoint(tiny_src, existing, overwrite=True)
    assert os.listdir(existing) == ["mine.txt"]  # no lock, no partial dir, no plan.json


def test_free_space_counts_what_overwrite_frees(tiny_src, tmp_path, monkeypatch):
    dst = tmp_path / "o"
    convert_checkpoint(tiny_src, dst)
    monkeypatch.setattr(writer_mod.shutil, "disk_usage", _full_disk(100_000))
    convert_checkpoint(tiny_src, dst, overwrite=True)  # the old files make room for the new ones
    with pytest.raises(GptOssFp8Error, match="that --overwrite would free"):
        convert_checkpoint(tiny_src, dst, overwrite=True, keep_attention_bf16=True)  # bf16 attention: larger
    no_lock(dst)


def test_resume_needs_only_the_missing_bytes(tiny_src, reference, tmp_path, monkeypatch):
    dst = interrupted(tiny_src, tmp_path / "o", cut=800_000)
    left = sum(p.stat().st_size for p in reference.glob("model-*.safetensors")) - \
        sum(p.stat().st_size for p in dst.glob("model-*.safetensors"))
    monkeypatch.setattr(writer_mod.shutil, "disk_usage", _full_disk(left + 20 * 65536 + 10**5))
    convert_checkpoint(tiny_src, dst, shard_bytes=SHARD, resume=True)
    monkeypatch.undo()
    assert tree(dst) == tree(reference)


def test_synth_full_disk_does_not_offer_resume(tmp_path, monkeypatch):
    fail_writes_with_enospc(monkeypatch, 3)
    with pytest.raises(GptOssFp8Error) as ei:
        write_synthetic(tmp_path / "s", "tiny", layout="hf")
    msg = one_line_error(ei, "disk full while writing", "synth again with --overwrite")
    assert "--resume" not in msg and "0.0 GB" not in msg
    assert not list((tmp_path / "s").glob("*.safetensors")) and not list((tmp_path / "s").glob(f".*{TMP_SUFFIX}"))
    monkeypatch.undo()
    # the same for its small files
    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_mod, "create_temp", no_space)
    with pytest.raises(GptOssFp8Error) as ei:
        write_synthetic(tmp_path / "s2", "tiny", layout="hf")
    assert "--resume" not in str(ei.value) and "synth again" in str(ei.value)


def test_synth_checks_free_space_first(tmp_path, monkeypatch):
    from gptoss_fp8.convert import synth

    monkeypatch.setattr(synth.shutil, "disk_usage", _full_disk(1000))
    with pytest.raises(GptOssFp8Error) as ei:
        write_synthetic(tmp_path / "s", "tiny")
    one_line_error(ei, "GB free", "nothing was written")
    assert not (tmp_path / "s").exists()


def test_synth_into_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(GptOssFp8Error, match="not a directory"):
        write_synthetic(f, "tiny")
    assert f.read_text() == "x"


BAD_ARGS = {
    "shard -1": (dict(shard_bytes=-1), "max shard size"),
    "shard 0": (dict(shard_bytes=0), "max shard size"),
    "shard nan": (dict(shard_bytes=float("nan")), "got nan"),
    "shard inf": (dict(shard_bytes=float("inf")), "got inf"),
    "shard -inf": (dict(shard_bytes=float("-inf")), "got -inf"),
    "shard fraction": (dict(shard_bytes=0.5), "max shard size"),
    "shard string": (dict(shard_bytes="5GB"), "max shard size"),
    "shard bool": (dict(shard_bytes=True), "max shard size"),
    "chunk 0": (dict(chunk_bytes=0), "chunk_bytes"),
    "scale mode": (dict(scale_mode="fast"), "scale mode 'fast'"),
    "device foo": (dict(device="foo"), "--device foo"),
    "device meta": (dict(device="meta"), "--device meta"),
    "device mps": (dict(device="mps"), "--device mps"),
    "device cuda:99": (dict(device="cuda:99"), "--device cuda:99"),
    "tp 0": (dict(tp=0), "--tp must be a positive integer"),
    "tp float": (dict(tp=2.0), "--tp must be a positive integer"),
    "ep string": (dict(ep="2"), "--ep must be a positive integer"),
    "both flags": (dict(overwrite=True, resume=True), "exclude each other"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_library_refuses_bad_arguments(tiny_src, tmp_path, case):
    kw, msg = BAD_ARGS[case]
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, tmp_path / "out", **kw)
    one_line_error(ei, msg)
    assert not (tmp_path / "out").exists()


def test_dst_a_file_or_unwritable(tiny_src, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(GptOssFp8Error) as ei:
        convert_checkpoint(tiny_src, f)
    one_line_error(ei, "not a directory")
    assert f.read_text() == "x"
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: the read-only DST case needs a normal user")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(GptOssFp8Error) as ei:
            convert_checkpoint(tiny_src, ro)
        one_line_error(ei, str(ro), "lock")
    finally:
        ro.chmod(0o700)


def test_refusal_under_the_lock_leaves_no_new_dirs(tiny_src, tmp_path):
    dst = interrupted(tiny_src, tmp_path / "o", tp=2)
    before = sorted(p.name for p in dst.iterdir())
    with pytest.raises(GptOssFp8Error):
        convert_checkpoint(tiny_src, dst, tp=4, resume=True)
    assert sorted(p.name for p in dst.iterdir()) == before
    no_lock(dst)
