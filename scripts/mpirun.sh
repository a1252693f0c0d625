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
# mawk reads a pipe in blocks unless interactive: a report must be seen when it comes.
awk=(awk)
awk -W version 2>&1 | grep -q mawk && awk=(awk -W interactive)
reports_last() {
  "${awk[@]}" -v pidfile="$1" -v grace="${PG_LOST_HOST_GRACE:-3}" '
    function is_rule(s) { return s ~ /^-+$/ && length(s) >= 20 }
    /^\[ranks? [0-9,-]+\] [^ ]*pglua: / { reported = 1 }
    /^\[ranks? [0-9,-]+\] [^ ]*pglua: .* on [^ ]+ never (arrived|sent it|received it)/ { lost = 1 }
    lost && /^\[ranks? [0-9,-]+\] [^ ]*pglua: / {
      # a timer per report; only the last one kills (each report pushes the end back)
      seq++
      system("echo " seq " > \"" pidfile ".last\"; (sleep " grace "; " \
             "[ \"$(cat \"" pidfile ".last\" 2> /dev/null)\" = " seq " ] && p=$(cat \"" pidfile "\" 2> /dev/null) && " \
             "[ -n \"$p\" ] && grep -qx \"mpirun\\|orterun\" /proc/$p/comm && kill -KILL $p) > /dev/null 2>&1 &")
    }
    inbox { box = box "\n" $0; if (is_rule($0)) { if (!(reported && box ~ /MPI_ABORT was invoked/)) print box; inbox = 0; fflush() }; next }
    is_rule($0) { inbox = 1; box = $0; next }
    reported && /ORTE_ERROR_LOG: / && (/show_help\.c/ || /Data unpack would read past end of buffer/) { next }
    { print; fflush() }
    END { if (inbox) print box }'
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
{ sh -c 'echo $$ > "$0"; exec mpirun "$@"' "$pidfile" "${args[@]}" "$@" 2>&1 1>&3 3>&- |
  { trap '' TERM INT HUP; reports_last "$pidfile"; } >&2; } 3>&1
status=${PIPESTATUS[0]}
rm -f "$pidfile" "$pidfile.last"
exit "$status"
