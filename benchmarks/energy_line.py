"""One line of energy a launch from benchmarks/attn_ncu.py's timing under benchmarks/clock_watch.py (issue 34).

    ... clock_watch.py OUT.csv -- python3 benchmarks/attn_ncu.py ... --seconds 5 | python3 benchmarks/energy_line.py NAME T

Reads their output on stdin ("... ms each", "SM clock MHz while busy: ... median C ...; power W: median P", the
throttle masks) and prints NAME, T, ms, clock, power and energy = P x ms, or the input itself when a figure is
missing (a run that failed shows its error instead of a made-up line).
"""

from __future__ import annotations

import re
import sys


def energy_line(name: str, tokens: str, text: str) -> str:
    ms = re.search(r"([\d.]+) ms each", text)
    clock = re.search(r"SM clock MHz while busy: min \d+, median (\d+)", text)
    power = re.search(r"power W: median (\d+)", text)
    if not (ms and clock and power):
        return f"{name} T={tokens}: no figure in the run's output:\n{text.strip()}"
    throttled = "0x0000000000000004" in text
    joules = float(power.group(1)) * float(ms.group(1)) / 1e3
    return (f"{name} T={tokens}: {float(ms.group(1)):.3f} ms, {clock.group(1)} MHz, {power.group(1)} W, "
            f"{joules:.2f} J a launch{', SW power cap' if throttled else ''}")


if __name__ == "__main__":
    print(energy_line(sys.argv[1], sys.argv[2], sys.stdin.read()))
