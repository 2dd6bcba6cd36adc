"""Default pass/fail thresholds (measured; see benchmarks/notes/verify.md and the README).

Profiles:
* ``exact``: ``weights`` mode compared with the reference that holds the weights the conversion
  should produce: OpenAI's model on the source with every converted weight replaced by its FP8
  round trip (quant/fp8.py; for an exact conversion that is the source itself). Our forward then
  computes what OpenAI's does; on CPU it is bit-identical (KL 0 on every shape, scale mode and
  attention choice tried, up to the 20b preset). The limits are the bf16 noise floor between two
  faithful implementations (transformers vs OpenAI on a random 3-layer model: mean KL 7.9e-4, max
  |delta logit| 0.21), with top-1 agreement 1.0 required on every position that is not a near-tie
  (reference top-1 leads by < 0.25 logits), so other op orders pass (our forward on an H200 vs the
  CPU reference, tiny model, 64 tokens: KL mean 1.0e-4, max |delta| 0.125, one near-tie flipped)
  and conversion errors fail: a sign-flipped block scale, swapped gate/up rows, one zeroed sink
  (KL 7e-3 to 4.7) are all caught and located.
* ``w8a8``: FP8 activations too, compared with the same expected reference, so it measures what
  quantizing activations adds. Worst measured on synthetic models (random weights and routers):
  10 small models (5 shapes x 2 seeds, 64 tokens, every conversion option): KL mean 0.229, KL max
  3.51, top-1 0.862, hidden rel. error 0.183; the 20b preset cut to 2 layers (128 tokens): KL mean
  1.14, KL max 17.2, top-1 0.744, hidden rel. error 0.25, because 8-23% of tokens flip to other
  experts under random routers. The defaults bound all of these with margin: a smoke check (a
  wrong scale on a whole attention block, KL 4.7; a x16 expert scale, KL 6.7) that does not flag a
  correct conversion of any shape tried. Trained routers have decisive margins; tighten with
  --max-kl-mean on real checkpoints.
* ``lossy``: ``weights`` mode against the source when no expected reference exists (a reference
  file saved without one, for a conversion that rounded weights): the whole FP8 weight cost.
  Measured: 20b x 2 layers with FP8 attention KL mean 1.05, KL max 19, top-1 0.759; the same
  bounds as w8a8.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class Thresholds:
    kl_mean: float  # max mean KL(ref || ours), nats
    kl_max: float  # max KL at any position, nats
    top1_min: float  # min top-1 agreement over positions that are not near-ties (metrics.TIE_MARGIN)
    layer_rel_err: float  # a capture point whose relative error exceeds this is reported as diverging

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULTS: dict[str, Thresholds] = {
    "exact": Thresholds(kl_mean=2e-3, kl_max=5e-2, top1_min=1.0, layer_rel_err=2e-2),
    "lossy": Thresholds(kl_mean=2.0, kl_max=30.0, top1_min=0.6, layer_rel_err=0.4),
    "w8a8": Thresholds(kl_mean=2.0, kl_max=30.0, top1_min=0.6, layer_rel_err=0.4),
}


def with_overrides(t: Thresholds, **kw: float | None) -> Thresholds:
    return replace(t, **{k: v for k, v in kw.items() if v is not None})
