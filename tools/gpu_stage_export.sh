#!/usr/bin/env bash
# GPU stage of issue 37 (ONNX / ONNX Runtime export). Needs onnxruntime-gpu 1.31.1 (CUDA 13) installed in /tmp/site
# (carried in pieces, see ../shared/tools/big-wheels.md) and the fuseinfer extension built. Writes to $OUT:
#   stage.log                  everything, incl. pytest (-m gpu tests/export) and the export timings
#   eval_b1.{json,md}          random opt-1.3b fp16, batch 1, prompt 512, 128 new tokens: eager, compile, fuseinfer, ort, ort-plain
#   eval_b8.{json,md}          the same at batch 8
#   eval_prefill2040.md        prefill of 1 x 2040 tokens (+ 8 decode steps; 2048 positions in all)
#   ort_profile.md             where ORT's time goes, fused vs plain (ORT profiler + torch.profiler kernels)
# Exits non-zero when a step fails. About 5-6 minutes on one H100.
set -uo pipefail
OUT=${OUT:-bench/results/export_stage}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export FUSEINFER_SHARED=${FUSEINFER_SHARED:-$PWD/../shared}
ONNX=${ONNX_CACHE:-/tmp/fuseinfer-onnx}
LOG="$OUT/stage.log"
fail=0
step() { echo "== $*" | tee -a "$LOG"; "$@" >>"$LOG" 2>&1; rc=$?; echo "== rc=$rc" >>"$LOG"; [ $rc -eq 0 ] || fail=1; return $rc; }

step python3 -c "import torch, onnxruntime as ort; print(ort.__version__, ort.get_available_providers()); assert 'CUDAExecutionProvider' in ort.get_available_providers(), 'onnxruntime-gpu not found in /tmp/site'" || exit 1
step python3 -m pytest tests/export -q -m gpu -rs -p no:cacheprovider
rm -rf "$ONNX"; mkdir -p "$ONNX"
# export timing (target < 3 min for opt-1.3b fp16), then a load in a fresh process; the eval below reuses these
for flavour in fused plain; do
  t0=$SECONDS
  step python3 -m fuseinfer.export onnx --model random:opt-1.3b \
    --dtype fp16 --device cuda --out "$ONNX/cli-$flavour" --$flavour
  echo "export $flavour wall $((SECONDS - t0)) s" | tee -a "$LOG"
done
step python3 -c "
import time, torch; from fuseinfer.export import OrtDecoder
t = time.perf_counter(); d = OrtDecoder('$ONNX/cli-fused', 'cuda'); load = time.perf_counter() - t
ids = torch.randint(3, 50000, (1, 16), device='cuda'); out = d.logits(ids); torch.cuda.synchronize()
assert torch.isfinite(out.float()).all(); print(f'fresh process: session load {load:.1f} s, logits {tuple(out.shape)} finite')"
EVAL="python3 -m fuseinfer.eval --model random:opt-1.3b --dtype fp16 --skip-ppl --onnx-dir $ONNX"
step $EVAL --backends eager,compile,fuseinfer,ort,ort-plain --batch-size 1 --prompt-len 512 --gen-len 128 \
  --warmup 1 --repeats 3 --output "$OUT/eval_b1.json" --markdown "$OUT/eval_b1.md"
step $EVAL --backends eager,compile,fuseinfer,ort,ort-plain --batch-size 8 --prompt-len 512 --gen-len 128 \
  --warmup 1 --repeats 3 --output "$OUT/eval_b8.json" --markdown "$OUT/eval_b8.md"
step $EVAL --backends eager,compile,fuseinfer,ort,ort-plain --batch-size 1 --prompt-len 2040 --gen-len 8 \
  --warmup 1 --repeats 5 --markdown "$OUT/eval_prefill2040.md"
step python3 bench/ort_profile.py "$ONNX/cli-fused" "$ONNX/cli-plain" "$OUT/ort_profile.md" 512 32
grep -E "^== |export .* wall|fresh process|passed|failed|skipped" "$LOG"
exit $fail
