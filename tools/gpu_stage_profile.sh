#!/usr/bin/env bash
# Issue 38 on the GPU: python -m fuseinfer.profile on random OPT-1.3b fp16 (fuseinfer vs eager), prefill of 2048
# tokens and one decode step after a 512-token prompt, plus the eval's figures for the same settings to check the
# profiler's step time against (target: within 10%). Needs the extension built (tools/gpu_check.sh build).
#
#   OUT=/path bash tools/gpu_stage_profile.sh      (NCU=1: also --ncu on the decode profile, where ncu is on PATH)
#
# Writes $OUT/profile/{profile_prefill,profile_decode}/ (summary.md, profile.json, plots, per-backend tables,
# traces) and the eval JSON / logs, packed into $OUT/profile.tar.gz (the device tool returns few files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuseinfer-gpu}
P="$OUT/profile"
mkdir -p "$P"
export PYTHONUNBUFFERED=1
status=0

RUN_LOGS="$P"
. tools/gpu_run.sh  # run NAME CMD...: logs to $RUN_LOGS/NAME.log, remembers failure

MODEL=random:opt-1.3b
run profile_prefill python3 -m fuseinfer.profile --model $MODEL --backend fuseinfer --compare eager --phase prefill \
  --prompt-len 2048 --out "$P/profile_prefill"
ncu_flag=()
[ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null && ncu_flag=(--ncu --ncu-top 3)
run profile_decode python3 -m fuseinfer.profile --model $MODEL --backend fuseinfer --compare eager --phase decode \
  --prompt-len 512 --out "$P/profile_decode" "${ncu_flag[@]}"
# the eval's figures for the same settings (its prefill needs room for one generated token: 2047 + 1, 0.05% less
# work than 2048; its decode median runs over the 32 steps after a 512-token prompt)
run eval_prefill python3 -m fuseinfer.eval --model $MODEL --dtype fp16 --backends eager,fuseinfer --skip-ppl \
  --prompt-len 2047 --gen-len 1 --output "$P/eval_prefill_2047.json"
run eval_decode python3 -m fuseinfer.eval --model $MODEL --dtype fp16 --backends eager,fuseinfer --skip-ppl \
  --prompt-len 512 --gen-len 32 --output "$P/eval_decode_512.json"
run check_prefill python3 tools/check_profile_vs_eval.py "$P/profile_prefill/profile.json" \
  "$P/eval_prefill_2047.json" prefill
run check_decode python3 tools/check_profile_vs_eval.py "$P/profile_decode/profile.json" \
  "$P/eval_decode_512.json" decode
run pytest_profile_gpu python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/profile
(cd "$OUT" && tar czf profile.tar.gz profile && rm -rf profile)
echo "gpu_stage_profile: $([ "$status" -eq 0 ] && echo PASS || echo FAIL); results in $OUT/profile.tar.gz"
exit "$status"
