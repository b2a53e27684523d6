#!/usr/bin/env bash
# Fast prefill on the GPU machine: the prefill GPU tests, then bench/bench_prefill.py, then the eval's
# prefill column at 512 tokens; logs and results packed into one tar under $OUT.
#
#   bash tools/gpu_stage_prefill.sh            (after tools/gpu_check.sh build, or with the extension built)
#
# Needs the shared assets in .gpu_assets/ (tools/stage_gpu_assets.sh; carry it) for the tiny-model tests. Set
# PREFILL_BENCH_ARGS (e.g. --no-compile) to shorten the benchmark; SKIP_EVAL=1 leaves out the eval run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuseinfer-gpu}
mkdir -p "$OUT/prefill"
export FUSEINFER_SHARED=${FUSEINFER_SHARED:-$PWD/.gpu_assets}
export FUSEINFER_BENCH_DIR=${FUSEINFER_BENCH_DIR:-$OUT/prefill/bench}
export PYTHONUNBUFFERED=1
status=0

RUN_LOGS="$OUT/prefill"
. tools/gpu_run.sh  # run NAME CMD...: logs to $RUN_LOGS/NAME.log, remembers failure

python3 -c 'import fuseinfer._C' || { echo "fuseinfer._C is not built: run tools/gpu_check.sh build first"; exit 2; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/prefill/gpu.txt"
# the new GPU tests, plus the existing ones that capture or compile the patched model and the runtime's GPU tests
run pytest_prefill python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/runtime/test_prefill.py tests/runtime/test_sessions.py tests/runtime/test_decode.py
run pytest_gpu_model python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_patching_gpu.py \
  -k "cuda_graphs or greedy or patched_opt"
run bench_prefill timeout 420 python3 bench/bench_prefill.py ${PREFILL_BENCH_ARGS:-}
if [ "${SKIP_EVAL:-0}" != 1 ]; then  # the eval's prefill column (fuseinfer's prefill goes through session.begin)
  run eval_prefill timeout 300 python3 -m fuseinfer.eval --model random:opt-1.3b --dtype fp16 \
    --backends eager,fuseinfer --skip-ppl --batch-size 1 --prompt-len 512 --gen-len 16 \
    --output "$FUSEINFER_BENCH_DIR/eval_prefill_opt-1.3b_fp16_b1.json" \
    --markdown "$FUSEINFER_BENCH_DIR/eval_prefill_opt-1.3b_fp16_b1.md"
fi
(cd "$OUT" && tar czf prefill.tar.gz prefill && rm -rf prefill)
echo "gpu_stage_prefill: $([ "$status" -eq 0 ] && echo PASS || echo FAIL); results in $OUT/prefill.tar.gz"
exit "$status"
