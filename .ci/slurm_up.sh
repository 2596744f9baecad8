#!/usr/bin/env bash
# A real Slurm (Debian's slurmctld/slurmd 22.05 + munge) on this one machine, on loopback, for
# tests/test_slurm.py. Idempotent: when the controller already answers and the node is usable,
# it only reports. Needs root (CI containers: no systemd, so the daemons are started directly).
#
#   .ci/slurm_up.sh          install if missing, write /etc/slurm/slurm.conf, start munged, slurmctld, slurmd
#   .ci/slurm_up.sh --down   stop the daemons this script started
#
# One node named "localhost" at 127.0.0.1 (Lightning's MASTER_ADDR comes from SLURM_NODELIST, so the
# name must resolve to loopback), CPUs=4 (SlurmdParameters=config_overrides lets 2-4 tasks fit on a
# 2-core runner), proctrack/linuxproc and task/none (no cgroup plugins), select/cons_tres.
# slurmd still needs /sys/fs/cgroup mounted; the script mounts a cgroup2 there when it is absent.
set -euo pipefail

STATE_DIR=${RAGGED_SLURM_STATE:-/var/tmp/ragged-slurm}
CONF=/etc/slurm/slurm.conf
MARKER="# written by lightning_ragged .ci/slurm_up.sh"
NODE=localhost

log() { echo "slurm_up: $*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
    log "needs root (it installs packages and starts munged/slurmctld/slurmd)"; exit 1
fi

stop_pidfile() {
    local file=$1 pid
    pid=$(cat "$file" 2>/dev/null || true)
    if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid" || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$file"
}

if [[ ${1:-} == "--down" ]]; then
    stop_pidfile "$STATE_DIR/slurmd.pid"
    stop_pidfile "$STATE_DIR/slurmctld.pid"
    stop_pidfile "$STATE_DIR/munged.pid"
    log "stopped"; exit 0
fi

node_ready() {
    # The controller answers and the node is in a state that runs jobs.
    timeout 5 scontrol ping 2>/dev/null | grep -q "is UP" || return 1
    local state
    state=$(timeout 5 sinfo -h -n "$NODE" -o %t 2>/dev/null | head -1)
    [[ $state == idle* || $state == mix* || $state == alloc* ]]
}

# ------------------------------------------------------------------------------ install
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
    || ! command -v munged >/dev/null; then
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

if [[ -f $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
    # Someone else's Slurm: use it as it is.
    if timeout 5 scontrol ping 2>/dev/null | grep -q "is UP"; then
        log "using the existing Slurm configured in $CONF"; exit 0
    fi
    log "$CONF exists, was not written by this script, and its controller does not answer"; exit 1
fi

if node_ready; then
    log "already up ($(sinfo -h -o '%P %D %t %c'))"; exit 0
fi

mkdir -p "$STATE_DIR"/{ctld,d,log}

# ------------------------------------------------------------------------------ munge
mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge
chmod 0755 /run/munge
chmod 0700 /var/lib/munge /var/log/munge /etc/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    stop_pidfile "$STATE_DIR/munged.pid"
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    cp /run/munge/munged.pid "$STATE_DIR/munged.pid"
fi
munge -n | unmunge >/dev/null || { log "munged does not work"; exit 1; }

# ------------------------------------------------------------------------------ cgroup fs
if ! mountpoint -q /sys/fs/cgroup; then
    log "mounting cgroup2 at /sys/fs/cgroup (slurmd needs it)"
    mount -t cgroup2 none /sys/fs/cgroup
fi

# ------------------------------------------------------------------------------ slurm.conf
cat >"$CONF" <<EOF
$MARKER
ClusterName=ragged
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/d
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
JobRequeue=1
ReturnToService=2
KillWait=10
MinJobAge=600
InactiveLimit=0
MessageTimeout=10
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=localhost CPUs=4 RealMemory=4096 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

# ------------------------------------------------------------------------------ daemons
stop_pidfile "$STATE_DIR/slurmd.pid"
stop_pidfile "$STATE_DIR/slurmctld.pid"
slurmctld -f "$CONF" -c            # -c: start clean (no jobs left from an earlier run)
slurmd -f "$CONF" -N "$NODE"

deadline=$((SECONDS + 30))
until node_ready; do
    if ((SECONDS > deadline)); then
        log "Slurm did not come up within 30 s"; sinfo -N -l || true
        tail -n 20 "$STATE_DIR/log/slurmctld.log" "$STATE_DIR/log/slurmd.log" >&2 || true
        exit 1
    fi
    sleep 0.2
done
log "up: $(sinfo -h -o '%P %D %t cpus=%c')"
