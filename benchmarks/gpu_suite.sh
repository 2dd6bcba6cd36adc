#!/usr/bin/env bash
# Everything that needs the GPU, in one device call:
#   GPU tests, kernel benchmarks, convert --device cuda benchmark. Results land under $OUT (or ./out).
# Usage (device tool): bash benchmarks/gpu_suite.sh [tests|verify|kernels|convert|prefill|prefill-20b|prefill-long|router|checkpoint|launch|ab|tiles|ws|moews|wscheck|attnws|decode1|clocks|depth|readprobe|final9|multigpu|gatherq|oproj|all]...
#   ws: the Gluon warp-specialized dense GEMM: its GPU tests, the probe against the Triton configs
#   and torch, whole-model A/B with and without it
#   moews: the Gluon warp-specialized expert GEMMs: their GPU tests (first, with a timeout), the MoE
#   variants bench, whole-model A/B (20b; 120b at 8192) against the Triton kernels
#   wscheck: GPU tests of the kernels and the model (OpenAI's reference included), the MoE variant
#   sweep and a 20b A/B at 8192 tokens (Gluon defaults vs Triton everywhere vs Gluon down too)
#   attnws: the Gluon warp-specialized attention: its GPU tests (with a timeout), A/B against the
#   Triton kernel at 8192 / 32768 / 131072 tokens, the attention GPU tests
#   gatherq: MoE GATHER_FROM_QUANT (on by default since the ninth session): its tests, then a
#   whole-model A/B (20b 8192 / 32768, 120b 8192) against it off
#   clocks: SM clock / power / throttle reasons sampled during a full-depth 20b prefill at 32768
#   tokens and during the short profiled run it is compared with (benchmarks/clock_watch.py)
#   oproj: o_proj at 4096 rows, the default beside the peer and 11 other tiles (benchmarks/oproj_small.py)
#   depth: kernel profiles at a few layers and at full depth (20b 32768, 120b 8192): do the same
#   kernels run slower per layer in the deep model (the ~9% gap of the eighth session)?
#   readprobe: plain streaming reads of a batch-1 decode's KV bytes against attention_decode
#   multigpu (on a 2-GPU machine): the sharded verify-logits GPU tests (tp 2, ep 1 / 2) over NCCL, one
#   GPU per rank, then decode's GPU tests and the fused / separate merge sweep (decode_merge)
#   decode1: decode GPU tests, then decode at batch 1 by tile, split count and merge chunk
#   tiles: plain FP8 GEMM by tile size vs ours and torch (is the tile's L2 traffic the limit?)
#   ab: same-process whole-model A/B (benchmarks/ab_prefill.py: fused combine, CUDA graph)
#   verify: only the verify-logits --device cuda tests (golden checkpoints, tp 2 on one GPU)
#   checkpoint: bench prefill on a converted checkpoint (synthetic 20b shapes, 2 layers) beside the
#   same shapes with random weights built on the GPU
set -uo pipefail
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1
# OpenAI's reference (gpt-oss 0.0.9) for the test that runs it on the GPU: the device machine has no
# network, so copy the installed package to .whl/gpt_oss (git-ignored) and carry .whl with the call.
if [[ -d .whl/gpt_oss ]]; then export PYTHONPATH=$PYTHONPATH:$(pwd)/.whl; fi
what=${*:-all}
has() { [[ " $what " == *" all "* || " $what " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
if has tests; then
  python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log"
  # The kernels' CPU tests pick CUDA when it is there (DEV): run them on the GPU too (compiled
  # kernels instead of the interpreter; CPU-tensor interpreter tests skip themselves there)
  python3 -m pytest -q -m "not gpu" tests/kernels tests/test_triton_ops.py 2>&1 | tee "$OUT/gpu_cpu_tests.log"
fi
if has verify && ! has tests; then
  python3 -m pytest -q -m gpu tests/test_verify_kernels.py 2>&1 | tee "$OUT/gpu_verify.log"
fi
if has kernels; then
  python3 -m gptoss_fp8.cli.main bench kernels --json "$OUT/bench_kernels.json" 2>&1 | tee "$OUT/bench_kernels.log"
fi
if has convert; then
  python3 -m gptoss_fp8.cli.main synth /tmp/src20b --preset 20b --layers 8 >/dev/null && python3 benchmarks/convert_bench.py /tmp/src20b --device cuda 2>&1 | tee "$OUT/bench_convert_cuda.log"
fi
# Whole-model prefill on our kernels at full depth; transformers bf16 beside it where it fits (20b).
# (--cuda-graph: the same forward also captured as a CUDA graph and timed; eager stays the headline)
# prefill = prefill-20b + prefill-long (20b 65536 / 128000, 120b 8192 / 128000), each ~3-4 min.
b() { python3 -m gptoss_fp8.cli.main bench prefill "$@"; }
if has prefill || has prefill-20b; then
  b --model 20b --tokens 8192,32768 --runs 5 --peer-runs 3 --cuda-graph --json "$OUT/prefill_20b.json" 2>&1 | tee "$OUT/prefill_20b.log"
fi
if has prefill || has prefill-long; then
  b --model 20b --tokens 65536,128000 --runs 2 --warmup 1 --no-peer --cuda-graph --json "$OUT/prefill_20b_long.json" 2>&1 | tee "$OUT/prefill_20b_long.log"
  # 120b at 8192 with 5 runs (a median of 2 can be an outlier's mean), 128000 with 2 (7.7 s each)
  b --model 120b --tokens 8192 --runs 5 --no-peer --cuda-graph --json "$OUT/prefill_120b.json" 2>&1 | tee "$OUT/prefill_120b.log"
  b --model 120b --tokens 128000 --runs 2 --warmup 1 --no-peer --cuda-graph --json "$OUT/prefill_120b_long.json" 2>&1 | tee "$OUT/prefill_120b_long.log"
fi
if has router; then  # the router kernel against torch's route, plain and graph-timed
  python3 -c "from gptoss_fp8.bench.kernels_gemm import bench_router
for r in bench_router([1024, 8192, 32768]): print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})" 2>&1 | tee "$OUT/bench_router.log"
fi
if has ab; then
  python3 benchmarks/ab_prefill.py --model 20b --tokens ${AB_TOKENS:-8192,32768} --runs 8 --variants ${AB_VARIANTS:-default,graph,torch-router} 2>&1 | tee "$OUT/ab_prefill.log"
fi
if has ws; then
  python3 -m pytest -q -m gpu tests/kernels/test_fp8_gemm.py tests/test_triton_ops.py 2>&1 | tail -15 | tee "$OUT/ws_tests.log"
  timeout 300 python3 -m gptoss_fp8.bench.kernels_gemm --probe --tokens ${WS_TOKENS:-1024,2048,4096,8192,32768} --json "$OUT/ws_probe.json" > "$OUT/ws_probe.log" 2>&1
  tail -3 "$OUT/ws_probe.log"
  if ! has ab; then
    timeout 240 python3 benchmarks/ab_prefill.py --model 20b --tokens 8192,32768 --runs 8 --variants default,triton-gemm 2>&1 | tee "$OUT/ws_ab_prefill.log"
  fi
fi
if has moews; then
  timeout 180 python3 -m pytest -x -q -m gpu tests/kernels/test_moe.py -k ws 2>&1 | tail -8 | tee "$OUT/moews_tests.log"
  timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_moe.py tests/kernels/test_fp8_gemm.py tests/test_triton_ops.py 2>&1 | tail -8 | tee -a "$OUT/moews_tests.log"
  timeout 200 python3 -m gptoss_fp8.bench.kernels_gemm --moe-variants --moe-tokens 8192,32768 --json "$OUT/moews_variants.json" > "$OUT/moews_variants.log" 2>&1
  tail -2 "$OUT/moews_variants.log"
  timeout 200 python3 benchmarks/ab_prefill.py --model 20b --tokens 8192,32768 --runs 6 --variants default,triton-moe,triton-all 2>&1 | tee "$OUT/moews_ab_20b.log"
  timeout 150 python3 benchmarks/ab_prefill.py --model 120b --tokens 8192 --runs 5 --variants default,triton-all 2>&1 | tee "$OUT/moews_ab_120b.log"
fi
if has wscheck; then
  timeout 240 python3 -m pytest -q -m gpu tests/kernels tests/test_triton_ops.py tests/test_verify_kernels.py 2>&1 | tail -8 | tee "$OUT/wscheck_tests.log"
  timeout 170 python3 -m gptoss_fp8.bench.kernels_gemm --moe-variants --moe-tokens 8192,32768 --json "$OUT/wscheck_variants.json" > "$OUT/wscheck_variants.log" 2>&1
  timeout 150 python3 benchmarks/ab_prefill.py --model 20b --tokens 8192 --runs 6 --variants default,triton-all,ws-down 2>&1 | tee "$OUT/wscheck_ab.log"
fi
if has attnws; then
  timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_attention.py -k ws 2>&1 | tail -6 | tee "$OUT/attnws_tests.log"
  timeout 120 python3 benchmarks/attn_ws_ab.py 8192 32768 131072 2>&1 | tee "$OUT/attnws_ab.log"
  timeout 90 python3 -m pytest -q -m gpu tests/kernels/test_attention.py -k "not ws" 2>&1 | tail -4 | tee -a "$OUT/attnws_tests.log"
fi
if has decode1; then
  timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_attention.py -k decode 2>&1 | tail -4 | tee "$OUT/decode1_tests.log"
  timeout 200 python3 -m gptoss_fp8.bench.kernels_attention decode_b1 2>&1 | tee "$OUT/decode1.log"
fi
if has gatherq; then
  timeout 150 python3 -m pytest -q tests/kernels/test_moe.py -k "gather" 2>&1 | tail -3 | tee "$OUT/gatherq_tests.log"
  timeout 200 python3 benchmarks/ab_prefill.py --model 20b --tokens 8192,32768 --runs 8 --variants default,gather-requant 2>&1 | tee "$OUT/gatherq_ab_20b.log"
  timeout 150 python3 benchmarks/ab_prefill.py --model 120b --tokens 8192 --runs 6 --variants default,gather-requant 2>&1 | tee "$OUT/gatherq_ab_120b.log"
fi
if has oproj; then
  timeout 150 python3 benchmarks/oproj_small.py ${OPROJ_ROWS:-4096} 2>&1 | tee "$OUT/oproj_small.log"
fi
if has final9; then  # the ninth session's closing run: defaults' GPU tests (MoE, model) and figures
  timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_moe.py tests/test_verify_kernels.py 2>&1 | tail -3 | tee "$OUT/final9_tests.log"
  timeout 60 python3 benchmarks/decode_read_probe.py 2>&1 | tee "$OUT/readprobe.log"
  timeout 230 python3 -m gptoss_fp8.cli.main bench prefill --model 20b --tokens 8192,32768 --runs 5 --peer-runs 3 \
    --json "$OUT/prefill_20b.json" 2>&1 | grep -v Warn | tee "$OUT/prefill_20b.log"
  timeout 110 python3 -m gptoss_fp8.cli.main bench prefill --model 120b --tokens 8192 --runs 5 --no-peer \
    --json "$OUT/prefill_120b.json" 2>&1 | grep -v Warn | tee "$OUT/prefill_120b.log"
fi
if has multigpu; then
  nvidia-smi topo -m 2>&1 | head -6 | tee "$OUT/multigpu_topo.txt"
  timeout 200 python3 -m pytest -q -m gpu tests/test_verify_kernels.py -k sharded -rA 2>&1 | grep -E "passed|failed|PASSED|FAILED|Error" | tail -8 | tee "$OUT/multigpu_tests.log"
  timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_attention.py -k decode 2>&1 | tail -3 | tee "$OUT/multigpu_decode_tests.log"
  timeout 150 python3 -m gptoss_fp8.bench.kernels_attention decode_merge 2>&1 | grep -v Warn | tee "$OUT/decode_merge.log"
fi
if has clocks; then
  timeout 200 python3 benchmarks/clock_watch.py "$OUT/clocks_prefill.csv" -- python3 -m gptoss_fp8.cli.main bench prefill \
    --model 20b --tokens 32768 --runs 5 --no-peer 2>&1 | grep -v Warn | tee "$OUT/clocks_prefill.log"
  timeout 120 python3 benchmarks/clock_watch.py "$OUT/clocks_profile.csv" -- python3 benchmarks/profile_prefill.py \
    --model 20b --layers 4 --tokens 32768 --rows 8 2>&1 | grep -v Warn | tee "$OUT/clocks_profile.log"
fi
if has depth; then
  for spec in "20b 4 32768" "20b 24 32768" "120b 6 8192" "120b 36 8192"; do
    set -- $spec
    timeout 150 python3 benchmarks/profile_prefill.py --model $1 --layers $2 --tokens $3 --rows 16 2>&1 | grep -v Warn | tee "$OUT/depth_$1_$2.log"
  done
fi
if has readprobe; then
  timeout 120 python3 benchmarks/decode_read_probe.py 2>&1 | tee "$OUT/readprobe.log"
fi
if has tiles; then
  timeout 300 python3 benchmarks/tile_intensity.py 2>&1 | tee "$OUT/tile_intensity.log"
fi
if has launch; then
  # host time per call (launch path) against GPU time, dense GEMM and fused MoE at small sizes
  python3 benchmarks/launch_overhead.py 2>&1 | tee "$OUT/launch_overhead.log"
fi
if has checkpoint; then
  m() { python3 -m gptoss_fp8.cli.main "$@"; }
  m synth /tmp/ck_src --preset 20b --layers 2 --overwrite >/dev/null \
    && m convert /tmp/ck_src /tmp/ck_fp8 --device cuda --overwrite 2>&1 | tail -3 | tee "$OUT/checkpoint_convert.log" \
    && m bench prefill --checkpoint /tmp/ck_fp8 --tokens 8192,32768 --runs 3 --no-peer --json "$OUT/prefill_checkpoint.json" 2>&1 | tee "$OUT/prefill_checkpoint.log" \
    && m bench prefill --model 20b --layers 2 --tokens 8192,32768 --runs 3 --no-peer 2>&1 | tee -a "$OUT/prefill_checkpoint.log"
fi
