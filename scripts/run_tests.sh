#!/usr/bin/env bash
# The whole test suite, as `make test` and CI run it:
#   1. the busted specs under spec/unit and spec/examples, in one pglua process;
#   2. every spec/dist/*_spec.lua under mpirun, once per world size listed in
#      its first line ("-- worlds: 1 2 4 8"), every rank running busted;
#   3. a merged summary: a test passes when it passed on every rank.
# The last line is "N passed, N failed, N skipped"; the exit status is 1 on any failure.
# PG_TEST_ONLY=unit|dist runs one part; PG_TEST_FILTER=pattern keeps matching dist files;
# PG_TEST_UNIT="files" runs those unit spec files instead of the folders;
# PG_TEST_BUSTED_FILTER=pattern keeps the tests whose names match (busted --filter).
set -u
cd "$(dirname "$0")/.."
PGLUA=${PGLUA:-./pglua}
BUSTED=${BUSTED:-$(command -v busted || echo /usr/bin/busted)}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/pg-tests.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
HANDLER=spec/support/summary_handler.lua
# Hang guard per mpirun, not a timing assertion: a stuck job is killed and counted as failed.
DIST_TIMEOUT=${PG_DIST_TIMEOUT:-900}
export PG_ABORT_GRACE=${PG_ABORT_GRACE:-1}

only=${PG_TEST_ONLY:-all}
filter=()
[ -n "${PG_TEST_BUSTED_FILTER:-}" ] && filter=(--filter "$PG_TEST_BUSTED_FILTER")
status=0

if [ "$only" != dist ]; then
  if [ -n "${PG_TEST_UNIT:-}" ]; then
    read -r -a dirs <<< "$PG_TEST_UNIT"
  else
    dirs=(spec/unit)
    [ -d spec/examples ] && dirs+=(spec/examples)
  fi
  echo "== busted ${dirs[*]}"
  PG_TEST_SUMMARY="$OUT/unit" "$PGLUA" "$BUSTED" -o "$HANDLER" "${filter[@]}" "${dirs[@]}" || status=1
  [ -f "$OUT/unit.0" ] || echo "unit specs: no summary written (crash?)" > "$OUT/unit.crashed"
fi

if [ "$only" != unit ]; then
  for spec in spec/dist/*_spec.lua; do
    [ -e "$spec" ] || continue
    [ -n "${PG_TEST_FILTER:-}" ] && [[ "$spec" != *${PG_TEST_FILTER}* ]] && continue
    worlds=$(sed -n '1s/^-- worlds:[[:space:]]*//p' "$spec")
    [ -n "$worlds" ] || worlds=2
    for n in $worlds; do
      name=$(basename "$spec" .lua).np$n
      echo "== mpirun -np $n busted $spec"
      start=$SECONDS
      PG_TEST_SUMMARY="$OUT/$name" PG_TEST_WORLD=$n timeout -k 10 "$DIST_TIMEOUT" \
        scripts/mpirun.sh -np "$n" -x PG_TEST_SUMMARY -x PG_TEST_WORLD -x PG_ABORT_GRACE \
        "$PGLUA" "$BUSTED" -o "$HANDLER" "${filter[@]}" "$spec"
      rc=$?
      echo "   (${n} ranks, $((SECONDS - start)) s, exit $rc)"
      for ((r = 0; r < n; r++)); do
        [ -f "$OUT/$name.$r" ] || { echo "$spec on $n ranks: rank $r wrote no summary (exit $rc)" >> "$OUT/$name.crashed"; }
      done
    done
  done
fi

"$PGLUA" scripts/test_summary.lua "$OUT" || status=1
exit $status
