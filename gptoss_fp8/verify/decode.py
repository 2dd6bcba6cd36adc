"""verify-logits ``--decode N``: the KV-cached decode against the same backend's full forward.

The last N tokens of the sequence are decoded one at a time after a prefill of the others
(``GptOss.prefill`` / ``GptOss.decode``), and every step is compared with the full-sequence
forward of the same mode at the same position, which the mode has just run anyway: the step's
logits, and the residual stream after each layer's attention and MoE (the decode step's
``capture`` against the forward's row at that position). Decode and forward are one model code
(``GptOss._run``); what differs is that attention reads the cache (a ring of ``sliding_window``
rows on sliding layers, the sinks once) and that every GEMM runs on one row, so a correct decode
agrees to accumulation noise (``thresholds.DECODE_LIMITS``). A cache, ring, RoPE-position or sink
bug acts at the first step that touches it, in attention: the first failing step and layer name it.

A step's errors are relative: ``||decode - forward|| / ||forward||`` of its logits row and of each
residual-stream row. The decode steps' logits are also compared with the reference's at the same
positions (KL, top-1), for information: the binding check against the reference stays the
teacher-forced verdict of the full forward (verify/parts.py).

Outputs of ``run_decode`` (all on CPU): ``logits`` float32 [N + 1, V] (row 0: the prefill's last
position, T - N - 1; row 1 + s: decode step s at position T - N + s), ``"{i}.attn"`` /
``"{i}.mlp"`` bf16 [N, H] and ``"{i}.router"`` bf16 [N, E] (the steps' captures), ``seconds``
float64 [2] (prefill, all decode steps).
"""

from __future__ import annotations

import time

import torch

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.verify.metrics import logit_metrics, point_order
from gptoss_fp8.verify.parts import routing_flips

PART_NAMES = {"attn": "attention", "mlp": "MoE", "router": "router"}


def check_decode_steps(n: int, n_tokens: int) -> None:
    """--decode N needs at least one prompt token to prefill: 1 <= N < T."""
    if n < 1 or n >= n_tokens:
        raise GptOssFp8Error(f"--decode {n}: give 1 to {n_tokens - 1} steps for these {n_tokens} tokens "
                             "(the prefill needs at least one token)")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run_decode(model, tokens: torch.Tensor, ops, n: int) -> dict[str, torch.Tensor]:
    """Prefill ``tokens[:T - n]`` (int [T]) then decode the last ``n`` one at a time with ``ops``;
    the logits and per-layer captures of every step (module docstring), on CPU."""
    n_tokens = int(tokens.shape[0])
    check_decode_steps(n, n_tokens)
    dev = next(iter(model.buffers())).device
    toks = tokens.to(dev)
    t0 = time.perf_counter()
    cache, last = model.prefill(toks[:n_tokens - n], ops, max_len=n_tokens)
    _sync(dev)
    t1 = time.perf_counter()
    rows, caps = [last], []
    for p in range(n_tokens - n, n_tokens):
        cap: dict[str, torch.Tensor] = {}
        rows.append(model.decode(cache, toks[p], ops, capture=cap))
        caps.append(cap)
    _sync(dev)
    t2 = time.perf_counter()
    out = {"logits": torch.cat(rows).float().cpu(), "seconds": torch.tensor([t1 - t0, t2 - t1], dtype=torch.float64)}
    for key in caps[0]:
        out[key] = torch.cat([c[key] for c in caps]).cpu()
    return out


def _row_rel_err(want: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Per row of [n, X]: ||got - want|| / ||want|| (float64 [n])."""
    w, g = want.double(), got.double()
    return (g - w).norm(dim=-1) / w.norm(dim=-1).clamp(min=1e-30)


def compare_decode(dec: dict[str, torch.Tensor], fwd_logits: torch.Tensor, fwd_hidden: dict[str, torch.Tensor],
                   n_layers: int, limits: dict[str, float], experts_per_token: int | None = None,
                   ref_logits: torch.Tensor | None = None, limits_profile: str = "",
                   spec_fallbacks: dict[str, int] | None = None, allow_fallback: bool = False) -> dict:
    """The ``decode`` section of a mode in the report: each decode step against the forward's row at
    its position, the first failing step and layer, and the steps' logits against the reference's
    (``ref_logits`` [T, V]), for information. ``limits`` (relative L2 errors of one step's rows):
    "logits"; "hidden", each layer's residual stream after its attention and after its MoE; "added",
    the growth of that error across one part (what the part itself adds: a decode bug acts in one
    part, while upstream noise carried along grows slowly); "router", a layer's router logits.

    Routing near-ties: a one-row GEMM rounds otherwise than a T-row one, and on random routers
    that can swap two nearly tied experts; the token's MoE output then changes wholesale (measured:
    rel. err up to 0.2 at that step, correct code). So each layer's router logits are checked too
    (relative error against the "hidden" limit), and a step whose layer-i router, within that limit,
    picks another expert set than the forward's is checked up to that router and not past it
    (``routing_near_tie``: the layer; ``routing_near_ties``: how many steps).
    ``spec_fallbacks`` (kernels mode): the decode's own hand-overs to the torch spec, failing the
    section unless ``allow_fallback``."""
    n = int(dec["logits"].shape[0]) - 1
    t = int(fwd_logits.shape[0])
    p0 = t - n  # position of decode step 0
    logit_err = _row_rel_err(fwd_logits[p0 - 1:], dec["logits"])  # [n + 1]: the prefill's, then the steps'
    points = [p for p in point_order(n_layers) if p in dec and p in fwd_hidden]
    hidden_err = {p: _row_rel_err(fwd_hidden[p][p0:], dec[p]) for p in points}  # each [n]

    steps, failing, near_ties = [], [], 0
    for s in range(n):
        # in forward order: each layer's attention stream, its router, its MoE stream; then the logits
        # prev: the error entering a part (layer 0's input, the embedding, is exact)
        checked, bad, tie, prev, router_max = [], [], None, 0.0, 0.0
        for p in points:
            layer, part = p.split(".")
            r = f"{layer}.router"
            if part == "mlp" and experts_per_token and r in dec and r in fwd_hidden:
                want, got = fwd_hidden[r][p0 + s:p0 + s + 1], dec[r][s:s + 1]
                e = float(_row_rel_err(want, got)[0])
                router_max = max(router_max, e)
                if not e <= limits["router"]:
                    bad.append((r, e, limits["router"], None))
                    break
                if routing_flips(want, got, experts_per_token)["flipped"]:
                    tie = int(layer)
                    break
            e = float(hidden_err[p][s])
            checked.append((p, e, e - prev))
            if not e <= limits["hidden"]:  # NaN fails
                bad.append((p, e, limits["hidden"], None))
                break
            if not e - prev <= limits["added"]:
                bad.append((p, e, limits["added"], e - prev))
                break
            prev = e
        le = float(logit_err[s + 1])
        if not bad and tie is None and not le <= limits["logits"]:
            bad.append(("logits", le, limits["logits"], None))
        worst = max(checked, key=lambda r: r[1], default=None)
        steps.append({"step": s, "position": p0 + s, "logits_rel_err": le,
                      "hidden_rel_err_max": worst[1] if worst else None,
                      "worst_point": _point(worst[0]) if worst else None,
                      "added_max": max((c[2] for c in checked), default=None), "router_rel_err_max": router_max,
                      "routing_near_tie": tie, "passed": not bad})
        near_ties += tie is not None
        if bad:
            failing.append((s, bad[0]))
    failures = []
    pre_err = float(logit_err[0])
    prefill = {"position": p0 - 1, "tokens": p0, "logits_rel_err": pre_err, "passed": pre_err <= limits["logits"]}
    if not prefill["passed"]:
        failures.append(f"decode: the prefill's last logits (position {p0 - 1}): rel. err {pre_err:.3g} > "
                        f"{limits['logits']:.3g} against the full forward")
    first = None
    if failing:
        s, (p, e, lim, added) = failing[0]
        first = {"step": s, "position": p0 + s, **_point(p)}
        what = f"rel. err {e:.3g} > {lim:.3g}" if added is None else f"rel. err {e:.3g}, {added:.3g} of it added here > {lim:.3g}"
        failures.append(f"decode step {s} (position {p0 + s}) {_where(p)}: {what} against the full forward")
        if len(failing) > 1:
            failures.append(f"decode: {len(failing)} of {n} steps fail (first {failing[0][0]}, last {failing[-1][0]})")
    fb = {op: c for op, c in (spec_fallbacks or {}).items() if c}
    if fb and not allow_fallback:
        failures += [f"decode {op}: {c} call(s) ran the torch spec instead of a kernel; pass --allow-fallback to accept"
                     for op, c in fb.items()]
    layers = []  # every step's error at each point (near-tie steps included), for information
    for p in points:
        e = hidden_err[p]
        layers.append({**_point(p), "rel_err_max": float(e.max()), "worst_step": int(e.argmax())})
    sec = {"steps": n, "prefill_tokens": p0, "passed": not failures, "failures": failures, "limits": dict(limits),
           "limits_profile": limits_profile, "compared_with": "the same mode's full forward",
           "prefill": prefill, "per_step": steps, "layers": layers, "first_failing": first,
           # the binding errors: steps with a routing near-tie count up to their router only
           "logits_rel_err_max": max((r["logits_rel_err"] for r in steps if r["routing_near_tie"] is None), default=0.0),
           "hidden_rel_err_max": max((r["hidden_rel_err_max"] for r in steps if r["hidden_rel_err_max"] is not None),
                                     default=None),
           "added_max": max((r["added_max"] for r in steps if r["added_max"] is not None), default=None),
           "router_rel_err_max": max(r["router_rel_err_max"] for r in steps),
           "routing_near_ties": near_ties}
    if spec_fallbacks is not None:
        sec["spec_fallbacks"] = dict(spec_fallbacks)
    secs = dec.get("seconds")
    if secs is not None:
        sec["seconds"] = {"prefill": float(secs[0]), "decode": float(secs[1]),
                          "decode_tokens_per_s": n / float(secs[1]) if float(secs[1]) > 0 else None}
    if ref_logits is not None:  # information: the decoded logits against the reference's
        s = logit_metrics(ref_logits[p0:], dec["logits"][1:])["summary"]
        sec["vs_reference"] = {k: s[k] for k in ("kl_mean", "kl_max", "top1_agreement", "top1_agreement_decisive",
                                                 "ties", "max_abs_delta")}
    return sec


def _point(p: str) -> dict:
    if p == "logits":
        return {"layer": None, "part": "logits"}
    layer, part = p.split(".")
    return {"layer": int(layer), "part": part}


def _where(p: str) -> str:
    if p == "logits":
        return "logits"
    layer, part = p.split(".")
    return f"layer {layer} {PART_NAMES[part]}" + (" logits" if part == "router" else "")


def summary_line(sec: dict) -> str:
    """One console line for a mode's decode section."""
    line = (f"        decode {sec['steps']} steps after a {sec['prefill_tokens']}-token prefill "
            f"{'PASS' if sec['passed'] else 'FAIL'} (vs the full forward, {sec['limits_profile']}): "
            f"logits rel. err max {sec['logits_rel_err_max']:.3g} (limit {sec['limits']['logits']:.3g})")
    if sec["hidden_rel_err_max"] is not None:
        line += f", layers max {sec['hidden_rel_err_max']:.3g} (limit {sec['limits']['hidden']:.3g})"
    if sec["routing_near_ties"]:
        line += f"; {sec['routing_near_ties']} step(s) with a routing near-tie (checked up to that router)"
    f = sec["first_failing"]
    if f:
        where = "logits" if f["layer"] is None else f"layer {f['layer']} {PART_NAMES[f['part']]}"
        line += f"; first failing: step {f['step']} {where}"
    vs = sec.get("vs_reference")
    if vs:
        line += f" | vs the reference: KL mean {vs['kl_mean']:.3g}, top-1 {vs['top1_agreement']:.3f}"
    s = sec.get("seconds")
    if s and s.get("decode_tokens_per_s"):
        line += f" | {s['decode_tokens_per_s']:.1f} tokens/s"
    return line
