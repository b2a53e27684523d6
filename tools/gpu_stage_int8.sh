#!/usr/bin/env bash
# GPU stage of the int8 weight-only (W8A16) feature, issue 35. Assumes the extension is built (gpu_check.sh build,
# which compiles csrc/int8_linear.cu and csrc/quant.cu with the rest) and the shared assets in .gpu_assets/.
#
#   bash tools/gpu_stage_int8.sh            # everything, ~6-7 min of GPU time on an H100
#   bash tools/gpu_stage_int8.sh quick      # tests + harness + sanitizers + quick benches (no eval / 66b)
#
# Writes logs and results under $OUT/int8 and packs them into $OUT/int8_stage.tar.gz; exits 1 if any step failed.
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
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
python3 -c 'import fuseinfer._C as C; assert hasattr(C, "int8_linear"), "rebuild: fuseinfer._C lacks int8_linear"' ||
  { echo "fuseinfer._C with the int8 kernels is not built"; exit 1; }

# 1. kernels standalone (no torch), then the GPU tests of tests/quant and the CPU ones (reference path, PPL)
run harness_build 300 nvcc -arch=sm_90a -std=c++17 -O3 -DFUSEINFER_KERNEL_HARNESS -Icsrc tools/int8_harness.cu \
  -o "$R/int8_harness"
run harness 60 "$R/int8_harness"
run pytest_quant 600 python3 -m pytest -q -ra -p no:cacheprovider -s tests/quant
# 2. sanitizers on the new kernels (small shapes): memcheck + racecheck through torch, memcheck of the harness
run memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/int8_smoke.py
run racecheck 300 compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/int8_smoke.py
run memcheck_harness 300 compute-sanitizer --tool memcheck --error-exitcode 1 "$R/int8_harness"
# 3. benches: int8 GEMV / prefill vs fp16 and copy; quantize kernels vs eager / compile
q=""; [ "$mode" = quick ] && q=--quick
run bench_int8_linear 600 python3 bench/bench_int8_linear.py $q
run bench_quant 600 python3 bench/bench_quant.py --quick  # (0.5M, 8M, 50M elements; full sweep: no --quick)
if [ "$mode" != quick ]; then
  # 4. eval rows: fp16 fuseinfer vs W8A16, OPT-1.3b batch 1 and 8, OPT-6.7b batch 1; then prefill 1x2048
  for spec in "opt-1.3b 1" "opt-1.3b 8" "opt-6.7b 1"; do
    set -- $spec
    run "eval_$1_b$2" 600 python3 -m fuseinfer.eval --model "random:$1" --dtype fp16 --backends fuseinfer,fuseinfer-w8a16 \
      --skip-ppl --batch-size "$2" --prompt-len 512 --gen-len 128 --output "$R/eval_$1_b$2.json"
  done
  run eval_prefill_2040 600 python3 -m fuseinfer.eval --model random:opt-1.3b --dtype fp16 \
    --backends fuseinfer,fuseinfer-w8a16 --skip-ppl --batch-size 1 --prompt-len 2040 --gen-len 8 \
    --output "$R/eval_prefill_2040.json"
  run eval_tiny_ppl 600 python3 -m fuseinfer.eval --model "$FUSEINFER_SHARED/models/opt-wt2-tiny" --dtype fp16 \
    --backends fuseinfer,fuseinfer-w8a16 --skip-latency --data-dir "$FUSEINFER_SHARED/data/wikitext-2-raw" \
    --output "$R/eval_tiny_ppl.json"
  # 5. OPT-66b int8 on one GPU
  run opt66b 600 python3 bench/bench_opt66b_int8.py --model opt-66b --batch 1 --prompt 128 --gen 64
fi
(cd "$OUT" && tar czf int8_stage.tar.gz int8)
echo "gpu_stage_int8: $([ $status -eq 0 ] && echo PASS || echo FAIL); results in $OUT/int8_stage.tar.gz"
exit $status
