#!/usr/bin/env bash
# A real Slurm (Debian's slurmctld/slurmd 22.05 + munge) on this one machine, on loopback, for
# tests/test_slurm.py. Idempotent: when the controller already answers and the node is usable,
# it only reports. Needs root (CI containers: no systemd, so the daemons are started directly).
#
#   .ci/slurm_up.sh          install if missing, write /etc/slurm/slurm.conf, start munged, slurmctld, slurmd
#   .ci/slurm_up.sh --two-nodes  the same, plus partition "two": nodes n1 and n2 (see below)
#   .ci/slurm_up.sh --down   stop the daemons this script started (and remove the namespaces)
#
# One node named "localhost" at 127.0.0.1 (Lightning's MASTER_ADDR comes from SLURM_NODELIST, so the
# name must resolve to loopback), CPUs=4 (SlurmdParameters=config_overrides lets 2-4 tasks fit on a
# 2-core runner), proctrack/linuxproc and task/none (no cgroup plugins), select/cons_tres.
# slurmd still needs /sys/fs/cgroup mounted; the script mounts a cgroup2 there when it is absent.
#
# --two-nodes adds partition "two" (not the default; the one-node setup is otherwise unchanged):
# two network namespaces ragged-n1/ragged-n2, each with one end of a veth pair (rs-n1 at
# 10.213.0.1, rs-n2 at 10.213.0.2; the other ends on a bridge rsbr0 at 10.213.0.254 in this
# namespace, so the nodes reach each other and the controller), and one slurmd per namespace
# (`nsenter --net=/run/netns/...`; `ip netns exec` remounts /sys and slurmd dies) as nodes n1 and
# n2 with 2 CPUs each. Those slurmds read a copy of slurm.conf whose controller address is the
# bridge's (their 127.0.0.1 is their own loopback). Jobs there set GLOO_SOCKET_IFNAME=rs-$SLURMD_NODENAME.
set -euo pipefail

STATE_DIR=${RAGGED_SLURM_STATE:-/var/tmp/ragged-slurm}
CONF=/etc/slurm/slurm.conf
MARKER="# written by lightning_ragged .ci/slurm_up.sh"
NODE=localhost
TWO_NODES=0
[[ ${1:-} == "--two-nodes" ]] && TWO_NODES=1
NODES_CONF=$STATE_DIR/slurm-nodes.conf
BRIDGE=rsbr0
BRIDGE_ADDR=10.213.0.254

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

two_nodes_down() {
    local i
    for i in 1 2; do
        stop_pidfile "$STATE_DIR/slurmd-n$i.pid"
        ip netns del "ragged-n$i" 2>/dev/null || true
        ip link del "rs-n${i}h" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

if [[ ${1:-} == "--down" ]]; then
    two_nodes_down
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

two_ready() {
    [[ $(timeout 5 sinfo -h -N -p two -o %t 2>/dev/null | grep -cE '^(idle|mix|alloc)') == 2 ]]
}

# The two namespaced nodes (--two-nodes): network, their slurm.conf copy, their slurmds.
two_nodes_up() {
    local i
    two_nodes_down
    sed -e "s|^SlurmctldHost=.*|SlurmctldHost=localhost($BRIDGE_ADDR)|" \
        -e "s|^SlurmdPidFile=.*|SlurmdPidFile=$STATE_DIR/slurmd-%n.pid|" \
        -e "s|^SlurmdLogFile=.*|SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log|" \
        -e "s|^SlurmdSpoolDir=.*|SlurmdSpoolDir=$STATE_DIR/d-%n|" "$CONF" >"$NODES_CONF"
    ip link add "$BRIDGE" type bridge
    ip addr add "$BRIDGE_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for i in 1 2; do
        mkdir -p "$STATE_DIR/d-n$i"
        ip netns add "ragged-n$i"
        ip link add "rs-n$i" type veth peer name "rs-n${i}h"
        ip link set "rs-n${i}h" master "$BRIDGE" up
        ip link set "rs-n$i" netns "ragged-n$i"
        nsenter --net="/run/netns/ragged-n$i" ip addr add "10.213.0.$i/24" dev "rs-n$i"
        nsenter --net="/run/netns/ragged-n$i" ip link set "rs-n$i" up
        nsenter --net="/run/netns/ragged-n$i" ip link set lo up
    done
    for i in 1 2; do
        nsenter --net="/run/netns/ragged-n$i" slurmd -f "$NODES_CONF" -N "n$i"
    done
    local deadline=$((SECONDS + 30))
    until two_ready; do
        if ((SECONDS > deadline)); then
            log "nodes n1, n2 did not come up within 30 s"; sinfo -N -l || true
            tail -n 20 "$STATE_DIR/log/slurmctld.log" "$STATE_DIR"/log/slurmd-n*.log >&2 || true
            exit 1
        fi
        sleep 0.2
    done
    log "two nodes up: $(sinfo -h -p two -o '%P %D %t cpus=%c')"
}

if node_ready; then
    if ((TWO_NODES == 0)); then
        log "already up ($(sinfo -h -o '%P %D %t %c'))"; exit 0
    fi
    if two_ready; then
        log "already up ($(sinfo -h -o '%P %D %t %c' | tr '\n' ';'))"; exit 0
    fi
    if grep -q "^PartitionName=two " "$CONF"; then
        two_nodes_up; exit 0
    fi
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
# --two-nodes: n1 and n2 come before "localhost" (while a node table holds one node named
# localhost, Slurm's node lookup returns it for every name, and the next NodeName line is fatal).
EXTRA_NODES="" EXTRA_PARTITIONS=""
if ((TWO_NODES)); then
    EXTRA_NODES="NodeName=n1 NodeAddr=10.213.0.1 CPUs=2 RealMemory=2048 State=UNKNOWN
NodeName=n2 NodeAddr=10.213.0.2 CPUs=2 RealMemory=2048 State=UNKNOWN
"
    EXTRA_PARTITIONS="
PartitionName=two Nodes=n1,n2 Default=NO MaxTime=INFINITE State=UP"
fi
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
${EXTRA_NODES}NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=localhost CPUs=4 RealMemory=4096 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP${EXTRA_PARTITIONS}
EOF

# ------------------------------------------------------------------------------ daemons
two_nodes_down  # namespaced nodes of an earlier --two-nodes run, if any
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
((TWO_NODES == 0)) || two_nodes_up
