"""Golden checks: small deterministic synthetic checkpoints and OpenAI-reference logits.

``golden/golden.json`` stores, per case, how to regenerate the synthetic MXFP4 source (preset,
seed, config overrides; ``write_synthetic`` is deterministic), the sha256 of its tensors (not the
weights), the token ids, and for every (conversion, tp, ep, mode) run the metrics measured at
``regen`` time with the drift limits ``check`` enforces. ``golden/<case>.reference.safetensors``
holds OpenAI's logits and hidden states on those tokens, on the source and on the source with the
default conversion's weight rounding (``expected.*``; see verify/reference.py for the format).

``check`` regenerates each source (its digest must match), re-runs OpenAI's reference when it is
installed (it must reproduce the stored logits to bf16 noise), converts, runs verify-logits
(tp 1, and tp 2 with ep 1 and 2 where the shape allows) and fails on any drift beyond the limits.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gptoss_fp8.errors import GptOssFp8Error

GOLDEN_FILE = "golden.json"
FORMAT = 1


@dataclass(frozen=True)
class Case:
    name: str
    seed: int
    n_tokens: int
    token_seed: int
    layers: int | None = None
    overrides: dict = field(default_factory=dict)
    preset: str = "tiny"


CASES = (
    Case("tiny", seed=1234, n_tokens=64, token_seed=7),  # 2 layers, 8 experts top-2, hidden 192, window 8
    Case("odd", seed=99, n_tokens=48, token_seed=8, layers=1,  # 1 layer, 3 experts top-1, hidden 96
         overrides={"hidden_size": 96, "intermediate_size": 288, "num_local_experts": 3, "num_experts_per_tok": 1}),
)
CONVERSIONS = {"exact": {"keep_attention_bf16": True}, "default": {"keep_attention_bf16": False}}
LAYOUTS = ((1, 1), (2, 1), (2, 2))
# Sharded layouts run on the exact conversion (where sharded must equal unsharded); the default
# (FP8 attention) conversion at tp 1. tests/test_model_sharded.py covers FP8 attention sharded.
SHARDED_CONVERSIONS = ("exact",)
MODES = ["weights", "w8a8"]


def default_dir() -> Path:
    """golden/ of the source tree this package runs from."""
    return Path(__file__).resolve().parents[2] / "golden"


def checkpoint_digest(root: Path) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes) of a checkpoint, in name order; file
    names, sharding and metadata do not enter it."""
    from safetensors import safe_open

    h = hashlib.sha256()
    entries = {}
    for f in sorted(Path(root).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118  (a safe_open handle is not iterable)
                entries[k] = f
    for k in sorted(entries):
        with safe_open(str(entries[k]), framework="pt") as sf:
            t = sf.get_tensor(k)
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def case_tokens(case: Case, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (case.n_tokens,), generator=torch.Generator().manual_seed(case.token_seed))


def _make_source(case: Case, dst: Path):
    from gptoss_fp8.convert.synth import write_synthetic

    return write_synthetic(dst, case.preset, seed=case.seed, layers=case.layers, layout="hf", **case.overrides)


def materialize(name: str, work: Path, conversion: str = "exact", tp: int = 1, ep: int = 1,
                golden_dir: Path | None = None) -> tuple[Path, Path]:
    """Golden case ``name`` on disk, for running verify-logits on it elsewhere (the GPU tests):
    regenerate its source under ``work/src`` once (the sha256 must match golden.json), convert it
    with ``conversion`` (a CONVERSIONS key) for tp/ep, and return (checkpoint dir, the stored
    OpenAI-reference file, whose tokens are the case's)."""
    from gptoss_fp8.convert.convert import convert_checkpoint

    golden_dir = Path(golden_dir or default_dir())
    entry = json.loads((golden_dir / GOLDEN_FILE).read_text())["cases"].get(name)
    if entry is None:
        raise GptOssFp8Error(f"no golden case {name!r}; cases: {', '.join(c.name for c in CASES)}")
    work = Path(work)
    src = work / "src"
    if not (src / "config.json").is_file():
        _make_source(Case(**entry["case"]), src)
        digest = checkpoint_digest(src)
        if digest != entry["source_sha256"]:
            raise GptOssFp8Error(f"golden {name}: regenerated source differs (sha256 {digest[:12]} != "
                                 f"{entry['source_sha256'][:12]}): synth drifted; run `gptoss-fp8 golden check`")
    dst = work / f"{conversion}-tp{tp}-ep{ep}"
    if not (dst / "config.json").is_file():
        convert_checkpoint(src, dst, **CONVERSIONS[conversion], **({"tp": tp, "ep": ep} if tp > 1 else {}))
    return dst, golden_dir / entry["reference"]


def _valid_layouts(cfg) -> list[tuple[int, int]]:
    from gptoss_fp8.parallel import check_layout

    out = []
    for tp, ep in LAYOUTS:
        try:
            check_layout(cfg, tp, ep)
        except GptOssFp8Error:
            continue
        out.append((tp, ep))
    return out


# The rounding of the default conversion (pow2 scales, FP8 attention): golden reference files hold
# OpenAI's logits on the source and on the source with this rounding applied.
DEFAULT_ROUNDING_KEY = "pow2/attention-fp8"


def _runs(src: Path, work: Path, cfg, ref_file: Path, tokens: torch.Tensor, layouts: list[tuple[int, int]]):
    """Yield (run key, report) for every conversion x layout, against the stored reference file."""
    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.verify.reference import reference_for
    from gptoss_fp8.verify.report import rounding_for
    from gptoss_fp8.verify.run import verify_checkpoint

    for conv, kw in CONVERSIONS.items():
        for tp, ep in layouts:
            if tp > 1 and conv not in SHARDED_CONVERSIONS:
                continue
            dst = work / f"{conv}-tp{tp}-ep{ep}"
            if tp == 1:
                convert_checkpoint(src, dst, **kw)
            else:
                convert_checkpoint(src, dst, tp=tp, ep=ep, **kw)
            ckpt = Checkpoint.open(dst)
            rounding, exact = rounding_for(ckpt)
            ref = reference_for(ref_file, tokens, rounding=None if exact else rounding)
            report, _ = verify_checkpoint(ckpt, ref, modes=MODES, tp=tp, ep=ep)
            yield f"{conv}/tp{tp}/ep{ep}", report


def _limits(s: dict, n_tokens: int) -> dict:
    """Drift limits around metrics measured at regen time."""
    return {
        "kl_mean": 1.5 * s["kl_mean"] + 1e-5,
        "kl_max": 1.5 * s["kl_max"] + 1e-4,
        "top1_min": max(0.0, s["top1_agreement"] - 2.0 / n_tokens),
        "max_abs_delta": 1.5 * s["max_abs_delta"] + 0.05,
    }


def regen(golden_dir: Path | None = None, log=print) -> dict:
    """Regenerate golden/: sources from seeds, OpenAI's reference logits, and measured expectations."""
    from gptoss_fp8.verify.reference import Rounding, reference_for, save_reference

    golden_dir = Path(golden_dir or default_dir())
    golden_dir.mkdir(parents=True, exist_ok=True)
    out = {"format": FORMAT, "note": "written by `gptoss-fp8 golden regen`; checked by `gptoss-fp8 golden check`",
           "cases": {}}
    for case in CASES:
        with tempfile.TemporaryDirectory(prefix=f"golden-{case.name}-") as tmp:
            work = Path(tmp)
            cfg = _make_source(case, work / "src")
            tokens = case_tokens(case, cfg.vocab_size)
            ref = reference_for(work / "src", tokens, rounding=Rounding.from_key(DEFAULT_ROUNDING_KEY))
            ref.source = f"golden:{case.name}"
            ref_file = f"{case.name}.reference.safetensors"
            save_reference(ref, golden_dir / ref_file)
            layouts = _valid_layouts(cfg)
            runs = {}
            for key, report in _runs(work / "src", work, cfg, golden_dir / ref_file, tokens, layouts):
                runs[key] = {}
                for mode in MODES:
                    s = report[mode]["summary"]
                    runs[key][mode] = {"profile": report[mode]["profile"], "passed": report[mode]["passed"],
                                       "measured": {k: s[k] for k in ("kl_mean", "kl_max", "top1_agreement", "max_abs_delta")},
                                       "limits": _limits(s, case.n_tokens)}
                log(f"{case.name} {key}: " + ", ".join(
                    f"{m} KL {runs[key][m]['measured']['kl_mean']:.3g} top-1 {runs[key][m]['measured']['top1_agreement']:.3f}"
                    for m in MODES))
            out["cases"][case.name] = {"case": asdict(case), "source_sha256": checkpoint_digest(work / "src"),
                                       "tokens": tokens.tolist(), "reference": ref_file, "runs": runs}
    (golden_dir / GOLDEN_FILE).write_text(json.dumps(out, indent=1) + "\n")
    return out


def check(golden_dir: Path | None = None, log=print, layouts: list[tuple[int, int]] | None = None) -> list[str]:
    """Run the golden checks; returns the list of failures (empty = pass)."""
    from gptoss_fp8.verify.metrics import logit_metrics
    from gptoss_fp8.verify.reference import load_reference_file
    from gptoss_fp8.verify.thresholds import DEFAULTS

    golden_dir = Path(golden_dir or default_dir())
    gf = golden_dir / GOLDEN_FILE
    if not gf.is_file():
        raise GptOssFp8Error(f"{gf}: not found; run `gptoss-fp8 golden regen` first")
    g = json.loads(gf.read_text())
    if g.get("format") != FORMAT:
        raise GptOssFp8Error(f"{gf}: format {g.get('format')} is not {FORMAT}; run `gptoss-fp8 golden regen`")
    failures: list[str] = []
    for name, entry in g["cases"].items():
        case = Case(**entry["case"])
        with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as tmp:
            work = Path(tmp)
            t0 = time.perf_counter()
            cfg = _make_source(case, work / "src")
            digest = checkpoint_digest(work / "src")
            if digest != entry["source_sha256"]:
                failures.append(f"{name}: regenerated synthetic source differs (sha256 {digest[:12]} != "
                                f"{entry['source_sha256'][:12]}): synth drifted")
                continue
            ref = load_reference_file(golden_dir / entry["reference"])
            tokens = torch.tensor(entry["tokens"], dtype=torch.long)
            if not torch.equal(ref.tokens, tokens):
                failures.append(f"{name}: {entry['reference']} holds other tokens than golden.json")
                continue
            try:
                from gptoss_fp8.verify.reference import Rounding, reference_for

                fresh = reference_for(work / "src", tokens, rounding=Rounding.from_key(DEFAULT_ROUNDING_KEY))
            except GptOssFp8Error:
                log(f"{name}: source sha256 ok; OpenAI reference not installed, using the stored logits only")
            else:
                ex, worst = DEFAULTS["exact"], 0.0
                for what, old, new in (("source", ref.logits, fresh.logits),
                                       ("rounded-weights", ref.expected.logits if ref.expected else None, fresh.expected.logits)):
                    if old is None:
                        failures.append(f"{name}: {entry['reference']} lacks the {what} logits; run `gptoss-fp8 golden regen`")
                        continue
                    s = logit_metrics(old, new)["summary"]
                    worst = max(worst, s["max_abs_delta"])
                    if s["kl_mean"] > ex.kl_mean or s["top1_agreement_decisive"] < 1.0:
                        failures.append(f"{name}: OpenAI's reference no longer reproduces the stored {what} logits "
                                        f"(KL mean {s['kl_mean']:.3g}, top-1 {s['top1_agreement']:.3f})")
                log(f"{name}: source sha256 ok; OpenAI reference reproduces the stored logits (max |dlogit| {worst:.3g})")
            want = layouts if layouts is not None else _valid_layouts(cfg)
            for key, report in _runs(work / "src", work, cfg, golden_dir / entry["reference"], tokens,
                                     [lo for lo in want if lo in _valid_layouts(cfg)]):
                exp = entry["runs"].get(key)
                if exp is None:
                    failures.append(f"{name} {key}: no stored expectation; run `gptoss-fp8 golden regen`")
                    continue
                for mode in MODES:
                    sec, e = report[mode], exp[mode]
                    s, lim = sec["summary"], e["limits"]
                    where = f"{name} {key} {mode}"
                    if sec["passed"] != e["passed"]:
                        failures.append(f"{where}: verify-logits {'passed' if sec['passed'] else 'failed'} "
                                        f"({'; '.join(sec['failures']) or 'no failures'}), "
                                        f"golden expects {'pass' if e['passed'] else 'fail'}")
                    for k, bad in (("kl_mean", s["kl_mean"] > lim["kl_mean"]), ("kl_max", s["kl_max"] > lim["kl_max"]),
                                   ("max_abs_delta", s["max_abs_delta"] > lim["max_abs_delta"])):
                        if bad:
                            failures.append(f"{where}: {k} {s[k]:.4g} drifted beyond {lim[k]:.4g} "
                                            f"(golden {e['measured'][k]:.4g})")
                    if s["top1_agreement"] < lim["top1_min"]:
                        failures.append(f"{where}: top1_agreement {s['top1_agreement']:.4f} < {lim['top1_min']:.4f} "
                                        f"(golden {e['measured']['top1_agreement']:.4f})")
                log(f"{name} {key}: " + ", ".join(f"{m} KL {report[m]['summary']['kl_mean']:.3g}" for m in MODES))
            log(f"{name}: {time.perf_counter() - t0:.1f} s")
    return failures
