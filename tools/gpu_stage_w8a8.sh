#!/usr/bin/env bash
# W8A8 SmoothQuant on the GPU machine: the kernels' memcheck, the GEMM / LayerNorm+quantize benchmarks,
# the outlier test on the GPU, and the end-to-end eval rows.
#
#   bash tools/gpu_stage_w8a8.sh [stage ...]   stages: cutlass build sanitize outlier paths bench e2e (default: all,
#                                              in order; the fused-LN / lean-prefill check alone: cutlass build paths e2e)
#
# build is skipped when fuseinfer._C already has the sm90 CUTLASS kernel (gpu_check.sh build with CUTLASS 4.2
# headers); otherwise it needs .whl/nvidia_cutlass-*.whl carried (or FUSEINFER_CUTLASS_DIR / nvidia-cutlass
# installed) and takes ~3-4 min. The GPU tests (pytest -m gpu) and the main sanitizers run elsewhere. Expected time
# on one H100 with the build done: memcheck ~1 min, outlier test ~0.5 min, bench ~2 min, e2e ~2.5 min.
# Needs .gpu_assets/ (tiny model + WikiText-2, tools/stage_gpu_assets.sh). Everything lands in $OUT/w8a8.tar.gz:
#   bench/w8a8_gemm.{json,md}            ours (CUTLASS sm90 int8 GEMM + epilogue) vs bare cuBLAS fp16 vs _int_mm +
#                                        rescale at OPT-1.3b / 6.7b, M = 2048 and 8192; TOPS and % of the fp16 rate
#   bench/w8a8_layernorm_quant.{json,md} add + LayerNorm + quantize vs eager and torch.compile, % of copy, L2 / HBM
#   eval_*.json, bench/w8a8_eval.{md,json} OPT-1.3b prefill 1x2047 W8A8 vs fp16 fuseinfer vs eager (one run),
#                                        OPT-6.7b prefill 1x2047 W8A8 vs fp16 fuseinfer, tiny-model PPL W8A8 vs fp16
#                                        (bench/quant_eval_summary.py: prefill / fp16, PPL / fp16 - 1, calibration s)
#   outlier.log                          the outlier model on the GPU: fp16, naive W8A8, SmoothQuant W8A8 PPL
#   paths_test.log                       GPU tests of the W8A8 layer's add_layer_norm_quant path and of W8A8 models in
#                                        the lean prefill loop / prefill graph (same logits and tokens as the modules)
#   bench/w8a8_prefill.{json,md}         OPT-1.3b prefill 1x2047/512/128, one run: fp16 graph vs W8A8 modules with
#                                        the old unfused LN -> quantize, W8A8 modules with add_layer_norm_quant, W8A8
#                                        lean loop, W8A8 prefill graph, and the W8A8 GEMMs alone (their floor)
#   prefill_path.log                     the prefill path each e2e W8A8 row took (must be the lean loop / graphs)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuseinfer-gpu}
W=$OUT/w8a8
mkdir -p "$W"
export FUSEINFER_SHARED=${FUSEINFER_SHARED:-$PWD/.gpu_assets}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FUSEINFER_BUILD_CUDA=1
export FUSEINFER_BENCH_DIR=${FUSEINFER_BENCH_DIR:-$W/bench} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(cutlass build sanitize outlier paths bench e2e)
status=0
. tools/gpu_run.sh  # find_cutlass; the run below replaces its run (this one also appends to times.log)

run() {  # run NAME CMD...: logs to $W/NAME.log, remembers failure
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$W/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$W/times.log"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

finish() {  # pack $W into $OUT/w8a8.tar.gz, print the verdict, exit
  (cd "$OUT" && tar czf w8a8.tar.gz w8a8 && rm -rf w8a8)
  echo "gpu_stage_w8a8: $([ "$1" -eq 0 ] && echo PASS || echo FAIL) (stages: ${stages[*]}); results in $OUT/w8a8.tar.gz"
  exit "$1"
}

e2e_eval() {  # e2e_eval MODEL BACKENDS: prefill 1x2047 (+ 1 decoded) in one eval run; a W8A8 row that failed (no
  # W8A8 model has run fast decode's CUDA graphs on a GPU before) is rerun with fp16 fuseinfer, both without decode
  # graphs (FUSEINFER_CUDA_GRAPHS=0 also turns off fuseinfer's prefill graphs: like for like, marked _nographs)
  local json="$W/eval_$1_prefill_2047.json"
  run "eval_$1_prefill" timeout 300 python3 -m fuseinfer.eval --model "random:$1" --dtype fp16 --backends "$2" \
    --skip-ppl --prompt-len 2047 --gen-len 1 --repeats 10 --calibration-samples 32 --output "$json"
  # the W8A8 row must have run the lean loop (prefill graphs at 1x2047), not the patched modules
  python3 - "$json" <<'PY' 2>&1 | tee -a "$W/prefill_path.log" || status=1
import json, sys
row = json.load(open(sys.argv[1]))["backends"]["fuseinfer-w8a8"]
path = row.get("prefill_path", "(none recorded)")
print(f"{sys.argv[1]}: fuseinfer-w8a8 status {row['status']}, prefill path: {path}")
sys.exit(0 if row["status"] != "ok" or path.startswith("lean loop") else 1)
PY
  if ! python3 -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["backends"]["fuseinfer-w8a8"]["status"] != "ok")' \
      "$json" 2>/dev/null; then
    echo "W8A8 row of $1 failed: rerun without CUDA graphs"
    run "eval_$1_prefill_nographs" env FUSEINFER_CUDA_GRAPHS=0 timeout 300 python3 -m fuseinfer.eval \
      --model "random:$1" --dtype fp16 --backends fuseinfer,fuseinfer-w8a8 --skip-ppl --prompt-len 2047 --gen-len 1 \
      --repeats 10 --calibration-samples 32 --output "$W/eval_$1_prefill_2047_nographs.json"
  fi
}

HAS_SM90='import torch, fuseinfer._C
from fuseinfer.ops.w8a8_linear import w8a8_backend, w8a8_unavailable_reason
d = torch.device("cuda"); b = w8a8_backend(d); print("w8a8 backend:", b, w8a8_unavailable_reason(d) or "")
assert torch.cuda.get_device_capability() != (9, 0) or b == "cutlass-sm90", "sm90 kernel not built"'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$W/gpu.log"
for stage in "${stages[@]}"; do
  case $stage in
    cutlass)
      if python3 -c "$HAS_SM90"; then echo "fuseinfer._C has the sm90 W8A8 kernel: no CUTLASS needed"; continue; fi
      # (not through run: its pipe would run find_cutlass in a subshell and lose the export)
      find_cutlass > "$W/cutlass.log" 2>&1; rc=$?; cat "$W/cutlass.log"
      [ "$rc" -eq 0 ] || { status=1; finish 1; } ;;
    build)
      if [ "${SKIP_BUILD:-0}" != 1 ] && ! python3 -c "$HAS_SM90"; then
        run build python3 -m pip install --no-deps --no-build-isolation --no-index -e . || finish 1
      fi
      run import python3 -c "$HAS_SM90" || finish 1 ;;
    sanitize)
      # memcheck only: racecheck flags every reuse of a TMA-filled shared-memory stage, which CUTLASS's pipelined
      # GEMM does by design (see tools/racecheck_tma.py and racecheck_ring.cu for the same on our own kernels)
      run memcheck timeout 240 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/w8a8_smoke.py ;;
    outlier)  # SmoothQuant must matter: naive W8A8 >= +20% PPL, SmoothQuant within 2% of fp16 (prints the three)
      run outlier timeout 240 python3 -m pytest -q -ra -p no:cacheprovider -s -m gpu tests/quant/test_smoothquant.py \
        -k outlier ;;
    paths)  # the fused LN + quantize layer and W8A8 through the lean loop / prefill graph, then where the time goes
      run paths_test timeout 240 python3 -m pytest -q -ra -p no:cacheprovider -s -m gpu tests/quant/test_w8a8_fused_ln.py
      run bench_w8a8_prefill timeout 300 python3 bench/bench_w8a8_prefill.py --reps 20 ;;
    bench)
      run bench_w8a8_gemm timeout 300 python3 bench/bench_w8a8.py --part gemm
      run bench_w8a8_ln timeout 300 python3 bench/bench_w8a8.py --part ln --quick ;;
    e2e)
      # prefill of 2047 tokens (+ 1 decoded: the 2048 positions); random weights are calibrated on random token ids
      # (no tokenizer), 32 windows of 512 (the time is reported apart, not in prefill)
      e2e_eval opt-1.3b eager,fuseinfer,fuseinfer-w8a8
      e2e_eval opt-6.7b fuseinfer,fuseinfer-w8a8
      run eval_tiny_ppl timeout 300 python3 -m fuseinfer.eval --model "$FUSEINFER_SHARED/models/opt-wt2-tiny" \
        --dtype fp16 --backends fuseinfer,fuseinfer-w8a8 --skip-latency \
        --data-dir "$FUSEINFER_SHARED/data/wikitext-2-raw" --output "$W/eval_tiny_ppl.json"
      run w8a8_eval_summary python3 bench/quant_eval_summary.py w8a8_eval "$W"/eval_opt-*_prefill_2047*.json \
        "$W/eval_tiny_ppl.json" ;;
    *) echo "unknown stage $stage"; finish 2 ;;
  esac
done
finish "$status"
