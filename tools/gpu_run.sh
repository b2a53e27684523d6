# Sourced by tools/gpu_check.sh and the feature stage scripts (tools/gpu_stage_*.sh): the one `run` they share.
#
#   RUN_LOGS=dir; run NAME CMD...    runs CMD, its output to the terminal and to $RUN_LOGS/NAME.log; prints its exit
#                                    status and time; sets status=1 when it fails; returns its status
#   run_quiet NAME CMD...            the same with only the exit line on the terminal, for runs side by side in the
#                                    background (`run_quiet ... &`, then `wait` each pid and set status yourself)
#   find_cutlass                     exports FUSEINFER_CUTLASS_DIR from a carried .whl/nvidia_cutlass-*.whl when no
#                                    CUTLASS is set or installed (call it directly: in a pipe the export is lost)
status=${status:-0}

run() {
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$RUN_LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

run_quiet() {
  local name=$1
  (run "$@") > /dev/null
  local rc=$?
  echo "=== $name: exit $rc"
  return "$rc"
}

find_cutlass() {  # exports FUSEINFER_CUTLASS_DIR from the carried wheel when no CUTLASS is set or installed
  if [ -n "${FUSEINFER_CUTLASS_DIR:-}" ]; then echo "CUTLASS: $FUSEINFER_CUTLASS_DIR"; return 0; fi
  if python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("cutlass_library") is None)'; then
    echo "CUTLASS: the installed nvidia-cutlass package"; return 0
  fi
  local whl
  whl=$(ls .whl/nvidia_cutlass-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ]; then echo "no CUTLASS: carry .whl/nvidia_cutlass-*.whl or set FUSEINFER_CUTLASS_DIR"; return 1; fi
  # a wheel is a zip: unpacking it is all `pip install --no-deps --target` would do for these headers
  [ -f /tmp/cutlass/cutlass_library/source/include/cutlass/cutlass.h ] || python3 -m zipfile -e "$whl" /tmp/cutlass
  export FUSEINFER_CUTLASS_DIR=/tmp/cutlass
  echo "CUTLASS: $whl unpacked in $FUSEINFER_CUTLASS_DIR"
}
