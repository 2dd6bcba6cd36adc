"""Teacher-forced parts: each layer's attention block and MoE block run on the target's own input.

A free-running comparison lets errors compound: on random routers a bf16-level difference sends a
token to other experts and the logits move more than most kernel bugs would move them. Here every
part gets the target's input to that part (the captured residual stream), so an error stays
where it is made:

* ``{i}.attn``: ``model.attention_part(i, x)`` with x the target's stream entering layer i (the
  embedding for layer 0, which is an exact copy in every mode), compared with the target's stream
  after layer i's attention;
* ``{i}.mlp``: ``model.moe_part(i, x, routing=...)`` with x the target's stream after layer i's
  attention and the target's own routing (``target_routing``: top-k of its router logits, softmax
  over the k, written here as OpenAI's MLPBlock writes it, not with our spec), so the expert FFN,
  the weighted combine and the residual add are judged on forced choice AND forced weights;
* ``{i}.router``: our router logits on that same input, compared with the target's (tokens whose
  top-k set differs are counted, for information);
* ``{i}.combine``: the step between: our backend's own expert choice and combine weights (from its
  router logits) against ``target_routing`` of those same logits (``combine_error``), so a softmax
  taken over all experts, or omitted, or a wrong top-k fails here and nowhere else.

The error of a part is relative to what the part adds: ``||ours - target|| / ||target - x_in||``
over the [T, H] block (the residual passes through unchanged, so it is not counted as agreement).
"""

from __future__ import annotations

import torch

PARTS = ("attn", "mlp")
FORWARD_ORDER = {"attn": 0, "router": 1, "combine": 2, "mlp": 3, "logits": 4}
# The combine weights are a softmax of bf16 logits rounded to bf16: two faithful implementations
# differ by a few bf16 ulps (2^-8 relative) of a weight; a kernel that takes the softmax from the
# fp32 logits before rounding them differs by the logits' own rounding (|logit| 2^-9) too. The
# bugs this part exists for move the weights by tens of percent (a softmax over all E experts
# leaves the k selected ones 1 - (their share) short; no softmax at all is off by O(1)).
COMBINE_LIMIT = 0.02


def target_routing(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing OpenAI's ``MLPBlock`` computes from router logits [T, E]: ``torch.topk(g, k,
    sorted=True)``, then ``softmax(values, dim=1)`` in the logits' dtype -> (ids int64 [T, k],
    weights [T, k]). Written here on purpose, not imported from our spec, so a bug there cannot
    agree with itself."""
    experts = torch.topk(logits, k=k, dim=-1, sorted=True)
    return experts.indices, torch.nn.functional.softmax(experts.values, dim=1)


def combine_error(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, k: int) -> dict:
    """Our expert choice and combine weights (ids [T, k], weights [T, k]) against ``target_routing``
    of our own router logits [T, E]: {"rel_err": ||w - w_ref|| / ||w_ref|| over the tokens whose
    choice agrees (weights matched by expert id), "tokens", "choice_differs": tokens whose expert set
    differs although their k-th and (k+1)-th logits are not tied}."""
    t = logits.float()
    want_ids, want_w = target_routing(logits, k)
    ids = ids.long().to(t.device)
    same = (ids.sort(-1).values == want_ids.sort(-1).values).all(-1)  # [T]
    if k < t.shape[-1]:
        top = torch.topk(t, k + 1, dim=-1).values
        tied = top[:, k - 1] == top[:, k]
    else:
        tied = torch.zeros_like(same)
    differs = ~same & ~tied
    # weights aligned by expert id: scatter both into [T, E]
    a = torch.zeros_like(t).scatter(1, want_ids, want_w.float())
    b = torch.zeros_like(t).scatter(1, ids.clamp(0, t.shape[-1] - 1), weights.float().to(t.device))
    a, b = a[same].double(), b[same].double()
    err = float((b - a).norm() / a.norm().clamp(min=1e-30)) if a.numel() else 0.0
    return {"rel_err": err, "tokens": int(t.shape[0]), "choice_differs": int(differs.sum()),
            "first_differing_token": int(differs.nonzero()[0, 0]) if bool(differs.any()) else None}


def forced_inputs_needed(n_layers: int) -> list[str]:
    """Capture keys of the target that the teacher-forced pass reads."""
    keys = []
    for i in range(n_layers):
        keys += [f"{i}.attn", f"{i}.mlp", f"{i}.router"]
    return keys


def has_forced_inputs(forced: dict | None, n_layers: int) -> bool:
    return forced is not None and all(k in forced for k in forced_inputs_needed(n_layers))


def run_parts(model, tokens: torch.Tensor, ops, target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our output of every part on the target's inputs (CPU tensors, keys as ``forced_inputs_needed``,
    plus ``"0.in"``: layer 0's input, the embedding, and ``"{i}.ids"`` / ``"{i}.weights"``: our own
    expert choice and combine weights on our router logits, for the combine part).

    ``model`` is one rank's GptOss (sharded parts all-reduce inside, so every rank returns the same);
    ``target`` holds the target's captures (bf16 [T, H] streams, router logits [T, E])."""
    dev = next(iter(model.buffers())).device
    k = model.cfg.num_experts_per_tok
    out: dict[str, torch.Tensor] = {}
    x_in = model.embed(tokens.to(dev), ops)  # (all-reduced over the ranks when vocab-parallel)
    out["0.in"] = x_in.cpu()  # layer 0's input: the embedding (a copy, the same in every mode)
    for i in range(model.cfg.num_hidden_layers):
        if i > 0:
            x_in = target[f"{i - 1}.mlp"].to(dev)
        out[f"{i}.attn"] = model.attention_part(i, x_in, ops).cpu()
        x_attn = target[f"{i}.attn"].to(dev)
        moe = model.moe_part(i, x_attn, ops, routing=target_routing(target[f"{i}.router"].to(dev), k))
        for what in ("mlp", "router", "ids", "weights"):
            out[f"{i}.{what}"] = moe["out" if what == "mlp" else what].cpu()
    last = f"{model.cfg.num_hidden_layers - 1}.mlp"
    out["logits"] = model.logits_part(target[last].to(dev), ops).cpu()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return out


def part_input(target: dict[str, torch.Tensor], key: str, embedded: torch.Tensor) -> torch.Tensor:
    """The target's input to part ``key`` ("{i}.attn" / "{i}.mlp"); ``embedded`` is layer 0's input."""
    layer, part = key.split(".")
    i = int(layer)
    if part == "mlp":
        return target[f"{i}.attn"]
    return embedded if i == 0 else target[f"{i - 1}.mlp"]


def part_rel_err(x_in: torch.Tensor, target_out: torch.Tensor, ours_out: torch.Tensor) -> float:
    """||ours - target|| / ||target - x_in||: the error relative to what the part adds."""
    t, o, x = target_out.double(), ours_out.double(), x_in.double()
    return float((o - t).norm() / (t - x).norm().clamp(min=1e-30))


def routing_flips(target_logits: torch.Tensor, ours_logits: torch.Tensor, k: int) -> dict:
    """Tokens whose top-k expert set differs (information, not a verdict): our router picks other
    experts for them. A flip is never more than the logits' own error shows: expert i in the
    target's top-k and j outside it swap only if o_j >= o_i, i.e. t_i - t_j <= 2 max |o - t| on
    that token, so the target's k-th / (k+1)-th gap is at most twice our largest logit error there.
    The router's verdict is its logits' relative error (``compare_parts``); the MoE part runs on
    the target's routing, so a flip can neither hide nor fake an FFN error."""
    t, o = target_logits.double(), ours_logits.double()
    a = torch.topk(t, k, dim=-1).indices.sort(-1).values
    b = torch.topk(o, k, dim=-1).indices.sort(-1).values
    differ = (a != b).any(-1)
    return {"tokens": int(t.shape[0]), "flipped": int(differ.sum()),
            "first_flipped_token": int(differ.nonzero()[0, 0]) if bool(differ.any()) else None}


def compare_parts(target: dict[str, torch.Tensor], ours: dict[str, torch.Tensor], n_layers: int, k: int,
                  limits: dict[str, float], part_limits: dict[str, float] | None = None,
                  noise: dict[str, float] | None = None, target_logits: torch.Tensor | None = None) -> dict:
    """Per layer and part: the relative error against its limit, routing flips, pass/fail, and the
    first failing part in forward order. ``limits`` ({"attn", "mlp", "router"}: the largest
    relative error that noise explains for this mode); ``part_limits`` ("{i}.attn" / "{i}.mlp" ->
    limit: this run's noise-following limits, verify/noise.py) replace the attn / mlp ones, and
    ``noise`` (the same keys) is reported beside them. Each layer's combine (our expert choice and
    weights from our router logits, when ``ours`` holds "{i}.ids" / "{i}.weights") is checked
    against ``target_routing`` of those logits (``combine_error``, limit ``COMBINE_LIMIT``). With
    ``target_logits`` [T, V] and ``ours["logits"]`` (our final norm and lm_head on the target's
    last stream), a last row ``part: "logits"`` (layer = n_layers) against ``limits["logits"]``."""
    rows, failures = [], []
    for i in range(n_layers):
        for part in PARTS:
            key = f"{i}.{part}"
            if key not in target or key not in ours:
                continue
            e = part_rel_err(part_input(target, key, ours["0.in"]), target[key], ours[key])
            lim = (part_limits or {}).get(key, limits[part])
            ok = e <= lim
            row = {"layer": i, "part": part, "rel_err": e, "limit": lim, "passed": ok}
            if noise and key in noise:
                row["noise"] = noise[key]
            rows.append(row)
            if not ok:
                failures.append(f"layer {i} {'attention' if part == 'attn' else 'MoE'}: rel. err {e:.3g} > {lim:.3g}")
        ck = (f"{i}.router", f"{i}.ids", f"{i}.weights")
        if all(c in ours for c in ck):
            c = combine_error(*(ours[x] for x in ck), k)
            ok = c["rel_err"] <= COMBINE_LIMIT and not c["choice_differs"]
            rows.append({"layer": i, "part": "combine", "rel_err": c["rel_err"], "limit": COMBINE_LIMIT,
                         "passed": ok, **{x: c[x] for x in ("tokens", "choice_differs", "first_differing_token")}})
            if not ok:
                what = (f"weights rel. err {c['rel_err']:.3g} > {COMBINE_LIMIT:.3g}" if c["rel_err"] > COMBINE_LIMIT else
                        f"{c['choice_differs']} token(s) routed to other experts than the top-k of our own logits "
                        f"(first: token {c['first_differing_token']})")
                failures.append(f"layer {i} combine (top-k + softmax of the router logits): {what}")
        rk = f"{i}.router"
        if rk in target and rk in ours:
            t, o = target[rk].double(), ours[rk].double()
            e = float((o - t).norm() / t.norm().clamp(min=1e-30))
            flips = routing_flips(target[rk], ours[rk], k)
            ok = e <= limits["router"]
            rows.append({"layer": i, "part": "router", "rel_err": e, "limit": limits["router"], "passed": ok, **flips})
            if not ok:
                failures.append(f"layer {i} router: logits rel. err {e:.3g} > {limits['router']:.3g}")
    if target_logits is not None and "logits" in ours:
        t, o = target_logits.double(), ours["logits"].double()
        e = float((o - t).norm() / t.norm().clamp(min=1e-30))
        ok = e <= limits["logits"]
        rows.append({"layer": n_layers, "part": "logits", "rel_err": e, "limit": limits["logits"], "passed": ok})
        if not ok:
            failures.append(f"final norm + lm_head: logits rel. err {e:.3g} > {limits['logits']:.3g}")
    rows.sort(key=lambda r: (r["layer"], FORWARD_ORDER[r["part"]]))
    first = next((r for r in rows if not r["passed"]), None)
    return {"passed": not failures, "failures": failures, "parts": rows,
            "first_failing": None if first is None else {"layer": first["layer"], "part": first["part"]}}
