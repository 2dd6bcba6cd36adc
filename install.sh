#!/usr/bin/env bash
# Install gptoss-fp8 into the active Python environment, with what it is tested with:
#   bash install.sh          the tool: torch (CPU build, pinned), triton, the project, OpenAI's reference
#   bash install.sh --test   also the test extras (pytest, ruff, the server stack, the openai client)
# OpenAI's reference (gpt-oss, whose gpt_oss.torch verify-logits compares against) is installed with
# --no-deps --ignore-requires-python: its metadata asks for Python >= 3.12 and serving packages that
# gpt_oss.torch never imports; what it does need (torch, safetensors) comes with the project.
# On a GPU machine, install the CUDA build of torch you use first and run with TORCH_SPEC=skip.
set -euo pipefail
cd "$(dirname "$0")"
extras="ref"
if [[ "${1:-}" == "--test" ]]; then extras="test,ref"; fi
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [[ "$TORCH_SPEC" != "skip" ]]; then
  # torch first, alone: otherwise pip may resolve it to a multi-GB CUDA build
  python -m pip install -q "$TORCH_SPEC"
fi
python -m pip install -q -e ".[$extras]"
python -m pip install -q --no-deps --ignore-requires-python gpt-oss==0.0.9
