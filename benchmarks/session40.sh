#!/usr/bin/env bash
# The fortieth session's one device call (device time was scarce: starts refused for an hour): on an H200 the
# must-shows first (prefill-fp8), then pending40's tests and the 32768 A/B; elsewhere pending40 with both A/Bs.
set -u
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  PREFILL_FP8_SPECS="${PREFILL_FP8_SPECS:-20b 32768,128000;120b 128000}" bash benchmarks/gpu_suite.sh prefill-fp8
  P40_TEST_S=90 P40_AB_S=${P40_AB_S:-150} P40_RUNS32K=7 P40_AB128K_S=0 bash benchmarks/gpu_suite.sh pending40
else
  P40_AB_S=200 P40_AB128K_S=${P40_AB128K_S:-170} bash benchmarks/gpu_suite.sh pending40
fi
