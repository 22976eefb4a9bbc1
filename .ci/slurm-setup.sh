#!/usr/bin/env bash
# Single-node SLURM on loopback for daskgen's end-to-end test (tests/test_slurm_e2e.py).
#
# Installs Debian's slurmctld + slurmd + munge, writes a minimal slurm.conf for this host with
# 4 *fake* GPUs (gres backed by /dev/tty0-3, so SLURM sets CUDA_VISIBLE_DEVICES for jobs that
# ask --gres=gpu:N, while no CUDA exists), and starts munged, slurmctld and slurmd in the
# background.  Needs root.  Takes ~30 s.  Stop with: .ci/slurm-setup.sh stop
#
# It succeeds only when the node is usable: state exactly idle, mix or alloc.  A node that is
# down, drained, failing or not responding (`idle*`, `down*`, ...) fails CI here with the state,
# SLURM's reason and the daemons' last log lines, instead of letting tests/test_slurm_e2e.py skip.
# `.ci/slurm-setup.sh check` runs only that check (no install, no restart, no resume).
#
# AuthInfo=cred_expire=10: SLURM 22.05 holds a requeued job for the launch credentials' lifetime plus
# one second before it may start again (120 s by default; newer releases read
# SchedulerParameters=requeue_delay); ten seconds is plenty on loopback.
# SchedulerParameters=sched_interval=2,bf_interval=2: a job that becomes eligible without an event that schedules at
# once (a requeued job once its hold ends) starts within two seconds, not at the next backfill pass (30 s by default)
# or main pass (60 s); the scheduling passes of a one-node cluster cost next to nothing.
set -euo pipefail

RUN=/run/daskgen-slurm
NODE=$(hostname -s)

stop() {
    for name in slurmd slurmctld munged; do
        if [[ -f $RUN/$name.pid ]]; then
            kill "$(cat "$RUN/$name.pid")" 2>/dev/null || true
            rm -f "$RUN/$name.pid"
        fi
    done
}

# The node's compact state (sinfo %t): idle, mix, alloc, or with a suffix when something is wrong
# (* not responding, ~ powered off, # powering up, ! % power down, $ maintenance, @ ^ reboot, - planned).
node_state() {
    sinfo -h -n "$NODE" -o %t 2>/dev/null | head -1
}

usable() {
    [[ $(node_state) =~ ^(idle|mix|alloc)$ ]]
}

refuse() {
    local state
    state=$(node_state)
    {
        echo "::: FAIL: SLURM node $NODE is not usable: state '${state:-unknown (sinfo did not answer)}'"
        echo "    (usable: idle, mix or alloc; a '*' suffix means slurmd is not responding)"
        sinfo -R 2>&1 || true
        scontrol show node "$NODE" 2>&1 | grep -E 'State=|Reason=' || true
        for log in /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log; do
            echo "--- last lines of $log"
            tail -n 15 "$log" 2>/dev/null || true
        done
    } >&2
    exit 1
}

case ${1:-start} in
    stop) stop; exit 0 ;;
    check) usable && { sinfo; exit 0; }; refuse ;;
    start) ;;
    *) echo "usage: $0 [start|stop|check]" >&2; exit 2 ;;
esac

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi

mkdir -p "$RUN" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
[[ -s /etc/munge/munge.key ]] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chmod 0400 /etc/munge/munge.key
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge

# Resources of this machine as slurmd sees them (CPUs, sockets, memory).
HW=$(slurmd -C | head -1 | sed "s/^NodeName=[^ ]*//")

cat >/etc/slurm/slurm.conf <<EOF
ClusterName=daskgen-ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=30
NodeName=$NODE NodeAddr=127.0.0.1 $HW Gres=gpu:4 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

cat >/etc/slurm/gres.conf <<EOF
AutoDetect=off
NodeName=$NODE Name=gpu File=/dev/tty[0-3]
EOF

stop
munged --force --pid-file="$RUN/munged.pid" 2>/dev/null || munged --force
slurmctld -i
slurmd

# A fresh node registers as down/unknown until slurmd answers; resume it while waiting.
for _ in $(seq 60); do
    if usable; then
        sinfo
        exit 0
    fi
    scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
    sleep 1
done
refuse
