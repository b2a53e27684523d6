#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels the GPU machine's wheel stage needs and cannot fetch there (it
# reaches no registry): build and its pyproject_hooks, wheel, and nvidia-cutlass (the W8A8 GEMM's headers). Carry
# .whl/ (and .gpu_assets/, tools/stage_gpu_assets.sh) in the remote run that runs `bash tools/gpu_check.sh wheel`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl build pyproject_hooks wheel "nvidia-cutlass>=4.2"
ls -l .whl
