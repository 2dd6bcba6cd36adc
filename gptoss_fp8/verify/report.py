"""The verify-logits verdict and report: compare each mode's logits and captures with the
reference (and the kernels with their spec), pass or fail against thresholds, the JSON report, its
terminal summary and the logits dump. Computing the outputs is verify/run.py's job."""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import torch

from gptoss_fp8 import __version__
from gptoss_fp8.checkpoint.checkpoint import Checkpoint
from gptoss_fp8.verify.backends import MODES, backend_device
from gptoss_fp8.verify.decode import compare_decode
from gptoss_fp8.verify.decode import summary_line as decode_summary_line
from gptoss_fp8.verify.metrics import layer_errors, logit_metrics
from gptoss_fp8.verify.noise import grid_noise, part_noise, store_floors
from gptoss_fp8.verify.parts import compare_parts
from gptoss_fp8.verify.reference import Reference, Rounding
from gptoss_fp8.verify.thresholds import (
    CROSS_DEVICE_FACTOR,
    DECODE_NOISE,
    DEFAULTS,
    NOISE_RULES,
    PART_LIMITS,
    SMOKE,
    Thresholds,
    decode_limits,
    decode_profile,
    noise_rule_key,
    with_overrides,
)


def smoke_failures(summary: dict) -> list[str]:
    """The loose check of free-running logits that stays binding beside the teacher-forced parts:
    garbage (non-finite or wholesale different logits) fails; random-router drift does not."""
    out = []
    if not all(math.isfinite(summary[k]) for k in ("kl_mean", "kl_max")):
        out.append("free-running logits are not finite")
    elif summary["kl_mean"] > SMOKE.kl_mean:
        out.append(f"free-running smoke check: kl_mean {summary['kl_mean']:.3g} > {SMOKE.kl_mean:g}")
    if summary["top1_agreement_decisive"] < SMOKE.top1_min:
        out.append(f"free-running smoke check: top-1 {summary['top1_agreement_decisive']:.3g} < {SMOKE.top1_min:g}")
    return out


class ModeOutput(NamedTuple):
    """One mode's forward pass: logits float32 [T, V] on CPU, captures (model.gptoss.GptOss.forward),
    seconds, and for the kernels mode the calls each kernel op handed to the torch spec."""

    logits: torch.Tensor
    hidden: dict[str, torch.Tensor]
    seconds: float
    spec_fallbacks: dict[str, int] | None = None
    collective: str | None = None  # sharded runs: the torch.distributed backend the ranks used
    # teacher-forced parts (verify/parts.py): our part outputs on the reference's inputs, and for
    # the kernels mode also on the w8a8 spec's own inputs (then compared with the spec's outputs)
    parts: dict[str, torch.Tensor] | None = None
    parts_vs_spec: dict[str, torch.Tensor] | None = None
    fallback_shapes: dict[str, list[str]] | None = None  # kernels mode: op -> shapes handed to the spec
    # --decode N: the KV-cached decode of the last N tokens (verify/decode.py ``run_decode``), and
    # for the kernels mode the decode's own hand-overs to the spec
    decode: dict[str, torch.Tensor] | None = None
    decode_fallbacks: dict[str, int] | None = None
    # FP8 modes with teacher-forced parts: the w8a8 spec's parts on two other activation grids
    # (verify/noise.py ``dither_parts``), whose difference is this run's FP8 noise per part
    dither: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
    # the w8a8 mode: its parts on the other activation grids (verify/noise.py GRIDS[1:]), through
    # the same ops hook: the verdict takes their mean (FP8 noise / sqrt(K), a bug stays whole)
    grids: list[dict[str, torch.Tensor]] | None = None


Outputs = dict[str, ModeOutput]  # mode -> its output


def rounding_for(ckpt: Checkpoint | Path) -> tuple[Rounding, bool]:
    """The weight rounding the checkpoint's conversion applied (its scale mode, FP8 attention or
    not), and whether conversion.json says every converted weight came out exact (then the rounding
    changes nothing and the source reference is the expected one)."""
    ckpt = Checkpoint.of(ckpt)
    return Rounding(ckpt.scale_mode, ckpt.attention_fp8), ckpt.exact_conversion


def profile_for(mode: str, ref: Reference, exact_conversion: bool, device: str = "cpu",
                attention: str = "bf16") -> tuple[str, str]:
    """Which threshold profile applies to ``mode``, against which reference, and why."""
    if mode == "weights" and attention != "bf16" and (ref.expected is not None or exact_conversion):
        return "attention-fp8", (f"--attention {attention}: the weights mode with FP8 prefill attention (spec.attention_fp8) "
                                 "against OpenAI's model on the expected weights (bf16 attention): the cost of FP8 "
                                 "attention alone, against measured bounds")
    profile, why = _profile_for(mode, ref, exact_conversion)
    ours = "cuda" if device.startswith("cuda") else "cpu"
    if profile == "exact" and ours != ref.device:
        return "exact-cross-device", (f"{why}; but OpenAI's model ran on {ref.device} and ours on {ours}: their bf16 "
                                      "GEMMs round differently, so bf16 noise plus rare router near-ties")
    return profile, why


def _profile_for(mode: str, ref: Reference, exact_conversion: bool) -> tuple[str, str]:
    if mode in ("w8a8", "kernels"):
        by = " computed by our Triton kernels (the triton ops backend)," if mode == "kernels" else ""
        if ref.expected is not None:
            return mode, (f"FP8 activations,{by} compared with OpenAI's model holding the same FP8-rounded weights: "
                          "the cost of quantizing activations, against generous measured bounds")
        return mode, (f"FP8 weights and activations,{by} compared with the source: the whole FP8 cost, "
                      "against generous measured bounds")
    if ref.expected is not None:
        return "exact", (f"compared with OpenAI's model holding the weights this conversion should produce "
                         f"({ref.rounding.key()}): must match to bf16 noise")
    if exact_conversion:
        return "exact", "conversion.json: every converted weight is exact, so logits must match the source to bf16 noise"
    return "lossy", ("the conversion rounded weights and no expected reference is available (a reference file made "
                     "without it): compared with the source against generous measured bounds")


def _divergence(layers: list[dict], th: Thresholds, exact: bool) -> dict | None:
    """Where the outputs part from the reference. Exact profile: the first capture point over the
    layer threshold (the noise floor is ~0, so the first one is the cause). Otherwise errors build up
    everywhere, so the part that adds the most error (and whether any point crosses the threshold)."""
    if not layers:
        return None
    if exact:
        for p in layers:
            if p["rel_err"] > th.layer_rel_err:
                return {"layer": p["layer"], "part": p["part"], "rel_err": p["rel_err"],
                        "reason": f"first point whose relative error exceeds {th.layer_rel_err:g}"}
        return None
    if max(p["rel_err"] for p in layers) <= th.layer_rel_err:
        return None
    p = max(layers, key=lambda p: p["added"])
    return _worst_part(p, f"errors exceed {th.layer_rel_err:g}; this part adds the most ({p['added']:.3g})")


def _worst_part(p: dict, why: str) -> dict:
    if p.get("routing_changed"):
        why += (f"; {100 * p['routing_changed']:.1f}% of tokens picked other experts than the reference here, "
                "so upstream error is amplified by routing")
    return {"layer": p["layer"], "part": p["part"], "rel_err": p["rel_err"], "reason": why}


def _largest_source(layers: list[dict]) -> dict | None:
    if not layers:
        return None
    p = max(layers, key=lambda p: p["added"])
    return {"layer": p["layer"], "part": p["part"], "added": p["added"]}


def compare_mode(ref: Reference, logits: torch.Tensor, hidden: dict[str, torch.Tensor], n_layers: int,
                 th: Thresholds, exact: bool = False, experts_per_token: int | None = None) -> dict:
    """One mode's section of the report (without profile fields)."""
    m = logit_metrics(ref.logits, logits)
    s = m["summary"]
    layers = layer_errors(ref.hidden, hidden, n_layers, experts_per_token)
    failures = []
    if s["kl_mean"] > th.kl_mean:
        failures.append(f"kl_mean {s['kl_mean']:.3g} > {th.kl_mean:g}")
    if s["kl_max"] > th.kl_max:
        failures.append(f"kl_max {s['kl_max']:.3g} > {th.kl_max:g}")
    if s["top1_agreement_decisive"] < th.top1_min:
        failures.append(f"top1_agreement_decisive {s['top1_agreement_decisive']:.4g} < {th.top1_min:g} "
                        f"(over the {len(ref.logits) - s['ties']} positions that are not near-ties)")
    div = _divergence(layers, th, exact)
    if failures and div is None and layers:
        p = max(layers, key=lambda p: p["added"])
        div = _worst_part(p, f"no point exceeds the layer threshold; this part adds the most error ({p['added']:.3g})")
    return {"passed": not failures, "failures": failures, "thresholds": th.to_dict(), "summary": s,
            "per_position": m["per_position"], "layers": layers, "divergence": div,
            "largest_error_source": _largest_source(layers)}


def build_report(ckpt: Checkpoint, ref: Reference, outputs: Outputs, n_layers: int, *, tp: int, ep: int, device: str,
                 overrides: dict | None = None, seconds: float | None = None, tokens_from: str = "",
                 experts_per_token: int | None = None, allow_fallback: bool = False, attention: str = "bf16") -> dict:
    """The verify-logits JSON report: top-level ``passed``, one section per mode, and the kernels'
    agreement with their spec (``kernels_vs_w8a8``) when both ran. A section passes when its
    teacher-forced parts (``teacher_forced``: every layer's attention, MoE and router on the
    target's own inputs, against ``thresholds.PART_LIMITS``) and the free-running smoke check pass;
    the kernels mode also fails on any fallback to the spec unless ``allow_fallback``. ``attention``
    "fp8": every mode ran FP8 prefill attention; the weights mode is judged by the ``attention-fp8``
    profile (the FP8 modes' noise grids redraw the attention's FP8 rounding too, verify/noise.py)."""
    report: dict = {
        "tool": "gptoss-fp8", "version": __version__, "passed": True,
        "checkpoint": str(ckpt.path.resolve()), "reference": ref.source,
        "expected_rounding": ref.rounding.key() if ref.expected is not None else None,
        "tokens": {"count": int(ref.logits.shape[0]), "from": tokens_from},
        "vocab": int(ref.logits.shape[1]), "device": device, "attention": attention,
        # the collective the ranks used (nccl: one GPU each; gloo: CPU, or ranks sharing a GPU)
        "parallel": {"tp": tp, "ep": ep, "collective": next((o.collective for o in outputs.values()), None)},
        "modes": list(outputs), "backends": {mode: MODES[mode] for mode in outputs},
        # --decode N (verify/decode.py): each mode section then holds ``decode``
        "decode_steps": next((int(o.decode["logits"].shape[0]) - 1 for o in outputs.values() if o.decode is not None),
                             None),
    }
    if seconds is not None:
        report["model_seconds"] = seconds  # load + all modes' forward passes (+ process start when sharded)
    _, exact_conversion = rounding_for(ckpt)
    free_overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    part_override = free_overrides.pop("part_rel_err", None)
    free_binding = bool(free_overrides)  # the user set free-running thresholds: they apply
    for mode, out in outputs.items():
        profile, why = profile_for(mode, ref, exact_conversion, device, attention)
        th = with_overrides(DEFAULTS[profile], **free_overrides)
        target = ref.expected if ref.expected is not None else ref
        sec = compare_mode(target, out.logits, out.hidden, n_layers, th, exact=profile.startswith("exact"),
                           experts_per_token=experts_per_token)
        sec = {"backend": MODES[mode], "backend_device": backend_device(mode, device), "profile": profile,
               "profile_reason": why, "compared_with": "expected" if ref.expected is not None else "source", **sec}
        fallback_failures = []
        if out.spec_fallbacks is not None:
            sec["spec_fallbacks"] = out.spec_fallbacks
            sec["fallback_shapes"] = out.fallback_shapes or {}
            fb = {op: n for op, n in out.spec_fallbacks.items() if n}
            if fb and not allow_fallback:
                fallback_failures = [
                    f"{op}: {n} call(s) ran the torch spec instead of a kernel (shapes "
                    f"{', '.join((out.fallback_shapes or {}).get(op, [])) or '?'}); pass --allow-fallback to accept"
                    for op, n in fb.items()]
        noise = floors = None
        ours_parts = out.parts
        one_grid = None  # the part noise of one activation grid (the decode limits follow it)
        if out.parts is not None and (ref.expected is not None or exact_conversion):
            # this run's FP8 noise per part (verify/noise.py): the FP8 modes' limits follow it
            if out.grids:  # w8a8: the mean over the grids is judged, against the noise of a mean
                mean, one_grid = grid_noise([out.parts, *out.grids], target.hidden, n_layers)
                ours_parts = out.parts | mean
                k = 1 + len(out.grids)
                noise = {key: v / math.sqrt(k) for key, v in one_grid.items()}
            elif out.dither is not None:
                noise = one_grid = part_noise(*out.dither, target.hidden, n_layers)
            if noise is not None:
                floors = store_floors(target.hidden, out.parts["0.in"], n_layers)
        if out.parts is not None and experts_per_token:
            # The verdict: the teacher-forced parts (+ fallbacks + a loose smoke check of the
            # free-running logits); the free-running comparison under the profile's thresholds
            # stays as information, binding only when its thresholds were overridden.
            ours = "cuda" if device.startswith("cuda") else "cpu"
            # both on the CPU, exact is bit-identical there: the tighter bound
            part_profile = "exact-cpu" if profile == "exact" and ours == ref.device == "cpu" else profile
            limits = dict(PART_LIMITS[part_profile])
            cross = ref.device != ours and not profile.startswith("exact")
            if cross:  # the reference's own bf16 GEMMs rounded on another device type
                floor = PART_LIMITS["exact-cross-device"]
                limits = {k: max(v * CROSS_DEVICE_FACTOR, floor[k]) for k, v in limits.items()}
            part_limits = None
            # the weights mode under --attention fp8: FP8 attention's own noise (its dither)
            rule_key = profile if profile == "attention-fp8" else noise_rule_key(mode, device)
            if noise is not None:
                rule = NOISE_RULES[rule_key]
                part_limits = {k: rule.limit(k.split(".")[1], v, floors[k]) for k, v in noise.items()}
                if cross:
                    part_limits = {k: max(v, PART_LIMITS["exact-cross-device"][k.split(".")[1]]) for k, v in part_limits.items()}
            if part_override is not None:
                limits, part_limits = dict.fromkeys(limits, part_override), None
            tf = compare_parts(target.hidden, ours_parts, n_layers, experts_per_token, limits, part_limits, noise,
                               target.logits)
            if out.grids and part_limits:
                tf["grids"] = 1 + len(out.grids)  # the attention / MoE rows: the mean over this many grids
            for r in tf["parts"]:
                if floors and f"{r['layer']}.{r['part']}" in floors:
                    r["store_floor"] = floors[f"{r['layer']}.{r['part']}"]
            tf["limits_profile"] = (f"{rule_key} (this run's FP8 noise x k + floors)"
                                    if part_limits else part_profile)
            tf["limits_profile"] += " x cross-device" if cross else ""
            sec["teacher_forced"] = tf
            sec["free_running"] = {"passed": sec["passed"], "failures": sec["failures"], "binding": free_binding}
            smoke = smoke_failures(sec["summary"])
            sec["failures"] = tf["failures"] + fallback_failures + smoke + (sec["failures"] if free_binding else [])
            sec["passed"] = not sec["failures"]
        else:  # no hidden states in the reference: the free-running comparison decides
            sec["failures"] = sec["failures"] + fallback_failures
            sec["passed"] = sec["passed"] and not fallback_failures
        if ref.expected is not None:  # the FP8 cost against the original model, for information
            vs = compare_mode(ref, out.logits, out.hidden, n_layers, DEFAULTS["lossy" if mode == "weights" else profile],
                              experts_per_token=experts_per_token)
            sec["vs_source"] = {"summary": vs["summary"], "per_position_kl": vs["per_position"]["kl"], "layers": vs["layers"]}
        if not target.hidden:
            sec["layers_note"] = "the reference file holds no hidden states: no per-layer errors"
        if out.decode is not None:  # --decode N: the cached decode against this mode's full forward
            dprof = decode_profile(mode, device)
            dec_limits = None
            if one_grid is not None and dprof in DECODE_NOISE:
                rule = DECODE_NOISE[dprof]
                dec_limits = {k: rule.limit(k.split(".")[1], v, floors[k]) for k, v in one_grid.items()}
            dec = compare_decode(out.decode, out.logits, out.hidden, n_layers, decode_limits(mode, device),
                                 experts_per_token, target.logits, dprof, out.decode_fallbacks, allow_fallback,
                                 part_limits=dec_limits)
            sec["decode"] = dec
            sec["failures"] = sec["failures"] + dec["failures"]
            sec["passed"] = sec["passed"] and dec["passed"]
        sec["forward_seconds"] = out.seconds
        report[mode] = sec
        report["passed"] = report["passed"] and sec["passed"]
    report["kernels_vs_w8a8"] = None
    if "kernels" in outputs and "w8a8" in outputs:
        agree = kernels_vs_spec(outputs["w8a8"], outputs["kernels"], n_layers, experts_per_token)
        vs = outputs["kernels"].parts_vs_spec
        if vs is not None and experts_per_token:
            agree["free_running"] = {"passed": agree["passed"], "failures": agree["failures"], "binding": False}
            agree["failures"] = smoke_failures(agree["summary"])
            agree["passed"] = not agree["failures"]
            key = "kernels_vs_w8a8" if device.startswith("cuda") else "kernels_vs_w8a8-interpreter"
            spec_floors = store_floors(outputs["w8a8"].hidden, vs["0.in"], n_layers)
            kd = outputs["kernels"].dither
            n1 = part_noise(*kd, target_of(ref).hidden, n_layers) if kd is not None else {}
            rule = NOISE_RULES[key]
            # (no noise measured: the table, PART_LIMITS[key])
            vs_limits = {k: rule.limit(k.split(".")[1], n1[k], f) for k, f in spec_floors.items()} if n1 else None
            tf = compare_parts(outputs["w8a8"].hidden, vs, n_layers, experts_per_token, PART_LIMITS[key], vs_limits,
                               target_logits=outputs["w8a8"].logits)
            tf["limits_profile"] = key
            agree["teacher_forced"] = tf
            agree["failures"] = agree["failures"] + tf["failures"]
            agree["passed"] = agree["passed"] and tf["passed"]
        report["kernels_vs_w8a8"] = agree
        report["passed"] = report["passed"] and agree["passed"]
    return report


def target_of(ref: Reference) -> Reference:
    return ref.expected if ref.expected is not None else ref


def kernels_vs_spec(spec: ModeOutput, kernels: ModeOutput, n_layers: int, experts_per_token: int | None = None) -> dict:
    """The kernels' agreement with the torch w8a8 spec on the same weights and tokens: the metrics of a
    mode section with the spec's logits and captures in the reference's place, the relative
    Frobenius error of the logits (``logits_rel_err``), and pass/fail against
    ``thresholds.DEFAULTS["kernels_vs_w8a8"]`` (not changed by the threshold overrides, which are
    about the checkpoint)."""
    base = Reference(tokens=torch.empty(0, dtype=torch.long), logits=spec.logits, hidden=spec.hidden, source="w8a8 mode")
    sec = compare_mode(base, kernels.logits, kernels.hidden, n_layers, DEFAULTS["kernels_vs_w8a8"],
                       experts_per_token=experts_per_token)
    a, b = spec.logits.double(), kernels.logits.double()
    return {"compared": "kernels (ours) against w8a8 (as the reference): KL(w8a8 || kernels)",
            "passed": sec["passed"], "failures": sec["failures"], "thresholds": sec["thresholds"],
            "summary": sec["summary"], "logits_rel_err": float((b - a).norm() / a.norm().clamp(min=1e-30)),
            "per_position_kl": sec["per_position"]["kl"], "layers": sec["layers"], "divergence": sec["divergence"],
            "largest_error_source": sec["largest_error_source"]}


def summary_lines(report: dict) -> list[str]:
    """A few human lines for the terminal."""
    lines = []
    for mode in report["modes"]:
        sec = report[mode]
        s = sec["summary"]
        lines.append(
            f"{mode:7s} {'PASS' if sec['passed'] else 'FAIL'} [{sec['backend']} ops on "
            f"{sec.get('backend_device', report['device'])}] "
            f"(limits for {sec['profile']}, vs {sec['compared_with']}): KL mean {s['kl_mean']:.3g} "
            f"p95 {s['kl_p95']:.3g} max {s['kl_max']:.3g} | top-1 {s['top1_agreement']:.4f} "
            f"({s['top1_agreement_decisive']:.4f} without {s['ties']} near-ties) | "
            f"top-5 overlap {s['top5_overlap']:.4f} | max |dlogit| {s['max_abs_delta']:.3g} | cosine min {s['cosine_min']:.6f}"
        )
        fb = {op: n for op, n in (sec.get("spec_fallbacks") or {}).items() if n}
        if fb:
            lines.append("        warning: these kernel ops ran the torch spec instead (shapes or device outside the kernels' "
                         "limits): " + ", ".join(f"{op} {n} call(s)" for op, n in fb.items()))
        vs = sec.get("vs_source")
        if vs:
            v = vs["summary"]
            lines.append(f"        (vs the source: KL mean {v['kl_mean']:.3g} max {v['kl_max']:.3g} "
                         f"| top-1 {v['top1_agreement']:.4f} "
                         f"| max |dlogit| {v['max_abs_delta']:.3g}: the FP8 cost, for information)")
        lines += _parts_lines(sec)
        if sec.get("decode"):
            lines.append(decode_summary_line(sec["decode"]))
        lines += _detail_lines(sec)
    agree = report.get("kernels_vs_w8a8")
    if agree:
        s = agree["summary"]
        lines.append(f"kernels vs w8a8 {'PASS' if agree['passed'] else 'FAIL'} (triton against the torch spec): "
                     f"KL mean {s['kl_mean']:.3g} max {s['kl_max']:.3g} | top-1 {s['top1_agreement']:.4f} "
                     f"({s['top1_agreement_decisive']:.4f} without {s['ties']} near-ties) "
                     f"| logits rel. err {agree['logits_rel_err']:.3g}")
        lines += _parts_lines(agree)
        lines += _detail_lines(agree, "the w8a8 spec")
    lines.append("PASSED" if report["passed"] else "FAILED")
    return lines


def _parts_lines(sec: dict) -> list[str]:
    """The teacher-forced verdict of a section: the worst error of each kind of part against its
    limit, and the first failing part (the failures themselves are listed with the others)."""
    tf = sec.get("teacher_forced")
    if not tf:
        return []
    worst = []
    for part, label in (("attn", "attention"), ("mlp", "MoE"), ("router", "router"), ("combine", "combine"),
                        ("logits", "logits")):
        rows = [r for r in tf["parts"] if r["part"] == part]
        if rows:
            r = max(rows, key=lambda r: r["rel_err"] / max(r["limit"], 1e-30))
            worst.append(f"{label} {r['rel_err']:.3g} (L{r['layer']}, limit {r['limit']:.3g})")
    line = f"        teacher-forced parts {'PASS' if tf['passed'] else 'FAIL'}: worst " + ", ".join(worst)
    if tf["first_failing"]:
        f = tf["first_failing"]
        line += f"; first failing: layer {f['layer']} {f['part']}"
    return [line]


def _detail_lines(sec: dict, against: str = "the reference") -> list[str]:
    """Failures, divergence, per-layer error and routing lines of one section."""
    lines = [f"        fail: {f}" for f in sec["failures"]]
    d = sec.get("divergence")
    if d:
        lines.append(f"        diverges at layer {d['layer']} ({d['part']}): relative error {d['rel_err']:.3g} ({d['reason']})")
    src = sec.get("largest_error_source")
    if src and sec["layers"] and src["added"] > 0:
        worst = ", ".join(f"L{p['layer']}.{p['part']} {p['rel_err']:.2g}" for p in sec["layers"][-2:])
        lines.append(f"        hidden rel. error at the last layer: {worst}; largest step: layer {src['layer']} ({src['part']})")
    flips = [(p["layer"], p["routing_changed"]) for p in sec["layers"] if p.get("routing_changed")]
    if flips:
        lines.append(f"        tokens routed to other experts than {against}: "
                     + ", ".join(f"L{n} {100 * f:.1f}%" for n, f in flips))
    return lines


def dump_paths(path: Path, modes: list[str]) -> dict[str, Path]:
    """--dump-logits FILE: one file for one mode; FILE.<mode>.safetensors for several."""
    path = Path(path)
    if len(modes) == 1:
        return {modes[0]: path}
    stem = path.name.removesuffix(".safetensors")
    return {m: path.with_name(f"{stem}.{m}.safetensors") for m in modes}


def dump_logits(outputs: Outputs, path: Path, tokens: torch.Tensor, *, overwrite: bool = False) -> list[Path]:
    """Write each mode's logits (float32 [T, V], key ``logits``) and the tokens (int64 [T]) as
    safetensors at ``dump_paths(path, modes)``, each atomically; an existing file is replaced only
    with ``overwrite`` (checkpoint.outputs). Returns the paths written."""
    from safetensors.torch import save_file

    from gptoss_fp8.checkpoint.outputs import atomic_output

    written = []
    for mode, p in dump_paths(path, list(outputs)).items():
        with atomic_output(p, overwrite=overwrite) as tmp:  # save_file writes to the file: no bytes copy in RAM
            save_file({"logits": outputs[mode].logits.float().contiguous(), "tokens": tokens.long().contiguous()}, str(tmp),
                      metadata={"producer": f"gptoss-fp8 {__version__} verify-logits", "mode": mode, "backend": MODES[mode]})
        written.append(p)
    return written
