#!/usr/bin/env bash
# A real SLURM cluster on this machine, for tests and CI: munged + slurmctld + one slurmd per node
# (Debian's slurm-wlm, SLURM 22.05), started without systemd in a private state directory. One node by
# default; SMLP_SLURM_NODES=N runs N slurmd on this host (`slurmd -N NAME`, one port each): a real
# N-node cluster to SLURM (sbatch --nodes=N, srun, SLURM_NODEID, ...) whose nodes share this machine.
#
#   launch/slurm/local_cluster.sh start    # idempotent; installs slurm-wlm + munge if missing (root)
#   launch/slurm/local_cluster.sh status   # exit 0 if up and the node is usable, 1 otherwise
#   launch/slurm/local_cluster.sh stop     # cancels jobs, stops the daemons it started
#
# `start` and `status` print the one line clients need on stdout, so this works:
#   eval "$(launch/slurm/local_cluster.sh start)"      # -> export SLURM_CONF=/tmp/smlp-slurm/slurm.conf
# Everything else goes to stderr.
#
# Environment (all optional):
#   SMLP_SLURM_DIR          state directory (default /tmp/smlp-slurm); one cluster per directory
#   SMLP_SLURM_NODES        number of nodes (default 1)
#   SMLP_SLURM_CPUS         CPUs of each node (default: the CPUs this process may run on)
#   SMLP_SLURM_CTLD_PORT    slurmctld port (default 6817)
#   SMLP_SLURMD_PORT        slurmd port (default 6818); node i of N listens on SMLP_SLURMD_PORT + i - 1
#   SMLP_SLURM_NODE         node name (default: short host name if it resolves, else localhost); with
#                           N > 1 nodes the names are n1..nN (they need not resolve: NodeAddr=127.0.0.1)
#   SMLP_SLURM_WAIT         seconds to wait for the node to become idle (default 60)
#   SMLP_SLURM_NO_INSTALL=1 never call apt-get
#
# Pitfalls handled here (each one cost time once):
#   - munged's default socket lives under /run/munge, which needs systemd's tmpfiles; we run munged on a
#     socket in the state dir and tell SLURM with AuthInfo=socket=...; clients find it through SLURM_CONF.
#   - without cgroup v1/systemd delegation, proctrack/cgroup and task/cgroup fail: use proctrack/linuxproc
#     and task/none (linuxproc still finds every process a task forks, so scancel reaches all of them).
#   - a requeued job may only restart once its credential expired (default 120 s): cred_expire=10.
#   - the node's CPUs must not exceed what slurmd detects, or the node goes to INVAL: CPUs = affinity
#     count, and config_overrides makes slurmd trust the config.
#   - jobs must reach the first node: train.sbatch takes MASTER_ADDR from the NodeAddr (127.0.0.1 here)
#     of the first host of `scontrol show hostnames`, so the n1..nN names need not resolve.
#   - several slurmd on one host (Debian's build allows it): each needs `-N NAME`, its own Port= on its
#     NodeName line, and its own spool dir, pid and log file (%n in those paths).
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin   # the daemons live in sbin, often not on a user's PATH

D=${SMLP_SLURM_DIR:-/tmp/smlp-slurm}
CTLD_PORT=${SMLP_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${SMLP_SLURMD_PORT:-6818}
WAIT_S=${SMLP_SLURM_WAIT:-60}
NNODES=${SMLP_SLURM_NODES:-1}
CONF=$D/slurm.conf
PIDS=$D/run/daemons.pids   # lines "<name> <pid>", written in start order
export SLURM_CONF=$CONF

say() { echo "[local_cluster] $*" >&2; }
die() { say "error: $*"; exit 1; }

node_name() {
  local n=${SMLP_SLURM_NODE:-$(hostname -s 2>/dev/null || true)}
  if [ -z "$n" ] || ! getent hosts "$n" >/dev/null 2>&1; then n=localhost; fi
  echo "$n"
}
NODE=$(node_name)
[[ "$NNODES" =~ ^[1-9][0-9]?$ ]] || die "SMLP_SLURM_NODES must be an integer from 1 to 99, got '$NNODES'"
NODES=("$NODE")
if [ "$NNODES" -gt 1 ]; then NODES=(); for ((i = 1; i <= NNODES; i++)); do NODES+=("n$i"); done; fi

# alive NAME PID: PID runs, is not a zombie, and is the daemon we recorded (same command name).
alive() {
  [ -n "${2:-}" ] && [ -r "/proc/$2/stat" ] || return 1
  [ "$(cat "/proc/$2/comm" 2>/dev/null)" = "$1" ] || return 1
  [ "$(awk '{print $3}' "/proc/$2/stat" 2>/dev/null)" != Z ]
}
# recorded NAME [NODE]: the pid recorded for a daemon (slurmd lines also name their node)
recorded() {
  [ -f "$PIDS" ] && awk -v n="$1" -v h="${2:-}" '$1 == n && (h == "" || $3 == h || $3 == "") {p = $2} END {print p}' "$PIDS" || true
}
# node_state: the state of the nodes, the first one that is not usable if any ("" if one is missing)
node_state() {
  local states
  states=$(timeout 10 sinfo -h -N -n "$(IFS=,; echo "${NODES[*]}")" -o %t 2>/dev/null || true)
  [ "$(echo "$states" | grep -c .)" -eq "$NNODES" ] || return 0
  echo "$states" | grep -Ev '^(idle|mix|alloc|comp)' | head -1 | grep . || echo "$states" | head -1
}
daemons_alive() {
  local n
  alive munged "$(recorded munged)" && alive slurmctld "$(recorded slurmctld)" || return 1
  for n in "${NODES[@]}"; do alive slurmd "$(recorded slurmd "$n")" || return 1; done
}
usable() { [[ "$(node_state)" =~ ^(idle|mix|alloc|comp) ]]; }

ensure_packages() {
  local missing=()
  for b in munged mungekey slurmctld slurmd sbatch; do
    command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing+=("$b")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "${SMLP_SLURM_NO_INSTALL:-0}" = 1 ]; then
    die "missing ${missing[*]}; install with: apt-get install -y slurm-wlm munge"
  fi
  if [ "$(id -u)" -ne 0 ]; then
    die "missing ${missing[*]}; run as root (or: sudo apt-get install -y slurm-wlm munge)"
  fi
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install SLURM 22.05 + munge"
  say "installing slurm-wlm munge with apt-get (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q slurm-wlm munge >&2 \
    || { apt-get update -q >&2 && apt-get install -y -q slurm-wlm munge >&2; } \
    || die "apt-get install slurm-wlm munge failed"
}

port_busy() {  # is someone listening on TCP port $1?
  local hex; hex=$(printf ':%04X ' "$1")
  grep -q "$hex" <(awk 'NR > 1 && $4 == "0A" {print $2" "}' /proc/net/tcp /proc/net/tcp6 2>/dev/null)
}

write_conf() {
  local cpus=${SMLP_SLURM_CPUS:-$(nproc)}
  local mem_mb; mem_mb=$(awk '/^MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
  local user; user=$(id -un)
  cat > "$CONF" <<EOF
# written by launch/slurm/local_cluster.sh; clients: export SLURM_CONF=$CONF
ClusterName=smlp-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.socket.2,cred_expire=10
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=600
InactiveLimit=0
JobRequeue=1
EOF
  local i host=""
  [ "$NNODES" -gt 1 ] && host="NodeHostname=localhost "   # n1..nN all live on this host
  for ((i = 0; i < NNODES; i++)); do
    echo "NodeName=${NODES[$i]} ${host}NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i)) CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"
  done >> "$CONF"
  echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
}

# wait_file FILE SECONDS: until FILE is non-empty
wait_file() { local i; for ((i = 0; i < $2 * 10; i++)); do [ -s "$1" ] && return 0; sleep 0.1; done; return 1; }

start() {
  if [ -f "$PIDS" ] && daemons_alive && [ -f "$CONF" ] && usable; then
    say "already running in $D (node $NODE is $(node_state))"
    echo "export SLURM_CONF=$CONF"; return 0
  fi
  if [ -f "$PIDS" ]; then
    say "found a partial or stale cluster in $D: stopping it first"
    stop || true
  fi
  ensure_packages
  for p in "$CTLD_PORT" $(seq "$SLURMD_PORT" $((SLURMD_PORT + NNODES - 1))); do
    port_busy "$p" && die "TCP port $p is in use (another SLURM?); pick others with SMLP_SLURM_CTLD_PORT/SMLP_SLURMD_PORT"
  done

  local t0; t0=$(date +%s%N)
  mkdir -p "$D"
  chmod 755 "$D"
  mkdir -p "$D/munge" "$D/state" "$D/spool" "$D/log" "$D/run"
  rm -rf "${D:?}/state/"* "${D:?}/spool/"*          # a fresh cluster on every start; job ids restart at 1
  chmod 755 "$D/munge"                               # munged refuses a group/other-writable socket dir
  : > "$PIDS"

  # munge: own key, socket, pid and log in the state dir
  if [ ! -s "$D/munge/munge.key" ]; then
    mungekey --create --keyfile="$D/munge/munge.key" >&2 \
      || dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none
  fi
  chmod 600 "$D/munge/munge.key"
  rm -f "$D/munge/munge.socket.2" "$D/munge/munge.socket.2.lock" "$D/munge/munged.pid"
  munged --key-file="$D/munge/munge.key" --socket="$D/munge/munge.socket.2" \
    --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" \
    --seed-file="$D/munge/munged.seed" \
    || die "munged did not start (see $D/munge/munged.log)"
  wait_file "$D/munge/munged.pid" 10 || die "munged wrote no pid file"
  echo "munged $(cat "$D/munge/munged.pid")" >> "$PIDS"
  munge -n -S "$D/munge/munge.socket.2" | unmunge -S "$D/munge/munge.socket.2" >/dev/null \
    || die "munge round trip failed (see $D/munge/munged.log)"

  write_conf
  rm -f "$D/run/slurmctld.pid" "$D/run/slurmd"*.pid
  slurmctld -c -f "$CONF" || die "slurmctld failed to start: $(tail -5 "$D/log/slurmctld.log" 2>/dev/null)"
  wait_file "$D/run/slurmctld.pid" 10 || die "slurmctld wrote no pid file: $(tail -5 "$D/log/slurmctld.log")"
  echo "slurmctld $(cat "$D/run/slurmctld.pid")" >> "$PIDS"
  local n
  for n in "${NODES[@]}"; do
    slurmd -N "$n" -f "$CONF" || die "slurmd $n failed to start: $(tail -5 "$D/log/slurmd-$n.log" 2>/dev/null)"
    wait_file "$D/run/slurmd-$n.pid" 10 || die "slurmd $n wrote no pid file: $(tail -5 "$D/log/slurmd-$n.log")"
    echo "slurmd $(cat "$D/run/slurmd-$n.pid") $n" >> "$PIDS"
  done

  local end=$(($(date +%s) + WAIT_S))
  until [[ "$(node_state)" == idle* ]]; do
    if [ "$(date +%s)" -ge "$end" ]; then
      say "node(s) ${NODES[*]} not idle after ${WAIT_S}s (state: '$(node_state)'); last log lines:"
      tail -n 15 "$D/log/slurmctld.log" "$D/log/slurmd-"*.log >&2 || true
      stop || true
      exit 1
    fi
    sleep 0.2
  done
  local ms=$((($(date +%s%N) - t0) / 1000000))
  say "up in ${ms} ms: node(s) ${NODES[*]} idle, $(awk -F'CPUs=' '/^NodeName/ {split($2, a, " "); print a[1]; exit}' "$CONF") CPUs each, state in $D"
  echo "export SLURM_CONF=$CONF"
}

stop() {
  if [ ! -f "$PIDS" ]; then say "no cluster recorded in $D"; return 0; fi
  if alive slurmctld "$(recorded slurmctld)"; then
    local jobs; jobs=$(timeout 10 squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      say "cancelling jobs: $jobs"
      # shellcheck disable=SC2086
      timeout 10 scancel $jobs 2>/dev/null || true
      local i
      for ((i = 0; i < 150; i++)); do
        [ -z "$(timeout 10 squeue -h -o %i 2>/dev/null || true)" ] && break
        sleep 0.2
      done
    fi
  fi
  local name pid i
  # every recorded daemon (whatever SMLP_SLURM_NODES says now), in reverse start order
  while read -r name pid; do
    alive "$name" "$pid" || continue
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do alive "$name" "$pid" || break; sleep 0.2; done
    if alive "$name" "$pid"; then say "$name ($pid) ignored SIGTERM: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
    say "stopped $name ($pid)"
  done < <(awk '{print $1, $2}' "$PIDS" | tac)
  rm -f "$PIDS"
}

status() {
  local ok=0 name n
  for name in munged slurmctld; do
    if alive "$name" "$(recorded "$name")"; then say "$name: running (pid $(recorded "$name"))"
    else say "$name: not running"; ok=1; fi
  done
  for n in "${NODES[@]}"; do
    if alive slurmd "$(recorded slurmd "$n")"; then say "slurmd $n: running (pid $(recorded slurmd "$n"))"
    else say "slurmd $n: not running"; ok=1; fi
  done
  if [ $ok -eq 0 ]; then
    say "node(s) ${NODES[*]}: $(node_state)"
    usable || ok=1
  fi
  [ $ok -eq 0 ] && echo "export SLURM_CONF=$CONF"
  return $ok
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status   (state in \$SMLP_SLURM_DIR, default /tmp/smlp-slurm)" >&2; exit 2 ;;
esac
