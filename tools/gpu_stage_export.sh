#!/usr/bin/env bash
# GPU stage of the ONNX export and the ONNX Runtime backend. About 5.5 minutes on one H100.
#
#   OUT=/path bash tools/gpu_stage_export.sh        (or: bash tools/gpu_check.sh export)
#
# Needs: the fuseinfer extension built (gpu_check.sh build), onnxruntime-gpu 1.31.1 (CUDA 13 build) installed in
# /tmp/site (carried in pieces: ../shared/tools/big-wheels.md; ORT_SITE overrides the path), FUSEINFER_SHARED (the
# tiny model; default .gpu_assets/ as gpu_check.sh, else ../shared).
#
# Steps (each under a timeout; a failing step marks the stage failed and the others still run; a step that would
# start after EXPORT_STAGE_BUDGET_S (default 345 s) is skipped and says so):
#   env          torch, onnxruntime version and providers (the CUDA provider must be there)
#   export_*     python -m fuseinfer.export onnx, random OPT-1.3b fp16 on CUDA, fused and plain, run concurrently in
#                the background (target: < 3 min each); the eval rows and the profile below reuse these exports
#   pytest_gpu   pytest -m gpu tests/export (CUDA provider, IO binding, fp16 within 2x PyTorch's error)
#   accuracy     bench/ort_accuracy.py: max logit error vs fp32 PyTorch next to PyTorch fp16's, greedy tokens
#   eval_b1/_b8  fuseinfer.eval, eager, compile, fuseinfer, ort, ort-plain; prompt 512, 128 new tokens
#   eval_prefill2040  the same at 1 x 2040 (+ 8 decoded); no compile row unless EXPORT_PREFILL_COMPILE=1 (its
#                first call compiles for ~1 min; gpu_check.sh's e2e stage has that row)
#   profile      bench/ort_profile.py: fused vs plain, ORT profiler + CUPTI kernels; loads both exports in a
#                fresh process (the "files load in a fresh process" check)
# Output: $OUT/export_summary.md (every figure with its target) and $OUT/export_stage.tar.gz (logs, JSON, Markdown
# of each step). Exit status 0 only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuseinfer-gpu}
R="$OUT/export_stage"
rm -rf "$R" && mkdir -p "$R"
if [ -z "${FUSEINFER_SHARED:-}" ]; then
  FUSEINFER_SHARED=$PWD/.gpu_assets
  [ -d "$FUSEINFER_SHARED/models" ] || FUSEINFER_SHARED=$PWD/../shared
fi
export FUSEINFER_SHARED PYTHONUNBUFFERED=1 FUSEINFER_BENCH_DIR="$R"
export PYTHONPATH=${ORT_SITE:-/tmp/site}:$PWD${PYTHONPATH:+:$PYTHONPATH}
ONNX=${ONNX_CACHE:-/tmp/fuseinfer-onnx}
BUDGET=${EXPORT_STAGE_BUDGET_S:-345}
# a CPU dry run of this script (no GPU figures):  EXPORT_STAGE_DEVICE=cpu EXPORT_STAGE_MODEL=<tiny dir>
#   EXPORT_STAGE_PROMPT=32 EXPORT_STAGE_GEN=8 EXPORT_STAGE_LONG=120 ORT_SITE=/nonexistent bash tools/gpu_stage_export.sh
MODEL=${EXPORT_STAGE_MODEL:-random:opt-1.3b}
DEVICE=${EXPORT_STAGE_DEVICE:-cuda}
DTYPE=$([ "$DEVICE" = cuda ] && echo fp16 || echo fp32)
P=${EXPORT_STAGE_PROMPT:-512}
G=${EXPORT_STAGE_GEN:-128}
LONG=${EXPORT_STAGE_LONG:-2040}
status=0

step() {  # step NAME LIMIT_S CMD...: CMD under a timeout, output in $R/NAME.log, one line in $R/steps.txt
  local name=$1 limit=$2 left=$((BUDGET - SECONDS)) t0=$SECONDS rc
  shift 2
  if [ "$left" -lt 20 ]; then
    echo "== $name: SKIPPED, the stage's ${BUDGET} s budget is spent" | tee -a "$R/steps.txt"
    status=1
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout -k 10 "$limit" "$@" >"$R/$name.log" 2>&1
  rc=$?
  echo "== $name: rc=$rc after $((SECONDS - t0)) s (limit $limit s)$([ $rc -eq 124 ] && echo ', TIMED OUT')" |
    tee -a "$R/steps.txt"
  [ $rc -eq 0 ] || { status=1; tail -5 "$R/$name.log"; }
  return $rc
}

export_bg() {  # export_bg FLAVOUR: the export CLI in the background; export_FLAVOUR.json = its JSON line + wall_s
  local flavour=$1
  (
    t0=$(date +%s.%N)
    timeout -k 10 240 python3 -m fuseinfer.export onnx --model "$MODEL" --dtype $DTYPE --device $DEVICE \
      --out "$ONNX/cli-$flavour" --"$flavour" >"$R/export_$flavour.out" 2>"$R/export_$flavour.log"
    rc=$?
    wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
    echo "== export_$flavour: rc=$rc after $wall s (limit 240 s)" >>"$R/steps.txt"
    [ $rc -eq 0 ] && python3 -c 'import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); d["wall_s"] = float(sys.argv[2])
print(json.dumps(d))' "$R/export_$flavour.out" "$wall" >"$R/export_$flavour.json"
    exit $rc
  ) &
}

step env 60 python3 -c "
import torch, onnxruntime as ort
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())
print('onnxruntime', ort.__version__, ort.__file__, ort.get_available_providers())
assert '$DEVICE' == 'cpu' or 'CUDAExecutionProvider' in ort.get_available_providers(), 'no CUDA provider: onnxruntime-gpu not in ${ORT_SITE:-/tmp/site}'"
cat "$R/env.log"

rm -rf "$ONNX" && mkdir -p "$ONNX"
export_bg fused
pid_fused=$!
export_bg plain
pid_plain=$!
step pytest_gpu 150 python3 -m pytest tests/export -q -m gpu -rs -p no:cacheprovider
step accuracy 90 python3 bench/ort_accuracy.py "$R/ort_accuracy" $DEVICE
wait $pid_fused || status=1
wait $pid_plain || status=1
grep -h "export_" "$R/steps.txt" | tail -2

EVAL=(python3 -m fuseinfer.eval --model "$MODEL" --device $DEVICE --dtype $DTYPE --skip-ppl --onnx-dir "$ONNX")
ALL=${EXPORT_STAGE_BACKENDS:-eager,compile,fuseinfer,ort,ort-plain}
step eval_b1 170 "${EVAL[@]}" --backends $ALL --batch-size 1 --prompt-len $P --gen-len $G \
  --warmup 0 --repeats 3 --output "$R/eval_b1.json" --markdown "$R/eval_b1.md"
step eval_b8 170 "${EVAL[@]}" --backends $ALL --batch-size 8 --prompt-len $P --gen-len $G \
  --warmup 0 --repeats 3 --output "$R/eval_b8.json" --markdown "$R/eval_b8.md"
PREFILL=${ALL/compile,/}
[ "${EXPORT_PREFILL_COMPILE:-0}" = 1 ] && PREFILL=$ALL
step eval_prefill2040 120 "${EVAL[@]}" --backends $PREFILL --batch-size 1 --prompt-len $LONG --gen-len 8 \
  --warmup 1 --repeats 5 --output "$R/eval_prefill2040.json" --markdown "$R/eval_prefill2040.md"
step profile 120 python3 bench/ort_profile.py "$ONNX/cli-fused" "$ONNX/cli-plain" "$R/ort_profile.md" $P 32

python3 tools/export_stage_summary.py "$R" >"$OUT/export_summary.md" 2>>"$R/steps.txt"
cp "$OUT/export_summary.md" "$R/"
cat "$OUT/export_summary.md" "$R/steps.txt"
(cd "$OUT" && tar czf export_stage.tar.gz export_stage && rm -rf export_stage)
echo "gpu_stage_export: $([ $status -eq 0 ] && echo PASS || echo FAIL) after $SECONDS s; $OUT/export_summary.md, $OUT/export_stage.tar.gz"
exit $status
