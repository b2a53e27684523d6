#!/usr/bin/env bash
# W8A8 SmoothQuant (issue 36) on the GPU machine: CUTLASS headers, build, GPU tests, compute-sanitizer memcheck, benchmark.
#
#   bash tools/gpu_stage_w8a8.sh [stage ...]     stages: cutlass build test sanitize bench (default: all, in order)
#
# Needs carried: .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl (CUTLASS's headers; `pip download --no-deps
# nvidia-cutlass`), unless FUSEINFER_CUTLASS_DIR is set or nvidia-cutlass is installed; .gpu_assets/ (the tiny
# model and WikiText-2, tools/stage_gpu_assets.sh) for the outlier perplexity test. Expected time on one H100: build
# ~3-4 min (the two CUTLASS files, ~1.5-2 min of nvcc each, compile in parallel with the rest), tests ~1 min,
# sanitizer ~1 min, bench ~3 min. Set SKIP_BUILD=1 when gpu_check.sh's build stage already ran with
# FUSEINFER_CUTLASS_DIR exported. Everything lands in $OUT/w8a8.tar.gz (logs + bench JSON/Markdown).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuseinfer-gpu}
W=$OUT/w8a8
mkdir -p "$W"
export FUSEINFER_SHARED=${FUSEINFER_SHARED:-$PWD/.gpu_assets}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FUSEINFER_BUILD_CUDA=1
export FUSEINFER_BENCH_DIR=${FUSEINFER_BENCH_DIR:-$W/bench}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(cutlass build test sanitize bench)
status=0

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

find_cutlass() {  # exports FUSEINFER_CUTLASS_DIR from the carried wheel when no CUTLASS is set or installed
  if [ -n "${FUSEINFER_CUTLASS_DIR:-}" ]; then echo "CUTLASS: $FUSEINFER_CUTLASS_DIR"; return 0; fi
  if python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("cutlass_library") is None)'; then
    echo "CUTLASS: the installed nvidia-cutlass package"; return 0
  fi
  local whl
  whl=$(ls .whl/nvidia_cutlass-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ]; then echo "no CUTLASS: carry .whl/nvidia_cutlass-*.whl or set FUSEINFER_CUTLASS_DIR"; return 1; fi
  # a wheel is a zip: unpacking it is all `pip install --no-deps --target` would do for these headers
  [ -f /tmp/cutlass/cutlass_library/source/include/cutlass/cutlass.h ] || python3 -m zipfile -e "$whl" /tmp/cutlass
  export FUSEINFER_CUTLASS_DIR=/tmp/cutlass
  echo "CUTLASS: $whl unpacked in $FUSEINFER_CUTLASS_DIR"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$W/gpu.log"
for stage in "${stages[@]}"; do
  case $stage in
    cutlass) run cutlass find_cutlass || finish 1 ;;
    build)
      if [ "${SKIP_BUILD:-0}" != 1 ]; then
        run build python3 -m pip install --no-deps --no-build-isolation --no-index -e . || finish 1
      fi
      run import python3 -c 'import fuseinfer._C as C, torch
from fuseinfer.ops.int8_gemm import w8a8_backend, w8a8_unavailable_reason
d = torch.device("cuda"); b = w8a8_backend(d); print("w8a8 backend:", b, w8a8_unavailable_reason(d))
assert torch.cuda.get_device_capability() != (9, 0) or b == "cutlass-sm90", "sm90 kernel not built: see build.log"' \
        || finish 1 ;;
    test)
      run pytest_w8a8 python3 -m pytest -q -ra -p no:cacheprovider -s \
        tests/ops/test_int8_gemm.py tests/ops/test_layer_norm_quant.py tests/quant/test_smoothquant.py ;;
    sanitize)
      # memcheck only: racecheck flags every reuse of a TMA-filled shared-memory stage, which CUTLASS's pipelined
      # GEMM does by design (see tools/racecheck_tma.py and racecheck_ring.cu for the same on our own kernels)
      run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/w8a8_smoke.py ;;
    bench) run bench_w8a8 python3 bench/bench_w8a8.py ${W8A8_BENCH_ARGS:-} ;;
    *) echo "unknown stage $stage"; finish 2 ;;
  esac
done
finish "$status"
