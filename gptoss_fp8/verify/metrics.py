"""Logit and hidden-state comparison metrics (float64 math; no thresholds here)."""

from __future__ import annotations

import torch

TOPK = 5
# A position whose reference top-1 logit leads the runner-up by less than this (logit units) is a
# near-tie: bf16 rounding in another op order (a GPU, another BLAS) may flip it without anything
# being wrong. 0.25 = two bf16 ulps at |logit| in [16, 32).
TIE_MARGIN = 0.25


def logit_metrics(ref: torch.Tensor, ours: torch.Tensor, tie_margin: float = TIE_MARGIN) -> dict:
    """Per-position and summarized comparison of logits [T, V] (any float dtype).

    Per position: ``kl`` = KL(ref || ours) in nats, ``top1`` (1.0 if the argmaxes agree),
    ``top5_overlap`` = |top-5(ref) & top-5(ours)| / 5, ``max_abs_delta`` = max |ours - ref| over the
    vocabulary (logit units), ``cosine`` of the two logit vectors, ``ref_margin`` = the reference's
    top-1 minus top-2 logit. Summary: kl_mean / kl_p95 / kl_max, top1_agreement,
    top1_agreement_decisive (over positions with ref_margin >= tie_margin; 1.0 if none), ties (count
    of the others), top5_overlap (mean), max_abs_delta (max), cosine_min, cosine_mean.
    """
    assert ref.shape == ours.shape and ref.dim() == 2, f"logits {tuple(ref.shape)} vs {tuple(ours.shape)}"
    r, o = ref.double(), ours.double()
    lp, lq = torch.log_softmax(r, -1), torch.log_softmax(o, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp(min=0.0)  # [T]; tiny negatives are rounding
    top1 = (r.argmax(-1) == o.argmax(-1)).double()
    k = min(TOPK, r.shape[-1])
    tr, to = r.topk(k, dim=-1).indices, o.topk(k, dim=-1).indices
    overlap = (tr[:, :, None] == to[:, None, :]).any(-1).double().sum(-1) / k
    delta = (o - r).abs().amax(-1)
    cos = torch.nn.functional.cosine_similarity(r, o, dim=-1)
    top2 = r.topk(min(2, r.shape[-1]), dim=-1).values
    margin = top2[:, 0] - top2[:, -1]
    decisive = margin >= tie_margin
    per = {"kl": kl, "top1": top1, "top5_overlap": overlap, "max_abs_delta": delta, "cosine": cos, "ref_margin": margin}
    summary = {
        "kl_mean": float(kl.mean()),
        "kl_p95": float(torch.quantile(kl, 0.95)),
        "kl_max": float(kl.max()),
        "top1_agreement": float(top1.mean()),
        "top1_agreement_decisive": float(top1[decisive].mean()) if decisive.any() else 1.0,
        "ties": int((~decisive).sum()),
        "top5_overlap": float(overlap.mean()),
        "max_abs_delta": float(delta.max()),
        "cosine_min": float(cos.min()),
        "cosine_mean": float(cos.mean()),
    }
    return {"summary": summary, "per_position": {k: [float(x) for x in v] for k, v in per.items()}}


def rel_err(ref: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    """(||ours - ref|| / ||ref|| over the whole [T, H] tensor, max over positions of the same per row)."""
    r, o = ref.double(), ours.double()
    d = (o - r).norm(dim=-1)
    n = r.norm(dim=-1).clamp(min=1e-30)
    return float((o - r).norm() / r.norm().clamp(min=1e-30)), float((d / n).max())


def point_order(n_layers: int) -> list[str]:
    """Capture points in forward order: "0.attn", "0.mlp", "1.attn", ..."""
    return [f"{i}.{p}" for i in range(n_layers) for p in ("attn", "mlp")]


def routing_changed(ref_logits: torch.Tensor, ours_logits: torch.Tensor, k: int) -> float:
    """Fraction of tokens whose set of top-k experts differs between two router logit tensors [T, E]."""
    a = torch.topk(ref_logits.float(), k, dim=-1, sorted=True).indices.sort(-1).values
    b = torch.topk(ours_logits.float(), k, dim=-1, sorted=True).indices.sort(-1).values
    return float((a != b).any(-1).double().mean())


def layer_errors(ref_hidden: dict[str, torch.Tensor], ours: dict[str, torch.Tensor], n_layers: int,
                 experts_per_token: int | None = None) -> list[dict]:
    """Relative error of the residual stream after each part of each layer, with its growth over the
    previous point (``added``: this part's own contribution to the error, in the same units). MLP
    points also carry ``routing_changed``: the fraction of tokens routed to another expert set than
    the reference's (a small error upstream can flip a near-tied router, and that token's MLP
    output then changes wholesale: the main amplifier on random synthetic models)."""
    out, prev = [], 0.0
    for p in point_order(n_layers):
        if p not in ref_hidden or p not in ours:
            continue
        e, emax = rel_err(ref_hidden[p], ours[p])
        layer, part = p.split(".")
        row = {"layer": int(layer), "part": part, "rel_err": e, "rel_err_max_position": emax, "added": e - prev}
        r = f"{layer}.router"
        if part == "mlp" and experts_per_token and r in ref_hidden and r in ours:
            row["routing_changed"] = routing_changed(ref_hidden[r], ours[r], experts_per_token)
        out.append(row)
        prev = e
    return out
