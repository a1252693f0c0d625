#!/usr/bin/env bash
# Hosts on one machine, for running Open MPI jobs between "nodes" over TCP:
# each host is a network namespace with a veth pair to a bridge in the root
# namespace, an address in a private /24 and a name in /etc/hosts; Open MPI
# starts its daemons there through scripts/netns_agent.sh (plm_rsh_agent),
# which also gives each host a UTS namespace of its own, so that the host
# name inside is the host's (Open MPI's session directories and pipegoose's
# reports use it). Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN).
#
#   scripts/netns_hosts.sh check               # exit 0 if hosts can be made here, else prints why
#   scripts/netns_hosts.sh up N [RATE]         # hosts PREFIX1..PREFIXN; RATE (e.g. 10mbit): tbf on both
#                                              # directions of every host's link
#   scripts/netns_hosts.sh shape RATE|off      # change the links' limit
#   scripts/netns_hosts.sh kill HOST           # SIGKILL every process inside HOST (a host lost)
#   scripts/netns_hosts.sh down                # removes every host, the bridge and the names
#   scripts/netns_hosts.sh mpirun-args [SLOTS] # the mpirun options for these hosts, SLOTS ranks
#                                              # each (default 1), one a line
#
# PG_NETNS_PREFIX (default pghost) names the hosts, PG_NETNS_NET (default
# 10.231.7) is the /24; the bridge is PREFIX-br with address .254. "up" is
# idempotent (it first removes what an earlier run left), and "down" removes
# whatever exists of it, so a caller's trap can always run it.
set -u
PREFIX=${PG_NETNS_PREFIX:-pghost}
NET=${PG_NETNS_NET:-10.231.7}
BRIDGE=${PREFIX}-br
MARK="# pipegoose netns $PREFIX"
LOCK=/run/lock/pipegoose-netns-$PREFIX.lock

die() { echo "netns_hosts: $*" >&2; exit 1; }
[[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "PG_NETNS_PREFIX=$PREFIX: 1-8 lower-case letters and digits, a letter first"
[[ "$NET" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "PG_NETNS_NET=$NET: the first three numbers of a /24 (10.231.7)"

# Why hosts cannot be made here, or nothing.
why_not() {
  [ "$(id -u)" -eq 0 ] || { echo "not root (ip netns needs CAP_NET_ADMIN and CAP_SYS_ADMIN)"; return; }
  command -v ip > /dev/null || { echo "no ip command (iproute2)"; return; }
  command -v unshare > /dev/null || { echo "no unshare command (util-linux)"; return; }
  mkdir -p /var/run/netns 2> /dev/null && [ -w /var/run/netns ] || { echo "/var/run/netns is not writable"; return; }
  [ -w /etc/hosts ] || { echo "/etc/hosts is not writable"; return; }
  local probe=${PREFIX}probe$$
  if ! err=$(ip netns add "$probe" 2>&1); then echo "ip netns add fails: $err"; return; fi
  if ! err=$(ip netns exec "$probe" unshare --uts true 2>&1); then
    ip netns del "$probe" 2> /dev/null
    echo "unshare --uts inside a network namespace fails: $err"
    return
  fi
  # a veth name holds 15 characters: the process id keeps two checks at once apart
  if ! err=$(ip link add "pgp$$a" type veth peer name "pgp$$b" 2>&1); then
    ip netns del "$probe" 2> /dev/null
    echo "ip link add type veth fails: $err"
    return
  fi
  ip link del "pgp$$a" 2> /dev/null
  ip netns del "$probe" 2> /dev/null
}

hosts() { ip netns list 2> /dev/null | awk -v p="$PREFIX" '$1 ~ "^" p "[0-9]+$" { print $1 }'; }

# /etc/hosts rewritten in place (it may be a bind mount: no rename), under the lock.
hosts_file_drop() {
  local keep
  keep=$(grep -v -F "$MARK" /etc/hosts)
  printf '%s\n' "$keep" > /etc/hosts
}

down() {
  local h
  for h in $(hosts); do
    ip netns pids "$h" 2> /dev/null | xargs -r kill -9 2> /dev/null
    ip netns del "$h" 2> /dev/null
  done
  ip link del "$BRIDGE" 2> /dev/null
  local v
  for v in $(ip -o link show 2> /dev/null | awk -F': ' -v p="$PREFIX" '$2 ~ "^" p "v[0-9]+" { sub(/@.*/, "", $2); print $2 }'); do
    ip link del "$v" 2> /dev/null
  done
  hosts_file_drop
}

# tbf on the root end of host i's veth (traffic to the host) and on the host's eth0 (traffic from it).
shape() {
  local rate=$1 h i
  for h in $(hosts); do
    i=${h#"$PREFIX"}
    tc qdisc del dev "${PREFIX}v$i" root 2> /dev/null
    ip netns exec "$h" tc qdisc del dev eth0 root 2> /dev/null
    [ "$rate" = off ] && continue
    # burst: at least rate/HZ; 32 KiB holds a few jumbo segments at 10 Mbit/s. latency caps the queue.
    tc qdisc add dev "${PREFIX}v$i" root tbf rate "$rate" burst 32kb latency 100ms || return 1
    ip netns exec "$h" tc qdisc add dev eth0 root tbf rate "$rate" burst 32kb latency 100ms || return 1
  done
}

up() {
  local n=$1 rate=${2:-}
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "up: N must be 1..200 hosts, got $n"
  down
  ip link add "$BRIDGE" type bridge stp_state 0 forward_delay 0 || return 1
  ip addr add "$NET.254/24" dev "$BRIDGE" && ip link set "$BRIDGE" up || return 1
  local i h lines=""
  for ((i = 1; i <= n; i++)); do
    h=$PREFIX$i
    ip netns add "$h" || return 1
    ip link add "${PREFIX}v$i" type veth peer name "${PREFIX}p$i" || return 1
    ip link set "${PREFIX}p$i" netns "$h" || return 1
    ip link set "${PREFIX}v$i" master "$BRIDGE" && ip link set "${PREFIX}v$i" up || return 1
    ip netns exec "$h" ip link set "${PREFIX}p$i" name eth0 || return 1
    ip netns exec "$h" ip addr add "$NET.$i/24" dev eth0 || return 1
    ip netns exec "$h" ip link set eth0 up || return 1
    ip netns exec "$h" ip link set lo up || return 1
    ip netns exec "$h" ip route add default via "$NET.254" 2> /dev/null
    lines+="$NET.$i $h $MARK"$'\n'
  done
  printf '%s' "$lines" >> /etc/hosts
  [ -z "$rate" ] || shape "$rate" || return 1
  # the links are up at both ends, and the bridge forwards on every port (state 3) before anyone connects
  local tries
  for ((i = 1; i <= n; i++)); do
    ip netns exec "$PREFIX$i" ip -o link show eth0 | grep -q 'state UP\|LOWER_UP' ||
      { echo "netns_hosts: up: $PREFIX$i's eth0 is not up" >&2; return 1; }
    for ((tries = 0; tries < 100; tries++)); do
      [ "$(cat "/sys/class/net/$BRIDGE/brif/${PREFIX}v$i/state" 2> /dev/null)" = 3 ] && break
      sleep 0.05
    done
    [ "$tries" -lt 100 ] || { echo "netns_hosts: up: the bridge does not forward to $PREFIX$i" >&2; return 1; }
  done
}

mpirun_args() {
  local slots=${1:-1} agent
  agent=$(cd "$(dirname "$0")" && pwd)/netns_agent.sh
  local list
  list=$(hosts | sort -V | sed "s/\$/:$slots/" | paste -sd, -)
  # the daemons start through the agent, each from mpirun (no tree spawn); every byte between
  # ranks goes over TCP on the hosts' /24 (vader only between ranks on one host), as does
  # Open MPI's own out-of-band traffic. A host's daemon counts only its own slots and would let
  # its ranks spin while they wait, though every host shares this machine's cores: they yield
  # (without it a 4-step spec run took 9 s instead of 1.5 s on 2 cores).
  printf '%s\n' --mca plm_rsh_agent "$agent" --mca plm_rsh_no_tree_spawn 1 --mca mpi_yield_when_idle 1 \
    --mca btl tcp,self,vader --mca btl_tcp_if_include "$NET.0/24" --mca oob_tcp_if_include "$NET.0/24" \
    --host "$list"
}

cmd=${1:-}
shift || true
case "$cmd" in
check)
  why=$(why_not)
  [ -z "$why" ] || { echo "$why"; exit 1; }
  ;;
up | down | shape | kill)
  exec 9> "$LOCK" || die "cannot open $LOCK"
  flock 9
  case "$cmd" in
  up) [ $# -ge 1 ] || die "up N [RATE]"; up "$@" || { down; die "up failed (removed what it made)"; } ;;
  down) down ;;
  shape) [ $# -eq 1 ] || die "shape RATE|off"; shape "$1" || die "shape $1 failed" ;;
  kill)
    [ $# -eq 1 ] || die "kill HOST"
    ip netns pids "$1" > /dev/null 2>&1 || die "kill: no host $1"
    ip netns pids "$1" | xargs -r kill -9
    ;;
  esac
  ;;
mpirun-args) [[ "${1:-1}" =~ ^[1-9][0-9]*$ ]] || die "mpirun-args: SLOTS must be a positive integer"; mpirun_args "$@" ;;
*) die "usage: $0 check | up N [RATE] | shape RATE|off | kill HOST | down | mpirun-args" ;;
esac
