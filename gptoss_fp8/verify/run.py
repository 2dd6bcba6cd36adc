"""verify-logits as a library: run our forward pass (any mode, any tp/ep), compare with the
reference, decide pass/fail, and build the JSON report."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from gptoss_fp8 import __version__
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.gptoss import load_model
from gptoss_fp8.model.parallel import Parallel
from gptoss_fp8.verify.backends import MODES, backend_device, ops_for, resolve_modes
from gptoss_fp8.verify.metrics import layer_errors, logit_metrics
from gptoss_fp8.verify.reference import Reference, Rounding
from gptoss_fp8.verify.thresholds import DEFAULTS, Thresholds, with_overrides


class ModeOutput(NamedTuple):
    """One mode's forward pass: logits float32 [T, V] on CPU, captures (model.gptoss.GptOss.forward),
    seconds, and for the kernels mode the calls each kernel op handed to the torch spec."""

    logits: torch.Tensor
    hidden: dict[str, torch.Tensor]
    seconds: float
    spec_fallbacks: dict[str, int] | None = None
    collective: str | None = None  # sharded runs: the torch.distributed backend the ranks used


Outputs = dict[str, ModeOutput]  # mode -> its output


# ----------------------------------------------------------------------------------------------
# Our forward pass, unsharded or over tp processes


def run_modes(model, tokens: torch.Tensor, modes: list[str]) -> Outputs:
    """Run one loaded model (any rank) once per mode (``backends.MODES``)."""
    out: Outputs = {}
    dev = next(iter(model.buffers())).device
    for mode in modes:
        cap: dict[str, torch.Tensor] = {}
        ops = ops_for(mode)
        t0 = time.perf_counter()
        logits = model(tokens.to(dev), ops, cap)
        if logits.is_cuda:
            torch.cuda.synchronize()
        out[mode] = ModeOutput(logits.float().cpu(), {k: v.cpu() for k, v in cap.items()}, time.perf_counter() - t0,
                               getattr(ops, "spec_fallbacks", None))
    return out


def _save_outputs(out: Outputs, path: Path, collective: str) -> None:
    from safetensors.torch import save_file

    t = {}
    for mode, o in out.items():
        t[f"{mode}/logits"] = o.logits.contiguous()
        t[f"{mode}/seconds"] = torch.tensor([o.seconds], dtype=torch.float64)
        t |= {f"{mode}/hidden.{k}": v.contiguous() for k, v in o.hidden.items()}
        t |= {f"{mode}/spec_fallbacks.{k}": torch.tensor([n]) for k, n in (o.spec_fallbacks or {}).items()}
    save_file(t, str(path), metadata={"collective": collective})


def _load_outputs(path: Path, modes: list[str]) -> Outputs:
    from safetensors import safe_open
    from safetensors.torch import load_file

    t = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        collective = (f.metadata() or {}).get("collective")
    out: Outputs = {}
    for mode in modes:
        pre, fb = f"{mode}/hidden.", f"{mode}/spec_fallbacks."
        fallbacks = {k[len(fb):]: int(v) for k, v in t.items() if k.startswith(fb)}
        out[mode] = ModeOutput(t[f"{mode}/logits"], {k[len(pre):]: v for k, v in t.items() if k.startswith(pre)},
                               float(t[f"{mode}/seconds"][0]), fallbacks if MODES[mode] == "triton" else None,
                               collective)
    return out


def _device_for(device: str, rank: int) -> str:
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise GptOssFp8Error(f"--device {device}: no CUDA GPU is visible; use --device cpu")
        return f"cuda:{rank % torch.cuda.device_count()}"
    return device


def _backend(dev: str, world: int) -> str:
    """NCCL with one GPU per rank; gloo on CPU, and when ranks share a GPU (NCCL refuses two ranks on
    one device; ``Parallel.all_reduce`` then stages the sums through host memory)."""
    return "nccl" if dev.startswith("cuda") and torch.cuda.device_count() >= world else "gloo"


def run_rank(job: dict) -> None:
    """One rank of a sharded run started by ``compute_outputs`` (``python -m gptoss_fp8.verify.run JOB``):
    join the process group from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, load this rank's
    tensors, run the modes; rank 0 writes the outputs (replicated after the all-reduces)."""
    import torch.distributed as dist

    rank, tp, ep = int(os.environ["RANK"]), int(job["tp"]), int(job["ep"])
    torch.set_num_threads(int(job.get("threads", 1)))
    dev = _device_for(job["device"], rank)
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    dist.init_process_group(_backend(dev, tp), init_method="env://", rank=rank, world_size=tp)
    try:
        model = load_model(Path(job["ckpt"]), Parallel(rank=rank, world=tp, tp=tp, ep=ep), dev)
        out = run_modes(model, torch.tensor(job["tokens"], dtype=torch.long), job["modes"])
        if rank == 0:
            _save_outputs(out, Path(job["result"]), dist.get_backend())
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compute_outputs(ckpt: Path, tokens: torch.Tensor, modes: list[str], tp: int = 1, ep: int = 1,
                    device: str = "cpu", timeout_s: float = 3600.0) -> Outputs:
    """Our logits and captures for each mode. tp > 1 starts tp worker processes (gloo on CPU,
    NCCL on GPUs), each loading only its rank's tensors; rank 0's outputs come back."""
    from gptoss_fp8.model.gptoss import resolve_layout

    resolve_layout(Path(ckpt), tp, ep)  # the checkpoint must have been converted for this layout
    modes = resolve_modes(modes, device)  # and every mode must be able to run on this device
    if tp == 1:
        return run_modes(load_model(ckpt, Parallel(), _device_for(device, 0)), tokens, modes)
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(prefix="gptoss-fp8-verify-") as tmp:
        job = {"ckpt": str(Path(ckpt).resolve()), "tokens": tokens.tolist(), "modes": modes, "tp": tp, "ep": ep,
               "device": device, "result": str(Path(tmp) / "outputs.safetensors"),
               "threads": max(1, (os.cpu_count() or 1) // tp)}
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        env = dict(os.environ, WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        procs = []
        for r in range(tp):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "gptoss_fp8.verify.run", str(Path(tmp) / "job.json")],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.DEVNULL,
                stderr=open(Path(tmp) / f"rank{r}.err", "w")))  # noqa: SIM115  (open while the worker runs)
        deadline = time.monotonic() + timeout_s
        failed = None
        while any(p.poll() is None for p in procs):
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad or time.monotonic() > deadline:
                failed = bad[0] if bad else -1
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.wait()
        if failed is None:
            failed = next((i for i, p in enumerate(procs) if p.returncode != 0), None)
        if failed is not None:
            if failed < 0:
                raise GptOssFp8Error(f"sharded run (tp {tp}) timed out after {timeout_s:.0f} s")
            err = (Path(tmp) / f"rank{failed}.err").read_text().strip().splitlines()
            last = err[-1] if err else f"exit code {procs[failed].returncode}"
            if "GptOssFp8Error:" in last:
                raise GptOssFp8Error(last.split("GptOssFp8Error:", 1)[1].strip())
            raise RuntimeError(f"rank {failed} of the sharded run failed:\n" + "\n".join(err[-30:]))
        return _load_outputs(Path(job["result"]), modes)


# ----------------------------------------------------------------------------------------------
# Comparison and report


def rounding_for(ckpt: Path) -> tuple[Rounding, bool]:
    """The weight rounding the checkpoint's conversion applied (scale mode from conversion.json or
    layout.json, FP8 attention from config.json), and whether conversion.json says every converted
    weight came out exact (then the rounding changes nothing and the source reference is the
    expected one)."""
    from gptoss_fp8.model.config import read_config_json
    from gptoss_fp8.model.gptoss import LAYOUT_NAME, attention_is_fp8

    ckpt = Path(ckpt)
    mode, exact = None, False
    for name, path in (("conversion.json", ("options", "scale_mode")), (LAYOUT_NAME, ("scale_mode",))):
        f = ckpt / name
        if mode is None and f.is_file():
            try:
                d = json.loads(f.read_text())
                mode = d[path[0]] if len(path) == 1 else d[path[0]][path[1]]
                if name == "conversion.json":
                    exact = float(d["exactness"]["overall"]["exact_fraction"]) == 1.0
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                mode = None
    if mode not in ("pow2", "amax"):
        mode = "pow2"
    return Rounding(mode, attention_is_fp8(read_config_json(ckpt / "config.json"))), exact


def profile_for(mode: str, ref: Reference, exact_conversion: bool, device: str = "cpu") -> tuple[str, str]:
    """Which threshold profile applies to ``mode``, against which reference, and why."""
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


def build_report(ckpt: Path, ref: Reference, outputs: Outputs, n_layers: int, *, tp: int, ep: int, device: str,
                 overrides: dict | None = None, seconds: float | None = None, tokens_from: str = "",
                 experts_per_token: int | None = None) -> dict:
    """The verify-logits JSON report: top-level ``passed``, one section per mode, and the kernels'
    agreement with their spec (``kernels_vs_w8a8``) when both ran."""
    report: dict = {
        "tool": "gptoss-fp8", "version": __version__, "passed": True,
        "checkpoint": str(Path(ckpt).resolve()), "reference": ref.source,
        "expected_rounding": ref.rounding.key() if ref.expected is not None else None,
        "tokens": {"count": int(ref.logits.shape[0]), "from": tokens_from},
        "vocab": int(ref.logits.shape[1]), "device": device,
        # the collective the ranks used (nccl: one GPU each; gloo: CPU, or ranks sharing a GPU)
        "parallel": {"tp": tp, "ep": ep, "collective": next((o.collective for o in outputs.values()), None)},
        "modes": list(outputs), "backends": {mode: MODES[mode] for mode in outputs},
    }
    if seconds is not None:
        report["model_seconds"] = seconds  # load + all modes' forward passes (+ process start when sharded)
    _, exact_conversion = rounding_for(ckpt)
    for mode, out in outputs.items():
        profile, why = profile_for(mode, ref, exact_conversion, device)
        th = with_overrides(DEFAULTS[profile], **(overrides or {}))
        target = ref.expected if ref.expected is not None else ref
        sec = compare_mode(target, out.logits, out.hidden, n_layers, th, exact=profile.startswith("exact"),
                           experts_per_token=experts_per_token)
        sec = {"backend": MODES[mode], "backend_device": backend_device(mode, device), "profile": profile,
               "profile_reason": why, "compared_with": "expected" if ref.expected is not None else "source", **sec}
        if out.spec_fallbacks is not None:
            sec["spec_fallbacks"] = out.spec_fallbacks
        if ref.expected is not None:  # the FP8 cost against the original model, for information
            vs = compare_mode(ref, out.logits, out.hidden, n_layers, DEFAULTS["lossy" if mode == "weights" else profile],
                              experts_per_token=experts_per_token)
            sec["vs_source"] = {"summary": vs["summary"], "per_position_kl": vs["per_position"]["kl"], "layers": vs["layers"]}
        if not target.hidden:
            sec["layers_note"] = "the reference file holds no hidden states: no per-layer errors"
        sec["forward_seconds"] = out.seconds
        report[mode] = sec
        report["passed"] = report["passed"] and sec["passed"]
    report["kernels_vs_w8a8"] = None
    if "kernels" in outputs and "w8a8" in outputs:
        agree = kernels_vs_spec(outputs["w8a8"], outputs["kernels"], n_layers, experts_per_token)
        report["kernels_vs_w8a8"] = agree
        report["passed"] = report["passed"] and agree["passed"]
    return report


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
            f"{mode:7s} {'PASS' if sec['passed'] else 'FAIL'} [{sec['backend']} ops on {sec.get('backend_device', report['device'])}] "
            f"({sec['profile']}, vs {sec['compared_with']}): KL mean {s['kl_mean']:.3g} "
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
            lines.append(f"        (vs the source: KL mean {v['kl_mean']:.3g} max {v['kl_max']:.3g} | top-1 {v['top1_agreement']:.4f} "
                         f"| max |dlogit| {v['max_abs_delta']:.3g}: the FP8 cost, for information)")
        lines += _detail_lines(sec)
    agree = report.get("kernels_vs_w8a8")
    if agree:
        s = agree["summary"]
        lines.append(f"kernels vs w8a8 {'PASS' if agree['passed'] else 'FAIL'} (triton against the torch spec): "
                     f"KL mean {s['kl_mean']:.3g} max {s['kl_max']:.3g} | top-1 {s['top1_agreement']:.4f} "
                     f"({s['top1_agreement_decisive']:.4f} without {s['ties']} near-ties) | logits rel. err {agree['logits_rel_err']:.3g}")
        lines += _detail_lines(agree, "the w8a8 spec")
    lines.append("PASSED" if report["passed"] else "FAILED")
    return lines


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
        lines.append(f"        tokens routed to other experts than {against}: " + ", ".join(f"L{n} {100 * f:.1f}%" for n, f in flips))
    return lines


def dump_paths(path: Path, modes: list[str]) -> dict[str, Path]:
    """--dump-logits FILE: one file for one mode; FILE.<mode>.safetensors for several."""
    path = Path(path)
    if len(modes) == 1:
        return {modes[0]: path}
    stem = path.name.removesuffix(".safetensors")
    return {m: path.with_name(f"{stem}.{m}.safetensors") for m in modes}


def dump_logits(outputs: Outputs, path: Path, tokens: torch.Tensor) -> list[Path]:
    from safetensors.torch import save_file

    written = []
    for mode, p in dump_paths(path, list(outputs)).items():
        p.parent.mkdir(parents=True, exist_ok=True)
        save_file({"logits": outputs[mode].logits.float().contiguous(), "tokens": tokens.long().contiguous()}, str(p),
                  metadata={"producer": f"gptoss-fp8 {__version__} verify-logits", "mode": mode, "backend": MODES[mode]})
        written.append(p)
    return written


def verify_checkpoint(ckpt: Path, ref: Reference, *, modes: list[str], tp: int = 1, ep: int = 1,
                      device: str = "cpu", overrides: dict | None = None, tokens_from: str = "") -> tuple[dict, Outputs]:
    """Run our model in each mode (tp/ep sharded when tp > 1) on the reference's tokens and report."""
    from gptoss_fp8.model.config import GptOssConfig

    cfg = GptOssConfig.from_file(Path(ckpt) / "config.json")
    if ref.logits.shape[1] != cfg.vocab_size:
        raise GptOssFp8Error(f"reference logits have vocab {ref.logits.shape[1]}, {ckpt} has vocab_size {cfg.vocab_size}; "
                             "is the reference for this model?")
    if ref.tokens.numel() and (int(ref.tokens.max()) >= cfg.vocab_size or int(ref.tokens.min()) < 0):
        raise GptOssFp8Error(f"token ids must lie in 0..{cfg.vocab_size - 1} for {ckpt}; got {int(ref.tokens.min())}..{int(ref.tokens.max())}")
    t0 = time.perf_counter()
    outputs = compute_outputs(Path(ckpt), ref.tokens, modes, tp, ep, device)
    total = time.perf_counter() - t0
    return build_report(ckpt, ref, outputs, cfg.num_hidden_layers, tp=tp, ep=ep, device=device,
                        overrides=overrides, seconds=total, tokens_from=tokens_from,
                        experts_per_token=cfg.num_experts_per_tok), outputs


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def verify_under_torchrun(ckpt: Path, reference: Path, tokens: torch.Tensor | None, *, modes: list[str], ep: int,
                          device: str, overrides: dict | None, tokens_from: str,
                          save_reference: Path | None = None) -> tuple[dict | None, Outputs | None, Reference | None]:
    """One rank of ``torchrun --nproc-per-node TP gptoss-fp8 verify-logits ...``: rank 0 runs the
    reference first (OpenAI's model reads torch.distributed's state when built, so it is built
    before the process group exists), every rank runs its shard, rank 0 reports. Returns
    (report, outputs, reference) on rank 0; other ranks get ({"passed": verdict}, None, None), the
    verdict broadcast from rank 0 so every process exits alike."""
    import torch.distributed as dist

    from gptoss_fp8.model.config import GptOssConfig
    from gptoss_fp8.model.gptoss import resolve_layout
    from gptoss_fp8.verify.reference import reference_for
    from gptoss_fp8.verify.reference import save_reference as save_ref

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    resolve_layout(Path(ckpt), world, ep)  # every rank fails alike, before any collective
    ref = None
    if rank == 0:
        rounding, exact = rounding_for(Path(ckpt))
        ref = reference_for(reference, tokens, device, None if exact else rounding)
        if save_reference is not None:
            save_ref(ref, save_reference)
    dev = _device_for(device, int(os.environ.get("LOCAL_RANK", rank)))
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    dist.init_process_group(_backend(dev, world), init_method="env://")
    try:
        n = torch.tensor([ref.tokens.numel() if ref is not None else 0])
        dist.broadcast(n, 0)
        toks = ref.tokens.clone() if ref is not None else torch.empty(int(n), dtype=torch.long)
        dist.broadcast(toks, 0)
        if world % ep:
            raise GptOssFp8Error(f"--ep {ep} must divide the world size {world}")
        model = load_model(Path(ckpt), Parallel(rank=rank, world=world, tp=world, ep=ep), dev)
        outputs = {m: o._replace(collective=dist.get_backend()) for m, o in run_modes(model, toks, modes).items()}
        report = None
        if rank == 0:
            cfg = GptOssConfig.from_file(Path(ckpt) / "config.json")
            report = build_report(ckpt, ref, outputs, cfg.num_hidden_layers, tp=world, ep=ep, device=device,
                                  overrides=overrides, tokens_from=tokens_from, experts_per_token=cfg.num_experts_per_tok)
        ok = torch.tensor([int(report["passed"]) if report else 0])
        dist.broadcast(ok, 0)
        if rank != 0:
            return {"passed": bool(ok.item()), "rank": rank}, None, None
        return report, outputs, ref
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # a worker of compute_outputs
    import sys

    run_rank(json.loads(Path(sys.argv[1]).read_text()))
