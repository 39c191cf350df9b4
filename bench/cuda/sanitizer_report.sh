# Sourced by the device scripts: keep_report, a compute-sanitizer run's output trimmed for $OUT.
# A report's text (what raced, where, in which kernel) comes first and its host stack after it;
# stop 59 kept only a run's last 20 lines and lost a racecheck report to its stack. So keep the
# first 12 kB without the tests' OK / RUN lines and the host frames, then the last 6 lines (the
# summary and the exit), whatever was cut between them.
#   compute-sanitizer ... 2>&1 | keep_report
keep_report() {
  local tmp
  tmp=$(mktemp)
  grep -v "^\[       OK\|^\[ RUN\|Host Frame" > "$tmp"
  if [ "$(wc -c < "$tmp")" -le 14000 ]; then
    cat "$tmp"
  else
    head -c 12000 "$tmp"
    printf '\n[... %s bytes cut by keep_report ...]\n' "$(( $(wc -c < "$tmp") - 12000 ))"
    tail -n 6 "$tmp"
  fi
  rm -f "$tmp"
}
