#!/bin/sh
# Open MPI's remote shell for the hosts of scripts/netns_hosts.sh
# (--mca plm_rsh_agent): called like ssh, "agent [options] HOST COMMAND...",
# it runs COMMAND (words joined with spaces and read by sh, as ssh's remote
# shell reads them) inside HOST's network namespace, in a UTS namespace of
# its own whose host name is HOST, with a clean environment (PATH, HOME,
# TMPDIR and LANG kept: what a login on another machine would have; the
# ranks get the rest through mpirun -x).
while [ $# -gt 0 ]; do
  case "$1" in
  -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;; # ssh options with an argument
  -*) shift ;;
  *) break ;;
  esac
done
[ $# -ge 2 ] || { echo "netns_agent: usage: $0 HOST COMMAND..." >&2; exit 2; }
host=$1
shift
ip netns pids "$host" > /dev/null 2>&1 || { echo "netns_agent: no host $host (scripts/netns_hosts.sh up N)" >&2; exit 255; }
exec ip netns exec "$host" unshare --uts \
  env -i PATH="$PATH" HOME="${HOME:-/root}" TMPDIR="${TMPDIR:-/tmp}" LANG="${LANG:-C}" \
  sh -c 'hostname "$0" && exec sh -c "$*"' "$host" "$*"
