# Sourced by .ci/run and scripts/test.sh: `phase NAME CMD...` runs CMD and, when
# $HIVEKEEPER_PHASES names a file, appends one line to it: NAME, start and end (epoch seconds)
# and CMD's exit code, tab-separated. scripts/ci_report.py prints them as CI's closing table.
phase() {
  local name=$1 start code=0
  shift
  start=$EPOCHREALTIME
  "$@" || code=$?
  if [ -n "${HIVEKEEPER_PHASES:-}" ]; then
    printf '%s\t%s\t%s\t%s\n' "$name" "$start" "$EPOCHREALTIME" "$code" >>"$HIVEKEEPER_PHASES"
  fi
  return "$code"
}
