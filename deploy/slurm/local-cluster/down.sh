#!/usr/bin/env bash
# Stop the local cluster that up.sh started: cancel its jobs, stop the stager daemons
# its prologs started, then slurmd, slurmctld and munged. Packages stay installed.
#   --purge   also delete SLURM's state and logs and the generated config files
set -euo pipefail

HERE=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
PURGE=0
[[ ${1:-} == --purge ]] && PURGE=1

say() { printf 'down.sh: %s\n' "$*"; }

[[ $(id -u) == 0 ]] || {
    say "run as root" >&2
    exit 1
}

# shellcheck source=pidfile.sh
source "$HERE/pidfile.sh"

cancel_jobs() {
    running /run/slurmctld.pid || return 0
    if [[ -n $(squeue --noheader --format %i 2>/dev/null) ]]; then
        say "cancelling every job"
        scancel --full --quiet --user=root 2>/dev/null || true
        scancel --full --quiet --state=PENDING 2>/dev/null || true
        # Wait for the epilogs so they release leases before the daemons go away.
        for _ in $(seq 60); do
            [[ -z $(squeue --noheader --format %i 2>/dev/null) ]] && break
            sleep 1
        done
    fi
}

# Daemons a prolog started (the epilog keeps them by default so the cache stays warm).
stop_stager_daemons() {
    # shellcheck source=../common.sh
    source "$HERE/../common.sh"
    load_config
    local marker uid
    for marker in "$STAGER_SLURM_STATE_DIR"/users/*/started-by-prolog; do
        [[ -e $marker ]] || continue
        uid=$(basename "$(dirname "$marker")")
        JOB_ID=none JOB_UID=$uid JOB_USER=$(id -un "$uid" 2>/dev/null || echo "$uid")
        local runtime stager
        runtime=$(expand_pattern "$STAGER_SLURM_RUNTIME_DIR")
        stager=$(stager_bin stager) || true
        if [[ -n $stager && -x $stager ]]; then
            JOB_GID=$(id -g "$uid" 2>/dev/null || echo "$uid")
            say "stopping the stager daemon of uid $uid ($runtime)"
            as_job_user "$stager" stop --runtime-dir "$runtime" || true
        fi
        rm -f "$marker"
    done
}

cancel_jobs
stop_stager_daemons
# A daemon that will not stop is left running (and said so); stop what else we can.
stop_pidfile /run/slurmd.pid slurmd || true
stop_pidfile /run/slurmctld.pid slurmctld || true
stop_pidfile /run/munge/munged.pid munged || true

if ((PURGE)); then
    say "purging state, logs and generated config"
    rm -rf /var/lib/slurm/slurmd /var/lib/slurm/slurmctld /var/log/slurm
    rm -f /etc/slurm/slurm.conf /etc/slurm/cgroup.conf /etc/stager/slurm.env
fi
say "stopped"
