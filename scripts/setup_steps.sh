# Sourced by scripts/setup.sh (and tests/test_hygiene.py): run set-up steps quietly.
# SETUP_LOG names the file that collects every step's full output.

# quiet CMD...: run CMD with its output appended to $SETUP_LOG; its exit status.
quiet() {
  local out rc=0
  out=$(mktemp)
  "$@" >"$out" 2>&1 || rc=$?
  { echo "### $*"; cat "$out"; echo "### exit $rc"; } >>"$SETUP_LOG"
  if [ "$rc" -ne 0 ]; then
    STEP_OUTPUT=$out
  else
    rm -f "$out"
  fi
  return "$rc"
}

# step "what" CMD...: print "[setup] what", run CMD quietly; on failure print its whole output
# and the log's path, and exit with its status.
step() {
  local what=$1 rc=0
  shift
  echo "[setup] $what"
  quiet "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "[setup] FAILED ($rc): $*" >&2
    cat "$STEP_OUTPUT" >&2
    rm -f "$STEP_OUTPUT"
    echo "[setup] the full log: $SETUP_LOG" >&2
    exit "$rc"
  fi
}
