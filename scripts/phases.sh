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

# sample_cpu FILE: appends, every 5 s until killed, the time (epoch seconds), the busy, total,
# I/O-wait and stolen jiffies of all CPUs (from /proc/stat), tab-separated; ci_report.py turns
# them into each phase's CPU use (is a phase bound by the CPU, or waiting?), and tells a machine
# whose hypervisor takes its CPUs (steal) or whose disk holds it up (I/O wait) from a busy one.
sample_cpu() {
  local file=$1 cpu user nice system idle iowait irq softirq steal rest
  while :; do
    read -r cpu user nice system idle iowait irq softirq steal rest </proc/stat
    printf '%s\t%s\t%s\t%s\t%s\n' "$EPOCHREALTIME" "$((user + nice + system + irq + softirq + steal))" \
      "$((user + nice + system + idle + iowait + irq + softirq + steal))" "$iowait" "$steal" >>"$file"
    sleep 5
  done
}
