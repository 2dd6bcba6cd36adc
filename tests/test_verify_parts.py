"""The verdict's pieces on made-up tensors (fast, fresh random inputs): the combine check
(``parts.combine_error``) catches each way of getting the routing weights wrong and passes
bf16-level differences; ``compare_parts`` names the failing layer and part in forward order with
per-key limits; the noise estimate (verify/noise.py) gives the expected value on tensors of known
scale; a reference of another model is refused in one line before anything runs
(``reference.check_reference_matches``)."""

import math

import pytest
import torch

from gptoss_fp8 import spec
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.verify.noise import bf16_ulp, part_noise, store_floor, store_floors
from gptoss_fp8.verify.parts import COMBINE_LIMIT, FORWARD_ORDER, combine_error, compare_parts, target_routing


def _seed() -> int:
    return int(torch.randint(0, 10**6, (1,)))


def _logits(t, e, seed, scale=2.0):
    """Router-like bf16 logits [t, e] with no tie between the k-th and (k+1)-th of any token (k <= 4)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        x = (scale * torch.randn(t, e, generator=g)).bfloat16()
        top = torch.topk(x.float(), 5, dim=-1).values
        if bool((top[:, :-1] > top[:, 1:]).all()):
            return x


# ------------------------------------------------------------------------------------------------
# target_routing and combine_error


def test_target_routing_is_top_k_then_softmax_over_the_k():
    seed = _seed()
    g = _logits(40, 12, seed)
    ids, w = target_routing(g, 3)
    assert ids.dtype == torch.int64 and w.dtype == torch.bfloat16 and ids.shape == w.shape == (40, 3)
    want = torch.topk(g.float(), 3, dim=-1)
    assert torch.equal(ids, want.indices), seed  # sorted, largest first
    assert torch.allclose(w.float(), torch.softmax(want.values, -1), rtol=2**-7, atol=0), seed
    assert torch.allclose(w.float().sum(-1), torch.ones(40), atol=3 * 2**-8)


def test_combine_error_passes_faithful_routings():
    seed = _seed()
    t, e, k, h = 96, 16, 4, 64
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).bfloat16()
    wr = (torch.randn(e, h, generator=gen) / 4).bfloat16()
    br = torch.randn(e, generator=gen).bfloat16()
    logits, ids, w = spec.route(x, wr, br, k)  # our spec's router
    c = combine_error(logits, ids, w, k)
    assert c == {"rel_err": c["rel_err"], "tokens": t, "choice_differs": 0, "first_differing_token": None}
    assert c["rel_err"] <= COMBINE_LIMIT, (seed, c)
    # the same, target_routing's own: exactly 0
    assert combine_error(logits, *target_routing(logits, k), k)["rel_err"] == 0.0
    # the slots in another order (weights matched by expert id, not by slot): exactly 0
    perm = torch.argsort(torch.rand(t, k, generator=gen), dim=-1)
    assert combine_error(logits, ids.gather(1, perm), w.gather(1, perm), k)["rel_err"] == 0.0
    # a kernel taking the softmax from fp32 logits before their bf16 rounding, fp32 weights out
    f32 = x.float() @ wr.float().t() + br.float()
    top = torch.topk(f32, k, dim=-1)
    c = combine_error(f32.bfloat16(), top.indices, torch.softmax(top.values, -1), k)
    assert c["choice_differs"] == 0 and c["rel_err"] <= COMBINE_LIMIT, (seed, c)
    # each weight moved by one bf16 ulp, up or down
    up = torch.randint(0, 2, w.shape, generator=gen).bool()
    moved = torch.nextafter(w, torch.where(up, torch.tensor(2.0), torch.tensor(-2.0)).bfloat16())
    c = combine_error(logits, ids, moved, k)
    assert 0 < c["rel_err"] <= COMBINE_LIMIT and c["choice_differs"] == 0, (seed, c)


@pytest.mark.parametrize("bug", ["softmax_all_experts", "no_softmax", "softmax_in_fp8"])
def test_combine_error_catches_wrong_weights(bug):
    seed = _seed()
    t, e, k = 64, 16, 4
    logits = _logits(t, e, seed)
    ids = torch.topk(logits.float(), k, dim=-1).indices
    vals = logits.float().gather(1, ids)
    if bug == "softmax_all_experts":  # softmax over all E, then the top-k of it
        w = torch.softmax(logits.float(), -1).gather(1, ids)
    elif bug == "no_softmax":  # the raw logits as weights
        w = vals
    else:  # the k weights rounded to e4m3: 1/16 relative steps
        w = torch.softmax(vals, -1).to(torch.float8_e4m3fn).float()
    c = combine_error(logits, ids, w.bfloat16(), k)
    assert c["choice_differs"] == 0, c  # the choice is right: only the weights are wrong
    assert c["rel_err"] > COMBINE_LIMIT, (seed, bug, c)


def test_combine_error_catches_a_wrong_top_k_but_not_a_tie():
    seed = _seed()
    t, e, k = 48, 8, 2
    logits = _logits(t, e, seed)
    order = torch.topk(logits.float(), k + 1, dim=-1).indices
    wrong = order[:, [0, 2]]  # the k-th expert swapped for the (k+1)-th
    w = torch.softmax(logits.float().gather(1, wrong), -1).bfloat16()
    c = combine_error(logits, wrong, w, k)
    assert c["choice_differs"] == t and c["first_differing_token"] == 0, (seed, c)
    assert c["rel_err"] == 0.0  # weights are compared only where the choice agrees: none here
    # one token only, in the middle
    ids, wt = target_routing(logits, k)
    ids, wt = ids.clone(), wt.clone()
    ids[17], wt[17] = wrong[17], w[17]
    c = combine_error(logits, ids, wt, k)
    assert c["choice_differs"] == 1 and c["first_differing_token"] == 17 and c["rel_err"] == 0.0
    # a real tie between the k-th and (k+1)-th logits: either choice is right
    logits[17, order[17, 2]] = logits[17, order[17, 1]]
    c = combine_error(logits, ids, wt, k)
    assert c["choice_differs"] == 0 and c["first_differing_token"] is None, c


# ------------------------------------------------------------------------------------------------
# compare_parts on made-up captures


def _captures(seed, layers=2, t=32, h=24, e=8, k=2, noise=1e-3):
    """(target captures, ours, embedding): ours = the target + ``noise`` x what each part adds,
    our router logits equal the target's, our routing their top-k + softmax."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(t, h, generator=g)
    target, ours, x = {}, {"0.in": emb}, emb
    for i in range(layers):
        for part in ("attn", "mlp"):
            y = x + torch.randn(t, h, generator=g)
            target[f"{i}.{part}"] = y
            d = torch.randn(t, h, generator=g)
            ours[f"{i}.{part}"] = y + noise * (y - x).norm() / d.norm() * d
            x = y
        target[f"{i}.router"] = _logits(t, e, seed + i)
        ours[f"{i}.router"] = target[f"{i}.router"].clone()
        ours[f"{i}.ids"], ours[f"{i}.weights"] = target_routing(ours[f"{i}.router"], k)
    return target, ours


LIMITS = {"attn": 0.01, "mlp": 0.01, "router": 0.01}  # made-up limits for made-up captures


def test_compare_parts_rows_in_forward_order_and_a_clean_pass():
    seed = _seed()
    target, ours = _captures(seed)
    r = compare_parts(target, ours, 2, 2, LIMITS)
    assert r["passed"] and r["first_failing"] is None and not r["failures"], (seed, r["failures"])
    assert [(x["layer"], x["part"]) for x in r["parts"]] == [
        (i, p) for i in range(2) for p in sorted(("attn", "router", "combine", "mlp"), key=FORWARD_ORDER.get)]
    assert [x["part"] for x in r["parts"][:4]] == ["attn", "router", "combine", "mlp"]
    rows = {(x["layer"], x["part"]): x for x in r["parts"]}
    # the error is relative to what the part adds (1e-3 of it), not to the residual stream
    assert rows[(1, "mlp")]["rel_err"] == pytest.approx(1e-3, rel=1e-4)
    assert rows[(0, "combine")]["rel_err"] == 0.0 and rows[(0, "combine")]["limit"] == COMBINE_LIMIT
    assert rows[(0, "combine")]["choice_differs"] == 0 and rows[(0, "router")]["flipped"] == 0


def test_compare_parts_names_the_first_failing_part():
    seed = _seed()
    target, ours = _captures(seed)
    x0, y0 = target["0.attn"], target["0.mlp"]
    ours["0.mlp"] = y0 + 0.05 * (y0 - x0)  # layer 0's MoE
    x1, y1 = target["0.mlp"], target["1.attn"]
    ours["1.attn"] = y1 + 0.5 * (y1 - x1)  # and later, layer 1's attention
    r = compare_parts(target, ours, 2, 2, LIMITS)
    assert r["first_failing"] == {"layer": 0, "part": "mlp"}, (seed, r["failures"])
    assert r["failures"][0].startswith("layer 0 MoE: rel. err 0.05 > 0.01"), r["failures"]
    assert r["failures"][1].startswith("layer 1 attention: rel. err 0.5 > 0.01"), r["failures"]
    # per-key limits (the noise-following ones) replace the mode's, and the noise is reported beside
    r = compare_parts(target, ours, 2, 2, LIMITS, part_limits={"0.mlp": 0.06}, noise={"0.mlp": 0.02})
    assert r["first_failing"] == {"layer": 1, "part": "attn"}, r["failures"]
    rows = {(x["layer"], x["part"]): x for x in r["parts"]}
    assert rows[(0, "mlp")]["limit"] == 0.06 and rows[(0, "mlp")]["noise"] == 0.02 and rows[(0, "mlp")]["passed"]
    assert rows[(1, "attn")]["limit"] == LIMITS["attn"] and "noise" not in rows[(1, "attn")]


def test_compare_parts_names_a_router_error():
    seed = _seed()
    target, ours = _captures(seed)
    g = torch.Generator().manual_seed(seed + 7)
    t = target["1.router"].float()
    d = torch.randn(t.shape, generator=g)
    ours["1.router"] = (t + 0.1 * t.norm() / d.norm() * d).bfloat16()
    ours["1.ids"], ours["1.weights"] = target_routing(ours["1.router"], 2)  # our routing follows our logits
    r = compare_parts(target, ours, 2, 2, LIMITS)
    assert r["first_failing"] == {"layer": 1, "part": "router"}, (seed, r["failures"])
    assert len(r["failures"]) == 1 and r["failures"][0].startswith("layer 1 router: logits rel. err "), r["failures"]
    assert r["parts"][4 + FORWARD_ORDER["router"]]["rel_err"] == pytest.approx(0.1, rel=0.05)


@pytest.mark.parametrize("bug", ["softmax_all_experts", "wrong_choice"])
def test_compare_parts_names_a_combine_failure(bug):
    seed = _seed()
    target, ours = _captures(seed)
    logits = ours["1.router"].float()
    ids = torch.topk(logits, 2, dim=-1).indices
    if bug == "softmax_all_experts":
        ours["1.ids"], ours["1.weights"] = ids, torch.softmax(logits, -1).gather(1, ids).bfloat16()
    else:  # token 5 picks the third expert instead of the second
        third = torch.topk(logits, 3, dim=-1).indices[:, 2]
        ours["1.ids"] = ids.clone()
        ours["1.ids"][5, 1] = third[5]
    r = compare_parts(target, ours, 2, 2, LIMITS)
    assert r["first_failing"] == {"layer": 1, "part": "combine"}, (seed, r["failures"])
    assert len(r["failures"]) == 1
    line = r["failures"][0]
    assert line.startswith("layer 1 combine (top-k + softmax of the router logits): "), line
    if bug == "softmax_all_experts":
        assert "weights rel. err " in line and line.endswith(f" > {COMBINE_LIMIT:.3g}")
    else:
        assert line.endswith("1 token(s) routed to other experts than the top-k of our own logits (first: token 5)")
    # the router and MoE rows of that layer pass: only the combine is wrong
    rows = {(x["layer"], x["part"]): x for x in r["parts"]}
    assert rows[(1, "router")]["passed"] and rows[(1, "mlp")]["passed"] and not rows[(1, "combine")]["passed"]


# ------------------------------------------------------------------------------------------------
# noise.py on tensors of known scale


def test_part_noise_of_known_scale():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(32, 24, generator=g)
    target, a, b, x = {}, {"0.in": emb}, {"0.in": emb}, emb
    sizes = {}  # key -> (||what the target's block adds||, ||n||)
    for i in range(2):
        for part in ("attn", "mlp"):
            key = f"{i}.{part}"
            target[key] = x + torch.randn(32, 24, generator=g)
            n = torch.randn(32, 24, generator=g)
            a[key], b[key] = target[key] + n, target[key] - n  # ||a - b|| = 2 ||n||
            sizes[key] = (float((target[key].double() - x.double()).norm()), float(n.double().norm()))
            x = target[key]
    got = part_noise(a, b, target, 2)
    assert set(got) == {"0.attn", "0.mlp", "1.attn", "1.mlp"}
    for key, (d, n) in sizes.items():
        assert got[key] == pytest.approx(math.sqrt(2) * n / d, rel=1e-5), key  # 2 ||n|| / sqrt(2) / ||added||
    # the noise scales with the spread of the two runs; two equal runs have none
    a3 = {k: (target[k] + 3 * (v - target[k]) if k != "0.in" else v) for k, v in a.items()}
    got3 = part_noise(a3, b, target, 2)
    assert all(got3[k] == pytest.approx(2 * got[k], rel=1e-5) for k in got)  # (3n + n) / (n + n)
    assert set(part_noise(a, a, target, 2).values()) == {0.0}
    # a part missing from either run is not estimated
    del b["1.mlp"]
    assert set(part_noise(a, b, target, 2)) == {"0.attn", "0.mlp", "1.attn"}


def test_bf16_ulp_is_the_spacing_of_bf16():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, 20, (4096,), generator=g).float())).bfloat16()
    t = t[t != 0]
    up = torch.nextafter(t.abs(), torch.full_like(t, float("inf"))).double() - t.abs().double()
    assert torch.equal(bf16_ulp(t), up), seed


def test_store_floor_of_known_scale():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    n = 32 * 40
    # outputs with magnitudes in [1, 2): one bf16 ulp is 2^-7 on every element
    out = ((1 + 0.99 * torch.rand(32, 40, generator=g)) * (torch.randint(0, 2, (32, 40), generator=g) * 2 - 1)).bfloat16()
    delta = 0.05 * torch.randn(32, 40, generator=g)
    x_in = out.float() - delta
    want = 2**-7 * math.sqrt(n) / float(delta.double().norm())
    assert store_floor(x_in, out) == pytest.approx(want, rel=1e-6)
    # scale-free: the same stream 2^5 larger
    assert store_floor(x_in * 32, (out.float() * 32).bfloat16()) == pytest.approx(want, rel=1e-6)
    # a block that adds 10x more has a 10x smaller floor
    assert store_floor(out.float() - 10 * delta, out) == pytest.approx(want / 10, rel=1e-6)
    fl = store_floors({"0.attn": out, "0.mlp": out}, x_in, 1)
    assert set(fl) == {"0.attn", "0.mlp"} and fl["0.attn"] == pytest.approx(want, rel=1e-6)


# ------------------------------------------------------------------------------------------------
# A reference of another model: one line before anything runs


@pytest.fixture(scope="module")
def two_and_three_layers(tmp_path_factory):
    """A 2-layer source and its conversion, and a 3-layer source of the same shapes."""
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic

    root = tmp_path_factory.mktemp("refmatch")
    write_synthetic(root / "src2", "tiny", layers=2, seed=11)
    write_synthetic(root / "src3", "tiny", layers=3, seed=11)
    convert_checkpoint(root / "src2", root / "fp8")
    return root


def _ref_file(path, layers, vocab, t=6, h=8, e=4):
    from gptoss_fp8.verify.reference import Reference, save_reference

    hidden = {}
    for i in range(layers):
        hidden |= {f"{i}.attn": torch.randn(t, h).bfloat16(), f"{i}.mlp": torch.randn(t, h).bfloat16(),
                   f"{i}.router": torch.randn(t, e).bfloat16()}
    save_reference(Reference(torch.arange(t), torch.randn(t, vocab), hidden, "made up"), path)
    return path


def test_reference_of_another_model_is_one_line(two_and_three_layers, tmp_path):
    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.verify.reference import check_reference_matches

    root = two_and_three_layers
    ckpt = root / "fp8"
    cfg = Checkpoint.open(ckpt).config
    with pytest.raises(GptOssFp8Error) as e:
        check_reference_matches(root / "src3", cfg, ckpt)
    msg = str(e.value)
    assert "\n" not in msg and "num_hidden_layers 3 (reference) vs 2 (checkpoint)" in msg, msg
    assert str(root / "src3") in msg and str(ckpt) in msg
    assert msg.count("(reference)") == 1  # nothing else differs, nothing else named
    with pytest.raises(GptOssFp8Error, match=r"num_hidden_layers 3 \(reference\) vs 2 \(checkpoint\)"):
        check_reference_matches(root / "src3" / "original", cfg, ckpt)  # OpenAI's layout too
    # a reference file of another layer count, or another vocabulary
    with pytest.raises(GptOssFp8Error, match=r"num_hidden_layers 3 \(reference\) vs 2 \(checkpoint\)"):
        check_reference_matches(_ref_file(tmp_path / "r3.safetensors", 3, cfg.vocab_size), cfg, ckpt)
    with pytest.raises(GptOssFp8Error, match=rf"vocab_size {cfg.vocab_size + 1} \(reference\) vs {cfg.vocab_size}"):
        check_reference_matches(_ref_file(tmp_path / "v.safetensors", 2, cfg.vocab_size + 1), cfg, ckpt)
    # the right source, in either layout, and a reference file of the right model: nothing to say
    for ok in (root / "src2", root / "src2" / "original", _ref_file(tmp_path / "r2.safetensors", 2, cfg.vocab_size)):
        check_reference_matches(ok, cfg, ckpt)


def test_reference_of_another_model_fails_the_cli_in_one_line(two_and_three_layers, tmp_path):
    from typer.testing import CliRunner

    from gptoss_fp8.cli.main import app

    root = two_and_three_layers
    (tmp_path / "t.json").write_text("[1, 2, 3, 4]")
    r = CliRunner().invoke(app, ["verify-logits", str(root / "fp8"), "--reference", str(root / "src3"),
                                 "--tokens", str(tmp_path / "t.json"), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 1, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --reference "), r.output
    assert "num_hidden_layers 3 (reference) vs 2 (checkpoint)" in lines[0]
    assert not (tmp_path / "r.json").exists()  # nothing ran, nothing written
