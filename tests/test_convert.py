"""synth -> convert end to end, on several shapes, and every bad input the converter must refuse."""

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from conftest import fail_writes_with_enospc
from safetensors import safe_open

from gptoss_fp8.checkpoint.format import REPORT_NAME, hf_source_tensors
from gptoss_fp8.config import GptOssConfig
from gptoss_fp8.convert import writer as writer_mod
from gptoss_fp8.convert.convert import LOCK_NAME, PARTIAL_DIR, convert_checkpoint
from gptoss_fp8.convert.synth import write_synthetic
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.quant.fp8 import dequantize_weight_blocks, quantize_weight_blocks
from gptoss_fp8.quant.mxfp4 import decode_mxfp4

# Shapes no preset has: odd multiples of 32, 1 expert per token, odd vocab, 1 and 3 layers.
SHAPES = {
    "tiny": {},
    "narrow": dict(hidden_size=96, intermediate_size=288, num_local_experts=3, num_experts_per_tok=1,
                   vocab_size=1001, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
    "wide": dict(hidden_size=416, intermediate_size=64, num_local_experts=5, num_experts_per_tok=3,
                 vocab_size=37, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, head_dim=8),
}


def load_all(root: Path) -> dict[str, torch.Tensor]:
    index = json.loads((root / "model.safetensors.index.json").read_text())
    out = {}
    for name, f in index["weight_map"].items():
        with safe_open(str(root / f), "pt") as fh:
            out[name] = fh.get_tensor(name)
    return out


def file_hashes(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("src") / "tiny"
    write_synthetic(d, "tiny", seed=3, layout="hf")
    return d


def _assert_converted_exactly(src: Path, dst: Path, keep_attention_bf16=False):
    cfg = GptOssConfig.from_file(src / "config.json")
    s, d = load_all(src), load_all(dst)
    for spec in hf_source_tensors(cfg):
        n = spec.name
        if n.endswith("_scales"):
            continue
        if n.endswith("_blocks"):
            base = n[: -len("_blocks")]
            ref = decode_mxfp4(s[n], s[base + "_scales"], torch.float32)
            w, si = d[base], d[base + "_scale_inv"]
            assert w.dtype == torch.float8_e4m3fn and si.dtype == torch.float32
            assert si.shape == (ref.shape[0], -(-ref.shape[1] // 128), -(-ref.shape[2] // 128))
            assert torch.equal(dequantize_weight_blocks(w, si), ref), n  # lossless
        elif ".self_attn." in n and n.endswith("_proj.weight") and not keep_attention_bf16:
            q, si = quantize_weight_blocks(s[n], "pow2")
            assert torch.equal(d[n].view(torch.uint8), q.view(torch.uint8)) and torch.equal(d[n + "_scale_inv"], si)
        else:
            assert d[n].dtype == s[n].dtype and torch.equal(d[n], s[n]), n


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_end_to_end_every_weight_exact(tmp_path, shape):
    src = tmp_path / "src"
    write_synthetic(src, "tiny", seed=11, layout="hf", **SHAPES[shape])
    rep = convert_checkpoint(src, tmp_path / "out", shard_bytes=200_000)  # several output files
    _assert_converted_exactly(src, tmp_path / "out")
    experts = {k: v for k, v in rep["exactness"]["tensors"].items() if ".experts." in k}
    assert experts and all(v["exact_fraction"] == 1.0 for v in experts.values())
    out = tmp_path / "out"
    assert len(list(out.glob("model-*.safetensors"))) > 1
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    src_cfg = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == {
        k: v for k, v in src_cfg.items() if k != "quantization_config"}
    for f in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json", "special_tokens_map.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes()
    assert not (out / PARTIAL_DIR).exists() and not (out / LOCK_NAME).exists()
    assert not list(out.glob("*.tmp"))
    with safe_open(str(next(out.glob("model-*.safetensors"))), "pt") as fh:
        meta = fh.metadata()
    assert meta["scale_mode"] == "pow2" and meta["producer"].startswith("gptoss-fp8")


def test_keep_attention_bf16_and_report(tiny_src, tmp_path):
    rep = convert_checkpoint(tiny_src, tmp_path / "o", keep_attention_bf16=True)
    _assert_converted_exactly(tiny_src, tmp_path / "o", keep_attention_bf16=True)
    assert rep["exactness"]["overall"]["exact_fraction"] == 1.0
    assert all(".experts." in k for k in rep["exactness"]["tensors"])
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert "model.layers.*.self_attn" in cfg["quantization_config"]["modules_to_not_convert"]
    saved = json.loads((tmp_path / "o" / REPORT_NAME).read_text())
    assert saved["source"]["path"] == str(tiny_src.resolve()) and saved["version"]


def test_amax_mode_rounds_and_reports_it(tiny_src, tmp_path):
    rep = convert_checkpoint(tiny_src, tmp_path / "o", scale_mode="amax")
    t = rep["exactness"]["tensors"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert 0.2 < t["exact_fraction"] < 0.9 and 0 < t["max_rel_err"] < 0.07
    d = load_all(tmp_path / "o")
    si = d["model.layers.0.mlp.experts.gate_up_proj_scale_inv"]
    m, _ = torch.frexp(si)
    assert not (m == 0.5).all()  # not powers of two


def test_conversion_is_deterministic(tiny_src, tmp_path):
    convert_checkpoint(tiny_src, tmp_path / "a")
    convert_checkpoint(tiny_src, tmp_path / "b")
    assert file_hashes(tmp_path / "a") == file_hashes(tmp_path / "b")


def test_synth_regenerates_bit_identically(tmp_path):
    write_synthetic(tmp_path / "a", "tiny", seed=5, layout="both")
    write_synthetic(tmp_path / "b", "tiny", seed=5, layout="both")
    write_synthetic(tmp_path / "c", "tiny", seed=6, layout="hf")
    ha, hb = file_hashes(tmp_path / "a"), file_hashes(tmp_path / "b")
    assert ha == hb and file_hashes(tmp_path / "a" / "original") == file_hashes(tmp_path / "b" / "original")
    assert ha["model-00001-of-00004.safetensors"] != file_hashes(tmp_path / "c")["model-00001-of-00004.safetensors"]


def test_synth_statistics(tiny_src):
    s = load_all(tiny_src)
    sc = s["model.layers.0.mlp.experts.gate_up_proj_scales"].int()
    assert sc.float().std(dim=1).mean() > 0.5  # exponents vary across rows
    assert sc.float().std(dim=2).mean() > 0.5  # and across groups of a row
    assert 5 <= int(sc.max() - sc.min()) <= 14  # within the lossless window of a block


def test_synth_original_layout_matches_hf(tmp_path):
    write_synthetic(tmp_path, "tiny", seed=2, layout="both")
    hf = load_all(tmp_path)
    with safe_open(str(tmp_path / "original" / "model.safetensors"), "pt") as fh:
        o = {k: fh.get_tensor(k) for k in fh.keys()}
    assert torch.equal(o["block.1.mlp.mlp1_weight.blocks"], hf["model.layers.1.mlp.experts.gate_up_proj_blocks"])
    qkv = torch.cat([hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(o["block.0.attn.qkv.weight"], qkv)
    assert torch.equal(o["unembedding.weight"], hf["lm_head.weight"])


def test_synth_outputs_are_peaked_under_openai_reference(tmp_path):
    model = pytest.importorskip("gpt_oss.torch.model")
    write_synthetic(tmp_path, "tiny", seed=4, layout="original")
    m = model.Transformer.from_checkpoint(str(tmp_path / "original"), device=torch.device("cpu"))
    toks = torch.randint(0, 503, (48,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p = m(toks).float().softmax(-1)
    assert p.max(-1).values.mean() > 50 / 503  # far above uniform


# ---------------------------------------------------------------------------------------------
# resume, overwrite, lock


def _interrupt_after(nbytes):
    seen = [0]

    def progress(n):
        seen[0] += n
        if seen[0] >= nbytes:
            raise KeyboardInterrupt

    return progress


def test_interrupted_run_never_looks_complete_and_resume_is_byte_identical(tiny_src, tmp_path):
    ref = tmp_path / "ref"
    convert_checkpoint(tiny_src, ref, shard_bytes=150_000)
    for cut in (5_000, 400_000):
        out = tmp_path / f"cut{cut}"
        with pytest.raises(KeyboardInterrupt):
            convert_checkpoint(tiny_src, out, shard_bytes=150_000, progress=_interrupt_after(cut))
        assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
        assert not list(out.glob("*.tmp"))
        with pytest.raises(GptOssFp8Error, match="--resume"):
            convert_checkpoint(tiny_src, out, shard_bytes=150_000)
        with pytest.raises(GptOssFp8Error, match="other options"):
            convert_checkpoint(tiny_src, out, shard_bytes=150_000, scale_mode="amax", resume=True)
        convert_checkpoint(tiny_src, out, shard_bytes=150_000, resume=True)
        assert file_hashes(out) == file_hashes(ref)


def test_non_empty_dst_refused_and_overwrite(tiny_src, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(GptOssFp8Error, match="not empty"):
        convert_checkpoint(tiny_src, out)
    assert (out / "mine.txt").read_text() == "keep me" and not (out / "config.json").exists()
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    convert_checkpoint(tiny_src, out, overwrite=True)
    assert not (out / "model-00009-of-00009.safetensors").exists()
    assert (out / "mine.txt").read_text() == "keep me"
    _assert_converted_exactly(tiny_src, out)
    with pytest.raises(GptOssFp8Error, match="source directory"):
        convert_checkpoint(tiny_src, tiny_src, overwrite=True)


def test_lock_refuses_second_convert(tiny_src, tmp_path):
    import fcntl

    out = tmp_path / "o"
    out.mkdir()
    fd = os.open(out / LOCK_NAME, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(GptOssFp8Error, match="another gptoss-fp8 convert"):
            convert_checkpoint(tiny_src, out)
    finally:
        os.close(fd)
    convert_checkpoint(tiny_src, out)  # lock released: works


def test_disk_full(tiny_src, tmp_path, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(writer_mod.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(GptOssFp8Error, match="GB free"):
        convert_checkpoint(tiny_src, tmp_path / "a")
    assert not list((tmp_path / "a").glob("*.safetensors"))
    monkeypatch.undo()

    # ENOSPC in the middle of a file: one clear line, no file left looking complete, resumable.
    fail_writes_with_enospc(monkeypatch, 5)  # the writer's 5th write fails
    with pytest.raises(GptOssFp8Error, match="disk full while writing .*--resume"):
        convert_checkpoint(tiny_src, tmp_path / "b", shard_bytes=150_000)
    monkeypatch.undo()
    assert not (tmp_path / "b" / "config.json").exists() and not list((tmp_path / "b").glob("*.tmp"))
    convert_checkpoint(tiny_src, tmp_path / "b", shard_bytes=150_000, resume=True)
    _assert_converted_exactly(tiny_src, tmp_path / "b")


# ---------------------------------------------------------------------------------------------
# bad inputs: one clear error each


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _rewrite_tensor(root: Path, name: str, fn):
    """Rewrite one tensor of an HF-layout checkpoint through safetensors (keeps the file valid)."""
    from safetensors.torch import save_file

    index = json.loads((root / "model.safetensors.index.json").read_text())
    f = root / index["weight_map"][name]
    with safe_open(str(f), "pt") as fh:
        d = {k: fh.get_tensor(k) for k in fh.keys()}
    out = fn(d)
    save_file(out, str(f))
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in out or v != f.name}
    for k in out:
        index["weight_map"][k] = f.name
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _cfg_edit(key, value):
    def edit(root):
        c = json.loads((root / "config.json").read_text())
        if value is None:
            del c[key]
        else:
            c[key] = value
        (root / "config.json").write_text(json.dumps(c))
    return edit


def _set(name, fn):
    return lambda root: _rewrite_tensor(root, name, lambda d: {**d, name: fn(d[name])})


L0 = "model.layers.0."
BAD_INPUTS = {
    "no config": (lambda r: (r / "config.json").unlink(), "config.json not found"),
    "config not json": (lambda r: (r / "config.json").write_text("{oops"), "invalid JSON"),
    "not gpt_oss": (_cfg_edit("model_type", "llama"), "not 'gpt_oss'"),
    "config missing key": (_cfg_edit("hidden_size", None), "missing key.*hidden_size"),
    "config disagrees": (_cfg_edit("intermediate_size", 192), "has shape .* config.json implies"),
    "missing tensor": (lambda r: _rewrite_tensor(r, L0 + "self_attn.sinks",
                                                 lambda d: {k: v for k, v in d.items() if k != L0 + "self_attn.sinks"}),
                       "self_attn.sinks is missing"),
    "wrong shape": (_set(L0 + "mlp.experts.down_proj_bias", lambda t: t[:, :-1].contiguous()), "down_proj_bias has shape"),
    "blocks vs scales": (_set(L0 + "mlp.experts.gate_up_proj_scales", lambda t: t[:, :-2].contiguous()),
                         "gate_up_proj_scales has shape"),
    "nan scale": (_set(L0 + "mlp.experts.down_proj_scales", lambda t: t.index_fill(1, torch.tensor([3]), 255)),
                  "down_proj_scales has .* equal to 255"),
    "wrong dtype": (_set(L0 + "mlp.experts.gate_up_proj_blocks", lambda t: t.to(torch.int16)), "expected uint8"),
    "truncated": (lambda r: _truncate(r / "model-00002-of-00004.safetensors"), "truncated"),
    "corrupt header": (lambda r: _corrupt_header(r / "model-00001-of-00004.safetensors"), "header is not JSON"),
    "index outside": (lambda r: _index_edit(r, "../../etc/passwd"), "outside"),
    "index missing file": (lambda r: _index_edit(r, "model-00077-of-00099.safetensors"), "does not exist"),
    "index pickle": (lambda r: _index_edit(r, "pytorch_model.bin", touch=True), "pickle"),
    "only pickle": (lambda r: _only_pickle(r), "pickle-format weights"),
    "extra tensor": (lambda r: _rewrite_tensor(r, L0 + "self_attn.sinks", lambda d: {**d, "model.layers.7.foo": torch.ones(2)}),
                     "unexpected tensor"),
}


def _truncate(f: Path):
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])


def _corrupt_header(f: Path):
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe\x00{"
    f.write_bytes(bytes(data))


def _index_edit(root: Path, target: str, touch=False):
    index = json.loads((root / "model.safetensors.index.json").read_text())
    k = next(iter(index["weight_map"]))
    index["weight_map"][k] = target
    if touch:
        (root / target).write_bytes(b"\x80\x02pickle")
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _only_pickle(root: Path):
    for p in list(root.glob("*.safetensors")) + [root / "model.safetensors.index.json"]:
        p.unlink()
    (root / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_one_clear_error(tiny_src, tmp_path, case):
    edit, pattern = BAD_INPUTS[case]
    src = _copy(tiny_src, tmp_path / "src")
    edit(src)
    with pytest.raises(GptOssFp8Error, match=pattern) as ei:
        convert_checkpoint(src, tmp_path / "out")
    msg = str(ei.value)
    assert "\n" not in msg and len(msg) < 400
    out = tmp_path / "out"
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()


def test_header_length_overflow(tmp_path):
    from gptoss_fp8.checkpoint.st_io import read_header

    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(GptOssFp8Error, match="does not fit"):
        read_header(f)
    f.write_bytes(b"abc")
    with pytest.raises(GptOssFp8Error, match="shorter than 8 bytes"):
        read_header(f)


@pytest.mark.gpu
@pytest.mark.parametrize("tp,ep", [(1, 1), (4, 2)])
def test_cuda_conversion_is_byte_identical_to_cpu(tiny_src, tmp_path, tp, ep):
    convert_checkpoint(tiny_src, tmp_path / "cpu", tp=tp, ep=ep)
    convert_checkpoint(tiny_src, tmp_path / "cuda", tp=tp, ep=ep, device="cuda")
    for f in sorted((tmp_path / "cpu").rglob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "cuda" / f.relative_to(tmp_path / "cpu")).read_bytes(), f
