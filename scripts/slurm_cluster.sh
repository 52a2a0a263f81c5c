#!/usr/bin/env bash
# A two-node SLURM cluster on this one machine, for the tests and for trying the launch scripts on a laptop:
# one munged, one slurmctld and two slurmd (node1, node2), on local ports, with every file under DIR.
#
#   sudo bash scripts/slurm_cluster.sh up DIR      # installs Debian's slurm-wlm and munge if missing; prints
#   export SLURM_CONF=DIR/slurm.conf              # the line to export, then sbatch/squeue/scontrol just work
#   sudo bash scripts/slurm_cluster.sh down DIR    # stops what `up` started (and nothing else)
#
# Needs root (the daemons, apt-get, node1/node2 in /etc/hosts so the rendezvous resolves). CPUs per node:
# SLURM_NODE_CPUS (default 2). Ports: SLURM_PORT_BASE (default 17000): slurmctld on it, the nodes on +1, +2.
set -euo pipefail
usage() { echo "usage: scripts/slurm_cluster.sh up|down DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1
DIR=$(mkdir -p "$2" && cd "$2" && pwd)
BASE=${SLURM_PORT_BASE:-17000}
CPUS=${SLURM_NODE_CPUS:-2}
NODES=(node1 node2)

down() {  # SIGTERM to each daemon, then SIGKILL to any still there 5 s later
  local pids=() f
  for f in "$DIR"/slurmd.*.pid "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
    [ -s "$f" ] && pids+=("$(cat "$f")") && rm -f "$f"
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 50); do
    local alive=0 pid
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  kill -KILL "${pids[@]}" 2>/dev/null || true
}

if [ "$action" = down ]; then down; exit 0; fi
[ "$action" = up ] || usage
if [ "$(id -u)" != 0 ]; then
  echo "slurm_cluster: needs root (daemons, apt-get, /etc/hosts)" >&2; exit 3
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  echo "slurm_cluster: installing Debian's slurm-wlm and munge" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } >"$DIR/apt.log" 2>&1 \
    || { echo "slurm_cluster: apt-get could not install slurm-wlm and munge (see $DIR/apt.log)" >&2; exit 3; }
fi
for n in "${NODES[@]}"; do
  grep -qE "^127\.0\.0\.1[[:space:]].*\b$n\b" /etc/hosts || echo "127.0.0.1 $n" >>/etc/hosts
done
down  # a cluster left over in DIR by an interrupted run
host=$(hostname)
mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
chmod 700 "$DIR/state"
[ -s "$DIR/munge.key" ] || { dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none; chmod 600 "$DIR/munge.key"; }
cat >"$DIR/slurm.conf" <<CONF
ClusterName=naflex
SlurmctldHost=$host
SlurmctldPort=$BASE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
SlurmdTimeout=30
InactiveLimit=0
MessageTimeout=10
NodeName=node[1-2] NodeHostname=$host Port=[$((BASE + 1))-$((BASE + 2))] CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
munged --force --socket="$DIR/munge.socket" --key-file="$DIR/munge.key" --pid-file="$DIR/munged.pid" \
  --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge.seed"
export SLURM_CONF=$DIR/slurm.conf
slurmctld -f "$SLURM_CONF"
for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; slurmd -f "$SLURM_CONF" -N "$n"; done
for _ in $(seq 120); do
  idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle' || true)
  [ "$idle" = 2 ] && { echo "export SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.5
done
echo "slurm_cluster: the two nodes did not come up within 60 s (logs: $DIR/log)" >&2
sinfo -N >&2 || true
down
exit 1
