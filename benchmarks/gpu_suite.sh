#!/usr/bin/env bash
# Everything that needs the GPU, by target; logs and JSON land under $OUT (or ./out).
# Usage (GPU machine, from the repository root): bash benchmarks/gpu_suite.sh [TARGET ...]   (default: all)
#   tests    GPU tests (pytest -m gpu), then the kernels' CPU tests run on the GPU (compiled kernels
#            instead of the interpreter)
#   pending-tests  the GPU tests of the code changed since the last GPU run (start here)
#   pending56  the fifty-sixth session's structured output on the GPU (allowed_mask / draw(allowed=) there:
#            tests/test_grammar.py, llguidance needed), then the runtime's GPU tests (tests/test_runtime_gpu.py, .whl
#            carried on PYTHONPATH for the trained fixture)
#   pending36  the thirty-sixth session's fixes: GluonTile.stage_scales' TMA boxes 16-byte aligned (and, 37th session,
#            128 bytes a stage's box), GluonTile.gather's row offsets once a tile: their GPU tests, then the 20b at
#            32768 beside the default, same process (run in the thirty-seventh session; stage scales now the default,
#            the comparison now default against wide-no-scales)
#   quant-out  the window layers' attention writing o_proj's input quantization (38th session): GPU tests, the 20b
#            beside the bf16 rows + act_quant (window-rows), same process, at 32768 and 128000
#   pending39  the thirty-ninth session's opt-ins, built without a GPU: o_proj's GEMM adding the residual in its
#            epilogue (KernelConfig.gemm_residual), the router remaking the post-attention norm's rows from the stream
#            (moe_rows_from_stream), the 128 x 256 tiles' narrow last column tile (GluonTile.narrow: o_proj, MoE down),
#            the FP8 attention's consumers quantizing their own Q tiles (attention_fp8_q_fused): their GPU tests, then
#            the 20b beside the default, each and all four, same process, 32768 / 128000
#   pending40  the fortieth session's q / k / v GEMM quantizing Q in its epilogue (KernelConfig.gemm_q_quant; one H100
#            A/B at 32768: exact, 0.5% slower; the fixed tests and the 128000 A/B not yet run): its GPU tests, then the
#            20b beside the default, same process, 32768 / 128000
#   attn-inmodel  benchmarks/attn_inmodel_probe.py: the FP8 full attention inside the 20b's forward against alone on
#            the same captured inputs, on random ones, after a heating GEMM (why 16.4 ms a layer in the model, ~14.0 alone;
#            INMODEL_ATTN=fp8-lin: fp8-lin's form 5, traced too)
#   rope-diag  benchmarks/fused_rope_diag.py: the FP8 attention's fused q rope against rotating first, byte by byte
#   quant    the quantizing kernels' hardware e4m3 cast (thirty-third session): their GPU tests (act_quant, the norm,
#            attn_quant, the MoE's, the decode kernels'), then benchmarks/quant_ab.py with it and with the old
#            rounding (GPTOSS_FP8_E4M3=soft): time and the outputs' digests, which must agree
#   gather   GluonTile.gather (the wide gate_up's A rows copied from the tokens' rows by its producer; 34th
#            session): its GPU tests, then the 20b at 32768 beside the default
#   moe-energy  the MoE GEMMs back to back at the power cap: DeepGEMM's against ours, clock and power (.peers/ carried)
#   moe-turns  GluonTile.turns (the MoE GEMMs' warpgroups in turns at the tensor core) and GluonTile.stage_scales
#            (the 128 x 256 tiles' scales through the stages, MoE and dense): the GPU tests, the MoE plans at the
#            power cap (issue 34; both built without a GPU, measure them first)
#   moe-turns-ab  the whole 20b with them, the rope fusion, the FP8 attention's Q in registers and (128000) the MoE
#            unchunked, beside the default, same process (a call of its own)
#   moe-unchunked-120b  the 120b at 128000 with its MoE over all tokens at once beside chunks of 32768 (bench
#            prefill's --moe-chunk; 128 experts: a chunk's ~1024 rows an expert pad ~6% of the MoE's tiles; 37th
#            session: -0.7%, now the 120b's default chunk, default_moe_chunk: run it with variants
#            default,moe-chunk32768 to repeat)
#   attn-offset  the Gluon attention kernels (bf16, FP8) on a later prompt chunk (q_offset): their GPU tests, then
#            benchmarks/attn_offset.py against the Triton kernel (issue 34; built without a GPU, opt-in until then)
#   segments  prefill_many's attention in one launch a layer over all chunks (KernelConfig.attention_segments, on;
#            thirtieth session, built without a GPU): the kernels' GPU tests (Triton; Gluon, opt-in
#            attention_gluon_segments), the engine under concurrency, then benchmarks/ab_prefill_many.py (one launch
#            on either kernel against a launch per chunk, the 20b, same process)
#   moe-ncu-plans  Nsight Compute on our MoE gate_up / down under those plans and the default (tensor pipe active)
#   moe-ncu  Nsight Compute on one launch of DeepGEMM's grouped gate_up and of our gate_up / down (.peers/ carried)
#   window-moe  the window-128 attention tiles side by side, the MoE's gather tiles and its clock / power back to back
#   verdict  the verdict's noise model on the GPU: benchmarks/verify_calibration.py, trained fixture + 20
#            random shapes, weights / w8a8 / kernels, prefill and decode, every bug injected (issue 32)
#   verdict-lin  the verdict with --attention fp8-lin (VL_ATTN) on the GPU: the trained fixture and 20 unseen random
#            shapes in VL_PROCS shards, every injected bug on the trained fixture (VL_MUT=0: not), merged
#   serve    bench serve --synthetic 20b (SERVE_LAYERS, default 24; or SERVE_CKPT served in its own process),
#            bench decode / prefill beside it
#   chunk    the prefill chunk size under load (bench serve --synthetic 20b --prefill-chunk, CHUNKS) and the
#            query-offset attention kernel's tests
#   engine   the serving engine in kernels mode under concurrency against generate alone (tests/test_runtime_gpu.py)
#   serve-peer  transformers' own server (transformers serve --continuous-batching, bf16) on a full synthetic
#            20b under bench serve --peer transformers at 1024-token prompts, 256 output tokens (~240 s)
#   attention  the Gluon attention's variants timed side by side (benchmarks/attn_variants.py) + GPU tests
#   fp8-probe  the FP8 attention's options at small T under a poisoned allocator, the FP8 attention GPU tests,
#            the FP8 options timed (issue 34)
#   prefill-fp8  bench prefill --attention fp8: 20b at 32768 / 128000, 120b at 128000 (issue 34's must-shows)
#   pending41  what the forty-first session left unrun (no H200 lent): the must-shows on the H200 (prefill-fp8's three
#            readings, then a 7-run A/B reading at 32768), then the Gluon window kernel's fixed GPU tests (its model
#            form at 32768, three consumers on a 3-deep Q ring) and the Triton tiles' (PrefillTile.one_loop's). One
#            call on an H200 (~500 s)
#   pending42  the forty-second session's checks: (P42_MUST=1, on an H200: pending41's must-shows) the GPU tests of the
#            quantizers without their clamp and of the Gluon window kernel's pair option, then window-gluon's sweep
#            and 20b A/B (default, gluon-window, gluon-window-pair)
#   pending43  the forty-third session's gathering gate_up (GluonTile.gather: a 4-warp producer, the row scales into
#            the stages too): its GPU tests (the pre-gathered plan's bits), the MoE's plans back to back (moe_parts.py
#            --only gather, 32768 tokens), the 20b beside the default, same process (P43_VARIANTS), 32768 / 128000
#   pending44  the forty-fourth session's gather walking the tokens (KernelConfig.moe_gather_by_token: each token's
#            FP8 row read once and stored into its k sorted rows) and the MoE tiles' per-thread stage release
#            (GluonTile.thread_release): their GPU tests, moe_parts.py's gather tiles both ways (rounds) and the MoE
#            back to back (P44_ONLY), then the 20b beside the default, same process (P44_VARIANTS), 32768 / 128000
#   norm-rows  the forty-fourth session's post-attention norm two rows a program (KernelConfig.norm_stream_rows=2, on
#            by default, its GPU test not yet run): the norm tests on the GPU, norm_sweep.py, the 20b beside
#            norm-one-row, same process, 32768 / 128000
#   prefill-lin  --attention fp8-lin (45th session): its GPU tests, the 20b beside --attention fp8 (same process),
#            bench prefill with it (LIN_SPECS; the 120b at 128000 needs an H200's memory; LIN_KOPT: a kernel option,
#            e.g. attention_exp_lin=5)
#   pending45  the forty-fifth session's exp_lin (the FP8 attention's P codes without 2^x, opt-in, another spec): its
#            GPU tests, attn_variants.py beside the default (LIN_VARIANTS; exp_lin 3 "fp8-lin16n" not yet run), again
#            with Q / K scaled to a trained model's amax (--qk-scale 7), energy a launch at 128000 (LIN_ENERGY)
#   must46   the forty-sixth session's must-show call (H200): fp8-lin's GPU tests, the 20b at 128000 beside fp8 and
#            fp8-lin's forms (same process), bench prefill --attention fp8-lin with exp_lin 5 (120b at 128000, 20b at
#            128000 and 32768; ~520 s)
#   pending46  the forty-sixth session's exp_lin 4 / 5 (fp8-lin's codes against the running max first: no fp32 row max,
#            no rescale in most steps) and the 45th's exp_lin 3: GPU tests, attn_variants (random inputs, then Q / K at
#            a trained model's amax), the 20b beside fp8 / fp8-lin (P46_AB_S, off by default)
#   distinct  bench prefill --distinct-layers (49th session): the 120b cut to 14 layers with its own weights beside 7
#            layers' repeated, then the whole 120b at 128000 on 12 layers' weights (fits 80 GB; DL_SPECS, LIN_RUNS)
#   moe120   the 120b's MoE beside the 20b's (50th session: 8-10% more a layer, same FLOPs): profile_prefill.py
#            on both (4 layers, 128000 tokens, fp8-lin), then moe_parts.py's stage-scales tiles at group_m 8 / 16 / 32 /
#            64 back to back at 128 and 32 experts (M120_TOKENS, M120_EXPERTS, M120_PLAN_S), then the whole 120b on 12
#            layers' weights beside group_m 32, same process (M120_VARIANTS, M120_AB_S)
#   lin6     the fifty-first session's exp_lin 6 (5 with a fast step whose codes are all <= 0 skipping its PV and
#            row-sum MMAs, the same bytes): its GPU tests (6 against 5 bit for bit, against the lin spec), then
#            attn_variants beside 5 at 128000 on random inputs and on Q / K at a trained model's amax (--qk-scale 7),
#            the whole 20b at 128000 beside 5 (same process, L6_AB_S); L6_K: the tests' -k; L6_TRACE_S: form 5's trace
#   lin52    the fifty-second session's call (either card, ~300 s): form 6's GPU tests and the traced launches' (the
#            bounds in their own pointer), attn_variants 5 beside 6 at 128000 on random inputs (did the release fix
#            take 6's 5% away?), then form 5's step traced phase by phase at 32768 (attn_trace.py, its first trace):
#            lin6 with those settings (its logs l6_*)
#   must51   the must-show call (H200, ~330 s): bench prefill --attention fp8-lin (exp_lin 8, the default form since
#            the fifty-fourth session; M51_FORM) on the 120b at 128000, then the 20b at 128000 and 32768 (M51_SPECS,
#            M51_RUNS)
#   lin8     the fifty-fourth session's exp_lin 8 (5 with the fast step's rescale unbranched: no warpgroup-wide
#            maximum, the same bytes): lin6's steps beside 5 (its logs l6_*; L8_TEST_S, L8_VAR_S, L8_WIDE_S, L8_AB_S)
#   prefix   the fifty-fourth session's prefix cache: its GPU test (tests/test_runtime_gpu.py -k prefix, .whl carried on
#            PYTHONPATH for the trained fixture), then benchmarks/prefix_turns.py: a next turn's first token with the
#            cache (in place, copied) and without, the 20b at PT_LENGTHS earlier tokens (+PT_NEW), same process
#   quant-out-fp8  the forty-third session's FP8 attention writing o_proj's quantization (two heads a program,
#            KernelConfig.attention_fp8_quant_out): its GPU tests (act_quant's bytes), the kernel beside rows +
#            act_quant (quant_out_bench.py --full), the 20b beside the default, same process, 32768 / 128000
#   window     benchmarks/window_sweep.py --model-form: the window layers' Triton tiles (PrefillTile.one_loop, 41st
#            session) as the 20b calls them, then Nsight Compute on one launch of WINDOW_NCU_TILES (digest; a Gluon
#            option set with WINDOW_NCU_KERNEL=_window_kernel)
#   window-gluon  the forty-first session's warp-specialized Gluon window kernel (KernelConfig.attention_gluon_window,
#            built without a GPU; the 42nd's pair option: a step's two heads interleaved): its GPU tests, the kernel
#            beside the Triton tiles (window_sweep.py --model-form, WG_ONLY), the 20b beside the default, same process,
#            32768 / 128000 (WG_VARIANTS)
#   attention-ncu  Nsight Compute on one launch of the Gluon attention per variant (NCU_VARIANTS)
#   attn-trace  the FP8 attention's steps timed phase by phase from the SM clock (benchmarks/attn_trace.py;
#            TRACE_VARIANTS: ';'-separated keyword sets, '' the default; TRACE_TOKENS)
#   attn-energy  time, SM clock, board power and energy a launch of the FP8 attention and its timing probes
#            (ENERGY_VARIANTS: ';'-separated attn_ncu.py variants; ENERGY_TOKENS): it runs at the power cap
#   flashinfer  FlashInfer's sink prefill beside ours (benchmarks/flashinfer_peer.py; .fi/ carried), then the
#            flashinfer attention backend's GPU tests (tests/test_flashinfer_attention.py)
#   attention-fp8  the FP8 attention kernel's GPU tests against its spec, the fused quantization's, and its bench (issue 34)
#   hf       import gptoss_fp8.hf: transformers' from_pretrained on the GPU with our FP8 weights and kernels
#   verdict-cpu  the verdict's calibration through Triton's interpreter on the machine's CPUs (14 processes)
#   kernels  gptoss-fp8 bench kernels: dense GEMM + bias, MoE FFN, router, attention, rope, decode
#   prefill  gptoss-fp8 bench prefill: 20b at 8192 / 32768 tokens (transformers bf16 beside it when
#            importable), 120b at 8192; CUDA-graph timing too
#   verify   verify-logits --device cuda on a tiny checkpoint and on a synthetic 20b cut to 2 layers
#            (synth, convert, verify; wall time and reports)
#   convert  convert --device cuda on a synthetic 20b cut to 8 layers, beside the disk's bandwidth
#   peers    DeepGEMM side by side with our MoE FFN and dense GEMM (needs .peers/ carried into the call):
#            its example, deepgemm_peer.py, the deep_gemm backend's GPU tests, bench kernels --only gemm
#            with deep_gemm importable, and verify-logits --mode kernels --gemm deep_gemm on a tiny
#            checkpoint and a synthetic 20b cut to 2 layers
#   skinny   the decode-sized kernels: their GPU tests, quick sweeps, a profile of 20b decode steps
#   decode   gptoss-fp8 bench decode: 20b and 120b, batch 1-128, context 8192 / 32768
#   sweep    benchmarks/gemm_sweep.py: the GEMM variants beside DeepGEMM and cuBLAS
#   sharded  the sharded benches' GPU tests; with several GPUs, bench prefill at the seed's layouts
#            (tp = ep = 2 / 4 / 8, 8192 and 128000 tokens) and bench decode --tp (issue 25)
#   peer-decode  transformers' decode peer at its best (static cache, torch.compile, CUDA graph) beside
#            ours at batch 1, and its GPU tests
#   decode-ab  one-process decode A/Bs of the kernel choices (benchmarks/ab_decode.py: the MoE's K
#            blocks a step end to end, the wgmma tile), the cuBLAS scale-layout probe, the fused
#            o_proj + norm kernel against the two launches, the decode MoE's k_step sweep
# The device machine has no network: OpenAI's reference (for the tests and verify that run it) comes
# from .whl/gpt_oss (the installed package copied there, git-ignored, carried with the call), and
# DeepGEMM from .peers/ (carried too).
set -uo pipefail
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1
if [[ -d .whl/gpt_oss ]]; then export PYTHONPATH=$PYTHONPATH:$(pwd)/.whl; fi
what=${*:-all}
has() { [[ " $what " == *" all "* || " $what " == *" $1 "* ]]; }
m() { python3 -m gptoss_fp8.cli.main "$@"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"

if has tests; then
  python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/tests_gpu.log"
  # The kernels' CPU tests pick CUDA when it is there: run them on the GPU too (CPU-tensor
  # interpreter cases skip themselves there).
  python3 -m pytest -q -m "not gpu" tests/kernels tests/test_triton_ops.py 2>&1 | tee "$OUT/tests_cpu_on_gpu.log"
fi

if has pending-tests; then
  # the GPU tests of what changed since the last complete GPU run (twenty-eighth session, built without a GPU):
  # q's rope inside the FP8 quantization and the window kernel (attention, attn_quant, triton_ops, model chunks,
  # the verdict's FP8 attention), the gather's MN-major scales (test_moe; the turns / stage-scales GEMM cases are
  # target moe-turns's). --dist load (the default loadfile put test_attention.py's 466 cases in one worker); six
  # workers, the MoE's three (twelve ran the GPU out of memory); -rf under SIGINT: the names of failures survive a
  # cut, the whole log comes back. Twenty-ninth session: a prefill's last layer on its last row only past its
  # K / V (GptOss.prune_last_layer): the chunked-prefill, decode and verdict-decode GPU tests. Thirtieth session: a
  # serving step's chunks in one attention launch a layer: its tests are target segments's (deselected here by
  # PENDING_K, so that this target stays within one call: PENDING_K="" runs them here too)
  # PENDING_WORKERS: 6 fit the H200's 141 GB; on an H100 (80 GB) 12 of the large FP8 cases ran out of memory with 6
  # (thirty-eighth session: all 47 passed again on 2)
  timeout -s INT ${PENDING_LIMIT:-330} python3 -m pytest -q -rf -n ${PENDING_WORKERS:-6} --dist load tests/kernels/test_attention.py \
    tests/kernels/test_attn_quant.py tests/test_triton_ops.py tests/test_model_chunks.py tests/test_hf_attention.py \
    tests/test_verify_attention_fp8.py tests/kernels/test_attention_quant_out.py \
    -k "${PENDING_K:-not segments and not prefill_many}" > "$OUT/pending_tests.log" 2>&1
  if [[ ${PENDING_MOE_LIMIT:-230} != 0 ]]; then  # (PENDING_MOE_LIMIT=0: the attention / model part only)
    timeout -s INT ${PENDING_MOE_LIMIT:-230} python3 -m pytest -q -rf -n 4 --dist load tests/kernels/test_moe.py \
      tests/test_decode.py tests/test_verify_decode.py -k "not wide_gpu" > "$OUT/pending_tests_moe.log" 2>&1
  fi
  tail -4 "$OUT"/pending_tests*.log
fi

if has pending56; then  # (.whl/w: llguidance, openai-harmony, bpe-openai wheels for the machine's Python 3.12)
  if [[ -d .whl/w ]]; then
    [[ -d /tmp/site/llguidance ]] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      .whl/w/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  if [[ -d .whl/cache ]]; then export XDG_CACHE_HOME=$(pwd)/.whl/cache; fi
  timeout -s INT ${P56_TEST_S:-240} python3 -m pytest -q -rf tests/test_grammar.py tests/test_runtime_gpu.py \
    > "$OUT/pending56.log" 2>&1
  tail -4 "$OUT/pending56.log"
fi

if has pending36; then
  # (a box starting off a 16-byte boundary stops the launch: benchmarks/tma1d_probe.py; the tests' "sc" cases first)
  timeout -s INT ${P36_TEST_S:-240} python3 -m pytest -q -rf -n 3 tests/kernels/test_moe.py tests/kernels/test_fp8_gemm.py \
    -k "serial_gpu or wide_gpu or stage_scales or gather" > "$OUT/p36_tests.log" 2>&1
  tail -4 "$OUT/p36_tests.log"
  [[ ${P36_AB_S:-300} == 0 ]] || timeout ${P36_AB_S:-300} python3 benchmarks/ab_prefill.py --model 20b --tokens 32768 \
    --runs 5 --variants "${P36_VARIANTS:-default,wide-no-scales,wide-gather,all-scales}" --attention fp8 2>&1 | grep -v Warn \
    | tee "$OUT/p36_ab32k.log"
fi

if has rope-diag; then
  # the FP8 attention's q rotated in its quantization against rotated first (31st session's failed bit-equality)
  timeout ${ROPE_DIAG_S:-150} python3 benchmarks/fused_rope_diag.py 2>&1 | grep -v Warn | tee "$OUT/fused_rope_diag.log"
fi

if has quant; then
  # thirty-third session (no device): act_quant.e4m3, the hardware cast in every quantizing kernel instead of
  # round_to_e4m3's integer arithmetic; the same values (test_e4m3_cast_gpu against torch's cast on every tie)
  # (QUANT_WORKERS: 4 fit the H200's 141 GB; on an 80 GB H100 four workers of the MoE's large cases ran out of memory)
  timeout -s INT ${QUANT_TEST_S:-200} python3 -m pytest -q -rf -n ${QUANT_WORKERS:-4} --dist load tests/kernels/test_act_quant.py \
    tests/kernels/test_norm.py tests/kernels/test_attn_quant.py tests/kernels/test_gemv_norm.py \
    tests/kernels/test_moe_gemv.py tests/kernels/test_moe.py -k "not wide_gpu and not turns and not stage_scales" \
    > "$OUT/quant_tests.log" 2>&1
  tail -4 "$OUT/quant_tests.log"
  for mode in soft ""; do
    GPTOSS_FP8_E4M3=$mode timeout ${QUANT_AB_S:-90} python3 benchmarks/quant_ab.py --tokens ${QUANT_TOKENS:-32768,128000} \
      2>&1 | grep -v Warn | tee -a "$OUT/quant_ab.log"
  done
  # (the digests: each kernel and length must print one digest in both modes)
  grep "| digest" "$OUT/quant_ab.log" | sed -E 's/^[a-z]+ +//; s/ *\| .* \| / /' | sort -u \
    | sed -E 's/ digest [0-9a-f]+$//' | uniq -d | sed 's/^/DIGESTS DIFFER: /' | tee -a "$OUT/quant_ab.log"
fi

if has gather; then
  # thirty-fourth session (no device at first): GluonTile.gather, the wide gate_up's A rows by cp.async from the
  # tokens' own FP8 rows (no gather_act_quant): its GPU tests (bits equal to the pre-gathered plan), then the 20b
  # at 32768 with it beside the default, same process (GATHER_AB_S; 0 skips)
  timeout -s INT ${GATHER_TEST_S:-150} python3 -m pytest -q -rf -n 4 --dist load tests/kernels/test_moe.py -k "gather" \
    > "$OUT/gather_tests.log" 2>&1
  tail -4 "$OUT/gather_tests.log"
  if [[ ${GATHER_AB_S:-200} != 0 ]]; then
    timeout ${GATHER_AB_S:-200} python3 benchmarks/ab_prefill.py --model 20b --tokens 32768 --runs 5 \
      --variants default,wide-gather --attention fp8 2>&1 | grep -v Warn | tee "$OUT/gather_ab32k.log"
  fi
fi

if has moe-energy; then
  # issue 34: the MoE GEMMs back to back at the power cap, DeepGEMM's two grouped GEMMs against our gather + gate_up +
  # down (E 32, T 32768), each under the clock / power watch: the clock each holds at 700 W is its energy a FLOP
  source .peers/deepgemm_setup.sh .peers/deepgemm-03d0be3.tgz >/dev/null
  for who in deepgemm ours; do
    python3 benchmarks/clock_watch.py "$OUT/moe_b2b_$who.csv" -- python3 benchmarks/deepgemm_peer.py --back-to-back $who \
      --seconds ${MOE_SECONDS:-6} 2>&1 | grep -v Warn | tee "$OUT/moe_b2b_$who.log"
  done
fi

if has moe-turns; then
  # issue 34: GluonTile.turns (built without a GPU in the 27th session): the heavy-load MoE tiles' two consumer
  # warpgroups issue their wgmmas in turns; GluonTile.stage_scales (28th session): the 128 x 256 tiles' scales
  # through the stages (MoE and dense). The GPU tests first (a miscounted turn or byte count hangs: time-limited;
  # the "sc" cases check the stage scales' bits against the tile without them), then the MoE plans at the power cap
  # (moe_parts.py --plans). The whole model: target moe-turns-ab (a call of its own: both exceed one call's 600 s)
  timeout -s INT ${MOE_TURNS_TEST_S:-240} python3 -m pytest -q -rf -n 3 tests/kernels/test_moe.py tests/kernels/test_fp8_gemm.py \
    -k "wide_gpu or turns or stage_scales or gather_act_quant or serial_gpu" > "$OUT/moe_turns_tests.log" 2>&1
  tail -4 "$OUT/moe_turns_tests.log"
  # (MOE_TURNS_PLANS_S=0: the tests only)
  [[ ${MOE_TURNS_PLANS_S:-200} == 0 ]] || timeout ${MOE_TURNS_PLANS_S:-200} python3 benchmarks/moe_parts.py --tokens 32768 --plans 3 2>&1 | grep -v Warn | grep "plan" \
    | tee "$OUT/moe_turns_plans.log"
fi

if has segments; then
  # thirtieth session (no device lent): the serving engine's prompts of a step attend in one Triton launch a layer
  # (k_starts / q_offsets: a full layer's keys read where the cache holds them), not a launch per chunk
  timeout -s INT ${SEGMENTS_TEST_S:-240} python3 -m pytest -q -rf tests/kernels/test_attention.py \
    tests/test_runtime_gpu.py tests/test_triton_ops.py -k "segments or greedy or prefill_many or given_no_keys" \
    > "$OUT/segments_tests.log" 2>&1
  tail -4 "$OUT/segments_tests.log"
  if [[ ${SEGMENTS_S:-300} != 0 ]]; then  # (SEGMENTS_S=0: the tests only)
    timeout ${SEGMENTS_S:-300} python3 benchmarks/ab_prefill_many.py --runs 10 2>&1 | grep -v Warn \
      | tee "$OUT/ab_prefill_many.log"
  fi
  if [[ ${SEGMENTS_FP8_S:-200} != 0 ]]; then  # (thirty-second session) the same under --attention fp8: SegmentPlan
    timeout ${SEGMENTS_FP8_S:-200} python3 benchmarks/ab_prefill_many.py --runs 6 --attention fp8 2>&1 | grep -v Warn \
      | tee "$OUT/ab_prefill_many_fp8.log"
  fi
fi

if has moe-unchunked-120b; then
  # issue 34: the 120b's MoE in chunks of 32768 tokens (bench prefill's default) pads each expert's rows to 128-row
  # tiles four times at 128000 tokens (128 experts x ~1024 rows a chunk: ~64 rows of padding an expert a chunk,
  # ~6% of the MoE's work; ~1.6% unchunked) and leaves its combine unfused; same process, interleaved
  timeout 420 python3 benchmarks/ab_prefill.py --model 120b --tokens 128000 --runs 3 \
    --variants default,moe-chunk32768 --attention fp8 2>&1 | grep -v Warn | tee "$OUT/moe_unchunked_120b.log"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$OUT/moe_unchunked_120b.log"
fi

if has attn-offset; then
  # issue 34 (29th session): KernelConfig.attention_gluon_offset / attention_gluon_fp8_offset. If the tests pass and
  # the Gluon rows win, turn both on (kernels/config.py) and say so in BENCHMARKS.md
  timeout -s INT 240 python3 -m pytest -q -rf -n 4 --dist load tests/kernels/test_attention.py -k "offset" \
    > "$OUT/attn_offset_tests.log" 2>&1
  tail -4 "$OUT/attn_offset_tests.log"
  timeout 240 python3 benchmarks/attn_offset.py --fp8-tiles 128x64x8x3r128,128x64x8x3,128x64x8x4,128x32x4x3 2>&1 \
    | grep -v Warn | tee "$OUT/attn_offset.log"
  # the whole 20b prefilled as the serving engine feeds a long prompt (chunks of 8192 into a cache) beside the whole
  # prompt at once, the later chunks on the Triton / the Gluon attention
  timeout 150 python3 benchmarks/ab_prefill.py --model 20b --tokens 32768 --runs 3 \
    --variants default,chunked,chunked-gluon --attention fp8 2>&1 | grep -v Warn | tee "$OUT/attn_offset_ab.log"
fi

if has moe-turns-ab; then
  # issue 34: the whole 20b with GluonTile.turns / stage_scales beside the default, same process (ab_prefill.py); q's
  # rope as its own pass ("unfused-rope", as before the 28th session) against its fusion (the default now); the FP8
  # attention's Q in registers ("fp8-qreg"); at 128000 the MoE unchunked; the last layer on every row
  # ("full-last-layer", before the 29th session's GptOss.prune_last_layer); at 128000 the chunked MoE's combine
  # written and read back ("chunk-combine", before the 34th session's out= rows). The kernel alone:
  # ATTN_VARIANTS=fp8,fp8-qreg bash benchmarks/gpu_suite.sh fp8-probe
  # (AB32K / AB128K: the variants at 32768 / 128000 tokens, "" skips that length; AB32K_S / AB128K_S their limits)
  v32=${AB32K-default,full-last-layer,unfused-rope,unfused-window-rope,fp8-qreg,wide-turns,wide-scales,wide-turns-scales,all-turns,all-scales,all-turns-scales}
  v128=${AB128K-default,chunk-combine,moe-unchunked,fp8-lanemax,wide-turns-scales,all-turns-scales,all-scales}
  [[ -z $v32 ]] || timeout ${AB32K_S:-240} python3 benchmarks/ab_prefill.py --model 20b --tokens 32768 --runs 5 \
    --variants "$v32" --attention fp8 2>&1 | grep -v Warn | tee "$OUT/moe_turns_ab32k.log"
  [[ -z $v128 ]] || timeout ${AB128K_S:-300} python3 benchmarks/ab_prefill.py --model 20b --tokens 128000 --runs 3 \
    --variants "$v128" --attention fp8 2>&1 | grep -v Warn | tee "$OUT/moe_turns_ab128k.log"
fi

if has moe-ncu; then
  # issue 34: Nsight Compute on one launch of DeepGEMM's grouped gate_up and of ours (E 32, T 32768): tensor pipe
  # activity, issue slots, warp stalls; what lets DeepGEMM's MoE do 21% more per joule at the cap (moe-energy)
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  mkdir -p "$OUT/ncu"
  source .peers/deepgemm_setup.sh .peers/deepgemm-03d0be3.tgz >/dev/null
  for spec in "deepgemm fp8_gemm" "ours _ws_moe_gemm_wide_kernel" "ours _ws_moe_down_kernel"; do
    set -- $spec
    rep="$OUT/ncu/$1$2"
    timeout ${NCU_S:-150} "$NCU" --clock-control none --set full --import-source no -k regex:$2 --launch-skip 4 \
      --launch-count 1 -f -o "/tmp/$1$2" python3 benchmarks/deepgemm_peer.py --back-to-back $1 --seconds 0.3 2>&1 | tail -3
    "$NCU" --import "/tmp/$1$2.ncu-rep" --page raw --csv > "/tmp/$1$2_raw.csv" 2>&1
    "$NCU" --import "/tmp/$1$2.ncu-rep" --page source --csv --print-source sass > "/tmp/$1$2_sass.csv" 2>&1
    "$NCU" --import "/tmp/$1$2.ncu-rep" --page details > "$rep.details.txt" 2>&1
    python3 benchmarks/ncu_digest.py "/tmp/$1$2_raw.csv" "/tmp/$1$2_sass.csv" > "$rep.digest.txt" 2>&1
  done
fi

if has moe-ncu-plans; then
  # issue 34: Nsight Compute on one launch of our MoE gate_up and down under the plans of GluonTile.turns /
  # stage_scales against the default (E 32, T 32768): does the tensor pipe's 65% active (27th session) move?
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  mkdir -p "$OUT/ncu"
  # (MOE_NCU_PLANS: ';'-separated moe_parts.py plan prefixes; MOE_NCU_KERNELS: the kernels, space-separated)
  IFS=';' read -r -a ncu_plans <<< "${MOE_NCU_PLANS:-default;turns (;stage scales;turns + stage}"
  for plan in "${ncu_plans[@]}"; do
    tag=$(echo "$plan" | tr -dc 'a-z')
    for kern in ${MOE_NCU_KERNELS:-_ws_moe_gemm_wide_kernel _ws_moe_down_kernel}; do
      rep="$OUT/ncu/plan_${tag}$kern"
      timeout ${NCU_S:-120} "$NCU" --clock-control none --set full --import-source no -k regex:$kern --launch-skip 2 \
        --launch-count 1 -f -o "/tmp/plan_${tag}$kern" python3 benchmarks/moe_parts.py --launch "$plan" --launches 4 \
        2>&1 | tail -2
      "$NCU" --import "/tmp/plan_${tag}$kern.ncu-rep" --page raw --csv > "/tmp/plan_${tag}${kern}_raw.csv" 2>&1
      "$NCU" --import "/tmp/plan_${tag}$kern.ncu-rep" --page source --csv --print-source sass \
        > "/tmp/plan_${tag}${kern}_sass.csv" 2>&1
      # (MOE_NCU_GREP: more raw metrics in the digest; by default the L2's sectors by source unit, hits and misses,
      # and DRAM's sectors: where a plan's DRAM reads come from)
      python3 benchmarks/ncu_digest.py "/tmp/plan_${tag}${kern}_raw.csv" "/tmp/plan_${tag}${kern}_sass.csv" \
        --grep "${MOE_NCU_GREP:-^lts__t_(sectors|requests)_srcunit_\w+(_lookup_(hit|miss))?\.sum$|^dram__sectors_\w+\.sum$}" \
        > "$rep.digest.txt" 2>&1
      grep -i -m3 "tensor\|pipe" "$rep.digest.txt"
    done
  done
fi

if has window-moe; then
  # issue 34: the window-128 Triton tiles side by side (benchmarks/window_sweep.py), the MoE's row gather per tile and
  # the MoE back to back under the clock / power watch (benchmarks/moe_parts.py: at the power cap?)
  python3 benchmarks/window_sweep.py 2>&1 | grep -v Warn | tee "$OUT/window_sweep.log"
  python3 benchmarks/clock_watch.py "$OUT/moe_clock.csv" -- python3 benchmarks/moe_parts.py --tokens 32768 --seconds 5 \
    --plans ${MOE_PLAN_SECONDS:-3} 2>&1 | grep -v Warn | tee "$OUT/moe_parts.log"
fi

if has verdict; then
  # issue 32: the noise-following verdict on the trained fixture and 20 unseen random shapes, every mode,
  # prefill and --decode 16; every bug of tests/mutations.py injected on the trained fixture (both conversions)
  timeout 500 python3 benchmarks/verify_calibration.py --device cuda --random 20 --modes weights,w8a8,kernels \
    --decode 16 --mutations 2 --json "$OUT/verdict_cuda.json" 2>&1 | tee "$OUT/verdict_cuda.log"
fi

if has verdict-lin; then
  # issue 34's last must-show with fp8-lin's kernel (exp_lin 5, the default form) on the GPU: the verdict on the trained
  # fixture and 20 unseen random shapes (both conversions, weights / w8a8 / kernels, prefill: FP8 attention has no
  # --decode) in VL_PROCS shards, and every bug of tests/mutations.py injected on the trained fixture (both conversions,
  # the w8a8 and kernels modes) in a process of its own; then merged
  vl() {  # shard name, then verify_calibration.py's arguments
    local name=$1; shift
    timeout ${VL_S:-540} python3 benchmarks/verify_calibration.py --device cuda --modes weights,w8a8,kernels --decode 0 \
      --attention ${VL_ATTN:-fp8-lin} --json "$OUT/verdict_lin_$name.json" "$@" > "$OUT/verdict_lin_$name.log" 2>&1
  }
  [[ ${VL_MUT:-1} == 0 ]] || vl mut --random 0 --mutations 2 --only-mutations &
  n=${VL_PROCS:-3}
  for k in $(seq 0 $((n - 1))); do vl s$k --random 20 --shard $k/$n & done
  wait
  tail -n 4 "$OUT"/verdict_lin_*.log > "$OUT/verdict_lin_tails.txt"
  python3 benchmarks/verify_calibration.py --merge "$OUT"/verdict_lin_*.json --json "$OUT/verdict_lin.json" 2>&1 \
    | tee "$OUT/verdict_lin.log"
  grep -h "FAIL\|MISSED" "$OUT"/verdict_lin_*.log | head -20
fi

if has serve; then
  # issue 35 on the GPU: the server (kernels, CUDA graphs per batch bucket) over the 20b (SERVE_LAYERS layers,
  # default all 24) at real shapes with random weights, built on the GPU (`bench serve --synthetic`: no
  # checkpoint to synthesize, convert and load; SERVE_CKPT=DIR serves a converted checkpoint instead, in a
  # process of its own), the load generator in processes of its own: 1024- and 8192-token prompts x 256
  # output tokens at concurrency 1 / 16 / 64 after a warm-up (kernel JIT); then `bench decode` / `bench
  # prefill` of the same model for the must-show ratios. The server's packages (fastapi, uvicorn, pydantic,
  # openai-harmony) travel as wheels in .whl/w, the o200k tokenizer file in .whl/cache. SERVE_SHARED=N: every case's
  # prompts share their first N tokens (bench serve --shared-prefix: the prefix cache under load, its cached_pct).
  # SERVE_STRUCTURED=1: every completion through a JSON-string grammar (bench serve --structured: structured output's
  # host cost under load; llguidance from .whl/w, benchmarks/gpu_carry.sh).
  if [[ -d .whl/w ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/w/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  if [[ -d .whl/cache ]]; then export XDG_CACHE_HOME=$(pwd)/.whl/cache; fi
  sl=${SERVE_LAYERS:-24}
  lens=${SERVE_PROMPTS:-1024,8192} conc=${SERVE_CONC:-1,16,64}
  if [[ -z ${SERVE_CKPT:-} ]]; then
    timeout ${SERVE_S:-300} python3 -m gptoss_fp8.cli.main bench serve --synthetic 20b --layers $sl --concurrency $conc \
      --prompt-len $lens --output-len 256 --warmup 64 --shared-prefix ${SERVE_SHARED:-0} \
      $([[ -n ${SERVE_STRUCTURED:-} ]] && echo --structured) --json "$OUT/bench_serve.json" \
      2>&1 | grep -v Warn | tail -14 | tee -a "$OUT/bench_serve.log"
  else
    port=8123 t0=$SECONDS
    python3 -m gptoss_fp8.cli.main serve $SERVE_CKPT --device cuda --max-batch 64 --max-context 8448 --port $port \
      > "$OUT/serve_server.log" 2>&1 &
    spid=$!
    get() { python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())" "$1"; }
    until get http://127.0.0.1:$port/health > /dev/null 2>&1; do
      if (( SECONDS - t0 > 180 )) || ! kill -0 $spid 2>/dev/null; then
        echo "serve: the server did not come up in $((SECONDS - t0)) s" | tee -a "$OUT/bench_serve.log"
        tail -20 "$OUT/serve_server.log" | tee -a "$OUT/bench_serve.log"; break
      fi
      sleep 2
    done
    echo "serve: healthy after $((SECONDS - t0)) s (load, KV, graph capture)" | tee -a "$OUT/bench_serve.log"
    timeout ${SERVE_S:-300} python3 -m gptoss_fp8.cli.main bench serve http://127.0.0.1:$port --concurrency $conc \
      --prompt-len $lens --output-len 256 --warmup 64 --json "$OUT/bench_serve.json" 2>&1 | tail -12 \
      | tee -a "$OUT/bench_serve.log"
    get http://127.0.0.1:$port/metrics | grep -E '^gptoss_(kv|requests|tokens|engine)' | tee -a "$OUT/bench_serve.log"
    kill $spid; wait $spid 2>/dev/null
  fi
  if [[ -z ${SERVE_NO_BENCH:-} ]]; then
    timeout 100 python3 -m gptoss_fp8.cli.main bench decode --model 20b --layers $sl --batch 1,16,64 --context 1280 \
      --no-peer --json "$OUT/bench_serve_decode.json" 2>&1 | grep -v Warn | tail -8 | tee -a "$OUT/bench_serve.log"
    timeout 60 python3 -m gptoss_fp8.cli.main bench prefill --model 20b --layers $sl --tokens 1024,8192 --runs 3 --no-peer \
      2>&1 | grep -v Warn | tail -6 | tee -a "$OUT/bench_serve.log"
  fi
  if [[ -n ${SERVE_NULL:-} ]]; then
    # the host path alone on this machine's CPUs: the same server over a model that costs nothing, a decode
    # step of 10 ms (the 20b's at batch 64, GIL released) and of 0 ms
    for ms in 10 0; do
      timeout 120 python3 -m gptoss_fp8.cli.main bench serve --null-model --null-step-ms $ms --concurrency 1,16,64 \
        --prompt-len 1024 --output-len 128 2>&1 | tail -5 | tee -a "$OUT/bench_serve_null.log"
    done
  fi
fi

if has chunk; then
  # the prefill chunk under load: later chunks of a prompt on the attention kernel with a query offset. The query-
  # offset kernel's GPU tests, then bench serve --synthetic 20b at 64 streams of 1024-token prompts and one stream of
  # 8192-token prompts, per chunk size (CHUNKS, default 8192 2048)
  if [[ -d .whl/w ]]; then
    [[ -d /tmp/site/fastapi ]] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/w/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  if [[ -d .whl/cache ]]; then export XDG_CACHE_HOME=$(pwd)/.whl/cache; fi
  timeout ${CHUNK_TEST_S:-150} python3 -m pytest -q tests/kernels/test_attention.py tests/test_triton_ops.py \
    -k "q_offset or chunked_prefill" 2>&1 | tail -4 | tee "$OUT/chunk_tests.log"
  for c in ${CHUNKS:-8192 2048}; do
    for case in "64 1024 128" "1 8192 6"; do
      set -- $case
      echo "prefill chunk $c, concurrency $1, prompt $2:" | tee -a "$OUT/bench_chunk.log"
      timeout ${CHUNK_S:-150} python3 -m gptoss_fp8.cli.main bench serve --synthetic 20b --prefill-chunk $c --concurrency $1 \
        --prompt-len $2 --output-len 256 --requests $3 --warmup $1 2>&1 | grep -v Warn | tail -2 | tee -a "$OUT/bench_chunk.log"
    done
  done
fi
if has engine; then
  # issue 35: the engine in kernels mode (CUDA graphs per bucket) under concurrency against generate alone
  timeout 150 python3 -m pytest -q -s -m gpu tests/test_runtime_gpu.py 2>&1 | tail -15 | tee "$OUT/runtime_gpu.log"
fi

if has serve-peer; then
  # issue 35's peer: transformers' own server (`transformers serve --continuous-batching`: paged KV cache, CUDA
  # graphs on; bf16: without the `kernels` package transformers dequantizes the MXFP4 source) on the full
  # synthetic 20b source (24 layers, random weights; PEER_SRC names an existing source to reuse), then the
  # load of the serve target: bench serve --peer transformers (text prompts of the same token counts in the
  # peer tokenizer written into a synthetic source, the output length forced through generation_config, a
  # warm-up first: bench/serve_peer.py). Each step's timeout is what is left of PEER_BUDGET (240 s), so the
  # target ends within it; the server's options can be changed with PEER_SERVE_ARGS (--no-cb-use-cuda-graph).
  # Its defaults ran out of memory on the H200 (5.17, 2-layer 20b): with the gpt-oss sinks its paged attention is
  # eager (no paged SDPA / flash kernel without the `kernels` package and the hub), which materializes heads x
  # batch tokens x cached tokens scores: a 24 GiB allocation after its KV cache took ~117 GB. So by default
  # 256 tokens per forward and half the memory for the KV cache.
  peer_t0=$SECONDS
  # seconds left of the budget less $1, at least 1 (timeout 0 would mean no limit)
  peer_left() { local l=$(( ${PEER_BUDGET:-240} - (SECONDS - peer_t0) - ${1:-0} )); echo $(( l > 1 ? l : 1 )); }
  if [[ -d .whl/w ]]; then
    # fastapi, uvicorn, pydantic, accelerate (device_map) and openai (transformers' is_serve_available)
    [[ -d /tmp/site/openai && -d /tmp/site/accelerate ]] || \
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/w/*.whl
    [[ ":$PYTHONPATH:" == *":/tmp/site:"* ]] || export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  # the o200k tokenizer file for our server (PEER_OURS), as in the serve target
  if [[ -d .whl/cache ]]; then export XDG_CACHE_HOME=$(pwd)/.whl/cache; fi
  psrc=${PEER_SRC:-/tmp/s20b-${PEER_LAYERS:-full}}
  if [[ -z ${PEER_SRC:-} && ! -f $psrc/.synth-complete ]]; then
    timeout "$(peer_left)" python3 -m gptoss_fp8.cli.main synth "$psrc" --preset 20b --layout hf --overwrite \
      ${PEER_LAYERS:+--layers $PEER_LAYERS} \
      > "$OUT/serve_tf_prep.log" 2>&1 && touch "$psrc/.synth-complete"
  fi
  if [[ -f $psrc/config.json && ! -f $psrc/tokenizer.json ]]; then
    python3 -m gptoss_fp8.bench.serve_peer tokenizer "$psrc" >> "$OUT/serve_tf_prep.log" 2>&1
  fi
  echo "serve-peer: source ready after $((SECONDS - peer_t0)) s" | tee "$OUT/bench_serve_tf.log"
  pport=8931
  # `transformers serve`'s own command (transformers/cli/serve.py Serve) through typer: the `transformers`
  # CLI module also imports cli/chat.py, which needs `requests`
  HF_HUB_OFFLINE=1 timeout -k 5 "$(peer_left 8)" python3 -c \
    'import typer; from transformers.cli.serve import Serve; a = typer.Typer(); a.command()(Serve); a()' \
    "$psrc" --continuous-batching --cb-use-cuda-graph --device cuda --dtype bfloat16 --host 127.0.0.1 \
    --port $pport --log-level info ${PEER_SERVE_ARGS:---cb-max-batch-tokens 256 --cb-max-memory-percent 0.5} \
    > "$OUT/serve_tf_server.log" 2>&1 &
  ppid_=$!
  pok=0
  while (( SECONDS - peer_t0 < ${PEER_BUDGET:-240} )) && kill -0 $ppid_ 2>/dev/null; do
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$pport/health', timeout=2)" 2>/dev/null
    then pok=1; break; fi
    sleep 2
  done
  echo "serve-peer: transformers serve healthy: $pok after $((SECONDS - peer_t0)) s" | tee -a "$OUT/bench_serve_tf.log"
  if (( pok )); then
    timeout "$(peer_left 10)" python3 -m gptoss_fp8.cli.main bench serve http://127.0.0.1:$pport \
      --peer transformers --tokenizer "$psrc" --concurrency ${PEER_CONC:-1,16,64} --prompt-len 1024 \
      --output-len ${PEER_OUTPUT_LEN:-256} --json "$OUT/bench_serve_tf.json" 2>&1 | tail -20 | tee -a "$OUT/bench_serve_tf.log"
  fi
  # TERM to timeout goes on to the server, and KILL 5 s later if it is still there (-k 5)
  kill $ppid_ 2>/dev/null; wait $ppid_ 2>/dev/null
  # how it ran: the dequantization, the attention and CUDA graphs it chose; the log's tail when it failed
  grep -a -i -E "dequantiz|Switching from|flash attention|cuda graphs for|Memory available|Traceback|Error:" \
    "$OUT/serve_tf_server.log" | head -20 | tee -a "$OUT/bench_serve_tf.log"
  if (( ! pok )) || [[ ! -s $OUT/bench_serve_tf.json ]]; then
    echo "serve-peer: no figures; prep and server logs' tails:"; tail -5 "$OUT/serve_tf_prep.log" 2>/dev/null
    tail -40 "$OUT/serve_tf_server.log"
  fi
  if [[ -n ${PEER_OURS:-} && -f $psrc/config.json ]]; then
    # ours on the same source, same load (token-id prompts of the same lengths), in this call: the ratio
    python3 -m gptoss_fp8.cli.main convert "$psrc" "$psrc-fp8" --device cuda --overwrite >> "$OUT/serve_tf_prep.log" 2>&1 \
      || { echo "serve-peer: our convert failed (tail of serve_tf_prep.log):"; tail -3 "$OUT/serve_tf_prep.log"; df -h /tmp | tail -1; }
    timeout 150 python3 -m gptoss_fp8.cli.main bench serve --launch "$psrc-fp8" --concurrency ${PEER_CONC:-1,16,64} \
      --prompt-len 1024 --output-len ${PEER_OUTPUT_LEN:-256} --warmup 64 --json "$OUT/bench_serve_ours_same.json" \
      2>&1 | grep -v Warn | tail -6 | tee -a "$OUT/bench_serve_tf.log"
  fi
  echo "serve-peer: done after $((SECONDS - peer_t0)) s" | tee -a "$OUT/bench_serve_tf.log"
fi

if has attention; then
  # issue 34: the warp-specialized attention's variants (options, FP8, timing probes) checked against the
  # spec and timed side by side in one process (benchmarks/attn_variants.py), the power each draws, then
  # the GPU tests
  # (ATTN_VARIANTS: attn_variants.py's names; the default: the shipped kernel, 128-key sync, FP8, the two timing probes)
  timeout 210 python3 benchmarks/attn_variants.py --variants "${ATTN_VARIANTS:-qreg,n128-sync,fp8,probe-mma,probe-softmax}" \
    --json "$OUT/attn_variants.json" 2>&1 | grep -v Warn | tee "$OUT/attn_variants.log"
  # clock and board power under each alone (is it at the 700 W cap?), 32768 tokens, 4 s back to back
  for v in "q_in_registers=True" "q_in_registers=True,exp=probe-mma-only" "q_in_registers=True,exp=probe-softmax-only" \
           "fp8=True"; do
    echo "== $v" | tee -a "$OUT/attn_power.log"
    timeout 60 python3 benchmarks/clock_watch.py "$OUT/attn_clock.csv" -- python3 benchmarks/attn_ncu.py --tokens 32768 \
      --variant "$v" --seconds 4 2>&1 | grep -v Warn | tail -4 | tee -a "$OUT/attn_power.log"
  done
  timeout 110 python3 -m pytest -q -n 6 -m gpu tests/kernels/test_attention.py -k "ws_gpu or ws_fp8_gpu or single_sequence" \
    2>&1 | tail -30 | tee "$OUT/attn_tests.log"
fi

if has fp8-probe; then
  # issue 34: the FP8 kernel's options at small T under a NaN-filled allocator (benchmarks/attn_poison_probe.py:
  # unwritten outputs vs reads of unwritten memory), the attention GPU tests (poisoned), then the FP8 options and
  # the bf16 128-key step timed side by side (ATTN_VARIANTS)
  timeout 150 python3 benchmarks/attn_poison_probe.py 2>&1 | grep -v Warn | tee "$OUT/attn_probe.log"
  # (every FP8 attention GPU test: 100 in ~110 s on 6 workers; the bf16 Gluon tests took the old 150 s alone)
  timeout 280 python3 -m pytest -q -n 6 -m gpu tests/kernels/test_attention.py -k "fp8" \
    -p no:warnings 2>&1 | grep -v "Warn\|warner" | tail -30 | tee "$OUT/attn_tests.log"
  timeout 240 python3 benchmarks/attn_variants.py --tokens ${ATTN_TOKENS:-32768,128000} \
    --variants "${ATTN_VARIANTS:-fp8,fp8-free,fp8-turn-q,fp8-sum}" \
    --json "$OUT/attn_variants.json" 2>&1 | grep -v Warn | tee "$OUT/attn_variants.log"
fi

if has quant-out; then
  # the window layers' Triton kernel writing o_proj's input quantization instead of its bf16 rows
  # (KernelConfig.attention_quant_out, thirty-eighth session): its GPU tests, then the 20b beside "window-rows"
  timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_attention_quant_out.py tests/test_triton_ops.py \
    tests/test_model_chunks.py 2>&1 | tail -8 | tee "$OUT/quant_out_tests.log"
  timeout 150 python3 benchmarks/ab_prefill.py --model 20b --tokens 32768 --runs ${QO_RUNS32K:-7} \
    --variants default,window-rows --attention fp8 2>&1 | grep -v Warn | tee "$OUT/quant_out_ab32k.log"
  timeout 150 python3 benchmarks/ab_prefill.py --model 20b --tokens 128000 --runs 3 \
    --variants default,window-rows --attention fp8 2>&1 | grep -v Warn | tee "$OUT/quant_out_ab128k.log"
fi

if has pending39; then
  # (the model-level ones run on the GPU too: tests/test_triton_ops.py picks CUDA when it is there). One call holds the
  # tests and the 32768 A/B (P39_AB128K_S=0); a second the 128000 A/B (P39_TEST_S=0 P39_AB_S=0)
  if [[ ${P39_TEST_S:-240} != 0 ]]; then
    timeout -s INT ${P39_TEST_S:-240} python3 -m pytest -q -rf -n 3 tests/kernels/test_fp8_gemm.py tests/kernels/test_router.py \
      tests/kernels/test_moe.py tests/kernels/test_attention.py tests/test_triton_ops.py -m "gpu or not slow" \
      -k "residual or remakes or keep_the_logits or decline or narrow or q_fused or q-fused" > "$OUT/p39_tests.log" 2>&1
    timeout 150 python3 -m pytest -q -m slow tests/kernels/test_fp8_gemm.py tests/test_triton_ops.py -k "res or moe_chunks" \
      >> "$OUT/p39_tests.log" 2>&1
    tail -6 "$OUT/p39_tests.log"
  fi
  _v=${P39_VARIANTS:-default,gemm-residual,rows-from-stream,narrow,q-fused,gemm-residual+rows-from-stream+narrow+q-fused}
  [[ ${P39_AB_S:-300} == 0 ]] || timeout ${P39_AB_S:-300} python3 benchmarks/ab_prefill.py --model 20b --tokens 32768 \
    --runs ${P39_RUNS32K:-9} --variants $_v --attention fp8 2>&1 | grep -v Warn | tee "$OUT/p39_ab32k.log"
  [[ ${P39_AB128K_S:-240} == 0 ]] || timeout ${P39_AB128K_S:-240} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens 128000 --runs 3 --variants $_v --attention fp8 2>&1 | grep -v Warn | tee "$OUT/p39_ab128k.log"
fi

if has pending40; then
  # the fortieth session's q / k / v GEMM quantizing Q in its epilogue (KernelConfig.gemm_q_quant, built without a GPU):
  # its GPU tests (the epilogue against the GEMM + quantize_qk, bit for bit; the model's logits with it on and off; the
  # dense GEMM and attention kernels whose helpers moved), then the 20b beside the default, same process, 32768 and
  # 128000. One call holds the tests and the 32768 A/B (P40_AB128K_S=0); a second the 128000 A/B (P40_TEST_S=0 P40_AB_S=0)
  if [[ ${P40_TEST_S:-200} != 0 ]]; then
    timeout -s INT 120 python3 -m pytest -q -rf -n 3 tests/kernels/test_gemm_q8.py tests/test_triton_ops.py \
      -k "q8 or q_made or takes_q" > "$OUT/p40_tests.log" 2>&1
    tail -4 "$OUT/p40_tests.log"
    timeout -s INT ${P40_TEST_S:-120} python3 -m pytest -q -rf -n 3 tests/kernels/test_fp8_gemm.py tests/test_triton_ops.py \
      tests/kernels/test_attention.py -m gpu -k "residual or narrow or test_prefill_ws_fp8_gpu or ops_on_the_same or \
      logits_match" > "$OUT/p40_tests2.log" 2>&1
    tail -4 "$OUT/p40_tests2.log"
  fi
  _v=${P40_VARIANTS:-default,q-gemm}
  [[ ${P40_AB_S:-300} == 0 ]] || timeout ${P40_AB_S:-300} python3 benchmarks/ab_prefill.py --model 20b --tokens 32768 \
    --runs ${P40_RUNS32K:-9} --variants $_v --attention fp8 2>&1 | grep -v Warn | tee "$OUT/p40_ab32k.log"
  [[ ${P40_AB128K_S:-240} == 0 ]] || timeout ${P40_AB128K_S:-240} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens 128000 --runs 3 --variants $_v --attention fp8 2>&1 | grep -v Warn | tee "$OUT/p40_ab128k.log"
fi

if has attn-inmodel; then
  timeout 300 python3 benchmarks/attn_inmodel_probe.py --model 20b --tokens ${INMODEL_TOKENS:-32768} --reps 10 \
    --attention ${INMODEL_ATTN:-fp8} 2>&1 | grep -v Warn | tee "$OUT/attn_inmodel.log"
fi

if has prefill-fp8; then
  # issue 34's must-shows: the whole 20b at 32768 / 128000 and the 120b at 128000 with FP8 attention (the breakdown
  # splits attention by layer kind: full / sliding window); PREFILL_FP8_SPECS: ';'-separated "model tokens" pairs
  # PREFILL_FP8_OPTS: space-separated NAME=VALUE KernelConfig settings (bench prefill --kernel-option)
  IFS=';' read -ra _specs <<< "${PREFILL_FP8_SPECS:-20b 32768,128000;120b 128000}"
  _opts=(); for o in ${PREFILL_FP8_OPTS:-}; do _opts+=(--kernel-option "$o"); done
  for spec in "${_specs[@]}"; do
    set -- $spec
    timeout 220 python3 -m gptoss_fp8.cli.main bench prefill --model $1 --tokens $2 --runs 2 --warmup 1 --no-peer \
      ${_opts[@]+"${_opts[@]}"} --attention ${PREFILL_ATTN:-fp8} --json "$OUT/prefill_$1_${PREFILL_ATTN:-fp8}.json" 2>&1 \
      | grep -v Warn | tail -12 | tee "$OUT/prefill_$1_${PREFILL_ATTN:-fp8}.log"
  done
fi

if has prefill-lin; then
  # the forty-fifth session's --attention fp8-lin (P's codes without 2^x): its GPU tests through attention_prefill
  # and the ops, then the 20b beside --attention fp8 in one process (ab_prefill attn-fp8-lin), then the must-shows
  # with it (prefill-fp8's bench prefill, PREFILL_ATTN=fp8-lin; LIN_SPECS as PREFILL_FP8_SPECS)
  [[ ${PL_TEST_S:-150} == 0 ]] || timeout -s INT ${PL_TEST_S:-150} python3 -m pytest -q -rf -n 4 tests/kernels/test_attention.py \
    tests/test_triton_ops.py tests/test_verify_attention_fp8.py -k "lin or fp8_attention_runs or fp8_gpu" \
    > "$OUT/pl_tests.log" 2>&1
  tail -4 "$OUT/pl_tests.log"
  [[ ${PL_AB_S:-200} == 0 ]] || timeout ${PL_AB_S:-200} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens ${PL_AB_TOKENS:-32768,128000} --runs ${PL_RUNS:-3} --variants default,attn-fp8-lin --attention fp8 2>&1 \
    | grep -v Warn | tee "$OUT/pl_ab.log"
  IFS=';' read -ra _specs <<< "${LIN_SPECS:-20b 32768,128000}"
  for spec in "${_specs[@]}"; do
    set -- $spec  # model, tokens, then any more bench prefill options (their letters and digits tag the files)
    _more="${*:3}"; _tag="${LIN_KOPT:+_$LIN_KOPT}${_more:+_${_more//[^A-Za-z0-9]/}}"
    timeout 220 python3 -m gptoss_fp8.cli.main bench prefill --model $1 --tokens $2 --runs ${LIN_RUNS:-2} --warmup 1 --no-peer \
      --attention fp8-lin ${LIN_KOPT:+--kernel-option $LIN_KOPT} ${_more} --json "$OUT/prefill_$1_$2_fp8-lin${_tag}.json" \
      2>&1 | grep -v Warn | tail -12 | tee "$OUT/prefill_$1_$2_fp8-lin${_tag}.log"
  done
fi

if has distinct; then
  # the forty-ninth session's --distinct-layers (a layer's weights repeated through the depth, so the 120b runs whole
  # on 80 GB): the 120b cut to 14 layers with its own weights beside the same with 7 layers' repeated (the method:
  # equal within the spread), then the whole 120b on 12 layers' weights, all with fp8-lin (DL_SPECS as LIN_SPECS)
  OUT="$OUT" LIN_SPECS="${DL_SPECS:-120b 128000 --layers 14;120b 128000 --layers 14 --distinct-layers 7;120b 128000 --distinct-layers 12}" \
    PL_AB_S=0 PL_TEST_S=0 bash "$0" prefill-lin
fi

if has moe120; then
  for m in ${M120_MODELS:-20b 120b}; do
    timeout 90 python3 benchmarks/profile_prefill.py --model $m --layers 4 --tokens ${M120_TOKENS:-128000} --attention fp8-lin \
      --rows 18 2>&1 | grep -v Warn | tee "$OUT/m120_profile_$m.log"
  done
  for e in ${M120_EXPERTS:-128 32}; do
    timeout 100 python3 benchmarks/moe_parts.py --tokens ${M120_TOKENS:-128000} --experts $e --plans ${M120_PLAN_S:-3} \
      --only "stage scales" 2>&1 | grep -v "Warn\|^tile\|^round" | tee "$OUT/m120_parts_$e.log"
  done
  # the whole 120b (12 layers' weights repeated: fits 80 GB) beside the MoE tiles' other tile-order groups
  [[ ${M120_AB_S:-200} == 0 ]] || timeout ${M120_AB_S:-200} python3 benchmarks/ab_prefill.py --model 120b --distinct-layers 12 \
    --tokens ${M120_TOKENS:-128000} --runs ${M120_RUNS:-3} --variants "${M120_VARIANTS:-default,wide-g32}" --attention fp8-lin \
    2>&1 | grep -v Warn | tee "$OUT/m120_ab.log"
fi

if has lin6; then
  [[ ${L6_TEST_S:-120} == 0 ]] || timeout -s INT ${L6_TEST_S:-120} python3 -m pytest -q -rf -n 4 tests/kernels/test_attention.py \
    -k "${L6_K:-exp_lin_skip or (exp_lin_gpu and 6-)}" > "$OUT/l6_tests.log" 2>&1
  tail -4 "$OUT/l6_tests.log"
  [[ ${L6_VAR_S:-120} == 0 ]] || timeout ${L6_VAR_S:-120} python3 benchmarks/attn_variants.py --tokens ${L6_TOKENS:-128000} \
    --variants "${L6_VARIANTS:-fp8-lin4n,fp8-lin6}" 2>&1 | grep -v Warn | tail -6 | tee "$OUT/l6_variants.log"
  [[ ${L6_WIDE_S:-120} == 0 ]] || timeout ${L6_WIDE_S:-120} python3 benchmarks/attn_variants.py --tokens ${L6_TOKENS:-128000} \
    --qk-scale 7 --skip-check --variants "${L6_VARIANTS:-fp8-lin4n,fp8-lin6}" 2>&1 | grep -v Warn | tail -6 \
    | tee "$OUT/l6_wide.log"
  [[ ${L6_AB_S:-150} == 0 ]] || timeout ${L6_AB_S:-150} python3 benchmarks/ab_prefill.py --model 20b --tokens 128000 --runs 3 \
    --variants ${L6_AB_VARIANTS:-default,attn-fp8-lin6} --attention fp8-lin 2>&1 | grep -v Warn | tee "$OUT/l6_ab.log"
  # (L6_TRACE_S: form 5's step traced phase by phase, attn_trace.py)
  [[ ${L6_TRACE_S:-0} == 0 ]] || timeout ${L6_TRACE_S} python3 benchmarks/attn_trace.py --tokens ${L6_TRACE_TOKENS:-32768} \
    --variant "exp_lin=5,turns=0" --json "$OUT/l6_trace.json" 2>&1 | grep -v Warn | tee "$OUT/l6_trace.log"
fi

if has lin52; then  # (lin6 with the traced launches' GPU test, no --qk-scale 7 or whole-model A/B, and the trace)
  OUT="$OUT" L6_K="exp_lin_skip or (exp_lin_gpu and 6-) or trace_keeps" L6_TEST_S=${L52_TEST_S:-130} \
    L6_VAR_S=${L52_VAR_S:-110} L6_WIDE_S=0 L6_AB_S=0 L6_TRACE_S=${L52_TRACE_S:-90} \
    L6_TRACE_TOKENS=${L52_TRACE_TOKENS:-32768} L6_TOKENS=${L52_TOKENS:-128000} bash "$0" lin6
fi

if has prefix; then
  [[ ${PT_TEST_S:-90} == 0 ]] || timeout -s INT ${PT_TEST_S:-90} python3 -m pytest -q -rf -s tests/test_runtime_gpu.py \
    -k prefix > "$OUT/pt_tests.log" 2>&1
  tail -4 "$OUT/pt_tests.log"
  timeout ${PT_S:-150} python3 benchmarks/prefix_turns.py --model 20b --lengths ${PT_LENGTHS:-2048,8192,32768} \
    --new ${PT_NEW:-256} --runs ${PT_RUNS:-3} --profile ${PT_PROFILE:-0} 2>&1 | grep -v Warn | tee "$OUT/prefix_turns.log"
fi

if has lin8; then  # (lin6's steps on form 8 beside 5: its GPU tests, attn_variants at 128000 random and x7, the 20b A/B)
  OUT="$OUT" L6_K="nobranch or (trace_keeps and 8)" L6_TEST_S=${L8_TEST_S:-100} L6_VAR_S=${L8_VAR_S:-100} \
    L6_WIDE_S=${L8_WIDE_S:-90} L6_AB_S=${L8_AB_S:-0} L6_AB_VARIANTS=default,attn-fp8-lin8 L6_VARIANTS=fp8-lin4n,fp8-lin8 \
    L6_TOKENS=${L8_TOKENS:-128000} bash "$0" lin6
fi

if has must51; then
  OUT="$OUT" LIN_SPECS="${M51_SPECS:-120b 128000;20b 128000;20b 32768}" LIN_KOPT=attention_exp_lin=${M51_FORM:-8} LIN_RUNS=${M51_RUNS:-3} \
    PL_AB_S=0 PL_TEST_S=0 bash "$0" prefill-lin
fi

if has quant-out-fp8; then
  [[ ${QOF_TEST_S:-150} == 0 ]] || timeout -s INT ${QOF_TEST_S:-150} python3 -m pytest -q -rf -n 2 --dist load \
    tests/kernels/test_attention_quant_out.py -k "fp8_gluon" > "$OUT/qof_tests.log" 2>&1
  tail -4 "$OUT/qof_tests.log"
  [[ ${QOF_BENCH_S:-90} == 0 ]] || timeout ${QOF_BENCH_S:-90} python3 benchmarks/quant_out_bench.py --full \
    --tokens ${QOF_TOKENS:-32768,128000} 2>&1 | grep -v Warn | tee "$OUT/qof_bench.log"
  [[ ${QOF_AB32K_S:-150} == 0 ]] || timeout ${QOF_AB32K_S:-150} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens 32768 --runs ${QOF_RUNS:-9} --variants "${QOF_VARIANTS:-default,fp8-quant-out}" --attention fp8 2>&1 \
    | grep -v Warn | tee "$OUT/qof_ab32k.log"
  [[ ${QOF_AB128K_S:-0} == 0 ]] || timeout ${QOF_AB128K_S} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens 128000 --runs ${QOF_RUNS128:-3} --variants "${QOF_VARIANTS:-default,fp8-quant-out}" --attention fp8 \
    2>&1 | grep -v Warn | tee "$OUT/qof_ab128k.log"
fi

if has norm-rows; then
  [[ ${NR_TEST_S:-90} == 0 ]] || timeout -s INT ${NR_TEST_S:-90} python3 -m pytest -q -rf -n 2 tests/kernels/test_norm.py \
    tests/kernels/test_router.py > "$OUT/nr_tests.log" 2>&1
  tail -4 "$OUT/nr_tests.log"
  [[ ${NR_SWEEP_S:-60} == 0 ]] || timeout ${NR_SWEEP_S:-60} python3 benchmarks/norm_sweep.py --rounds 2 2>&1 \
    | grep -v Warn | tee "$OUT/nr_sweep.log"
  [[ ${NR_AB32K_S:-150} == 0 ]] || timeout ${NR_AB32K_S:-150} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens 32768 --runs ${NR_RUNS:-7} --variants default,norm-one-row --attention fp8 2>&1 | grep -v Warn \
    | tee "$OUT/nr_ab32k.log"
  [[ ${NR_AB128K_S:-150} == 0 ]] || timeout ${NR_AB128K_S:-150} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens 128000 --runs ${NR_RUNS128:-3} --variants default,norm-one-row --attention fp8 2>&1 | grep -v Warn \
    | tee "$OUT/nr_ab128k.log"
fi

if has must46; then
  # the forty-sixth session's must-show call (an H200: the 120b): fp8-lin's GPU tests (M46_TEST_S), the 20b at
  # 128000 beside --attention fp8 and fp8-lin's forms 2 / 5 in one process, then bench prefill with exp_lin 5
  # (M46_SPECS as LIN_SPECS)
  [[ ${M46_TEST_S:-60} == 0 ]] || timeout -s INT ${M46_TEST_S:-60} python3 -m pytest -q -rf -n 4 tests/kernels/test_attn_quant.py \
    tests/kernels/test_attention.py -k "norms or fp8_operands or (exp_lin and not late)" > "$OUT/m46_tests.log" 2>&1
  tail -4 "$OUT/m46_tests.log"
  [[ ${M46_AB_S:-150} == 0 ]] || timeout ${M46_AB_S:-150} python3 benchmarks/ab_prefill.py --model 20b --tokens ${M46_AB_TOKENS:-128000} \
    --runs ${M46_RUNS:-3} --variants "${M46_AB_VARIANTS:-default,attn-fp8-lin,attn-fp8-lin5}" --attention fp8 2>&1 | grep -v Warn \
    | tee "$OUT/m46_ab.log"
  OUT="$OUT" LIN_SPECS="${M46_SPECS:-120b 128000;20b 128000;20b 32768}" LIN_KOPT=attention_exp_lin=5 PL_AB_S=0 PL_TEST_S=0 bash "$0" prefill-lin
fi

if has pending46; then
  # the forty-sixth session's exp_lin 4 / 5 (the codes against the running max first, their row maxima on packed
  # halves; m raised and the accumulators rescaled only where a code passes 126) and exp_lin 3 (45th, not yet run):
  # their GPU tests, attn_variants beside fp8 / fp8-lin16, again at a trained model's Q / K amax, then the 20b
  [[ ${P46_TEST_S:-150} == 0 ]] || timeout -s INT ${P46_TEST_S:-150} python3 -m pytest -q -rf -n 4 tests/kernels/test_attention.py \
    -k "exp_lin or prefill_fp8_lin_gpu" > "$OUT/p46_tests.log" 2>&1
  tail -6 "$OUT/p46_tests.log"
  [[ ${P46_VAR_S:-240} == 0 ]] || timeout ${P46_VAR_S:-240} python3 benchmarks/attn_variants.py --tokens ${P46_TOKENS:-32768,128000} \
    --variants "${P46_VARIANTS:-fp8,fp8-lin16,fp8-lin4,fp8-lin4n,fp8-lin16n}" --json "$OUT/p46_variants.json" 2>&1 \
    | grep -v Warn | tee "$OUT/p46_variants.log"
  [[ ${P46_WIDE_S:-120} == 0 ]] || timeout ${P46_WIDE_S:-120} python3 benchmarks/attn_variants.py --tokens 128000 \
    --qk-scale 7 --skip-check --variants "${P46_VARIANTS:-fp8,fp8-lin16,fp8-lin4,fp8-lin4n,fp8-lin16n}" 2>&1 \
    | grep -v Warn | tail -7 | tee "$OUT/p46_wide.log"
  [[ ${P46_AB_S:-0} == 0 ]] || timeout ${P46_AB_S} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens ${P46_AB_TOKENS:-32768,128000} --runs ${P46_RUNS:-3} --variants "${P46_AB_VARIANTS:-default,attn-fp8-lin,attn-fp8-lin4}" \
    --attention fp8 2>&1 | grep -v Warn | tee "$OUT/p46_ab.log"
fi

if has pending45; then
  [[ ${P45_TEST_S:-120} == 0 ]] || timeout -s INT ${P45_TEST_S:-120} python3 -m pytest -q -rf -n 4 tests/kernels/test_attention.py \
    -k "exp_lin or ws_fp8_options_gpu and lane" > "$OUT/p45_tests.log" 2>&1
  tail -6 "$OUT/p45_tests.log"
  [[ ${P45_VAR_S:-240} == 0 ]] || timeout ${P45_VAR_S:-240} python3 benchmarks/attn_variants.py --tokens ${P45_TOKENS:-32768,128000} \
    --variants "${LIN_VARIANTS:-fp8,fp8-lin,fp8-lin16,fp8-lin16n}" --json "$OUT/p45_variants.json" 2>&1 | grep -v Warn \
    | tee "$OUT/p45_variants.log"
  # the same on Q / K of a trained model's size (amax ~30, not the random inputs' ~4.5): the bounds' regime
  [[ ${P45_WIDE_S:-150} == 0 ]] || timeout ${P45_WIDE_S:-150} python3 benchmarks/attn_variants.py --tokens 128000 \
    --qk-scale 7 --skip-check --variants "${LIN_VARIANTS:-fp8,fp8-lin,fp8-lin16,fp8-lin16n}" 2>&1 | grep -v Warn \
    | tail -6 | tee "$OUT/p45_wide.log"
  IFS=';' read -ra _lv <<< "${LIN_ENERGY:-fp8=True;fp8=True,exp_lin=1}"
  for var in "${_lv[@]}"; do
    timeout 90 python3 benchmarks/clock_watch.py "$OUT/p45_clock.csv" -- python3 benchmarks/attn_ncu.py --tokens 128000 \
      --variant "$var" --seconds 5 2>&1 | grep -v Warn | python3 benchmarks/energy_line.py "$var" 128000 \
      | tee -a "$OUT/p45_energy.log"
  done
fi

if has pending44; then
  # the forty-fourth session: gather_act_quant walking the tokens (each FP8 row read once, stored into its k rows)
  if [[ ${P44_TEST_S:-120} != 0 ]]; then
    timeout -s INT ${P44_TEST_S:-120} python3 -m pytest -q -rf -n 3 --dist load tests/kernels/test_moe.py \
      -k "by_token or align or gather_act or thread_release" > "$OUT/p44_tests.log" 2>&1
    tail -6 "$OUT/p44_tests.log"
  fi
  [[ ${P44_PLANS_S:-120} == 0 ]] || timeout ${P44_PLANS_S:-120} python3 benchmarks/moe_parts.py --tokens 32768 \
    --plans ${P44_PLAN_SECONDS:-3} --only "${P44_ONLY:-gather by,thread release}" 2>&1 | grep -v "^tile\|Warn" | tee "$OUT/p44_parts.log"
  [[ ${P44_AB32K_S:-150} == 0 ]] || timeout ${P44_AB32K_S:-150} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens 32768 --runs ${P44_RUNS:-7} --variants "${P44_VARIANTS:-default,gather-by-token,wide-release}" --attention fp8 2>&1 \
    | grep -v Warn | tee "$OUT/p44_ab32k.log"
  [[ ${P44_AB128K_S:-150} == 0 ]] || timeout ${P44_AB128K_S:-150} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens 128000 --runs ${P44_RUNS128:-3} --variants "${P44_VARIANTS:-default,gather-by-token,wide-release}" --attention fp8 \
    2>&1 | grep -v Warn | tee "$OUT/p44_ab128k.log"
fi

if has pending43; then
  # the forty-third session: the gathering gate_up's producer on four warps (8 copies a thread a K block, was 32 on
  # one warp) and with the stage scales (the row scales by cp.async, the weight scales by TMA): its GPU tests, then
  # the MoE alone (each plan back to back, checked against the default's bits first), then the whole 20b
  if [[ ${P43_TEST_S:-120} != 0 ]]; then
    timeout -s INT ${P43_TEST_S:-120} python3 -m pytest -q -rf -n 3 --dist load tests/kernels/test_moe.py \
      -k "gather" > "$OUT/p43_tests.log" 2>&1
    tail -6 "$OUT/p43_tests.log"
  fi
  [[ ${P43_PLANS_S:-100} == 0 ]] || timeout ${P43_PLANS_S:-100} python3 benchmarks/moe_parts.py --tokens 32768 \
    --plans ${P43_PLAN_SECONDS:-3} --only gather 2>&1 | grep -v "^tile\|Warn" | tee "$OUT/p43_plans.log"
  [[ ${P43_AB32K_S:-150} == 0 ]] || timeout ${P43_AB32K_S:-150} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens 32768 --runs ${P43_RUNS:-7} --variants "${P43_VARIANTS:-default,wide-gather}" --attention fp8 2>&1 \
    | grep -v Warn | tee "$OUT/p43_ab32k.log"
  [[ ${P43_AB128K_S:-0} == 0 ]] || timeout ${P43_AB128K_S} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens 128000 --runs ${P43_RUNS128:-3} --variants "${P43_VARIANTS:-default,wide-gather}" --attention fp8 2>&1 \
    | grep -v Warn | tee "$OUT/p43_ab128k.log"
fi

if has pending42; then
  # the forty-second session: on an H200 the must-shows first (pending41's, P42_MUST=1 there); then the GPU tests of
  # the quantizers whose clamp went (e4m3_saturated: act_quant, the norm, attn_quant, the window layers' quant_out,
  # the MoE's Gluon epilogues) and of the Gluon window kernel (pair: a step's two heads interleaved); then the
  # window kernels side by side and the 20b with each (window-gluon's sweep and A/B)
  if [[ ${P42_MUST:-0} == 1 ]]; then
    OUT="$OUT" P41_TEST_S=0 P41_TILE_S=0 bash "$0" pending41
  fi
  if [[ ${P42_TEST_S:-150} != 0 ]]; then
    timeout -s INT ${P42_TEST_S:-150} python3 -m pytest -q -rf -n 3 -m gpu tests/kernels/test_act_quant.py \
      tests/kernels/test_norm.py tests/kernels/test_attn_quant.py tests/kernels/test_attention_quant_out.py \
      tests/kernels/test_attention_window_ws.py tests/kernels/test_moe.py > "$OUT/p42_tests.log" 2>&1
    tail -6 "$OUT/p42_tests.log"
  fi
  OUT="$OUT" WG_TEST_S=0 WG_AB128K_S=0 bash "$0" window-gluon
fi

if has pending41; then
  OUT="$OUT" PREFILL_FP8_SPECS="${P41_SPECS:-20b 32768,128000;120b 128000}" bash "$0" prefill-fp8
  [[ ${P41_AB_S:-110} == 0 ]] || timeout ${P41_AB_S:-110} python3 benchmarks/ab_prefill.py --model 20b --tokens 32768 \
    --runs 7 --variants default --attention fp8 2>&1 | grep -v Warn | tee "$OUT/p41_ab32k.log"
  [[ ${P41_TEST_S:-90} == 0 ]] || timeout -s INT ${P41_TEST_S:-90} python3 -m pytest -q -rf \
    tests/kernels/test_attention_window_ws.py -k "model_form or shapes" > "$OUT/p41_tests.log" 2>&1
  tail -4 "$OUT/p41_tests.log"
  # the Triton prefill tiles' GPU tests, PrefillTile.one_loop's two among them (never run yet)
  [[ ${P41_TILE_S:-90} == 0 ]] || timeout -s INT ${P41_TILE_S:-90} python3 -m pytest -q -rf -n 3 \
    tests/kernels/test_attention.py -k "test_prefill_gpu" > "$OUT/p41_tiles.log" 2>&1
  tail -4 "$OUT/p41_tiles.log"
fi

if has window; then
  # issue 34: the sliding-window layers' Triton kernel (0.48 ms a layer in the 20b at 32768, 2.4-3x its bytes floor):
  # the tiles side by side as the model calls the kernel, then where one launch's time goes (Nsight Compute digest)
  [[ ${WINDOW_SWEEP_S:-150} == 0 ]] || timeout ${WINDOW_SWEEP_S:-150} python3 benchmarks/window_sweep.py \
    --tokens ${WINDOW_TOKENS:-32768,128000} --model-form ${WINDOW_ONLY:+--only "$WINDOW_ONLY"} 2>&1 | grep -v Warn \
    | tee "$OUT/window_sweep.log"
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  mkdir -p "$OUT/ncu"
  IFS=';' read -ra _wt <<< "${WINDOW_NCU_TILES:-default}"
  i=0
  for tile in "${_wt[@]}"; do
    [[ -n "$NCU" && ${WINDOW_NCU_S:-90} != 0 ]] || break
    rep="/tmp/window$i"
    # launches: the 4096-token check, then do_bench's at 32768 (skip its first two)
    timeout ${WINDOW_NCU_S:-90} "$NCU" --clock-control none --set full --import-source no \
      -k "regex:${WINDOW_NCU_KERNEL:-_attn_prefill_kernel}" \
      --launch-skip 3 --launch-count 1 -f -o "$rep" python3 benchmarks/window_sweep.py --tokens 32768 --model-form \
      --only "$tile" 2>&1 | tail -3 | tee "$OUT/ncu/window$i.log"
    "$NCU" --import "$rep.ncu-rep" --page raw --csv > "/tmp/window${i}_raw.csv" 2>&1
    "$NCU" --import "$rep.ncu-rep" --page source --csv --print-source sass > "/tmp/window${i}_sass.csv" 2>&1
    { echo "tile $i: '$tile'"; python3 benchmarks/ncu_digest.py "/tmp/window${i}_raw.csv" "/tmp/window${i}_sass.csv" \
      --hot 10000; } > "$OUT/ncu/window${i}_digest.txt" 2>&1
    i=$((i + 1))
  done
fi

if has window-gluon; then
  if [[ ${WG_TEST_S:-150} != 0 ]]; then
    timeout -s INT ${WG_TEST_S:-150} python3 -m pytest -q -rf -x tests/kernels/test_attention_window_ws.py \
      > "$OUT/wg_tests.log" 2>&1
    tail -4 "$OUT/wg_tests.log"
  fi
  [[ ${WG_SWEEP_S:-120} == 0 ]] || timeout ${WG_SWEEP_S:-120} python3 benchmarks/window_sweep.py --tokens 32768,128000 \
    --model-form --only "${WG_ONLY:-default,gluon r8 c2,gluon r8 c2 pair,gluon r16 c2 pair,gluon r16 c2}" \
    2>&1 | grep -v Warn | tee "$OUT/wg_sweep.log"
  [[ ${WG_AB_S:-200} == 0 ]] || timeout ${WG_AB_S:-200} python3 benchmarks/ab_prefill.py --model 20b --tokens 32768 \
    --runs ${WG_RUNS32K:-7} --variants ${WG_VARIANTS:-default,gluon-window,gluon-window-pair} --attention fp8 2>&1 \
    | grep -v Warn | tee "$OUT/wg_ab32k.log"
  [[ ${WG_AB128K_S:-0} == 0 ]] || timeout ${WG_AB128K_S} python3 benchmarks/ab_prefill.py --model 20b \
    --tokens 128000 --runs 3 --variants ${WG_VARIANTS:-default,gluon-window,gluon-window-pair} --attention fp8 2>&1 \
    | grep -v Warn | tee "$OUT/wg_ab128k.log"
fi

if has attention-ncu; then
  # issue 34: Nsight Compute on one launch of the Gluon attention per variant (NCU_VARIANTS: ';'-separated
  # ws_attention_prefill keywords, '' the default): pipe utilization, issue slots, warp stalls, per-SASS
  # stall samples (benchmarks/attn_ncu.py). --clock-control none: the card's clocks are left alone.
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  mkdir -p "$OUT/ncu"
  IFS=';' read -ra _vars <<< "${NCU_VARIANTS:-}"
  [[ ${#_vars[@]} -eq 0 ]] && _vars=("")
  i=0
  for var in "${_vars[@]}"; do
    rep="$OUT/ncu/attn$i"
    timeout ${NCU_S:-240} "$NCU" --clock-control none --set full --import-source no -k regex:_ws_attention \
      --launch-skip 2 --launch-count 1 -f -o "$rep" python3 benchmarks/attn_ncu.py --tokens ${NCU_TOKENS:-16384} \
      --variant "$var" 2>&1 | tail -5 | tee "$OUT/ncu/attn$i.log"
    "$NCU" --import "$rep.ncu-rep" --page details > "$OUT/ncu/attn${i}_details.txt" 2>&1
    # the raw and source pages stay here (large, and a call returns 8 files): their digest comes back
    "$NCU" --import "$rep.ncu-rep" --page raw --csv > "/tmp/attn${i}_raw.csv" 2>&1
    "$NCU" --import "$rep.ncu-rep" --page source --csv --print-source sass > "/tmp/attn${i}_sass.csv" 2>&1
    { echo "variant $i: '$var'"; python3 benchmarks/ncu_digest.py "/tmp/attn${i}_raw.csv" "/tmp/attn${i}_sass.csv"; } \
      > "$OUT/ncu/attn${i}_digest.txt" 2>&1
    [[ -n "${NCU_KEEP_REP:-}" ]] || rm -f "$rep.ncu-rep"  # (4.7 MB a variant; NCU_KEEP_REP=1 keeps it)
    echo "variant $i: '$var'" | tee -a "$OUT/ncu/variants.txt"
    i=$((i + 1))
  done
fi

if has attn-trace; then
  # issue 34: where a consumer warpgroup's 128-key step goes (clock stamps, head 0's longest programs)
  IFS=';' read -ra _tv <<< "${TRACE_VARIANTS:-}"
  [[ ${#_tv[@]} -eq 0 ]] && _tv=("")
  i=0
  for var in "${_tv[@]}"; do
    for t in ${TRACE_TOKENS:-32768 128000}; do
      timeout 200 python3 benchmarks/attn_trace.py --tokens $t --variant "$var" --json "$OUT/trace_${i}_$t.json" 2>&1 \
        | grep -v Warn | tee -a "$OUT/attn_trace.log"
    done
    i=$((i + 1))
  done
fi

if has attn-energy; then
  # issue 34: energy a launch = median board power x time (5 s back to back under benchmarks/clock_watch.py); the
  # probes' rows split it between the MMAs and the softmax (wrong values: timing only)
  IFS=';' read -ra _ev <<< "${ENERGY_VARIANTS:-fp8=True;fp8=True,probe=mma;fp8=True,probe=softmax}"
  for var in "${_ev[@]}"; do
    for t in ${ENERGY_TOKENS:-32768 128000}; do
      timeout 90 python3 benchmarks/clock_watch.py "$OUT/energy_clock.csv" -- python3 benchmarks/attn_ncu.py --tokens $t \
        --variant "$var" --seconds 5 2>&1 | grep -v Warn | python3 benchmarks/energy_line.py "$var" $t \
        | tee -a "$OUT/attn_energy.log"
    done
  done
fi

if has flashinfer; then
  # issue 34's peer: FlashInfer 0.7.2's sink prefill (fa3, JIT-compiled here: ~2-3 min of nvcc) beside ours;
  # needs .fi/ carried (benchmarks/flashinfer_slim.py builds it from the wheels, 44.6 MiB)
  PATH=$PATH:$(pwd)/.fi/bin PYTHONPATH=$PYTHONPATH:$(pwd)/.fi timeout ${FI_S:-540} python3 benchmarks/flashinfer_peer.py \
    --json "$OUT/flashinfer.json" 2>&1 | grep -v Warn | tail -25 | tee "$OUT/flashinfer.log"
  # the flashinfer attention backend (kernels/flashinfer_attention.py) against spec.attention and our kernels; its
  # first calls JIT-build the fa3 module with the window (~85 s of nvcc; the one without is the peer's, cached on disk)
  PATH=$PATH:$(pwd)/.fi/bin PYTHONPATH=$PYTHONPATH:$(pwd)/.fi timeout ${FI_TEST_S:-540} python3 -m pytest -q -m gpu -s \
    tests/test_flashinfer_attention.py 2>&1 | grep -v Warn | tail -40 | tee "$OUT/flashinfer_tests.log"
fi

if has attention-fp8; then
  # issue 34's FP8 attention (spec.attention_fp8; the Triton kernel's fp8 path, kernels/attention.py): its GPU
  # tests against the spec and the fused Q / K / V quantization's against quant/attn_fp8.py, then bench kernels
  # --only attention --attention fp8 (pairs/s; the row "fp8 quantize q,k,v": fused ms vs the torch ops' ms)
  timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_attention.py -k "prefill_fp8_gpu" 2>&1 | tail -8 \
    | tee "$OUT/attn_fp8_tests.log"
  timeout 120 python3 -m pytest -q tests/kernels/test_attn_quant.py 2>&1 | tail -8 | tee "$OUT/attn_quant_tests.log"
  timeout 120 python3 -m gptoss_fp8.cli.main bench kernels --only attention --attention fp8 --tokens 32768,128000 \
    --json "$OUT/attn_fp8_bench.json" 2>&1 | grep -v Warn | tail -28 | tee "$OUT/attn_fp8_bench.log"
fi

if has hf; then
  # issue 36 on the GPU: import gptoss_fp8.hf, from_pretrained(device_map="cuda") keeps the weights FP8 and runs
  # our kernels (tests/test_hf_gpu.py: the trained fixture against kernels mode and generate, a synthetic 20b
  # cut to 2 layers beside transformers bf16). accelerate (device_map) travels as a wheel in .whl/w.
  if [[ -d .whl/w ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/w/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  timeout ${HF_S:-240} python3 -m pytest -q -m gpu -s tests/test_hf_gpu.py 2>&1 | tail -40 | tee "$OUT/hf_gpu.log"
fi

if has verdict-cpu; then
  # issue 32 through Triton's interpreter on this machine's CPUs (no GPU): the calibration of the verdict
  # target, weights / w8a8 / kernels, in 16 processes (one thread each), then merged; a case cut short by
  # the time limit keeps what it measured (each shard writes its JSON as it goes)
  # Triton 3.6's interpreter needs a numpy that still turns one-element arrays into scalars: the image's
  # numpy 2.5 stops every kernel ("only 0-dimensional arrays can be converted"); numpy 2.3.5 travels in .whl/np
  np_path=
  if [[ -d .whl/np ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-np .whl/np/*.whl && np_path=/tmp/site-np:
  fi
  vc() {  # shard name, then verify_calibration.py's arguments; niced: GPU targets may run beside it
    local name=$1; shift
    PYTHONPATH=$np_path$PYTHONPATH CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 OMP_NUM_THREADS=1 \
      nice -n 19 timeout ${VERDICT_CPU_S:-420} python3 \
      benchmarks/verify_calibration.py --device cpu --modes weights,w8a8,kernels --decode 16 \
      --json "$OUT/verdict_cpu_$name.json" "$@" > "$OUT/verdict_cpu_$name.log" 2>&1
  }
  vc t0 --random 0 --shard 0/2 & vc t1 --random 0 --shard 1/2 &  # the trained fixture, each conversion
  n=${VERDICT_CPU_PROCS:-14}  # random-checkpoint shards; VERDICT_CPU_FROM=J skips the cases j < J (run before)
  for k in $(seq 0 $((n - 1))); do vc r$k --random 20 --no-trained --shard $k/$n --from-case ${VERDICT_CPU_FROM:-0} & done
  wait
  tail -n 3 "$OUT"/verdict_cpu_[rt]*.log > "$OUT/verdict_cpu_tails.txt"
  python3 benchmarks/verify_calibration.py --merge "$OUT"/verdict_cpu_[rt]*.json --json "$OUT/verdict_cpu.json" \
    2>&1 | tee "$OUT/verdict_cpu.log"
fi

if has kernels; then
  m bench kernels --json "$OUT/bench_kernels.json" 2>&1 | tee "$OUT/bench_kernels.log"
fi

if has prefill; then
  # 20b: transformers' bf16 GptOss runs beside ours in the same process when it is importable.
  m bench prefill --model 20b --tokens 8192,32768 --runs 5 --peer-runs 3 --cuda-graph \
    --json "$OUT/prefill_20b.json" 2>&1 | tee "$OUT/prefill_20b.log"
  # 120b (does not fit one GPU in bf16: no peer); 5 runs, a median of 2 can be an outlier's mean.
  m bench prefill --model 120b --tokens 8192 --runs 5 --no-peer --cuda-graph \
    --json "$OUT/prefill_120b.json" 2>&1 | tee "$OUT/prefill_120b.log"
fi

if has verify; then
  tokens() {  # $1: checkpoint dir, $2: count, $3: output file: random ids below the config's vocab
    python3 -c "import json, sys, torch; v = json.load(open(sys.argv[1] + '/config.json'))['vocab_size']
json.dump(torch.randint(0, v, (int(sys.argv[2]),), generator=torch.Generator().manual_seed(0)).tolist(), open(sys.argv[3], 'w'))" "$1" "$2" "$3"
  }
  for spec in "tiny tiny 64" "20b-2l 20b 128"; do
    set -- $spec
    name=$1 preset=$2 n=$3 src=/tmp/verify_$1_src dst=/tmp/verify_$1_fp8
    layers=(); [[ $preset == 20b ]] && layers=(--layers 2)
    m synth "$src" --preset "$preset" "${layers[@]}" --overwrite >/dev/null \
      && m convert "$src" "$dst" --device cuda --overwrite 2>&1 | tail -3 | tee "$OUT/verify_${name}_convert.log" \
      && tokens "$src" "$n" "/tmp/verify_${name}_tokens.json" \
      && /usr/bin/time -f "wall %e s, peak RSS %M KB" python3 -m gptoss_fp8.cli.main verify-logits "$dst" \
        --reference "$src" --tokens "/tmp/verify_${name}_tokens.json" --device cuda \
        --json "$OUT/verify_${name}.json" 2>&1 | tee "$OUT/verify_${name}.log"
  done
fi

if has convert; then
  m synth /tmp/src20b --preset 20b --layers 8 --overwrite >/dev/null \
    && python3 benchmarks/convert_bench.py /tmp/src20b --device cuda 2>&1 | tee "$OUT/convert_cuda.log"
fi

if has peers; then
  if [[ -f .peers/deepgemm_setup.sh ]]; then
    (  # a subshell: the setup's PYTHONPATH / CUDA_HOME stay inside this target
      source .peers/deepgemm_setup.sh .peers/deepgemm-03d0be3.tgz \
        && python3 .peers/deepgemm_example.py 2>&1 | tee "$OUT/peers_deepgemm_example.log" \
        && python3 benchmarks/deepgemm_peer.py --json "$OUT/peers_deepgemm.json" 2>&1 | tee "$OUT/peers_deepgemm.log"
      # the deep_gemm backend (kernels/deepgemm.py): its GPU tests, the gemm suite with its rows, verify
      python3 -m pytest -q -s -m gpu tests/test_deepgemm.py 2>&1 | tee "$OUT/peers_tests_deepgemm.log"
      m bench kernels --only gemm --gemm deep_gemm --tokens 1024,8192,32768 \
        --json "$OUT/peers_bench_gemm.json" 2>&1 | tee "$OUT/peers_bench_gemm.log"
      for spec in "tiny tiny 64" "20b-2l 20b 128"; do
        set -- $spec
        name=$1 preset=$2 n=$3 src=/tmp/peers_$1_src dst=/tmp/peers_$1_fp8
        layers=(); [[ $preset == 20b ]] && layers=(--layers 2)
        m synth "$src" --preset "$preset" "${layers[@]}" --overwrite >/dev/null \
          && m convert "$src" "$dst" --device cuda --overwrite >/dev/null \
          && python3 -c "import json, sys, torch; v = json.load(open(sys.argv[1] + '/config.json'))['vocab_size']
json.dump(torch.randint(0, v, (int(sys.argv[2]),), generator=torch.Generator().manual_seed(0)).tolist(), open(sys.argv[3], 'w'))" \
            "$src" "$n" "/tmp/peers_${name}_tokens.json" \
          && m verify-logits "$dst" --reference "$src" --tokens "/tmp/peers_${name}_tokens.json" --device cuda \
            --mode kernels --gemm deep_gemm --json "$OUT/peers_verify_deepgemm_${name}.json" 2>&1 \
            | tee "$OUT/peers_verify_deepgemm_${name}.log"
      done
    )
  else
    echo "peers: .peers/deepgemm_setup.sh not found (carry .peers into the call)" | tee "$OUT/peers_deepgemm.log"
  fi
fi

if has decode; then
  m bench decode --model 20b --batch 1,8,32,64,128 --context 8192,32768 \
    --json "$OUT/decode_20b.json" 2>&1 | tee "$OUT/decode_20b.log"
  m bench decode --model 120b --batch 1,8,32,64 --context 8192,32768 \
    --json "$OUT/decode_120b.json" 2>&1 | tee "$OUT/decode_120b.log"
fi

if has peer-decode; then
  # transformers' decode at its best beside ours: a StaticCache, the step torch.compile'd and replayed
  # as a CUDA graph (bench/decode_peer.py "compiled"; each case compiles, 1-2.5 min guessed), and eager
  timeout 280 python3 -m pytest -q -s -m gpu tests/test_decode_peer.py 2>&1 | tail -15 | tee "$OUT/peer_decode_tests.log"
  timeout 420 python3 -m gptoss_fp8.cli.main bench decode --model 20b --batch 1 --context 8192 \
    --peer-mode eager,compiled --peer-steps 10 --json "$OUT/peer_decode_b1.json" 2>&1 | tee "$OUT/peer_decode_b1.log"
fi

if has sweep; then
  (
    if [[ -f .peers/deepgemm_setup.sh ]]; then source .peers/deepgemm_setup.sh .peers/deepgemm-03d0be3.tgz; fi
    python3 benchmarks/gemm_sweep.py --json "$OUT/gemm_sweep.json" 2>&1 | tee "$OUT/gemm_sweep.log"
  )
fi

if has skinny; then
  # the decode-sized kernels (fp8_gemv, moe_gemv, the split router, rope_append): GPU tests, sweeps
  # (quick forms, time-limited), and where a decode step's time goes (profile_decode.py)
  timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_fp8_gemv.py tests/kernels/test_moe_gemv.py \
    tests/kernels/test_router.py tests/kernels/test_rope.py 2>&1 | tail -15 | tee "$OUT/skinny_tests.log"
  timeout 80 python3 benchmarks/profile_decode.py --model 20b --batch 1,8 --context 8192 --rows 22 --no-pdl 2>&1 \
    | tee "$OUT/profile_decode.log"
  timeout 90 python3 benchmarks/skinny_sweep.py --quick --json "$OUT/skinny_sweep.json" 2>&1 | tail -30 \
    | tee "$OUT/skinny_sweep.log"
  timeout 100 python3 benchmarks/moe_gemv_sweep.py --quick --budget 85 --json "$OUT/moe_gemv_sweep.json" 2>&1 \
    | tail -30 | tee "$OUT/moe_gemv_sweep.log"
  timeout 50 python3 benchmarks/router_sweep.py --tokens 1,16 --splits 8,16,32 --block-k 64,128 --warps 4 \
    --json "$OUT/router_sweep.json" 2>&1 | tail -20 | tee "$OUT/router_sweep.log"
fi

if has decode-ab; then
  timeout 240 python3 benchmarks/ab_decode.py --model 20b --batch 1,4,8,64 --context 8192 \
    --variants default,moe-s5,moe-k2,moe-k4,wgmma --replays 150 2>&1 | tee "$OUT/ab_decode_20b.log"
  timeout 150 python3 benchmarks/ab_decode.py --model 120b --batch 1 --context 8192 \
    --variants default,moe-s5,moe-k2,moe-k4 --replays 100 2>&1 | tee "$OUT/ab_decode_120b.log"
  timeout 60 python3 benchmarks/cublas_layout_probe.py 2>&1 | tee "$OUT/cublas_layout_probe.log"
  # o_proj + residual add + RMSNorm + quantization in one kernel against the two launches (24-layer
  # graphs, PDL off / on, 1 / 4 / 8 rows; kernels/fp8_gemv.py fp8_gemm_skinny_add_rms_norm)
  timeout 120 python3 benchmarks/gemv_norm_ab.py 2>&1 | tee "$OUT/gemv_norm_ab.log"
  # the decode MoE's K blocks a step (DRAM locality: 256-512 contiguous bytes of each weight row)
  timeout 120 python3 benchmarks/moe_gemv_sweep.py --tokens 1,4 --budget 100 --variants \
    "heuristic,32/32 w2,32/32 w2 s5,32/32 w2 s3 k2,32/32 w2 s2 k4,32/32 k2,32/32 s2 k2,64/64 s6" 2>&1 \
    | tee "$OUT/moe_gemv_k_step.log"
fi

if has sharded; then
  # on one GPU the ranks share it over gloo (mechanics only); on an nvidia-h200-x2 / x4 / x8 machine
  # one GPU per rank over NCCL, the decode steps CUDA graphs: the figures of issue 25
  gpus=$(nvidia-smi -L | wc -l)
  python3 -m pytest -q -m gpu tests/test_bench_sharded.py tests/test_decode_sharded.py tests/test_vocab_parallel.py \
    2>&1 | tail -15 | tee "$OUT/sharded_tests.log"
  m bench prefill --model 20b --layers 2 --tokens 8192 --tp 2 --ep 2 --runs 3 \
    --json "$OUT/prefill_sharded.json" 2>&1 | tee "$OUT/prefill_sharded.log"
  if (( gpus >= 2 )); then
    for t in 2 4 8; do
      (( gpus >= t )) || continue
      m bench prefill --model 20b --tokens 8192,128000 --tp $t --ep $t --runs 3 --cuda-graph \
        --json "$OUT/prefill_20b_tp$t.json" 2>&1 | tee "$OUT/prefill_20b_tp$t.log"
      m bench prefill --model 120b --tokens 8192,128000 --tp $t --ep $t --runs 3 --cuda-graph \
        --json "$OUT/prefill_120b_tp$t.json" 2>&1 | tee "$OUT/prefill_120b_tp$t.log"
      m bench decode --model 20b --batch 1,8,64 --context 8192 --tp $t --ep $t --vocab-parallel \
        --json "$OUT/decode_20b_tp$t.json" 2>&1 | tee "$OUT/decode_20b_tp$t.log"
      m bench decode --model 120b --batch 1,8,64 --context 8192 --tp $t --ep $t \
        --json "$OUT/decode_120b_tp$t.json" 2>&1 | tee "$OUT/decode_120b_tp$t.log"
    done
  fi
fi

