#!/usr/bin/env bash
# Smoke run of `python -m fuseinfer.eval` on the shared tiny OPT: on CPU when no flags are given, else with the
# given flags (e.g. --device cuda --dtype fp16 --backends eager,compile,fuseinfer; later flags win).
# Assets come from $FUSEINFER_SHARED (default: ../shared next to the repository); extra flags are passed on.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
shared="${FUSEINFER_SHARED:-$repo/../shared}"
out="${OUT_DIR:-/tmp/fuseinfer-eval-tiny}"
if [ ! -f "$shared/models/opt-wt2-tiny/config.json" ]; then
  echo "error: the shared tiny OPT is not at $shared/models/opt-wt2-tiny: set FUSEINFER_SHARED to the folder holding models/ and data/" >&2
  exit 2
fi
plot=()  # the plot needs matplotlib (pip install -e ".[plot]"); without it the run writes the other two files
python -c 'import matplotlib' 2>/dev/null && plot=(--plot "$out/plot.png")
python -m fuseinfer.eval \
    --model "$shared/models/opt-wt2-tiny" \
    --data-dir "$shared/data/wikitext-2-raw" \
    --backends eager,fuseinfer --max-windows 8 \
    --output "$out/results.json" --markdown "$out/report.md" ${plot[@]+"${plot[@]}"} \
    "${@:---device=cpu}"
