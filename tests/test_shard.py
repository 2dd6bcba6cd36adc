"""TP/EP sharded layouts: the plan, the rank files, reassembly from the manifest, and corrupt inputs."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from gptoss_fp8.checkpoint.manifest import load_rank, reassemble
from gptoss_fp8.checkpoint.plan import fp8_checkpoint_tensors, plan, rank_slice
from gptoss_fp8.config import preset_config
from gptoss_fp8.convert.convert import convert_checkpoint
from gptoss_fp8.convert.synth import write_synthetic
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.parallel import Parallel

LAYOUTS = [(tp, ep) for tp in (1, 2, 4, 8) for ep in (1, 2, 4, 8) if ep <= tp and tp % ep == 0]
SHAPES = {
    "tiny": {},
    # kv heads 1 (replicated on every rank), intermediate 288: down_proj column shards of 144/72/36
    # cut MXFP4 groups; hidden 96 and an odd vocab.
    "odd": dict(hidden_size=96, intermediate_size=288, num_local_experts=8, num_experts_per_tok=3,
                num_attention_heads=8, num_key_value_heads=1, head_dim=8, vocab_size=1001, num_hidden_layers=1),
    # 16 experts, 4 kv heads, q_dim 384 = 3 blocks: tp 8 q/o shards of 48 rows/columns straddle blocks.
    "straddle": dict(hidden_size=160, intermediate_size=64, num_local_experts=16, num_experts_per_tok=4,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=48, vocab_size=77, num_hidden_layers=2),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = {}
    for name, kw in SHAPES.items():
        d = tmp_path_factory.mktemp("src") / name
        write_synthetic(d, "tiny", seed=21, layout="hf", **kw)
        unsharded = tmp_path_factory.mktemp("unsharded") / name
        convert_checkpoint(d, unsharded)
        out[name] = (d, reassemble(unsharded))
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_reassembly_reproduces_unsharded(sources, tmp_path, shape, tp, ep):
    src, ref = sources[shape]
    dst = tmp_path / "out"
    rep = convert_checkpoint(src, dst, tp=tp, ep=ep, shard_bytes=60_000)
    assert rep["layout"] == {"tp": tp, "ep": ep}
    full = reassemble(dst)  # from the manifest alone; asserts coverage and replica equality
    assert set(full) == set(ref)
    manifest = json.loads((dst / "layout.json").read_text())

    def straddles(name):  # some rank's own 128-block spans two whole-tensor blocks
        return any(a % 128 and a // 128 != (b - 1) // 128
                   for rk in manifest["ranks"] for _, a, b in (rk["tensors"].get(name, {}).get("slices") or []))

    for name, t in ref.items():
        if ".self_attn." in name and name.endswith("proj.weight") and straddles(name):
            assert shape == "straddle"
            # own-grid blocks that straddle two whole-tensor blocks are requantized at the larger
            # scale: within one e4m3 rounding of the unsharded value, not bit-equal
            step = (t.abs() * 2.0**-3).clamp(min=t.abs().max() * 2.0**-12)
            assert ((full[name] - t).abs() <= step).all(), name
            continue
        assert torch.equal(full[name], t), name
    experts = {k: v for k, v in rep["exactness"]["tensors"].items() if ".experts." in k}
    assert all(v["exact_fraction"] == 1.0 for v in experts.values())
    if tp > 1:
        assert sorted(p.name for p in dst.glob("rank-*")) == [f"rank-{r:05d}" for r in range(tp)]
        assert not list(dst.glob("*.safetensors"))


def test_rank_contents_follow_the_rules(sources, tmp_path):
    src, _ = sources["tiny"]
    dst = tmp_path / "o"
    convert_checkpoint(src, dst, tp=8, ep=2)
    ranks = [load_rank(dst, r) for r in range(8)]
    cfg = preset_config("tiny")
    hd = cfg.head_dim
    for r, t in enumerate(ranks):
        # 8 q heads over 8 ranks; 2 kv heads replicated: ranks 0-3 hold head 0, ranks 4-7 head 1
        assert t["model.layers.0.self_attn.q_proj.weight"].shape == (hd, cfg.hidden_size)
        assert t["model.layers.0.self_attn.k_proj.bias"].shape == (hd,)
        assert t["model.layers.0.self_attn.sinks"].shape == (1,)
        # 8 experts over 2 groups, intermediate 160 over 4 parts: 80 gate_up rows (40 pairs)
        assert t["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 80, cfg.hidden_size)
        assert t["model.layers.0.mlp.experts.down_proj"].shape == (4, cfg.hidden_size, 40)
        assert t["model.layers.0.mlp.experts.down_proj_scale_inv"].shape == (4, 2, 1)
        assert ("model.layers.0.mlp.experts.down_proj_bias" in t) == (r % 4 == 0)  # bias once per expert
        assert ("model.layers.0.self_attn.o_proj.bias" in t) == (r == 0)
    assert torch.equal(ranks[0]["model.layers.1.self_attn.k_proj.bias"], ranks[3]["model.layers.1.self_attn.k_proj.bias"])
    assert not torch.equal(ranks[3]["model.layers.1.self_attn.k_proj.bias"], ranks[4]["model.layers.1.self_attn.k_proj.bias"])


@pytest.mark.parametrize("preset", ["20b", "120b"])
@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_plan_at_real_shapes(preset, tp, ep):
    cfg = preset_config(preset)
    full = {n: (d, s) for n, d, s in fp8_checkpoint_tensors(cfg)}
    ranks = plan(cfg, tp, ep)
    assert len(ranks) == tp
    held: dict[str, int] = {}
    for r, tensors in enumerate(ranks):
        names = {t.name for t in tensors}
        # no rank without work: attention heads and experts everywhere
        for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.35.mlp.experts.gate_up_proj"
                  if preset == "120b" else "model.layers.23.mlp.experts.gate_up_proj"):
            assert n in names, (r, n)
        for t in tensors:
            if t.slice is None:
                n, k = t.shape[-2:]
                w = next(x for x in tensors if x.name == t.name[: -len("_scale_inv")])
                assert (n, k) == (math.ceil(w.shape[-2] / 128), math.ceil(w.shape[-1] / 128))
                continue
            assert t.nbytes == math.prod(t.shape) * t.dtype.itemsize
            held[t.name] = held.get(t.name, 0) + math.prod(t.shape)
        gu = next(t for t in tensors if t.name == "model.layers.0.mlp.experts.gate_up_proj")
        assert gu.shape == (128 // ep if preset == "120b" else 32 // ep, 5760 * ep // tp, 2880)
        kv = next(t for t in tensors if t.name == "model.layers.0.self_attn.k_proj.weight")
        assert kv.shape == (512 // tp, 2880)  # 8 kv heads: split, never replicated up to tp 8
    # byte totals add up: split tensors sum to the full size, replicated ones appear tp times
    for name, count in held.items():
        size = math.prod(full[name][1])
        rule = rank_slice(name, full[name][1], cfg, Parallel(0, tp, ep))
        if rule is not None and not rule.ranges and "o_proj.bias" not in name:
            assert count == size * tp, name
        else:
            assert count == size, name
    # attention slices of real shapes fall inside 128-blocks (bit-exact sharding of attention)
    for tensors in ranks:
        for t in tensors:
            if t.slice is not None and ".self_attn." in t.name and t.name.endswith("proj.weight"):
                for _, a, b in t.slice.ranges:
                    assert a % 128 == 0 or a // 128 == (b - 1) // 128, (t.name, a, b)


def test_plan_cli(tmp_path):
    from typer.testing import CliRunner

    from gptoss_fp8.cli.main import app

    r = CliRunner().invoke(app, ["plan", "--preset", "120b", "--tp", "4", "--ep", "2", "--summary"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[-1].startswith("total over 4 ranks:") and sum(ln.startswith("rank ") for ln in lines) == 4
    r = CliRunner().invoke(app, ["plan", "--preset", "20b", "--tp", "4", "--ep", "3"])
    assert r.exit_code == 1 and "ep must divide tp" in r.output
    r = CliRunner().invoke(app, ["plan", "--preset", "20b", "--tp", "2"])
    assert "model.layers.0.mlp.experts.down_proj  float8_e4m3fn [32, 2880, 1440]" in r.output


def test_bad_layouts(sources, tmp_path):
    src, _ = sources["tiny"]
    for tp, ep, msg in ((3, 1, "attention heads"), (4, 8, "ep must divide"), (16, 16, "experts")):
        with pytest.raises(GptOssFp8Error, match=msg):
            convert_checkpoint(src, tmp_path / f"x{tp}{ep}", tp=tp, ep=ep)


# ---------------------------------------------------------------------------------------------
# corrupt or missing rank files, manifests that lie


@pytest.fixture
def sharded(sources, tmp_path):
    src, _ = sources["tiny"]
    dst = tmp_path / "o"
    convert_checkpoint(src, dst, tp=2, ep=2)
    return dst


def _manifest_edit(dst: Path, fn):
    m = json.loads((dst / "layout.json").read_text())
    fn(m)
    (dst / "layout.json").write_text(json.dumps(m))


def _flip_byte(f: Path, where: int = -100):
    b = bytearray(f.read_bytes())
    b[where] ^= 0x40
    f.write_bytes(bytes(b))


F1 = "rank-00001/model-00001-of-00001.safetensors"
CORRUPTIONS = {
    "missing file": (lambda d: (d / F1).unlink(), "file is missing"),
    "truncated": (lambda d: (d / F1).write_bytes((d / F1).read_bytes()[:-10]), "truncated"),
    "flipped byte": (lambda d: _flip_byte(d / F1), "sha256 does not match"),
    "no manifest": (lambda d: (d / "layout.json").unlink(), "no layout.json"),
    "manifest garbage": (lambda d: (d / "layout.json").write_text("[1, 2"), "not a valid"),
    "shape lie": (lambda d: _manifest_edit(d, lambda m: m["ranks"][1]["tensors"]["model.norm.weight"].update(shape=[7])),
                  "the manifest does not match"),
    "tensor missing from manifest": (lambda d: _manifest_edit(d, lambda m: m["ranks"][1]["tensors"].pop("model.norm.weight")),
                                     "not in layout.json"),
    "tensor in wrong file": (lambda d: _manifest_edit(d, lambda m: m["ranks"][1]["tensors"]["model.norm.weight"].update(
        file="rank-00000/model-00001-of-00001.safetensors")), "not in that file"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_layout_is_caught(sharded, case):
    edit, msg = CORRUPTIONS[case]
    load_rank(sharded, 1)  # fine before
    edit(sharded)
    with pytest.raises(GptOssFp8Error, match=msg) as ei:
        load_rank(sharded, 1)
    assert "\n" not in str(ei.value)


def test_sharded_resume_is_byte_identical(sources, tmp_path):
    src, _ = sources["tiny"]
    ref = tmp_path / "ref"
    convert_checkpoint(src, ref, tp=4, ep=2, shard_bytes=40_000)
    out = tmp_path / "cut"
    seen = [0]

    def stop(n):
        seen[0] += n
        if seen[0] > 300_000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, out, tp=4, ep=2, shard_bytes=40_000, progress=stop)
    assert not (out / "layout.json").exists() and not (out / "config.json").exists()
    convert_checkpoint(src, out, tp=4, ep=2, shard_bytes=40_000, resume=True)
    for f in sorted(ref.rglob("*")):
        if f.is_file():
            assert f.read_bytes() == (out / f.relative_to(ref)).read_bytes(), f
    shutil.rmtree(out)


@pytest.mark.parametrize("tp,ep", [(1, 1), (4, 2)])
def test_plan_matches_what_convert_writes(sources, tmp_path, tp, ep):
    """`plan` reads only config.json; its per-rank tensors and bytes are what convert writes."""
    from gptoss_fp8.config import GptOssConfig

    src, _ = sources["odd"]
    planned = plan(GptOssConfig.from_file(src / "config.json"), tp, ep)
    dst = tmp_path / "o"
    convert_checkpoint(src, dst, tp=tp, ep=ep)
    manifest = json.loads((dst / "layout.json").read_text())
    for r, tensors in enumerate(planned):
        listed = manifest["ranks"][r]["tensors"]
        assert [t.name for t in tensors] == list(listed)
        for t in tensors:
            assert list(t.shape) == listed[t.name]["shape"], t.name
        data = sum(t.nbytes for t in tensors)
        on_disk = sum(m["bytes"] for m in manifest["ranks"][r]["files"].values())
        assert data < on_disk < data + 64 * 1024  # the files add only their headers
