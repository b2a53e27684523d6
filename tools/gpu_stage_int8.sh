#!/usr/bin/env bash
# GPU stage of the int8 weight-only (W8A16) feature. Assumes the extension is built (gpu_check.sh build,
# which compiles csrc/w8a16_linear.cu and csrc/quant.cu with the rest) and the shared assets in .gpu_assets/.
# The GPU tests of tests/quant and the main sanitizers run elsewhere (gpu_check.sh gputest / sanitize); this stage
# keeps only what is int8-specific: memcheck of tools/int8_smoke.py, the benches and the eval rows.
#
#   bash tools/gpu_stage_int8.sh            # everything, ~5-6 min on an H100 (each step has a time limit)
#   bash tools/gpu_stage_int8.sh quick      # memcheck + the GEMV bench only
#   bash tools/gpu_stage_int8.sh step       # only the int8 one-kernel decode step (~3-4 min): see part 0 below
#   bash tools/gpu_stage_int8.sh evals      # parts 1-3 (memcheck, GEMV bench, eval rows), ~4 min
#   bash tools/gpu_stage_int8.sh opt66b     # part 4 only (OPT-66b int8 on one GPU), ~3-5 min
#   BENCH_QUANT=1 bash tools/gpu_stage_int8.sh   # also the quantize kernels vs eager / torch.compile (~1 min)
#
# Writes logs and results under $OUT/int8 and packs them into $OUT/int8_stage.tar.gz; exits 1 if any step failed.
# Outputs (in $OUT/int8/bench unless said): w8a16_linear.{json,md} (GEMV % of copy counting int8 bytes, in a CUDA
# graph over weights > 4x L2, M = 1, 8, 16; prefill int8/fp16), eval_*.json ($OUT/int8) and int8_eval.{md,json}
# (bench/quant_eval_summary.py: ms/token, weight bytes, GB/s, % copy, x int8 floor, peak vs fp16, PPL vs fp16),
# opt66b_int8.{json,md} (OPT-66b random int8 weights built on the GPU: decode ms/token, peak memory, path taken).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuseinfer-gpu}
R="$OUT/int8"
mkdir -p "$R"
export FUSEINFER_SHARED=${FUSEINFER_SHARED:-$PWD/.gpu_assets} PYTHONUNBUFFERED=1
export FUSEINFER_BENCH_DIR="$R/bench" PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mode=${1:-all}
status=0
run() {  # run NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$R/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$R/times.log"
  [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
python3 -c 'from fuseinfer.core.extension import extension; assert hasattr(extension(), "w8a16_linear"), "rebuild: fuseinfer._C lacks w8a16_linear"' ||
  { echo "fuseinfer._C with the int8 kernels is not built"; exit 1; }

# 0. the int8 one-kernel decode step (csrc/decode_step.cu, Q8; docs/quantization.md "int8 in the one-kernel
# step"), first run on a GPU: its GPU tests (int8 kernel vs the fp32 int8 reference, opcheck, fast decode taking it
# with the per-op int8 step's greedy tokens; and the fp16/bf16 step's tests, whose kernel shares the code), memcheck
# and racecheck (gated like gpu_check's ring-wrap parts: only hazards other than a TMA-filled stage's reuse fail) of
# kernel_smoke's int8-step part, then OPT-1.3b batch 1 ms/token: fp16 fuseinfer vs W8A16 with the step (default
# FUSEINFER_DECODE_KERNEL=auto takes it at batch 1; the row's "decode" says "step: one kernel") and W8A16 per op
# (FUSEINFER_DECODE_KERNEL=0, the 0.928 ms/token path) in one run each. Target: W8A16 <= 0.55 ms/token.
if [ "$mode" = step ] || [ "$mode" = all ]; then
  run step_pytest 300 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/ops/test_decode_step.py
  run step_memcheck 240 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/kernel_smoke.py \
    --part int8-step
  run step_racecheck 240 compute-sanitizer --tool racecheck python3 tools/kernel_smoke.py --part int8-step
  run step_racecheck_gate 30 python3 tools/racecheck_tma.py "$R/step_racecheck.log"
  run step_eval_opt-1.3b_b1 240 python3 -m fuseinfer.eval --model random:opt-1.3b --dtype fp16 \
    --backends fuseinfer,fuseinfer-w8a16 --skip-ppl --batch-size 1 --prompt-len 512 --gen-len 128 --repeats 5 \
    --output "$R/step_eval_opt-1.3b_b1.json"
  run step_eval_opt-1.3b_b1_per_op 240 env FUSEINFER_DECODE_KERNEL=0 python3 -m fuseinfer.eval --model random:opt-1.3b \
    --dtype fp16 --backends fuseinfer-w8a16 --skip-ppl --batch-size 1 --prompt-len 512 --gen-len 128 --repeats 5 \
    --output "$R/step_eval_opt-1.3b_b1_per_op.json"
  run step_eval_summary 60 python3 bench/quant_eval_summary.py int8_step_eval "$R/step_eval_opt-1.3b_b1.json" \
    "$R/step_eval_opt-1.3b_b1_per_op.json"
  grep -ho '"decode": "[^"]*"' "$R"/step_eval_*.json | tee "$R/step_paths.txt"  # which step each row took
  if [ "$mode" = step ]; then
    (cd "$OUT" && tar czf int8_stage.tar.gz int8)
    echo "gpu_stage_int8 step: $([ $status -eq 0 ] && echo PASS || echo FAIL); results in $OUT/int8_stage.tar.gz"
    exit $status
  fi
fi

if [ "$mode" != opt66b ]; then
# 1. memcheck of the int8 kernels (small odd shapes + a small W8A16 model's fast decode)
run memcheck_int8 240 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/int8_smoke.py
# 2. int8 GEMV (M = 1, 8, 16) and prefill vs fp16 and the copy ceiling
run bench_int8_linear 240 python3 bench/bench_int8_linear.py --quick
[ "${BENCH_QUANT:-0}" = 1 ] && run bench_quant 240 python3 bench/bench_quant.py --quick  # 0.5M, 8M, 50M elements
if [ "$mode" != quick ]; then
  # 3. eval rows, fp16 fuseinfer vs W8A16 in one run each: OPT-1.3b batch 1 and 8, OPT-6.7b batch 1 (its int8
  # floor), prefill 1x2040 (+ 8 decoded = 2048 positions), PPL of the tiny trained model on the GPU
  evals=()
  for spec in "opt-1.3b 1" "opt-1.3b 8" "opt-6.7b 1"; do
    set -- $spec
    run "eval_$1_b$2" 240 python3 -m fuseinfer.eval --model "random:$1" --dtype fp16 \
      --backends fuseinfer,fuseinfer-w8a16 --skip-ppl --batch-size "$2" --prompt-len 512 --gen-len 128 --repeats 5 \
      --output "$R/eval_$1_b$2.json"
    evals+=("$R/eval_$1_b$2.json")
  done
  run eval_prefill_2040 180 python3 -m fuseinfer.eval --model random:opt-1.3b --dtype fp16 \
    --backends fuseinfer,fuseinfer-w8a16 --skip-ppl --batch-size 1 --prompt-len 2040 --gen-len 8 --repeats 5 \
    --output "$R/eval_prefill_2040.json"
  run eval_tiny_ppl 180 python3 -m fuseinfer.eval --model "$FUSEINFER_SHARED/models/opt-wt2-tiny" --dtype fp16 \
    --backends fuseinfer,fuseinfer-w8a16 --skip-latency --data-dir "$FUSEINFER_SHARED/data/wikitext-2-raw" \
    --output "$R/eval_tiny_ppl.json"
  run int8_eval_summary 60 python3 bench/quant_eval_summary.py int8_eval "${evals[@]}" "$R/eval_prefill_2040.json" \
    "$R/eval_tiny_ppl.json"
fi
fi
if [ "$mode" = all ] || [ "$mode" = opt66b ]; then
  # 4. OPT-66b int8 on one GPU (random weights drawn and quantized layer by layer on the GPU)
  run opt66b 420 python3 bench/bench_opt66b_int8.py --model opt-66b --batch 1 --prompt 128 --gen 64
fi
(cd "$OUT" && tar czf int8_stage.tar.gz int8)
echo "gpu_stage_int8: $([ $status -eq 0 ] && echo PASS || echo FAIL); results in $OUT/int8_stage.tar.gz"
exit $status
