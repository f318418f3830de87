#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for tests/slurm (`make test-slurm`).
#
#   tests/slurm/cluster.sh start    # install the Debian packages when missing, write slurm.conf, start the daemons
#   tests/slurm/cluster.sh status   # sinfo / squeue
#   tests/slurm/cluster.sh stop     # cancel every job, stop the daemons this script started; nothing is left running
#
# Nodes n1 and n2 are two `slurmd -N <node>` on 127.0.0.1 (ports 17001/17002; Debian's Slurm is built
# with multiple-slurmd support), slurmctld on 16817, munged for authentication. Two partitions: `low`
# (default; its jobs are preempted by requeue after GraceTime) and `high` (preempts `low`).
# Everything lives under $SLURM_TEST_DIR (default /var/tmp/fsdp_strategies-slurm); commands need
# SLURM_CONF=$SLURM_TEST_DIR/slurm.conf (tests/slurm/conftest.py sets it). Exit status 3 from `start`:
# the packages are missing and cannot be installed (not root / no apt-get) -- the suite is skipped then.
# Why each setting is there: docs/multi-node.md ("Tested on a real SLURM cluster").
set -euo pipefail

DIR=${SLURM_TEST_DIR:-/var/tmp/fsdp_strategies-slurm}
CONF=$DIR/slurm.conf
GRACE_TIME=${SLURM_TEST_GRACE_TIME:-60}    # the low partition's GraceTime (SIGTERM -> SIGKILL on preemption)
export SLURM_CONF=$CONF
PACKAGES=(slurmctld slurmd slurm-client munge)

log() { echo "cluster.sh: $*" >&2; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
            && command -v munged >/dev/null; then
        return 0
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "SLURM is not installed and cannot be installed here (needs root and apt-get: ${PACKAGES[*]})."
        return 3
    fi
    log "installing ${PACKAGES[*]} (apt-get)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${PACKAGES[@]}" >/dev/null; }; then
        log "apt-get could not install ${PACKAGES[*]}."
        return 3
    fi
}

write_conf() {
    mkdir -p "$DIR/state" "$DIR/log" "$DIR/spool/n1" "$DIR/spool/n2" "$DIR/run"
    grep -qE '^127\.0\.0\.1[[:space:]]+n1 n2$' /etc/hosts || echo "127.0.0.1 n1 n2" >> /etc/hosts
    cat > "$CONF" <<EOF
# written by tests/slurm/cluster.sh
ClusterName=fsdptest
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=16817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# job credentials expire after 10 s instead of 120: a requeued job is started again within seconds
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# without a default memory per CPU one job takes a whole node's memory, hence the node
DefMemPerCPU=500
# declare more CPUs than this machine has
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=5
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
KillWait=30
MinJobAge=3600
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001 CPUs=8 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17002 CPUs=8 RealMemory=8000 State=UNKNOWN
PartitionName=low Nodes=n1,n2 Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_TIME MaxTime=INFINITE State=UP
PartitionName=high Nodes=n1,n2 PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
EOF
}

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pidof_file() { [ -s "$1" ] && cat "$1" || true; }

start_munge() {
    if [ -S /run/munge/munge.socket.2 ] && munge -n </dev/null >/dev/null 2>&1; then
        return 0  # a munged is already serving (the machine's own, or ours from an earlier start)
    fi
    mkdir -p /run/munge && chown munge:munge /run/munge
    /usr/sbin/munged --force --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log"
    for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && return 0; sleep 0.2; done
    log "munged did not start (log: $DIR/log/munged.log)"; return 1
}

start() {
    install_packages || exit $?
    if alive "$(pidof_file "$DIR/run/slurmctld.pid")"; then
        log "already running (stop it first: $0 stop)"; status; return 0
    fi
    rm -rf "$DIR/state"  # a fresh controller: no job of an earlier run
    write_conf
    start_munge
    slurmctld -f "$CONF"
    slurmd -f "$CONF" -N n1
    slurmd -f "$CONF" -N n2
    for _ in $(seq 120); do
        if [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ')" = "n1 idle n2 idle " ]; then
            log "up: nodes n1 n2 idle (SLURM_CONF=$CONF)"; return 0
        fi
        sleep 0.5
    done
    log "the nodes did not become idle within 60 s:"; sinfo -N 2>&1 >&2 || true
    tail -n 20 "$DIR"/log/*.log >&2 || true
    stop; exit 1
}

stepd_pids() {  # slurmstepd processes (they outlive slurmd): this cluster's, as no other SLURM runs here
    local pid
    for pid in /proc/[0-9]*; do
        [ "$(cat "$pid/comm" 2>/dev/null)" = slurmstepd ] && echo "${pid#/proc/}"
    done
    return 0
}

stop() {
    if alive "$(pidof_file "$DIR/run/slurmctld.pid")"; then
        scancel --quiet --full --signal=KILL --state=RUNNING "$(squeue -h -o %i | tr '\n' ',' | sed 's/,$//')" \
            2>/dev/null || true
        scancel --quiet "$(squeue -h -o %i | tr '\n' ',' | sed 's/,$//')" 2>/dev/null || true
        for _ in $(seq 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
    local name pid
    for name in slurmd-n1 slurmd-n2 slurmctld munged; do
        pid=$(pidof_file "$DIR/run/$name.pid")
        if alive "$pid"; then
            kill -TERM "$pid"
            for _ in $(seq 40); do alive "$pid" || break; sleep 0.25; done
            alive "$pid" && kill -KILL "$pid"
        fi
        rm -f "$DIR/run/$name.pid"
    done
    for pid in $(stepd_pids); do  # a step daemon whose job was not cancelled in time
        log "killing a left-over slurmstepd ($pid)"; kill -KILL "$pid" 2>/dev/null || true
    done
    log "stopped"
}

status() {
    sinfo -N || true
    squeue || true
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
