"""--plot PNG: per mode, the teacher-forced part errors against their limits (the verdict), the
free-running per-layer relative error of the residual stream, and per-position KL."""

from __future__ import annotations

from pathlib import Path

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.verify.parts import FORWARD_ORDER


def plot_report(report: dict, path: Path) -> None:
    """Three panels: teacher-forced error of each part (layer x, its parts in forward order at
    x.00, x.25, ...: ``parts.FORWARD_ORDER``) divided by its limit (log scale; above 1 fails), the
    free-running hidden-state relative error after each attention / MLP (layer threshold dashed),
    and KL(ref || ours) per position."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GptOssFp8Error("--plot needs matplotlib; run: pip install matplotlib (or drop --plot)") from None
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(17, 4.5))
    # every part the verdict has, in forward order within its layer (attention, router, combine, MoE)
    offset = {p: j / len(FORWARD_ORDER) for p, j in FORWARD_ORDER.items()}
    sections = [(m, report[m]) for m in report["modes"]]
    if report.get("kernels_vs_w8a8"):
        sections.append(("kernels vs w8a8", report["kernels_vs_w8a8"]))
    for name, sec in sections:
        tf = sec.get("teacher_forced")
        if not tf:
            continue
        rows = tf["parts"]
        x = [r["layer"] + offset[r["part"]] for r in rows]
        y = [max(r["rel_err"] / r["limit"], 1e-4) for r in rows]
        ax0.plot(x, y, marker="o", ls="none", label=f"{name} ({'PASS' if tf['passed'] else 'FAIL'})")
        if tf["first_failing"]:
            f = tf["first_failing"]
            ax0.annotate(f"{name}: L{f['layer']} {f['part']}", (f["layer"] + offset[f["part"]], 1.0),
                         textcoords="offset points", xytext=(5, 8), fontsize=8)
    ax0.axhline(1.0, color="red", ls="--", lw=0.8)
    ax0.set_yscale("log")
    ax0.set_xlabel("layer (" + ", ".join(f"x.{round(100 * v):02d} {p}" for p, v in offset.items()) + ")")
    ax0.set_ylabel("part error / its limit (1e-4 floor)")
    ax0.set_title("teacher-forced parts (the verdict)")
    # Log axes: exact zeros (bit-identical results) are drawn at a floor a decade under the
    # smallest nonzero value, and said so in the legend.
    errs = [p["rel_err"] for m in report["modes"] for p in report[m]["layers"] if p["rel_err"] > 0]
    kls = [v for m in report["modes"] for v in report[m]["per_position"]["kl"] if v > 0]
    e_floor = min(errs) / 10 if errs else 1e-6
    k_floor = min(kls) / 10 if kls else 1e-9
    for mode in report["modes"]:
        sec = report[mode]
        pts = sec["layers"]
        if pts:
            x = [p["layer"] + (0.0 if p["part"] == "attn" else 0.5) for p in pts]
            y = [max(p["rel_err"], e_floor) for p in pts]
            zero = " - 0 drawn at floor" if any(p["rel_err"] == 0 for p in pts) else ""
            line, = ax1.plot(x, y, marker="o", label=f"{mode} [{sec['backend']}] ({sec['profile']}){zero}")
            ax1.axhline(sec["thresholds"]["layer_rel_err"], color=line.get_color(), ls="--", lw=0.8)
            d = sec.get("divergence")
            if d:
                ax1.annotate(f"{mode}: L{d['layer']} {d['part']}",
                             (d["layer"] + (0 if d["part"] == "attn" else 0.5), max(d["rel_err"], e_floor)),
                             textcoords="offset points", xytext=(5, 8), fontsize=8)
        kl = [max(v, k_floor) for v in sec["per_position"]["kl"]]
        zero = " - 0 drawn at floor" if any(v == 0 for v in sec["per_position"]["kl"]) else ""
        ax2.plot(range(len(kl)), kl, lw=1, label=f"{mode}: mean {sec['summary']['kl_mean']:.2g}{zero}")
    ax1.set_yscale("log")
    ax1.set_xlabel("layer (x.0 after attention, x.5 after MLP)")
    ax1.set_ylabel("relative error of hidden state vs reference")
    ax1.set_title("free-running per-layer error")
    ax2.set_yscale("log")
    ax2.set_xlabel("token position")
    ax2.set_ylabel("KL(ref || ours), nats")
    ax2.set_title("per-position KL")
    for ax in (ax0, ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"verify-logits: {'PASSED' if report['passed'] else 'FAILED'}  ({Path(report['checkpoint']).name})")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise GptOssFp8Error(f"cannot write plot {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
