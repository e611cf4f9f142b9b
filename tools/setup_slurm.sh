#!/usr/bin/env bash
# A real SLURM on this one machine, for the SLURM tests and CI: munge, slurmctld and two slurmd
# "virtual nodes" (n1, n2) on 127.0.0.1, so that heterogeneous jobs schedule (a hetjob stays
# PENDING on a one-node cluster), each with 4 fake GPUs. Facts behind every setting: ../shared/CPU_NOTES.md section B.
#
#   bash tools/setup_slurm.sh          # install if needed, configure, start (idempotent, ~10 s)
#   bash tools/setup_slurm.sh stop     # stop the daemons this script started (by their pid files)
#   bash tools/setup_slurm.sh status   # exit 0 iff both nodes are up
#
# Needs root (apt, /etc/slurm, daemons run as root). State, logs and pid files live in
# APRIEL_SLURM_DIR (default /tmp/apriel-slurm); the only files written outside it are
# /etc/slurm/slurm.conf and gres.conf (and munge's key when Debian's postinst did not create one).
set -euo pipefail

S="${APRIEL_SLURM_DIR:-/tmp/apriel-slurm}"
CPUS_PER_NODE="${APRIEL_SLURM_CPUS:-2}"         # what each virtual node offers (they share the real cores)
MEM_PER_NODE_MB="${APRIEL_SLURM_MEM_MB:-9000}"
KILL_WAIT_S="${APRIEL_SLURM_KILL_WAIT_S:-10}"   # SIGTERM -> SIGKILL of a cancelled step (SLURM's KillWait)
# Each node advertises this many GPUs (GRES gpu) backed by device files that are not GPUs
# ($S/dev/gpuN, made like /dev/null): SLURM schedules them and sets CUDA_VISIBLE_DEVICES in the tasks
# of the steps that ask for them, which is all a CPU test of the one-node job needs.
FAKE_GPUS="${APRIEL_SLURM_FAKE_GPUS:-4}"
CONF=/etc/slurm/slurm.conf
GRES_CONF=/etc/slurm/gres.conf
NODES=(n1 n2)
PORTS=(6818 6819)

pid_alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_slurm() {
  local f pid
  for f in "$S"/slurmd-*.pid "$S"/slurmctld.pid; do
    [[ -e "$f" ]] || continue
    if pid_alive "$f"; then
      pid="$(cat "$f")"
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$f"
  done
}

stop() {
  stop_slurm
  if [[ -s "$S/munged.started" ]] && [[ -s /run/munge/munged.pid ]] && \
     [[ "$(cat /run/munge/munged.pid)" == "$(cat "$S/munged.started")" ]]; then
    kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true   # only the munged this script started
  fi
  rm -f "$S/munged.started"
}

nodes_up() {
  local out
  out="$(sinfo -h -N -o '%N %t' 2>/dev/null)" || return 1
  for n in "${NODES[@]}"; do grep -qE "^$n (idle|alloc|mix|comp)" <<<"$out" || return 1; done
}

case "${1:-start}" in
  stop) stop; exit 0 ;;
  status) nodes_up; exit $? ;;
  start) ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac

if [[ "$(id -u)" != 0 ]]; then
  echo "setup_slurm.sh: needs root (installs packages, writes $CONF, runs the daemons as root)" >&2
  exit 1
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
   || ! command -v sbatch >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

mkdir -p "$S"/state "$S"/log "$S"/spool "$S"/dev /run/munge /etc/slurm
for i in $(seq 0 $(( FAKE_GPUS - 1 ))); do [[ -c "$S/dev/gpu$i" ]] || mknod -m 666 "$S/dev/gpu$i" c 1 3; done
chown munge:munge /run/munge
[[ -s /etc/munge/munge.key ]] || { mungekey --create; chown munge:munge /etc/munge/munge.key; }
if ! munge -n >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
  cat /run/munge/munged.pid > "$S/munged.started"
fi

want="$(cat <<CONF
# Written by tools/setup_slurm.sh (megatron_apriel): a two-node test cluster on 127.0.0.1.
ClusterName=apriel
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=$KILL_WAIT_S
StateSaveLocation=$S/state
SlurmdSpoolDir=$S/spool/%n
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$S/slurmd-%n.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd-%n.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
GresTypes=gpu
NodeName=${NODES[0]} NodeHostname=localhost NodeAddr=127.0.0.1 Port=${PORTS[0]} CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE_MB Gres=gpu:$FAKE_GPUS
NodeName=${NODES[1]} NodeHostname=localhost NodeAddr=127.0.0.1 Port=${PORTS[1]} CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE_MB Gres=gpu:$FAKE_GPUS
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
CONF
)"
want_gres="Name=gpu File=$S/dev/gpu[0-$(( FAKE_GPUS - 1 ))]"
restart=0
if [[ ! -f "$CONF" ]] || [[ "$(cat "$CONF")" != "$want" ]]; then
  printf '%s\n' "$want" > "$CONF"
  restart=1
fi
if [[ ! -f "$GRES_CONF" ]] || [[ "$(cat "$GRES_CONF")" != "$want_gres" ]]; then
  printf '%s\n' "$want_gres" > "$GRES_CONF"
  restart=1
fi
if (( restart )); then stop_slurm; fi

pid_alive "$S/slurmctld.pid" || /usr/sbin/slurmctld -c -i
for n in "${NODES[@]}"; do
  mkdir -p "$S/spool/$n"
  pid_alive "$S/slurmd-$n.pid" || /usr/sbin/slurmd -N "$n"
done
for _ in $(seq 100); do nodes_up && break; sleep 0.1; done
if ! nodes_up; then
  sinfo -N >&2 || true
  echo "setup_slurm.sh: the nodes did not come up; logs in $S/log" >&2
  exit 1
fi
echo "setup_slurm.sh: SLURM up (nodes ${NODES[*]}, partition debug; state and logs in $S)"
