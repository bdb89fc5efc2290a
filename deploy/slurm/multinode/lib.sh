# shellcheck shell=bash
# shellcheck disable=SC2034  # the variables set here are read by the scripts that source this file
# Shared by up.sh, down.sh, node.sh and on-node.sh: the multi-node test cluster's
# names, addresses and paths, and helpers. Sourced, never executed.
#
# Everything the cluster creates is named here, so down.sh can find and remove all
# of it even after a crash: the bridge, one network namespace per node and one for
# the storage, the mount-namespace files, the state folder, the storage folder.
# None of it overlaps the one-node local cluster (deploy/slurm/local-cluster):
# other config file (SLURM_CONF), ports, state, spool, logs and munged socket.

MN_HERE=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
MN_REPO=$(cd "$MN_HERE/../../.." && pwd)

# Settings (environment). Only up.sh reads them; it records what it used in
# $MN_ROOT/cluster.env, which down.sh, on-node.sh and the tests read back.
MN_NODES=${MN_NODES:-4}
MN_ROOT=${MN_ROOT:-/run/stager-mn}                    # small state: config, logs, sockets
MN_STORAGE_DIR=${MN_STORAGE_DIR:-/var/tmp/stager-mn-storage} # what shared storage serves
MN_STORAGE_RATE=${MN_STORAGE_RATE:-200mbit}           # tc rate of the storage link; 0: none
MN_STORAGE_DELAY=${MN_STORAGE_DELAY:-0}               # netem delay on it, e.g. 1ms; 0: none
MN_LOCAL_SIZE=${MN_LOCAL_SIZE:-2g}                    # each node's local disk (a tmpfs)
MN_SUBNET=${MN_SUBNET:-10.199.0}                      # a /24 no other interface uses
MN_LOCK=${MN_LOCK:-/tmp/stager-multinode.lock}
# 1: every node runs the node service (stager serve --multi-user, as root) from its
# start, as an admin's systemd would, and jobs use it; 0: per-user daemons (prolog).
MN_NODE_SERVICE=${MN_NODE_SERVICE:-0}
# 1: pre-staging (docs/prestaging.md): backfill every MN_PLAN_INTERVAL seconds,
# job_submit.lua, node services (implied) taking the planner's orders on their address's
# MN_PREFETCH_PORT and keeping stg_ node features, and the planner (`stager plan`, as
# root = SlurmUser) in the root namespace; 0: none of it.
MN_PRESTAGE=${MN_PRESTAGE:-0}
MN_PLAN_INTERVAL=${MN_PLAN_INTERVAL:-5}

MN_PREFIX=stmn                     # every link and namespace name starts with it
MN_BRIDGE=$MN_PREFIX-br
MN_STORAGE_NS=$MN_PREFIX-storage
MN_SFTP_PORT=7022                  # inside the storage namespace: no clash possible
MN_SLURMD_PORT=6818                # inside each node's namespace: no clash possible
MN_PREFETCH_PORT=866               # the node services' prefetch port, on each node's address

MN_CONF_DIR=$MN_ROOT/etc/slurm     # bind-mounted over /etc/slurm on the nodes
MN_STAGER_ETC=$MN_ROOT/etc/stager  # bind-mounted over /etc/stager on the nodes
MN_NS_DIR=$MN_ROOT/ns              # persistent mount namespaces, one file per node
MN_LOG_DIR=$MN_ROOT/log
MN_RUN_DIR=$MN_ROOT/run
MN_MUNGE_DIR=$MN_ROOT/munge
MN_BIN_DIR=$MN_ROOT/bin            # stager wrappers that run this checkout's code
MN_SHARED=$MN_ROOT/shared          # where every node mounts the shared storage
MN_PRIVATE=$MN_ROOT/private        # a node-private tmpfs for root-owned state
MN_NODE_RUN=$MN_PRIVATE/stager-node # the node service's runtime folder (its socket)
MN_JOBS=$MN_ROOT/jobs              # job scripts and outputs, visible everywhere
MN_ENV=$MN_ROOT/cluster.env

mn_say() { printf '%s: %s\n' "${MN_SCRIPT:-multinode}" "$*"; }
mn_die() {
    printf '%s: %s\n' "${MN_SCRIPT:-multinode}" "$*" >&2
    exit 1
}

mn_node_name() { printf 'mn%s\n' "$1"; }
mn_node_ns() { printf '%s%s\n' "$MN_PREFIX" "$1"; }
mn_node_addr() { printf '%s.%s\n' "$MN_SUBNET" "$((10 + $1))"; }
mn_storage_addr() { printf '%s.2\n' "$MN_SUBNET"; }

# Read back what up.sh recorded (down.sh must remove what was made, whatever the
# environment says now).
mn_load_recorded() {
    if [[ -r $MN_ROOT/cluster.env ]]; then
        # shellcheck source=/dev/null
        source "$MN_ROOT/cluster.env"
    fi
}

# The namespace's inode as the kernel names it in /proc/PID/ns/*; empty if none.
mn_ns_inode() {
    stat -L -c %i "$1" 2>/dev/null || true
}

# Pids of every process inside namespace file $2 of type $1 (mnt, net): those whose
# /proc/PID/ns/TYPE link reads TYPE:[inode]. One find, not one stat per process.
mn_ns_pids() {
    local type=$1 file=$2 inode
    inode=$(mn_ns_inode "$file")
    [[ -n $inode ]] || return 0
    find /proc -mindepth 3 -maxdepth 3 -path "/proc/[0-9]*/ns/$type" \
        -lname "$type:\[$inode\]" 2>/dev/null | cut -d/ -f3
}

# Stop every process in a namespace: TERM, up to 10 s, then KILL. They are all ours:
# nothing but this cluster runs inside its namespaces.
mn_kill_ns() {
    local type=$1 file=$2 pids
    pids=$(mn_ns_pids "$type" "$file")
    [[ -n $pids ]] || return 0
    # shellcheck disable=SC2086  # one pid per word
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 50); do
        pids=$(mn_ns_pids "$type" "$file")
        [[ -n $pids ]] || return 0
        sleep 0.2
    done
    mn_say "killing what ignored SIGTERM in $file: $(tr '\n' ' ' <<<"$pids")"
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    for _ in $(seq 25); do
        [[ -n $(mn_ns_pids "$type" "$file") ]] || return 0
        sleep 0.2
    done
    return 1
}

# shellcheck source=../local-cluster/pidfile.sh
source "$MN_HERE/../local-cluster/pidfile.sh"  # running PIDFILE

# SIGTERM the process of a pid file, wait up to 15 s, then SIGKILL.
mn_stop_pidfile() {
    local pidfile=$1 pid
    running "$pidfile" || return 0
    pid=$(<"$pidfile")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 75); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    kill -KILL "$pid" 2>/dev/null || true
}

# Daemons must not inherit a descriptor of the lock file: they would hold the lock
# for as long as they live. Closes every inherited descriptor above stderr (an outer
# `flock FILE up.sh` passes its own), then spawn daemons through mn_spawn.
mn_close_inherited_fds() {
    local fd
    for fd in "/proc/$$/fd"/*; do
        fd=${fd##*/}
        if ((fd > 2)); then
            eval "exec $fd>&-" 2>/dev/null || true
        fi
    done
}

# The node service of node INDEX, as an admin's systemd starts it
# (deploy/systemd/stager.service): root, every user, its cache on the node's own disk,
# munged for vouching. Run inside the node's namespaces (node.sh, node-service.sh).
mn_start_node_service() {
    local index=$1
    (
        if [[ ${MN_PRESTAGE:-0} == 1 ]]; then
            # Pre-staging: the planner's orders name this node by its Slurm name (the
            # host name is the machine's, shared by every node) and arrive on this
            # node's address; the service tags the node with a stg_ feature per
            # declared dataset held here.
            STAGER_NODE_NAME=$(mn_node_name "$index")
            STAGER_PREFETCH_LISTEN=$(mn_node_addr "$index"):$MN_PREFETCH_PORT
            export STAGER_NODE_NAME STAGER_PREFETCH_LISTEN STAGER_SLURM_NODE_FEATURES=1
        fi
        # shellcheck disable=SC2086 # MN_SERVE_ARGS is a list of flags
        "$MN_BIN_DIR/stager" serve --multi-user --runtime-dir "$MN_NODE_RUN" \
            --cache-dir /tmp/stager-node $MN_SERVE_ARGS --detach
    )
}

mn_spawn() {
    if [[ -n ${MN_LOCK_FD:-} ]]; then
        "$@" {MN_LOCK_FD}>&-
    else
        "$@"
    fi
}

# Hold the cluster's lock for the rest of the calling script, unless the caller
# already holds it (a test session or `make demo-multinode` holds it from up to down
# and says so with MN_LOCK_HELD=1; flock would otherwise wait for itself).
mn_lock() {
    [[ ${MN_LOCK_HELD:-0} == 1 ]] && return 0
    exec {MN_LOCK_FD}>>"$MN_LOCK"
    if ! flock -w 600 "$MN_LOCK_FD"; then
        mn_die "another multi-node cluster run held $MN_LOCK for 10 minutes; try again later"
    fi
}
