#!/usr/bin/env bash
# The wheel on the GPU machine: build it from a clean copy of the tree (fuseinfer._C for sm_90a; with
# FUSEINFER_CUDA_ARCH="8.0;9.0a" also sm_80), install it into a fresh venv and test the installed package, not the
# source tree: no nvcc on PATH, run from a temp folder, the tests copied there (--import-mode=importlib).
#
#   bash tools/gpu_check.sh wheel                    or   OUT=dir bash tools/gpu_stage_wheel.sh [step ...]
#   steps: build install test eval (default: all, in order; each later step reuses $WORK from an earlier call on
#   the same machine, so a long run can be split over remote runs: `... build install`, then `... test eval`)
#
# The GPU machine reaches no registry: carry .whl/ (git-ignored) with the wheels of build, pyproject_hooks, wheel and
# nvidia-cutlass (tools/stage_wheel_assets.sh downloads them) and .gpu_assets/ (tools/stage_gpu_assets.sh). The
# machine's torch, transformers and accelerate serve the venv (--system-site-packages). Wall time of every step is in
# $OUT/wheel/times.log; expected on one H100: build ~4 min (MAX_JOBS=16), install < 10 s, test ~3-5 min, eval ~2 min.
# Returns $OUT/wheel.tar.gz: the logs, the eval's JSON / Markdown, the wheel's file list (the wheel itself stays).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/fuseinfer-gpu}
W=$OUT/wheel
WORK=${WHEEL_WORK:-/tmp/fuseinfer-wheel}
mkdir -p "$W" "$WORK"
export FUSEINFER_SHARED=${FUSEINFER_SHARED:-$PWD/.gpu_assets}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
BUILD_CUDA=${WHEEL_BUILD_CUDA:-1}  # (0: a pure-Python wheel, to try this script's steps on a machine without a GPU)
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build install test eval)
status=0

RUN_LOGS="$W"
. tools/gpu_run.sh  # run NAME CMD...: logs to $RUN_LOGS/NAME.log, remembers failure

timed() {  # timed NAME CMD...: `run`, with its wall time appended to times.log
  local t0=$SECONDS rc
  run "$@"; rc=$?
  echo "$1: exit $rc, $((SECONDS - t0)) s" >> "$W/times.log"
  return "$rc"
}

finish() {  # pack $W into $OUT/wheel.tar.gz, print the verdict, exit
  cat "$W/times.log" 2>/dev/null
  (cd "$OUT" && tar czf wheel.tar.gz wheel && rm -rf wheel)
  echo "gpu_stage_wheel: $([ "$1" -eq 0 ] && echo PASS || echo FAIL) (steps: ${steps[*]}); results in $OUT/wheel.tar.gz"
  exit "$1"
}

clean_copy() {  # the tracked sources only: no build folder, no .so, no editable-install leftovers, no carried assets
  rm -rf "$WORK/src" && mkdir -p "$WORK/src"
  tar -C "$REPO" -c --exclude=./.git --exclude=./build --exclude=./dist --exclude='*.egg-info' --exclude='*.so' \
    --exclude=__pycache__ --exclude=./.gpu_assets --exclude=./.whl --exclude=./.venv --exclude=./venv \
    --exclude=./fuseinfer/_build_info.json . | tar -C "$WORK/src" -x
}

# A venv that sees the machine's torch, transformers and accelerate: --system-site-packages alone is not enough where
# the machine's python3 is itself a venv (its packages are not the base interpreter's), so a .pth names their folders.
mkvenv() {
  python3 -m venv --system-site-packages "$1" || return 1
  local sp
  sp=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') &&
    python3 -c 'import os, sys, torch, transformers, accelerate
print("\n".join(dict.fromkeys(os.path.dirname(os.path.dirname(m.__file__)) for m in (torch, transformers, accelerate))))' \
    > "$sp/machine-site.pth"
}

build_wheel() {
  clean_copy || return 1
  # build's tools and CUTLASS's headers, offline; --skip-dependency-check (-x) because build would also demand
  # nvidia-cutlass's own run-time dependencies (cuda-python, scipy, ...), which header-only use never imports
  mkvenv "$WORK/buildenv" &&
    "$WORK/buildenv/bin/python" -m pip install -q --no-index --no-deps "$REPO"/.whl/*.whl || return 1
  # (nvidia-cutlass is installed in buildenv: no FUSEINFER_CUTLASS_DIR needed)
  (cd "$WORK/src" && FUSEINFER_BUILD_CUDA=$BUILD_CUDA "$WORK/buildenv/bin/python" -m build --wheel --no-isolation -x \
    --outdir "$WORK/dist") || return 1
  local whl
  whl=$(ls "$WORK"/dist/fuseinfer-*.whl | head -1)
  python3 -m zipfile -l "$whl" > "$W/wheel_files.txt"
  grep -E "fuseinfer/_C.*\.so|_build_info" "$W/wheel_files.txt"
  [ "$BUILD_CUDA" = 0 ] || grep -q "fuseinfer/_C.*\.so" "$W/wheel_files.txt" || { echo "no fuseinfer/_C*.so in $whl"; return 1; }
  # the architectures inside the extension (cuobjdump comes with the toolkit that built it)
  (cd "$WORK" && rm -rf so && mkdir so && cd so && python3 -m zipfile -e "$whl" . &&
    cuobjdump --list-elf fuseinfer/_C*.so | sed 's/.*\.\(sm_[0-9a-z]*\)\..*/\1/' | sort | uniq -c) || true
}

# the venv's python with no nvcc on PATH, no CUDA_HOME and no source tree near: the installed package only
venv_python() { (cd "$WORK/run" && env -u CUDA_HOME -u PYTHONPATH PATH="$WORK/venv/bin:/usr/bin:/bin" \
  "$WORK/venv/bin/python" "$@"); }

install_wheel() {
  rm -rf "$WORK/venv" "$WORK/run" && mkdir -p "$WORK/run" &&
    mkvenv "$WORK/venv" &&
    "$WORK/venv/bin/python" -m pip install -q --no-index --no-deps "$WORK"/dist/fuseinfer-*.whl || return 1
  venv_python - "$WORK/venv" "$BUILD_CUDA" <<'PY'
import sys, torch, fuseinfer
assert fuseinfer.__file__.startswith(sys.argv[1]), f"fuseinfer imported from {fuseinfer.__file__}, not the venv"
status = fuseinfer.extension_status(torch.device("cuda"))
print("fuseinfer", fuseinfer.__file__, "| extension:", status, "| build:", fuseinfer.core.extension.build_info())
from fuseinfer.ops.w8a8_linear import w8a8_gemm_note
print(w8a8_gemm_note(torch.device("cuda")))
assert status == "built" or sys.argv[2] == "0", status
PY
}

test_installed() {  # the GPU tests against the installed package: tests (and what they read) copied to $WORK/run
  rm -rf "$WORK/run/tests" && cp -r "$REPO/tests" "$REPO/pyproject.toml" "$WORK/run/" &&
    for d in examples bench tools; do cp -r "$REPO/$d" "$WORK/run/"; done
  venv_python -m pytest -q -ra -p no:cacheprovider --import-mode=importlib -m gpu tests \
    --ignore=tests/repo/test_install.py --ignore=tests/repo/test_readme.py  # (these two read the source tree, hold no GPU test)
}

eval_installed() {
  venv_python -m fuseinfer.eval --model random:opt-1.3b --backends fuseinfer,fuseinfer-w8a8 --skip-ppl \
    --data-dir "$FUSEINFER_SHARED/data/wikitext-2-raw" --calibration-samples 32 \
    --output "$W/eval_wheel.json" --markdown "$W/eval_wheel.md" || return 1
  grep -q "W8A8 GEMM: CUTLASS sm_90 int8" "$W/eval_wheel.md" || { echo "the W8A8 row did not run the CUTLASS GEMM"; return 1; }
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for step in "${steps[@]}"; do
  case $step in
    build) timed wheel_build build_wheel || finish 1 ;;
    install) timed wheel_install install_wheel || finish 1 ;;
    test) timed wheel_pytest_gpu test_installed ;;
    eval) timed wheel_eval eval_installed ;;
    *) echo "unknown step $step"; finish 2 ;;
  esac
done
finish "$status"
