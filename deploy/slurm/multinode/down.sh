#!/usr/bin/env bash
# Take the multi-node test cluster down and leave nothing behind: its jobs, every
# process inside its namespaces (slurmd, stager daemons, sshfs, job steps), slurmctld,
# munged, the pre-staging planner, the storage server, the namespaces, the bridge, the
# mounts, $MN_ROOT and the storage folder. Safe to run when nothing (or half a cluster)
# is up. Run as root.
#
#   --quiet   say nothing when there was nothing to stop
# MN_KEEP_LOGS=1 keeps $MN_ROOT/log (up.sh sets it when it fails half-way).
set -euo pipefail

MN_SCRIPT=down.sh
# shellcheck source=lib.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh"

QUIET=0
[[ ${1:-} == --quiet ]] && QUIET=1

[[ $(id -u) == 0 ]] || mn_die "run as root"
mn_lock
mn_load_recorded

cancel_jobs() {
    running "$MN_RUN_DIR/slurmctld.pid" || return 0
    export SLURM_CONF=$MN_CONF_DIR/slurm.conf
    [[ -n $(squeue --noheader --format %i 2>/dev/null) ]] || return 0
    mn_say "cancelling the cluster's jobs"
    scancel --full --quiet 2>/dev/null || true
    # Epilogs release leases; give them a moment, the daemons are stopped anyway.
    for _ in $(seq 30); do
        [[ -z $(squeue --noheader --format %i 2>/dev/null) ]] && return 0
        sleep 0.5
    done
}

stop_node() {
    local file=$1
    mn_kill_ns mnt "$file" || mn_say "processes in $file would not die" >&2
    umount "$file" 2>/dev/null || true
    rm -f "$file"
}

# All at once: each waits for its stager daemon and slurmd to stop.
stop_nodes() {
    local file
    for file in "$MN_NS_DIR"/mnt*; do
        [[ -e $file ]] && stop_node "$file" &
    done
    wait
    if mountpoint -q "$MN_NS_DIR" 2>/dev/null; then
        umount "$MN_NS_DIR"
    fi
}

remove_network() {
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$MN_PREFIX" || true); do
        mn_kill_ns net "/run/netns/$ns" || mn_say "processes in netns $ns would not die" >&2
        ip netns del "$ns"
    done
    if ip link show "$MN_BRIDGE" >/dev/null 2>&1; then
        ip link del "$MN_BRIDGE"
    fi
    # Outer veth ends die with their namespace; a half-made one may be left.
    local link
    for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 |
        grep "^$MN_PREFIX-v" || true); do
        ip link del "$link" 2>/dev/null || true
    done
}

anything_up() {
    [[ -d $MN_ROOT || -d $MN_STORAGE_DIR ]] && return 0
    ip netns list 2>/dev/null | grep -q "^$MN_PREFIX" && return 0
    ip link show "$MN_BRIDGE" >/dev/null 2>&1
}

main() {
    if ! anything_up; then
        ((QUIET)) || mn_say "nothing to take down"
        return 0
    fi
    # The planner first: no orders to nodes on their way down.
    mn_stop_pidfile "$MN_RUN_DIR/planner.pid"
    cancel_jobs
    stop_nodes
    mn_stop_pidfile "$MN_RUN_DIR/slurmctld.pid" &
    mn_stop_pidfile "$MN_RUN_DIR/storage.pid" &
    mn_stop_pidfile "$MN_RUN_DIR/munged.pid" &
    wait
    remove_network
    if [[ ${MN_KEEP_LOGS:-0} == 1 && -d $MN_LOG_DIR ]]; then
        find "$MN_ROOT" -mindepth 1 -maxdepth 1 ! -name log -exec rm -rf {} +
    else
        rm -rf "$MN_ROOT"
    fi
    rm -rf "$MN_STORAGE_DIR"
    mn_say "the multi-node cluster is down"
}

main "$@"
