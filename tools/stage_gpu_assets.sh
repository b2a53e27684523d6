#!/usr/bin/env bash
# Copies the shared assets a GPU run needs into .gpu_assets/ (git-ignored) so a remote run can `carry` them.
# With TRANSFORMERS_VERSION=X.Y.Z it also downloads that transformers wheel into .gpu_assets/wheels/ (the GPU
# machine reaches no registry); tools/gpu_check.sh runs under it when FUSEINFER_GPU_TRANSFORMERS names the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${FUSEINFER_SHARED:-../shared}
mkdir -p .gpu_assets/models .gpu_assets/data
for m in opt-wt2-tiny llama-wt2-tiny; do cp -r "$SHARED/models/$m" .gpu_assets/models/; done
cp -r "$SHARED/data/wikitext-2-raw" .gpu_assets/data/
if [ -n "${TRANSFORMERS_VERSION:-}" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu_assets/wheels "transformers==$TRANSFORMERS_VERSION"
fi
du -sh .gpu_assets
