#!/usr/bin/env bash
# Make .whl/ (git-ignored), what device calls carry (`carry: [".whl"]`, PYTHONPATH=$(pwd):$(pwd)/.whl there):
#   .whl/gpt_oss  OpenAI's reference package from this venv (the trained fixture's GPU tests, the verdict)
#   .whl/w        wheels of the serving stack for the GPU machine's Python 3.12 (fastapi, uvicorn, pydantic,
#                 openai-harmony, bpe-openai, llguidance, httpx): gpu_suite.sh's serve / pending56 targets install
#                 them with pip --no-index into /tmp/site (nothing can be fetched there). ~51 MB of the 64 MiB a call
#                 may carry: leave .peers out of such a call.
# Run here (with network), from the repository root, with the project's venv active.
set -euo pipefail
site=$(python -c 'import gpt_oss, os; print(os.path.dirname(os.path.dirname(gpt_oss.__file__)))')
mkdir -p .whl/w
rm -rf .whl/gpt_oss && cp -r "$site/gpt_oss" .whl/
python -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -d .whl/w \
  'fastapi>=0.115,<1' 'uvicorn>=0.30,<1' 'openai-harmony>=0.0.8' 'bpe-openai>=0.1.4' 'llguidance>=1.9,<2' \
  'httpx>=0.27,<1'
du -sh .whl .whl/w
