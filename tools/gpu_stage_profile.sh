#!/usr/bin/env bash
# The profiler on the GPU: python -m fuseinfer.profile on random OPT-1.3b fp16 (fuseinfer vs eager), prefill of 2048
# tokens and one decode step after a 512-token prompt, plus the eval's figures for the same settings to check the
# profiler's step time against (target: within 10%) and the compare (>= 90% of the difference by module kind); the
# dtype is the eval's and the profiler's default on CUDA, fp16.
# Needs the extension built (tools/gpu_check.sh build). ~3 min on an H100.
#
#   OUT=/path bash tools/gpu_stage_profile.sh      (NCU=1: also --ncu --ncu-top 2 on the decode profile, where ncu is
#                                                   on PATH and may read the counters; ~1 min more per kernel)
#
# Returns two files in $OUT:
#   profile_results.tar.gz  what bench/results/<gpu>/profile/ commits (small): per phase (prefill/, decode/) summary.md,
#                           time_by_kind.png, roofline.png, memory_<backend>.png, compare.csv, profile.json and per
#                           backend <backend>/{ops,kernels,modules,layers}.csv + memory.json; the eval JSONs; the
#                           checks (check_*.log: step time vs eval, compare by kind, verdict tables); the run logs
#   profile_traces.tar      the Chrome traces (trace.json and the module pass trace_modules.json, gzipped; Perfetto opens .json.gz) when together < 15 MiB,
#                           else left out (the TensorBoard log dirs, a gzip of the same trace, are never returned)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuseinfer-gpu}
P="$OUT/profile"
mkdir -p "$P"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0

RUN_LOGS="$P"
. tools/gpu_run.sh  # run NAME CMD...: logs to $RUN_LOGS/NAME.log, remembers failure

# (MODEL, DEVICE, PREFILL_LEN, DECODE_PROMPT: for a dry run of this script on CPU with the tiny model)
MODEL=${MODEL:-random:opt-1.3b} DEVICE=${DEVICE:-cuda} PREFILL_LEN=${PREFILL_LEN:-2048} DECODE_PROMPT=${DECODE_PROMPT:-512}
dev=(--device "$DEVICE")
run profile_prefill timeout 300 python3 -m fuseinfer.profile --model $MODEL --backend fuseinfer --compare eager \
  --phase prefill --prompt-len "$PREFILL_LEN" --out "$P/prefill" --no-tensorboard "${dev[@]}"
ncu_flag=()
[ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null && ncu_flag=(--ncu --ncu-top 2)
run profile_decode timeout 400 python3 -m fuseinfer.profile --model $MODEL --backend fuseinfer --compare eager \
  --phase decode --prompt-len "$DECODE_PROMPT" --out "$P/decode" --no-tensorboard "${dev[@]}" "${ncu_flag[@]}"
# the eval's figures for the same settings (its prefill needs room for one generated token: 2047 + 1, 0.05% less
# work than 2048; its decode median runs over the 32 steps after a 512-token prompt)
run eval_prefill timeout 200 python3 -m fuseinfer.eval --model $MODEL "${dev[@]}" --backends eager,fuseinfer \
  --skip-ppl --prompt-len $((PREFILL_LEN - 1)) --gen-len 1 --output "$P/eval_prefill.json"
run eval_decode timeout 200 python3 -m fuseinfer.eval --model $MODEL "${dev[@]}" --backends eager,fuseinfer \
  --skip-ppl --prompt-len "$DECODE_PROMPT" --gen-len 32 --output "$P/eval_decode.json"
run check_prefill python3 tools/check_profile_vs_eval.py "$P/prefill/profile.json" "$P/eval_prefill.json" prefill
run check_decode python3 tools/check_profile_vs_eval.py "$P/decode/profile.json" "$P/eval_decode.json" decode

# the files back: results small enough to commit, traces compressed apart (or left out when too large)
find "$P" -name tensorboard -type d -prune -exec rm -rf {} +
T="$OUT/profile_traces"
mkdir -p "$T"
for trace in "$P"/*/*/trace*.json; do
  [ -f "$trace" ] || continue
  rel=${trace#"$P"/}
  mkdir -p "$T/$(dirname "$rel")"
  gzip -9 -c "$trace" > "$T/$rel.gz" && rm -f "$trace"
done
(cd "$OUT" && tar cf profile_traces.tar profile_traces && rm -rf profile_traces)  # (each trace gzipped already)
if [ "$(stat -c %s "$OUT/profile_traces.tar")" -gt $((15 * 1024 * 1024)) ]; then
  echo "traces: $(du -h "$OUT/profile_traces.tar" | cut -f1) together, over 15 MiB: left out" | tee -a "$P/files.log"
  rm -f "$OUT/profile_traces.tar"
fi
find "$P" -type f -size +15M -print -delete | sed 's/^/left out (over 15 MiB): /' | tee -a "$P/files.log"
du -ah "$P" | sort -h | tail -n 12
(cd "$OUT" && tar czf profile_results.tar.gz profile && rm -rf profile)
ls -la "$OUT"/profile_*.tar*
echo "gpu_stage_profile: $([ "$status" -eq 0 ] && echo PASS || echo FAIL); results in $OUT/profile_results.tar.gz"
exit "$status"
