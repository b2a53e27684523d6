#!/usr/bin/env bash
# Packs a baseline revision's code (fuseinfer/, csrc/, setup.py, pyproject.toml) into .stage/base.tar.gz (git-ignored)
# for tools/gpu_stage_baseline.sh.   bash tools/stage_baseline.sh REV
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .stage
git archive "${1:?usage: stage_baseline.sh REV}" fuseinfer csrc setup.py pyproject.toml | gzip > .stage/base.tar.gz
echo "baseline $(git rev-parse --short "$1") -> .stage/base.tar.gz ($(du -h .stage/base.tar.gz | cut -f1))"
