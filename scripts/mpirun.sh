#!/usr/bin/env bash
# mpirun with the flags this project always wants: oversubscription allowed
# (8 ranks on 2 cores), running as root allowed (CI containers), no binding
# (our thread count is set per rank), and help messages not aggregated
# (Open MPI 4.1's aggregation garbles the MPI_Abort notice).
#
# Called from inside an MPI process (a spec running under pglua), the job's
# own Open MPI/PMIx variables would make this mpirun join that job: drop them.
if [ -n "${PMIX_RANK:-}" ] || [ -n "${OMPI_COMM_WORLD_RANK:-}" ]; then
  for v in $(env | grep -oE '^(OMPI|PMIX|ORTE)[A-Za-z0-9_]*' | grep -v '^OMPI_MCA_btl' ); do unset "$v"; done
fi
args=(--oversubscribe --bind-to none --mca orte_base_help_aggregate 0)
[ "$(id -u)" -eq 0 ] && args+=(--allow-run-as-root)

# stderr, so that the last line a user sees is the error that ended the job
# (pglua prints the cause after its consequences: src/lua/pglua.c): once one of
# pglua's reports ("[rank 2] pglua: ...", "[ranks 0-3] ...") has passed, Open
# MPI's notice of the MPI_Abort that ended the job (a box of dashes) and the
# "ORTE_ERROR_LOG: ..." lines of its help system failing to deliver that
# notice ("Data unpack would read past end of buffer", "Out of resource ...
# show_help.c") are dropped (they name no cause, and came after it). Everything else passes at
# once, unchanged (a report is never held back: a job killed whole loses
# nothing it printed); stdout is not touched.
#
# A host lost (its link down, its power gone): the watchdog's report names a
# rank "on HOST" that never arrived (pglua names hosts only when the world
# spans more than one), the ranks that remain abort, but Open MPI 4.1's
# mpirun then waits for the lost host's daemon to confirm for as long as TCP
# retries (a quarter of an hour). So once such a report has passed, mpirun
# is killed PG_LOST_HOST_GRACE seconds (default 3: more than PG_ABORT_GRACE,
# for the other failing ranks' reports and Open MPI's abort) after the last
# report (its daemons on the hosts that remain then end their ranks); the
# cause, printed last, stays the last line.
#
# A host killed outright (its daemon gone): Open MPI aborts the job at once (no watchdog runs) and its notice
# names the host ("Remote daemon: [[...],1] on node HOST"), not the ranks. pipegoose's world rank 0 writes
# the rank -> host map it gathers at start-up to PG_HOST_MAP_FILE (exported here, a temporary file; written
# once, renamed into place), and after the notice this filter prints "pipegoose: host HOST lost (ranks 4-7)"
# (without a map, as when rank 0 does not share this machine's TMPDIR, "(ranks unknown)").
#
# mawk reads a pipe in blocks unless interactive: a report must be seen when it comes.
awk=(awk)
awk -W version 2>&1 | grep -q mawk && awk=(awk -W interactive)
reports_last() {
  "${awk[@]}" -v pidfile="$1" -v hostmap="$2" -v grace="${PG_LOST_HOST_GRACE:-3}" '
    function is_rule(s) { return s ~ /^-+$/ && length(s) >= 20 }
    # the ranks on host h as ranges ("4-7", "0,2-3"), from the map rank 0 wrote
    function ranks_on(h,   line, f, n, r, out, first, prev, i) {
      n = 0
      while ((getline line < hostmap) > 0) if (split(line, f, " ") == 2 && f[2] == h) r[n++] = f[1] + 0
      close(hostmap)
      if (n == 0) return "ranks unknown"
      out = ""; first = r[0]; prev = r[0]
      for (i = 1; i <= n; i++) {
        if (i < n && r[i] == prev + 1) { prev = r[i]; continue }
        out = out (out == "" ? "" : ",") (first == prev ? first : first "-" prev)
        if (i < n) { first = r[i]; prev = r[i] }
      }
      return (n == 1 ? "rank " : "ranks ") out
    }
    function lost_host_line() { if (lost_host != "") { print "pipegoose: host " lost_host " lost (" ranks_on(lost_host) ")"; lost_host = ""; fflush() } }
    # Open MPI 4.1: "Remote daemon: [[J,0],D] on node HOST" in its lost-daemon notice (a box); said once per host
    /Remote daemon: .* on node [^ ]+/ {
      h = $0; sub(/.* on node /, "", h); sub(/[ \t].*/, "", h)
      if (!(h in named)) { named[h] = 1; lost_host = h }
    }
    /^\[ranks? [0-9,-]+\] [^ ]*pglua: / { reported = 1 }
    /^\[ranks? [0-9,-]+\] [^ ]*pglua: .* on [^ ]+ never (arrived|sent it|received it)/ { lost = 1 }
    lost && /^\[ranks? [0-9,-]+\] [^ ]*pglua: / {
      # a timer per report; only the last one kills (each report pushes the end back)
      seq++
      system("echo " seq " > \"" pidfile ".last\"; (sleep " grace "; " \
             "[ \"$(cat \"" pidfile ".last\" 2> /dev/null)\" = " seq " ] && p=$(cat \"" pidfile "\" 2> /dev/null) && " \
             "[ -n \"$p\" ] && grep -qx \"mpirun\\|orterun\" /proc/$p/comm && kill -KILL $p) > /dev/null 2>&1 &")
    }
    inbox { box = box "\n" $0; if (is_rule($0)) { if (!(reported && box ~ /MPI_ABORT was invoked/)) print box; inbox = 0; fflush(); lost_host_line() }; next }
    is_rule($0) { inbox = 1; box = $0; next }
    reported && /ORTE_ERROR_LOG: / && (/show_help\.c/ || /Data unpack would read past end of buffer/) { next }
    { print; fflush(); lost_host_line() }
    END { if (inbox) print box; lost_host_line() }'
}
# mpirun's stderr into the filter, its stdout to ours (fd 3); a pipeline, so the filter's last lines are out
# before this script ends, and mpirun's exit status is the script's.
# Signals: a TERM or INT for the job (timeout(1), Ctrl-C) reaches mpirun through the process group, and
# mpirun ends the ranks. This shell must not die first: with the trap it waits for mpirun (a shell that
# died would orphan a mpirun stuck in its shutdown, holding the output pipe open, and timeout -k's KILL,
# sent only while its child lives, would never come). The filter ignores them, to print what it holds
# once mpirun's stderr closes.
[[ "${PG_LOST_HOST_GRACE:-3}" =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
  { echo "scripts/mpirun.sh: PG_LOST_HOST_GRACE=$PG_LOST_HOST_GRACE is not a number of seconds" >&2; exit 2; }
# mpirun's pid goes to a file for the lost-host timer (sh writes its own, then becomes mpirun:
# Open MPI's mpirun is orterun under another name).
trap ':' TERM INT HUP
pidfile=$(mktemp "${TMPDIR:-/tmp}/pg-mpirun.XXXXXX") || exit 1
export PG_HOST_MAP_FILE="$pidfile.hosts"
args+=(-x PG_HOST_MAP_FILE) # a host's daemon starts with a clean environment
{ sh -c 'echo $$ > "$0"; exec mpirun "$@"' "$pidfile" "${args[@]}" "$@" 2>&1 1>&3 3>&- |
  { trap '' TERM INT HUP; reports_last "$pidfile" "$PG_HOST_MAP_FILE"; } >&2; } 3>&1
status=${PIPESTATUS[0]}
rm -f "$pidfile" "$pidfile.last" "$PG_HOST_MAP_FILE"
exit "$status"
