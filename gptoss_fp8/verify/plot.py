"""--plot PNG: per-layer relative error of the residual stream and per-position KL, per mode."""

from __future__ import annotations

from pathlib import Path

from gptoss_fp8.errors import GptOssFp8Error


def plot_report(report: dict, path: Path) -> None:
    """Two panels: hidden-state relative error after each attention / MLP (log scale, layer
    threshold dashed), and KL(ref || ours) per token position (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GptOssFp8Error("--plot needs matplotlib; run: pip install matplotlib (or drop --plot)") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
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
    ax1.set_title("per-layer error")
    ax2.set_yscale("log")
    ax2.set_xlabel("token position")
    ax2.set_ylabel("KL(ref || ours), nats")
    ax2.set_title("per-position KL")
    for ax in (ax1, ax2):
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
