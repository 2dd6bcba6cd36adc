"""The verdict's noise model, measured: correct code and injected bugs, per part, against this run's noise.

    python benchmarks/verify_calibration.py [--device cpu|cuda] [--random 20] [--modes weights,w8a8]
        [--decode 16] [--attention bf16|fp8|fp8-lin] [--mutations N] [--json out.json] [--shard K/N]
    python benchmarks/verify_calibration.py --merge shard*.json [--json all.json]

Runs verify-logits (the library: verify.run.verify_checkpoint) on the trained fixture (golden/trained,
a Python-source sample) and on ``--random`` fresh synthetic checkpoints of shapes no test uses (seeds
7000 + i; hidden, heads, head_dim, window, layers, experts varied), each converted twice (FP8
attention, attention kept bf16). For every teacher-forced part it records the error, this run's FP8
noise (verify/noise.py), the store floor and the limit, and prints per mode and part: the worst
error / limit of correct code, and the largest (error - floors) / noise ratio (what k must exceed).
With ``--mutations`` every bug of tests/mutations.py is injected into each FP8 mode in turn on the
trained fixture and the first random checkpoints, and the weakest catch (error / limit at the
part the bug is in) is printed. The kernels mode on CPU runs Triton's interpreter (slow: set
TRITON_INTERPRET=1 and expect minutes).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from gptoss_fp8.convert.convert import convert_checkpoint  # noqa: E402
from gptoss_fp8.convert.synth import write_synthetic  # noqa: E402
from gptoss_fp8.model.ops import ATTENTION_KINDS  # noqa: E402
from gptoss_fp8.tokenizer import ByteTokenizer  # noqa: E402
from gptoss_fp8.verify.reference import reference_for  # noqa: E402
from gptoss_fp8.verify.report import rounding_for  # noqa: E402
from gptoss_fp8.verify.run import verify_checkpoint  # noqa: E402


def random_shape(i: int) -> tuple[int, dict, int]:
    r = random.Random(7000 + i)
    kvh, grp = r.choice([(1, 2), (2, 3), (1, 6), (4, 1), (2, 1), (1, 4), (3, 2)])
    experts = r.choice([3, 6, 7, 10, 16, 20])
    ov = dict(hidden_size=r.choice([64, 128, 256, 352, 384, 416]), intermediate_size=r.choice([64, 128, 192, 320]),
              head_dim=r.choice([16, 32, 64]), num_attention_heads=kvh * grp, num_key_value_heads=kvh,
              num_local_experts=experts, num_experts_per_tok=min(r.choice([1, 2, 4]), experts),
              sliding_window=r.choice([3, 6, 12, 24, 32]), vocab_size=r.choice([131, 389, 600]))
    return r.choice([1, 2, 3, 4]), ov, r.choice([40, 56, 72])


def cases(tmp: Path, n_random: int, device: str, want=lambda j: True, trained_too: bool = True):
    """(j, name, checkpoint, reference) of case j = 0, 1, ... for the j that ``want`` takes."""
    trained = ROOT / "golden" / "trained"
    text = (ROOT / "gptoss_fp8" / "tokenizer.py").read_text()[:160]
    toks = torch.tensor(ByteTokenizer().encode(text))
    for keep in (False, True) if trained_too else ():
        if not want(int(keep)):
            continue
        dst = tmp / f"trained-{keep}"
        convert_checkpoint(trained, dst, keep_attention_bf16=keep)
        rounding, exact = rounding_for(dst)
        yield int(keep), f"trained bf16-attn={keep}", dst, reference_for(trained, toks, device, None if exact else rounding)
    for i in range(n_random):
        if not (want(2 + 2 * i) or want(3 + 2 * i)):
            continue
        layers, ov, n = random_shape(i)
        src = tmp / f"r{i}-src"
        write_synthetic(src, "tiny", layers=layers, seed=7000 + i, **ov)
        toks = torch.randint(0, ov["vocab_size"], (n,), generator=torch.Generator().manual_seed(i))
        for keep in (False, True):
            if not want(2 + 2 * i + int(keep)):
                continue
            dst = tmp / f"r{i}-{keep}"
            convert_checkpoint(src, dst, keep_attention_bf16=keep)
            rounding, exact = rounding_for(dst)
            name = (f"random {i} L{layers} h{ov['hidden_size']} d{ov['head_dim']} {ov['num_attention_heads']}/"
                    f"{ov['num_key_value_heads']} E{ov['num_local_experts']}k{ov['num_experts_per_tok']} "
                    f"w{ov['sliding_window']} T{n} bf16-attn={keep}")
            yield 2 + 2 * i + int(keep), name, dst, reference_for(src, toks, device, None if exact else rounding)


def rows_of(report: dict, modes: list[str]):
    for m in [*modes, "kernels_vs_w8a8"]:
        sec = report.get(m)
        if not sec or "teacher_forced" not in sec:
            continue
        for r in sec["teacher_forced"]["parts"]:
            yield m, "prefill", r
        for r in (sec.get("decode") or {}).get("layers", []):
            yield m, "decode", r | {"rel_err": r["rel_err_max"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random", type=int, default=20)
    ap.add_argument("--modes", default="weights,w8a8")
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--attention", default="bf16", choices=ATTENTION_KINDS,
                    help="prefill attention numerics (fp8, fp8-lin: FP8 full-attention layers; --decode 0 with them)")
    ap.add_argument("--mutations", type=int, default=0, help="inject every bug on the first N cases")
    ap.add_argument("--only-mutations", action="store_true", help="skip the correct-code runs")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--shard", default="0/1", help="K/N: only the cases j with j %% N == K (parallel runs; then --merge)")
    ap.add_argument("--no-trained", action="store_true", help="the random checkpoints only")
    ap.add_argument("--from-case", type=int, default=0,
                    help="skip the cases j < J (0, 1: the trained fixture; 2 + 2i, 3 + 2i: random shape i)")
    ap.add_argument("--merge", type=Path, nargs="*", help="print the summary of these --json files (of the shards)")
    a = ap.parse_args()
    if a.merge:
        records, catches = [], []
        for f in a.merge:
            d = json.loads(f.read_text())
            records += d["records"]
            catches += d["catches"]
        worst: dict = {}
        for r in records:
            key = (r["mode"], r["where"], r["part"])
            ratio = r["rel_err"] / r["limit"] if r["limit"] else 0.0
            if key not in worst or ratio > worst[key][0]:
                worst[key] = (ratio, r["rel_err"], r["limit"], r["case"], r["layer"])
        summary(worst, records, catches)
        save(a.json, worst, records, catches)
        return
    modes = a.modes.split(",")
    k_shard, n_shard = map(int, a.shard.split("/"))
    import mutations

    worst = {}
    catches = []
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for j, name, dst, ref in cases(Path(tmp), a.random, a.device, lambda j: j >= a.from_case and j % n_shard == k_shard,
                                     not a.no_trained):
            if a.only_mutations and j >= a.mutations:
                continue
            report = {"passed": True}
            if not a.only_mutations:
                report, _ = verify_checkpoint(dst, ref, modes=modes, device=a.device, decode=a.decode,
                                              attention=a.attention)
                fails = {m: report[m]["failures"] for m in modes if not report[m]["passed"]}
                print(f"{name}: {'PASS' if report['passed'] else 'FAIL'} {fails if fails else ''}", flush=True)
            for m, where, r in rows_of(report, modes):
                key = (m, where, r["part"])
                ratio = r["rel_err"] / r["limit"] if r["limit"] else 0.0
                if key not in worst or ratio > worst[key][0]:
                    worst[key] = (ratio, r["rel_err"], r["limit"], name, r["layer"])
                records.append({"case": name, "mode": m, "where": where, **{k: r.get(k) for k in
                                ("layer", "part", "rel_err", "limit", "noise", "store_floor")}})
            save(a.json, worst, records, catches)
            if j < a.mutations:
                for target in [m for m in modes if m in mutations.TARGET_MODES]:
                    for mut in mutations.MUTATIONS:
                        # the spec alone, or the kernels with the spec (their verdict against it too)
                        mm = [target] if target == "w8a8" else ["w8a8", target]
                        rep, _ = verify_checkpoint(dst, ref, modes=mm, device=a.device, attention=a.attention,
                                                   ops_hook=f"mutations:{target}__{mut}")
                        sec = rep[target]["teacher_forced"]
                        if target == "kernels" and rep[target]["passed"] and rep.get("kernels_vs_w8a8"):
                            sec = rep["kernels_vs_w8a8"]["teacher_forced"]
                        part = mutations.PART_OF[mut]
                        rows = [r for r in sec["parts"] if r["part"] == part]
                        best = max(rows, key=lambda r: r["rel_err"] / r["limit"]) if rows else None
                        margin = None if best is None else best["rel_err"] / best["limit"]
                        catches.append({"case": name, "target": target, "mutation": mut, "caught": not rep["passed"],
                                        "first_failing": sec["first_failing"], "margin": margin})
                        save(a.json, worst, records, catches)  # as it goes: a run cut short keeps what it measured
                        print(f"   {target} {mut}: {'caught' if not rep['passed'] else 'MISSED'} "
                              f"first {sec['first_failing']} margin {margin if margin is None else round(margin, 2)}",
                              flush=True)
    summary(worst, records, catches)
    save(a.json, worst, records, catches)


def summary(worst: dict, records: list, catches: list) -> None:
    print("\nworst error / limit of correct code (mode, where, part): ratio, error, limit, case, layer")
    for key, v in sorted(worst.items()):
        print(f"  {key}: {v[0]:.3f}  {v[1]:.4g} / {v[2]:.4g}  {v[3]} L{v[4]}")
    fx = [r for r in records if r.get("noise")]
    if fx:
        ratios = {p: [r["rel_err"] / r["noise"] for r in fx if r["part"] == p and r["where"] == "prefill"]
                  for p in ("attn", "mlp")}  # attention kept bf16 has no FP8 noise: no attn rows
        print("largest error / noise (FP8 parts, prefill):", {p: round(max(v), 3) for p, v in ratios.items() if v})
    if catches:
        missed = [c for c in catches if not c["caught"]]
        weakest = min((c for c in catches if c["margin"]), key=lambda c: c["margin"], default=None)
        print(f"mutations: {len(catches) - len(missed)} of {len(catches)} caught; weakest catch {weakest}")
        for c in missed:
            print("  MISSED", c)


def save(path: Path | None, worst: dict, records: list, catches: list) -> None:
    if path:
        path.write_text(json.dumps({"worst": {str(k): v for k, v in worst.items()}, "records": records,
                                    "catches": catches}, indent=1))


if __name__ == "__main__":
    main()
