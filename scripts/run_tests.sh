#!/usr/bin/env bash
# The whole test suite, as `make test` and CI run it:
#   1. the busted specs under spec/unit and spec/examples, in one pglua process,
#      and the tests tagged #bf16 again under each bf16 GEMM path (PG_BF16_GEMM);
#   2. every spec/dist/*_spec.lua under mpirun, once per world size listed in
#      its first line ("-- worlds: 1 2 4 8"), every rank running busted; and
#      again with PG_TEST_DEVICE=cuda on the emulated device (PG_EMU_PGLUA)
#      at the sizes its second line lists ("-- device worlds: 2 8");
#   3. a merged summary: a test passes when it passed on every rank.
# The last line is "N passed, N failed, N skipped"; the exit status is 1 on any failure.
# PG_TEST_ONLY=unit|dist runs one part; PG_TEST_FILTER=pattern keeps matching dist files;
# PG_TEST_UNIT="files" runs those unit spec files instead of the folders;
# PG_TEST_BUSTED_FILTER=pattern keeps the tests whose names match (busted --filter);
# PG_TEST_DEVICE_ONLY=1 runs only the dist specs' device worlds (scripts/gpu_check.sh).
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
  PG_TEST_SUMMARY="$OUT/unit" "$PGLUA" "$BUSTED" -o "$HANDLER" --exclude-tags=bf16 "${filter[@]}" "${dirs[@]}" || status=1
  [ -f "$OUT/unit.0" ] || echo "unit specs: no summary written (crash?)" > "$OUT/unit.crashed"
  # Tests tagged #bf16 depend on the bf16 GEMM's path (oneDNN's kernels or the
  # widen-and-sgemm fallback: src/backend/cpu_bf16_gemm.c's probe picks one per CPU), so
  # they run under each path on every machine: a spec written where the probe
  # picks one must hold where it picks the other. oneDNN runs by name wherever
  # it has AVX-512 (emulating bf16 where the CPU lacks it); elsewhere that run
  # is one skipped test that says why.
  for path in onednn fallback; do
    name=unit-bf16-$path
    if ! why=$("$PGLUA" -e "local ok, e = pcall(require('pipegoose').ops.bf16_gemm_path, '$path')
                            if not ok then io.write(e) os.exit(1) end" 2>&1); then
      echo "== busted #bf16 under PG_BF16_GEMM=$path: skipped ($why)"
      printf '{"rank":0,"results":[{"name":"the #bf16 specs under PG_BF16_GEMM=%s","status":"skipped"}]}' "$path" \
        > "$OUT/$name.0"
      continue
    fi
    echo "== busted #bf16 ${dirs[*]} (PG_BF16_GEMM=$path)"
    PG_BF16_GEMM=$path PG_TEST_SUMMARY="$OUT/$name" "$PGLUA" "$BUSTED" -o "$HANDLER" --tags=bf16 "${filter[@]}" \
      "${dirs[@]}" || status=1
    [ -f "$OUT/$name.0" ] || echo "#bf16 specs under $path: no summary written (crash?)" > "$OUT/$name.crashed"
  done
fi

# One mpirun of a dist spec: run_dist SPEC N NAME PGLUA [VAR=value...]
run_dist() {
  local spec=$1 n=$2 name=$3 pglua=$4
  shift 4
  echo "== mpirun -np $n busted $spec${*:+ ($*)}"
  local start=$SECONDS
  env "$@" PG_TEST_SUMMARY="$OUT/$name" PG_TEST_WORLD=$n timeout -k 10 "$DIST_TIMEOUT" \
    scripts/mpirun.sh -np "$n" -x PG_TEST_SUMMARY -x PG_TEST_WORLD -x PG_ABORT_GRACE -x PG_TEST_DEVICE \
    "$pglua" "$BUSTED" -o "$HANDLER" "${filter[@]}" "$spec"
  local rc=$?
  echo "   (${n} ranks, $((SECONDS - start)) s, exit $rc)"
  for ((r = 0; r < n; r++)); do
    [ -f "$OUT/$name.$r" ] || { echo "$spec on $n ranks: rank $r wrote no summary (exit $rc)" >> "$OUT/$name.crashed"; }
  done
}

if [ "$only" != unit ]; then
  for spec in spec/dist/*_spec.lua; do
    [ -e "$spec" ] || continue
    [ -n "${PG_TEST_FILTER:-}" ] && [[ "$spec" != *${PG_TEST_FILTER}* ]] && continue
    worlds=$(sed -n '1s/^-- worlds:[[:space:]]*//p' "$spec")
    [ -n "$worlds" ] || worlds=2
    [ "${PG_TEST_DEVICE_ONLY:-0}" = 1 ] && worlds=
    for n in $worlds; do run_dist "$spec" "$n" "$(basename "$spec" .lua).np$n" "$PGLUA" PG_TEST_DEVICE=cpu; done
    # a second time on the emulated device (PG_EMU_PGLUA, make emu), at the
    # world sizes its second line lists ("-- device worlds: 2 8")
    dworlds=$(sed -n '2s/^-- device worlds:[[:space:]]*//p' "$spec")
    if [ -n "$dworlds" ] && [ -n "${PG_EMU_PGLUA:-}" ]; then
      for n in $dworlds; do
        run_dist "$spec" "$n" "$(basename "$spec" .lua).cuda.np$n" "$PG_EMU_PGLUA" PG_TEST_DEVICE=cuda
      done
    fi
  done
fi

"$PGLUA" scripts/test_summary.lua "$OUT" || status=1
exit $status
