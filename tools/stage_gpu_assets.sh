#!/usr/bin/env bash
# Copies the shared assets a GPU run needs into .gpu_assets/ (git-ignored) so a device call can `carry` them.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${FUSEINFER_SHARED:-../shared}
mkdir -p .gpu_assets/models .gpu_assets/data
cp -r "$SHARED/models/opt-wt2-tiny" .gpu_assets/models/
cp -r "$SHARED/data/wikitext-2-raw" .gpu_assets/data/
du -sh .gpu_assets
