# Sourced by tools/gpu_check.sh and the feature stage scripts (tools/gpu_stage_*.sh): the one `run` they share.
#
#   RUN_LOGS=dir; run NAME CMD...    runs CMD, its output to the terminal and to $RUN_LOGS/NAME.log; prints its exit
#                                    status and time; sets status=1 when it fails; returns its status
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
