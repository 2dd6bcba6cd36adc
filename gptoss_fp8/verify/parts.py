"""Teacher-forced parts: each layer's attention block and MoE block run on the target's own input.

A free-running comparison lets errors compound: on random routers a bf16-level difference sends a
token to other experts and the logits move more than most kernel bugs would move them. Here every
part gets the target's input to that part (the captured residual stream), so an error stays
where it is made:

* ``{i}.attn``: ``model.attention_part(i, x)`` with x the target's stream entering layer i (the
  embedding for layer 0, which is an exact copy in every mode), compared with the target's stream
  after layer i's attention;
* ``{i}.mlp``: ``model.moe_part(i, x, routing=...)`` with x the target's stream after layer i's
  attention and the target's own routing (top-k of its router logits, softmax over them, as OpenAI's
  reference), so a flipped expert can neither hide nor fake an FFN error;
* ``{i}.router``: our router logits on that same input, compared with the target's; a token whose
  top-k set differs is a *real* flip only when the target's gap between its k-th and (k+1)-th logit
  is larger than what our logit error on that token can explain.

The error of a part is relative to what the part adds: ``||ours - target|| / ||target - x_in||``
over the [T, H] block (the residual passes through unchanged, so it is not counted as agreement).
"""

from __future__ import annotations

import torch

from gptoss_fp8.spec import select_experts

PARTS = ("attn", "mlp")


def forced_inputs_needed(n_layers: int) -> list[str]:
    """Capture keys of the target that the teacher-forced pass reads."""
    keys = []
    for i in range(n_layers):
        keys += [f"{i}.attn", f"{i}.mlp", f"{i}.router"]
    return keys


def run_parts(model, tokens: torch.Tensor, ops, target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our output of every part on the target's inputs (CPU tensors, keys as ``forced_inputs_needed``,
    plus ``"0.in"``: layer 0's input, the embedding).

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
        ids, weights = select_experts(target[f"{i}.router"].to(dev), k)
        y, logits = model.moe_part(i, x_attn, ops, routing=(ids, weights))
        out[f"{i}.mlp"], out[f"{i}.router"] = y.cpu(), logits.cpu()
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
                  limits: dict[str, float]) -> dict:
    """Per layer and part: the relative error against ``limits`` ({"attn", "mlp", "router"}: the
    largest relative error that noise explains for this mode), routing flips, pass/fail, and the
    first failing part in forward order."""
    rows, failures = [], []
    for i in range(n_layers):
        for part in PARTS:
            key = f"{i}.{part}"
            if key not in target or key not in ours:
                continue
            e = part_rel_err(part_input(target, key, ours["0.in"]), target[key], ours[key])
            ok = e <= limits[part]
            rows.append({"layer": i, "part": part, "rel_err": e, "limit": limits[part], "passed": ok})
            if not ok:
                failures.append(f"layer {i} {'attention' if part == 'attn' else 'MoE'}: rel. err {e:.3g} > {limits[part]:.3g}")
        rk = f"{i}.router"
        if rk in target and rk in ours:
            t, o = target[rk].double(), ours[rk].double()
            e = float((o - t).norm() / t.norm().clamp(min=1e-30))
            flips = routing_flips(target[rk], ours[rk], k)
            ok = e <= limits["router"]
            rows.append({"layer": i, "part": "router", "rel_err": e, "limit": limits["router"], "passed": ok, **flips})
            if not ok:
                failures.append(f"layer {i} router: logits rel. err {e:.3g} > {limits['router']:.3g}")
    first = next((r for r in rows if not r["passed"]), None)
    return {"passed": not failures, "failures": failures, "parts": rows,
            "first_failing": None if first is None else {"layer": first["layer"], "part": first["part"]}}
