"""The ``gptoss-fp8`` command line (main.py wires the commands, one per module).

When this process is the ``gptoss-fp8`` program, SIGINT is held from here on (``SIGINT_MASK``: the mask before),
so that a Ctrl-C while Python's import machinery finds and loads cli/main.py, before its first line runs, is
``interrupted`` / 130 too (main.py lets a pending one through inside its guard, at its last line). Imported as
a library (tests, ``python -m``), nothing is held here: main.py holds it from its own first lines."""

from __future__ import annotations

import os
import signal
import sys

SIGINT_MASK = None
if (hasattr(signal, "pthread_sigmask") and sys.argv and os.path.basename(sys.argv[0]).startswith("gptoss-fp8")):
    SIGINT_MASK = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
