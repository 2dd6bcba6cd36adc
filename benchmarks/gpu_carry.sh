#!/usr/bin/env bash
# Make .whl/ (git-ignored), what device calls carry (`carry: [".whl"]`, PYTHONPATH=$(pwd):$(pwd)/.whl there):
#   .whl/gpt_oss  OpenAI's reference package from this venv (the trained fixture's GPU tests, the verdict)
#   .whl/w        wheels of the serving stack for the GPU machine's Python 3.12 (fastapi, uvicorn, pydantic,
#                 openai-harmony, llguidance, httpx): gpu_suite.sh's serve / pending56 targets install them with pip
#                 --no-index into /tmp/site (nothing can be fetched there). ~10 MB.
#   .whl/cache    o200k_base.tiktoken where verify/prompt.py looks for it (XDG_CACHE_HOME=.whl/cache there), unpacked
#                 from this venv's bpe-openai: its wheel (42 MB, every tokenizer it knows) would not fit beside the
#                 tree in the 64 MiB a call may carry
# Run here (with network), from the repository root, with the project's venv active.
set -euo pipefail
site=$(python -c 'import gpt_oss, os; print(os.path.dirname(os.path.dirname(gpt_oss.__file__)))')
mkdir -p .whl/w
rm -rf .whl/gpt_oss && cp -r "$site/gpt_oss" .whl/
rm -f .whl/w/bpe_openai-*.whl
XDG_CACHE_HOME=$(pwd)/.whl/cache python -c 'from gptoss_fp8.verify.prompt import ensure_o200k; print(ensure_o200k())'
python -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -d .whl/w \
  'fastapi>=0.115,<1' 'uvicorn>=0.30,<1' 'openai-harmony>=0.0.8' 'llguidance>=1.9,<2' \
  'httpx>=0.27,<1'
du -sh .whl .whl/w .whl/cache
