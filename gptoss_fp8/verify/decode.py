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
from gptoss_fp8.verify.metrics import logit_metrics
from gptoss_fp8.verify.parts import COMBINE_LIMIT, combine_error, target_routing

PART_NAMES = {"attn": "attention", "mlp": "MoE", "router": "router", "combine": "combine (top-k + softmax)"}


def check_decode_steps(n: int, n_tokens: int) -> None:
    """--decode N needs at least one prompt token to prefill: 1 <= N < T."""
    if n < 1 or n >= n_tokens:
        raise GptOssFp8Error(f"--decode {n}: give 1 to {n_tokens - 1} steps for these {n_tokens} tokens "
                             "(the prefill needs at least one token)")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def forced_row(forward: dict[str, torch.Tensor], p: int, n_layers: int, k: int, dev) -> dict[str, torch.Tensor]:
    """Teacher forcing for the decode step at position p: the full forward's own stream entering
    each layer i > 0 (``"{i}.in"``) and its MoE (``"{i}.attn"``), and the routing the forward used
    at p (its captured ``"{i}.ids"`` / ``"{i}.weights"``; ``target_routing`` of its router logits
    for captures without them), rows [1, ...]. The forward's own choice, not one recomputed from its
    logits: where two of them tie at the k-th place the two top-k's may pick differently, and the
    decode step would run other experts than the output it is compared with (0.43 measured)."""
    f = {}
    for i in range(n_layers):
        if i > 0:
            f[f"{i}.in"] = forward[f"{i - 1}.mlp"][p:p + 1].to(dev)
        f[f"{i}.attn"] = forward[f"{i}.attn"][p:p + 1].to(dev)
        if f"{i}.ids" in forward:
            f[f"{i}.ids"], f[f"{i}.weights"] = (forward[f"{i}.{key}"][p:p + 1].to(dev) for key in ("ids", "weights"))
        else:
            f[f"{i}.ids"], f[f"{i}.weights"] = target_routing(forward[f"{i}.router"][p:p + 1].to(dev), k)
    return f


def run_decode(model, tokens: torch.Tensor, ops, n: int,
               forward: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Prefill ``tokens[:T - n]`` (int [T]) then decode the last ``n`` one at a time with ``ops``;
    the logits and per-layer captures of every step (module docstring), on CPU. ``forward`` (the
    same mode's full-forward captures): every step teacher-forced on them (``forced_row``), so each
    part of each step runs on the forward's own inputs at that position and noise cannot carry
    from one part or step to the next; then also ``"0.in"`` (the steps' embedding rows)."""
    n_tokens = int(tokens.shape[0])
    check_decode_steps(n, n_tokens)
    dev = next(iter(model.buffers())).device
    toks = tokens.to(dev)
    cfg = model.cfg
    t0 = time.perf_counter()
    cache, last = model.prefill(toks[:n_tokens - n], ops, max_len=n_tokens)
    _sync(dev)
    t1 = time.perf_counter()
    rows, caps = [last], []
    for p in range(n_tokens - n, n_tokens):
        cap: dict[str, torch.Tensor] = {}
        force = None if forward is None else forced_row(forward, p, cfg.num_hidden_layers, cfg.num_experts_per_tok, dev)
        rows.append(model.decode(cache, toks[p], ops, capture=cap, force=force))
        caps.append(cap)
    _sync(dev)
    t2 = time.perf_counter()
    out = {"logits": torch.cat(rows).float().cpu(), "seconds": torch.tensor([t1 - t0, t2 - t1], dtype=torch.float64)}
    for key in caps[0]:
        out[key] = torch.cat([c[key] for c in caps]).cpu()
    if forward is not None:
        out["0.in"] = model.embed(toks[n_tokens - n:], ops).cpu()
    return out


def _row_rel_err(want: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Per row of [n, X]: ||got - want|| / ||want|| (float64 [n])."""
    w, g = want.double(), got.double()
    return (g - w).norm(dim=-1) / w.norm(dim=-1).clamp(min=1e-30)


def _row_part_err(x_in: torch.Tensor, want: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Per row: ||got - want|| / ||want - x_in||, the error relative to what the part adds (float64 [n])."""
    w = want.double()
    return (got.double() - w).norm(dim=-1) / (w - x_in.double()).norm(dim=-1).clamp(min=1e-30)


def step_points(n_layers: int) -> list[str]:
    """A step's checked points in forward order: each layer's attention, router, combine, MoE."""
    return [f"{i}.{p}" for i in range(n_layers) for p in ("attn", "router", "combine", "mlp")]


def compare_decode(dec: dict[str, torch.Tensor], fwd_logits: torch.Tensor, fwd_hidden: dict[str, torch.Tensor],
                   n_layers: int, limits: dict[str, float], experts_per_token: int | None = None,
                   ref_logits: torch.Tensor | None = None, limits_profile: str = "",
                   spec_fallbacks: dict[str, int] | None = None, allow_fallback: bool = False,
                   part_limits: dict[str, float] | None = None) -> dict:
    """The ``decode`` section of a mode in the report: each teacher-forced decode step (``run_decode``
    with ``forward``) against the forward's row at its position, part by part, the first failing
    step and part, and the steps' logits against the reference's (``ref_logits`` [T, V]), for
    information. ``limits``: "part", a part's error relative to what it adds on that row (the
    attention of layer i on the forward's stream entering layer i, its MoE on the forward's stream
    after attention and routing: noise cannot carry from one part or step to the next); "router",
    the relative error of a step's router logits; "logits", of the step's logits row (the last
    layer's output, itself forced, through the final norm and lm_head). ``part_limits``
    ("{i}.attn" / "{i}.mlp" -> limit) replace "part" where given (the FP8 modes' limits follow
    this run's noise, verify/noise.py). Each step's own expert choice and combine weights are
    checked against the top-k and softmax of its own router logits (``parts.combine_error``).
    ``spec_fallbacks`` (kernels mode): the decode's own hand-overs to the torch spec, failing the
    section unless ``allow_fallback``."""
    n = int(dec["logits"].shape[0]) - 1
    t = int(fwd_logits.shape[0])
    p0 = t - n  # position of decode step 0
    logit_err = _row_rel_err(fwd_logits[p0 - 1:], dec["logits"])  # [n + 1]: the prefill's, then the steps'
    errs: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        a, m, r = f"{i}.attn", f"{i}.mlp", f"{i}.router"
        x0 = dec["0.in"] if i == 0 else fwd_hidden[f"{i - 1}.mlp"][p0:]
        if a in dec:
            errs[a] = _row_part_err(x0, fwd_hidden[a][p0:], dec[a])
        if m in dec:
            errs[m] = _row_part_err(fwd_hidden[a][p0:], fwd_hidden[m][p0:], dec[m])
        if r in dec and r in fwd_hidden:
            errs[r] = _row_rel_err(fwd_hidden[r][p0:], dec[r])
    points = [p for p in step_points(n_layers) if p in errs or (p.endswith(".combine") and experts_per_token)]

    def limit_of(p: str) -> float:
        if p.endswith(".router"):
            return limits["router"]
        if p.endswith(".combine"):
            return COMBINE_LIMIT
        return (part_limits or {}).get(p, limits["part"])

    steps, failing = [], []
    for s in range(n):
        bad, worst, router_max = [], None, 0.0
        for p in points:
            layer, part = p.split(".")
            if part == "combine":
                ck = (f"{layer}.router", f"{layer}.ids", f"{layer}.weights")
                if not all(c in dec for c in ck):
                    continue
                c = combine_error(*(dec[x][s:s + 1] for x in ck), experts_per_token)
                e = c["rel_err"] + (1.0 if c["choice_differs"] else 0.0)  # another choice: fails outright
            else:
                e = float(errs[p][s])
            if part == "router":
                router_max = max(router_max, e)
            elif part != "combine" and (worst is None or e > worst[1]):
                worst = (p, e)
            if not e <= limit_of(p):  # NaN fails
                bad.append((p, e, limit_of(p)))
        le = float(logit_err[s + 1])
        if not le <= limits["logits"]:
            bad.append(("logits", le, limits["logits"]))
        steps.append({"step": s, "position": p0 + s, "logits_rel_err": le,
                      "part_rel_err_max": worst[1] if worst else None,
                      "worst_point": _point(worst[0]) if worst else None,
                      "router_rel_err_max": router_max, "passed": not bad})
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
        s, (p, e, lim) = failing[0]
        first = {"step": s, "position": p0 + s, **_point(p)}
        failures.append(f"decode step {s} (position {p0 + s}) {_where(p)}: rel. err {e:.3g} > {lim:.3g} "
                        "against the full forward")
        if len(failing) > 1:
            failures.append(f"decode: {len(failing)} of {n} steps fail (first {failing[0][0]}, last {failing[-1][0]})")
    fb = {op: c for op, c in (spec_fallbacks or {}).items() if c}
    if fb and not allow_fallback:
        failures += [f"decode {op}: {c} call(s) ran the torch spec instead of a kernel; pass --allow-fallback to accept"
                     for op, c in fb.items()]
    layers = []  # every step's error at each part, for information
    for p, e in errs.items():
        layers.append({**_point(p), "rel_err_max": float(e.max()), "worst_step": int(e.argmax()),
                       "limit": limit_of(p)})
    sec = {"steps": n, "prefill_tokens": p0, "passed": not failures, "failures": failures, "limits": dict(limits),
           "limits_profile": limits_profile, "teacher_forced": True,
           "compared_with": "the same mode's full forward, each part on the forward's own inputs at that position",
           "prefill": prefill, "per_step": steps, "layers": layers, "first_failing": first,
           "logits_rel_err_max": max((r["logits_rel_err"] for r in steps), default=0.0),
           "part_rel_err_max": max((r["part_rel_err_max"] for r in steps if r["part_rel_err_max"] is not None),
                                   default=None),
           "router_rel_err_max": max(r["router_rel_err_max"] for r in steps)}
    if part_limits:
        sec["part_limits"] = {k: v for k, v in part_limits.items() if k in errs}
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
            f"{'PASS' if sec['passed'] else 'FAIL'} (teacher-forced, vs the full forward, {sec['limits_profile']}): "
            f"logits rel. err max {sec['logits_rel_err_max']:.3g} (limit {sec['limits']['logits']:.3g})")
    worst = max(sec["layers"], key=lambda r: r["rel_err_max"] / max(r["limit"], 1e-30), default=None)
    if worst is not None:
        line += (f", worst part L{worst['layer']} {PART_NAMES[worst['part']]} {worst['rel_err_max']:.3g} "
                 f"(limit {worst['limit']:.3g})")
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
