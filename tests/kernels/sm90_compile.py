"""Running a compile script for sm_90 from a CPU test: the kernels' register / MMA checks without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_compile_script(script: str, *args: str):
    """Run ``script`` (Python source printing one JSON line last) in a child process outside Triton's interpreter
    (whose jit functions cannot be compiled): its last line, parsed; the child's error output on failure."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
