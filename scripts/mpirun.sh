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
exec mpirun "${args[@]}" "$@"
