#!/usr/bin/env bash
# "Nothing slower": the eval table of this tree against a baseline tree, back to back on one GPU, in one process
# each, alternating base / new so that clock drift falls on both.
#
#   bash tools/stage_baseline.sh REV            # here: packs REV's fuseinfer/ csrc/ setup.py into .stage/base.tar.gz
#   OUT=... bash tools/gpu_stage_baseline.sh [build-only]  # on the GPU machine, after `gpu_check.sh build`
#                                               (carry .stage); build-only builds the base tree and stops
#
# The baseline reuses this tree's built extension when its csrc/ is identical, else builds its own (~150 s).
# Writes base_*.json / new_*.json and compare.md (tools/compare_evals.py) to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuseinfer-baseline}
mkdir -p "$OUT"
RUN_LOGS="$OUT"
. tools/gpu_run.sh
BASE_TAR=${BASE_TAR:-.stage/base.tar.gz}
BASE=/tmp/fuseinfer-base
BACKENDS=${BASELINE_BACKENDS:-fuseinfer,fuseinfer-w8a16,fuseinfer-w8a8}
PEERS=${BASELINE_PEERS:-}  # backends timed in the new tree only (e.g. eager,compile: the table's peers, code unchanged)
PROMPTS=${BASELINE_PROMPTS:-512 2040}
if [ "${1:-}" = build-only ] || ! ls "$BASE"/fuseinfer/_C*.so >/dev/null 2>&1; then  # (kept on a warm machine)
  rm -rf "$BASE" && mkdir -p "$BASE" && tar xzf "$BASE_TAR" -C "$BASE" || { echo "no baseline at $BASE_TAR"; exit 2; }
  if diff -rq csrc "$BASE/csrc" >/dev/null && ls fuseinfer/_C*.so >/dev/null 2>&1; then
    cp fuseinfer/_C*.so "$BASE/fuseinfer/" && echo "baseline: csrc identical, this tree's extension reused"
  else
    (cd "$BASE" && FUSEINFER_BUILD_CUDA=1 run base_build python3 setup.py -q build_ext --inplace) || exit 1
  fi
fi
[ "${1:-}" = build-only ] && exit "$status"   # `gpu_stage_baseline.sh build-only`: the base tree's build alone
NEW=$PWD
ev() {  # ev TREE TAG PROMPT GEN
  local backends=$BACKENDS
  [ "$2" = new ] && [ -n "$PEERS" ] && backends="$PEERS,$BACKENDS"
  (cd "$1" && PYTHONPATH="$1" run "$2_p$3" python3 -m fuseinfer.eval --model random:opt-1.3b --dtype fp16 \
    --backends "$backends" --skip-ppl --batch-size 1 --prompt-len "$3" --gen-len "$4" --data-dir "$FUSEINFER_SHARED/data/wikitext-2-raw" \
    --output "$OUT/$2_p$3.json")
}
pairs=()
for p in $PROMPTS; do
  gen=64; [ "$p" -gt 1024 ] && gen=8
  if [ ${#pairs[@]} -eq 0 ] || [ $(( ${#pairs[@]} % 4 )) -eq 0 ]; then ev "$BASE" base "$p" $gen; ev "$NEW" new "$p" $gen
  else ev "$NEW" new "$p" $gen; ev "$BASE" base "$p" $gen; fi
  pairs+=("$OUT/base_p$p.json" "$OUT/new_p$p.json")
done
python3 tools/compare_evals.py "${pairs[@]}" | tee "$OUT/compare.md"
exit "$status"
