#!/usr/bin/env bash
# Elastic restart: runs a job under scripts/mpirun.sh and, when it ends with a
# failure (a rank or a host died: a non-zero exit), runs it again, up to
# --max-restarts times. The program resumes itself: the examples take
# --resume=auto (the newest checkpoint under --out that verifies, or a fresh
# start), so every relaunch continues from the last verified checkpoint.
#
#   scripts/launch.sh --max-restarts=N [--min-data=D] [--model-parallel=K]
#                     [--np-after-failure=P2] [--hostfile=FILE] -np P PROGRAM ARGS...
#
# Each restart is logged on stderr with its cause: the exit status and the
# failing rank's message line when one was printed (pglua's "[rank r] ..."
# report, or Open MPI's line naming the process that died). After N restarts
# it gives up with the last cause and that exit status.
#
# Fewer ranks after a failure (a host lost): --np-after-failure=P2 gives the
# world size of every relaunch, or --hostfile=FILE is passed to mpirun and its
# slots (slots=S on each line, 1 without) are counted again before every
# launch, so a hostfile edited to drop a host shrinks the next run. The world
# size is rounded down to a multiple of --model-parallel=K (tensor x pipeline,
# default 1); the program's data dimension is what remains (the examples'
# --data defaults to world size / (tensor x pipeline); checkpoints reshard
# across data sizes). Below --min-data=D data ranks (default 1) it gives up.
#
# The program sees PG_LAUNCH_RESTART (0 for the first launch, then 1, 2, ...)
# and PG_LAUNCH_NP (this launch's world size).
set -u
here=$(cd "$(dirname "$0")" && pwd)

usage() {
  sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}
die() { echo "launch.sh: $*" >&2; exit 2; }
int_of() { # name value
  [[ "$2" =~ ^[0-9]+$ ]] || die "$1: expected a non-negative integer, got '$2'"
  echo $((10#$2))
}

max_restarts="" min_data=1 model_parallel=1 np="" np_after="" hostfile=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --max-restarts=*) max_restarts=$(int_of --max-restarts "${1#*=}") || exit 2 ;;
    --min-data=*) min_data=$(int_of --min-data "${1#*=}") || exit 2 ;;
    --model-parallel=*) model_parallel=$(int_of --model-parallel "${1#*=}") || exit 2 ;;
    --np-after-failure=*) np_after=$(int_of --np-after-failure "${1#*=}") || exit 2 ;;
    --hostfile=*) hostfile=${1#*=}; [ -r "$hostfile" ] || die "--hostfile: cannot read '$hostfile'" ;;
    -np|-n) [ $# -ge 2 ] || die "$1 needs a number"; np=$(int_of "$1" "$2") || exit 2; shift ;;
    --) shift; break ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) break ;;
  esac
  shift
done
[ -n "$max_restarts" ] || die "--max-restarts=N is required (see --help)"
[ $# -ge 1 ] || die "no program to run (see --help)"
[ "$model_parallel" -ge 1 ] || die "--model-parallel must be at least 1"
[ "$min_data" -ge 1 ] || die "--min-data must be at least 1"
if [ -z "$np" ]; then
  [ -n "$hostfile" ] || die "-np P (or --hostfile=FILE) is required"
fi

# slots of the hostfile: "host slots=S" lines (S = 1 without), comments and blank lines skipped
hostfile_slots() {
  awk '{ sub(/#.*/, "") } NF { s = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) { s = substr($i, 7) + 0 } n += s }
       END { print n + 0 }' "$hostfile"
}

# the world size of this launch: the first -np, then --np-after-failure, then what the hostfile has
world_for() { # attempt
  local n=$np
  [ "$1" -gt 0 ] && [ -n "$np_after" ] && n=$np_after
  if [ -n "$hostfile" ]; then
    local slots
    slots=$(hostfile_slots)
    if [ -z "$n" ] || [ "$slots" -lt "$n" ]; then n=$slots; fi
  fi
  echo $(( n / model_parallel * model_parallel ))
}

log=$(mktemp "${TMPDIR:-/tmp}/launch.XXXXXX") || die "cannot create a temporary file"
trap 'rm -f "$log"' EXIT
attempt=0
cause=""
while :; do
  world=$(world_for "$attempt")
  data=$(( world / model_parallel ))
  if [ "$data" -lt "$min_data" ]; then
    echo "launch.sh: giving up: $world ranks leave $data data ranks, below --min-data=$min_data${cause:+ (last failure: $cause)}" >&2
    exit 1
  fi
  mpi=(-np "$world")
  [ -n "$hostfile" ] && mpi+=(--hostfile "$hostfile")
  # stderr passes through as it comes and is kept for the cause
  PG_LAUNCH_RESTART=$attempt PG_LAUNCH_NP=$world \
    "$here/mpirun.sh" -x PG_LAUNCH_RESTART -x PG_LAUNCH_NP "${mpi[@]}" "$@" 2> >(tee "$log" >&2)
  rc=$?
  wait # the tee
  [ "$rc" -eq 0 ] && exit 0
  # the cause: pglua's report of the failing rank, else Open MPI's line naming the process that died
  line=$(grep -E '^\[ranks? [0-9,-]+\] ' "$log" | tail -n 1)
  [ -n "$line" ] || line=$(grep -E 'exited on signal|returned a non-zero exit code|killed' "$log" | head -n 1 | sed 's/^ *//')
  # Open MPI's "Process name: [[job,1],R]" and "Exit code: C" lines: the rank that ended first
  if [ -z "$line" ]; then
    proc=$(grep -E '^ *Process name:' "$log" | head -n 1 | sed -E 's/.*,([0-9]+)\]$/\1/')
    code=$(grep -E '^ *Exit code:' "$log" | head -n 1 | sed -E 's/.*: *//')
    [ -n "$proc" ] && line="rank $proc exited first${code:+ with status $code}"
  fi
  cause="exit status $rc${line:+: $line}"
  if [ "$attempt" -ge "$max_restarts" ]; then
    echo "launch.sh: giving up after $max_restarts restarts; last failure: $cause" >&2
    exit "$rc"
  fi
  attempt=$((attempt + 1))
  echo "launch.sh: restart $attempt of $max_restarts after a failure on $world ranks ($cause)" >&2
done
