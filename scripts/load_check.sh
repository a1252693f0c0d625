#!/usr/bin/env bash
# The suite on a busy machine, as CI meets it (CI runs while other work runs):
# two busy loops beside `make test`, then the distributed specs and the
# agreement/watchdog/report specs ROUNDS more times (default 3) under the same
# load. Every run must pass; the first failure ends the check (exit 1).
#   scripts/load_check.sh [ROUNDS]        (after make all emu fuzz-replay)
# LOAD_CHECK_SKIP_FULL=1 skips the first `make test`.
set -u
cd "$(dirname "$0")/.."
rounds=${1:-3}
case "$rounds" in '' | *[!0-9]*) echo "load_check.sh: ROUNDS must be a number, got '$rounds'" >&2; exit 1 ;; esac

busy=()
stop_busy() { [ ${#busy[@]} -gt 0 ] && kill "${busy[@]}" 2> /dev/null; }
trap stop_busy EXIT
for _ in 1 2; do
  sh -c 'while :; do :; done' &
  busy+=($!)
done
echo "== load_check: two busy loops (pids ${busy[*]}) beside the suite"

run() {
  echo "== load_check: $*"
  "$@" || { echo "load_check: failed under load: $*"; exit 1; }
}

[ "${LOAD_CHECK_SKIP_FULL:-0}" = 1 ] || run make test
for ((i = 1; i <= rounds; i++)); do
  echo "== load_check: round $i of $rounds"
  run env PGLUA=build/pglua PG_EMU_PGLUA=build-emu/pglua PG_TEST_ONLY=dist scripts/run_tests.sh
  run env PGLUA=build/pglua PG_TEST_ONLY=unit \
    PG_TEST_UNIT="spec/unit/collectives_agreement_spec.lua spec/unit/error_report_spec.lua spec/unit/parallel_errors_spec.lua" \
    scripts/run_tests.sh
done
echo "load_check: passed (make test and $rounds rounds of the distributed and agreement specs, under two busy loops)"
