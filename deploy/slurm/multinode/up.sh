#!/usr/bin/env bash
# Bring up a multi-node SLURM cluster on this one (Debian) machine, for stager's
# fan-out tests, demo and benchmark. Run as root.
#
#   bridge stmn-br (MN_SUBNET.1, slurmctld listens here)
#     |-- stmn-storage  MN_SUBNET.2   shared storage: sftp-server over a tc-limited link
#     |-- stmn1 .. stmnN MN_SUBNET.11+  one slurmd each, in its own network AND mount
#                                       namespace (own /tmp: the node's local disk)
#
# Every node mounts the storage with sshfs at $MN_SHARED, so reads from it cross the
# storage link at MN_STORAGE_RATE with real per-file round trips. Bytes leaving the
# storage are counted on the storage side: the sftp-server's own log (bytes read per
# file) and the storage link's counters; see storage-bytes.sh.
#
# Coexists with deploy/slurm/local-cluster: its own SLURM_CONF, ports, state, spool,
# logs and munged. Starts clean every time (down.sh first). Prints nothing but
# progress; the settings it used are in $MN_ROOT/cluster.env:
#
#   source /run/stager-mn/cluster.env; export SLURM_CONF; sbatch -N4 job.sh
#
# Environment (defaults in lib.sh): MN_NODES, MN_STORAGE_RATE (e.g. 200mbit; 0 for
# none), MN_STORAGE_DELAY (e.g. 1ms), MN_LOCAL_SIZE, MN_SUBNET, MN_ROOT,
# MN_STORAGE_DIR, MN_SERVE_ARGS (more `stager serve` flags for the nodes' daemons),
# MN_NODE_SERVICE=1 (each node runs the node service for every user, not per-user
# daemons), MN_PRESTAGE=1 (pre-staging: the planner, job_submit.lua, a short backfill
# interval MN_PLAN_INTERVAL, node services taking prefetch orders; implies
# MN_NODE_SERVICE=1; planner.sh stops and starts the planner),
# MN_PYTHON (the interpreter with stager's dependencies; default .venv/bin/python),
# MN_LOCK_HELD=1 (the caller holds /tmp/stager-multinode.lock already).
set -euo pipefail

MN_SCRIPT=up.sh
# shellcheck source=lib.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh"

MN_PYTHON=${MN_PYTHON:-$MN_REPO/.venv/bin/python}
MN_SERVE_ARGS=${MN_SERVE_ARGS:---min-free-bytes 64000000}
UP_TIMEOUT=${MN_UP_TIMEOUT:-90}
PACKAGES=(slurm-wlm slurm-client munge sshfs socat openssh-sftp-server iproute2 util-linux curl)
TOOLS=(slurmctld slurmd sbatch srun sbcast scontrol munged mungekey sshfs socat ip tc nsenter
    unshare flock curl setpriv)

require_root() {
    [[ $(id -u) == 0 ]] || mn_die "run as root: it makes namespaces, mounts and starts SLURM"
    command -v apt-get >/dev/null || mn_die "needs a Debian-like system with apt-get"
}

# shellcheck source=../packages.sh
source "$(dirname "$MN_HERE")/packages.sh"

install_packages() {
    apt_install_missing "${TOOLS[*]} /usr/lib/openssh/sftp-server" "${PACKAGES[@]}"
}

check_inputs() {
    [[ $MN_NODES =~ ^[1-9][0-9]?$ ]] || mn_die "MN_NODES=$MN_NODES: give a node count from 1 to 99"
    [[ $MN_SUBNET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || mn_die "MN_SUBNET=$MN_SUBNET: give 3 octets, e.g. 10.199.0"
    [[ -x $MN_PYTHON ]] || mn_die "no Python at $MN_PYTHON (set MN_PYTHON, or run \`make venv\`)"
    # Each node mounts its own /tmp: the prolog, daemons and jobs could not see a checkout there.
    case $MN_REPO/ in /tmp/*) mn_die "this checkout is under /tmp ($MN_REPO), which every node of the cluster replaces with its own; clone it elsewhere (e.g. /var/tmp)";; esac
    case $MN_PYTHON in /tmp/*) mn_die "MN_PYTHON=$MN_PYTHON is under /tmp, which every node replaces with its own; use a virtualenv elsewhere";; esac
    if ip -o addr show | grep -v " $MN_BRIDGE " | grep -qF " $MN_SUBNET."; then
        mn_die "another interface already uses $MN_SUBNET.0/24; set MN_SUBNET to a free /24"
    fi
    [[ -c /dev/fuse ]] || mn_die "no /dev/fuse: sshfs needs it (modprobe fuse)"
    [[ $MN_PRESTAGE =~ ^[01]$ ]] || mn_die "MN_PRESTAGE=$MN_PRESTAGE: give 1 (pre-staging) or 0"
    if [[ $MN_PRESTAGE == 1 ]]; then
        [[ $MN_NODE_SERVICE == 1 ]] || mn_say "MN_PRESTAGE=1: node services on (MN_NODE_SERVICE=1)"
        MN_NODE_SERVICE=1 # prefetches are the node service's: per-user daemons take none
        [[ $MN_PLAN_INTERVAL =~ ^[1-9][0-9]?$ ]] ||
            mn_die "MN_PLAN_INTERVAL=$MN_PLAN_INTERVAL: give seconds from 1 to 99 (slurm.conf's bf_interval)"
    fi
}

free_port() {
    local port
    for port in $(seq 16817 16999); do
        if [[ -z $(ss -Hltn "sport = :$port") ]]; then
            printf '%s\n' "$port"
            return 0
        fi
    done
    mn_die "no free TCP port in 16817-16999 for slurmctld"
}

record_settings() {
    install -d -m 0755 "$MN_ROOT" "$MN_CONF_DIR" "$MN_STAGER_ETC" "$MN_NS_DIR" "$MN_LOG_DIR" \
        "$MN_RUN_DIR" "$MN_BIN_DIR" "$MN_SHARED" "$MN_PRIVATE" "$MN_ROOT/spool" \
        "$MN_ROOT/state" "$MN_ROOT/etc"
    install -d -m 1777 "$MN_JOBS"
    install -d -m 0755 "$MN_STORAGE_DIR"
    # Mount points the nodes bind over; harmless empty folders where missing.
    install -d -m 0755 /etc/slurm /etc/stager /run/munge
    CTLD_PORT=$(free_port)
    local nodes=() i
    for i in $(seq "$MN_NODES"); do nodes+=("$(mn_node_name "$i")"); done
    {
        printf '# Written by deploy/slurm/multinode/up.sh: the cluster it brought up.\n'
        local key
        for key in MN_NODES MN_ROOT MN_STORAGE_DIR MN_STORAGE_RATE MN_STORAGE_DELAY \
            MN_LOCAL_SIZE MN_SUBNET CTLD_PORT MN_SHARED MN_JOBS MN_BIN_DIR MN_LOG_DIR \
            MN_NODE_SERVICE MN_SERVE_ARGS MN_PRESTAGE MN_PLAN_INTERVAL; do
            printf '%s=%q\n' "$key" "${!key}"
        done
        printf 'MN_NODE_NAMES=%q\n' "${nodes[*]}"
        printf 'MN_STORAGE_NS=%q\n' "$MN_STORAGE_NS"
        printf 'SLURM_CONF=%q\n' "$MN_CONF_DIR/slurm.conf"
    } >"$MN_ENV"
}

make_network() {
    mn_say "network: bridge $MN_BRIDGE, storage and $MN_NODES node namespaces on $MN_SUBNET.0/24"
    ip link add "$MN_BRIDGE" type bridge
    ip addr add "$MN_SUBNET.1/24" dev "$MN_BRIDGE"
    ip link set "$MN_BRIDGE" up
    add_host_ns "$MN_STORAGE_NS" "$MN_PREFIX-vst" "$(mn_storage_addr)"
    limit_storage_link
    local i
    for i in $(seq "$MN_NODES"); do
        add_host_ns "$(mn_node_ns "$i")" "$MN_PREFIX-v$i" "$(mn_node_addr "$i")"
    done
}

# A namespace with a veth whose inner end is eth0 and whose outer end is on the bridge.
add_host_ns() {
    local ns=$1 outer=$2 addr=$3
    ip netns add "$ns"
    ip link add "$outer" type veth peer name eth0 netns "$ns"
    ip link set "$outer" master "$MN_BRIDGE" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
}

# The storage link is the slow one, as on a real cluster: shaped on both ends so it
# is MN_STORAGE_RATE in each direction; nodes talk to each other at full speed.
limit_storage_link() {
    local dev ns qdisc=()
    [[ $MN_STORAGE_DELAY != 0 ]] && qdisc=(netem delay "$MN_STORAGE_DELAY")
    for dev in "eth0 $MN_STORAGE_NS" "$MN_PREFIX-vst -"; do
        read -r dev ns <<<"$dev"
        local -a tc_cmd=(tc)
        [[ $ns != - ]] && tc_cmd=(tc -n "$ns")
        if ((${#qdisc[@]})); then
            "${tc_cmd[@]}" qdisc add dev "$dev" root handle 1: "${qdisc[@]}"
            if [[ $MN_STORAGE_RATE != 0 ]]; then
                "${tc_cmd[@]}" qdisc add dev "$dev" parent 1: handle 2: \
                    tbf rate "$MN_STORAGE_RATE" burst 256kb latency 200ms
            fi
        elif [[ $MN_STORAGE_RATE != 0 ]]; then
            "${tc_cmd[@]}" qdisc add dev "$dev" root tbf rate "$MN_STORAGE_RATE" \
                burst 256kb latency 200ms
        fi
    done
    mn_say "storage link: rate ${MN_STORAGE_RATE/#0/unlimited}, delay $MN_STORAGE_DELAY"
}

start_munge() {
    install -d -m 0755 "$MN_MUNGE_DIR"
    mungekey -c -f -k "$MN_MUNGE_DIR/munge.key" 2>/dev/null
    chmod 0600 "$MN_MUNGE_DIR/munge.key"
    # --force: root runs it and the folders are root's.
    mn_spawn munged --force --socket="$MN_MUNGE_DIR/munge.socket.2" \
        --key-file="$MN_MUNGE_DIR/munge.key" --pid-file="$MN_RUN_DIR/munged.pid" \
        --log-file="$MN_LOG_DIR/munged.log" --seed-file="$MN_RUN_DIR/munged.seed"
    munge -S "$MN_MUNGE_DIR/munge.socket.2" -n | unmunge -S "$MN_MUNGE_DIR/munge.socket.2" \
        >/dev/null || mn_die "this cluster's munged does not work; see $MN_LOG_DIR/munged.log"
}

# Pre-staging's lines (MN_PRESTAGE=1): a backfill cycle, hence a plan the planner can
# act on, every MN_PLAN_INTERVAL seconds instead of 30; --prefer for data a node holds
# (job_submit.lua; a prefer naming a feature no node has would otherwise reject the
# job); the lua that copies #STAGER lines where the planner reads them.
prestage_lines() {
    [[ $MN_PRESTAGE == 1 ]] || return 0
    printf '# stager pre-staging (MN_PRESTAGE=1; docs/prestaging.md).\n'
    printf 'SchedulerParameters=bf_interval=%s,ignore_prefer_validation\n' "$MN_PLAN_INTERVAL"
    printf 'JobSubmitPlugins=lua\n'
}

render_slurm_conf() {
    local lines="" i prestage
    prestage=$(prestage_lines)
    for i in $(seq "$MN_NODES"); do
        # Each node claims this machine's CPUs; the cluster is for function, not capacity.
        lines+="NodeName=$(mn_node_name "$i") NodeAddr=$(mn_node_addr "$i") CPUs=$(nproc) RealMemory=2000 State=UNKNOWN"$'\n'
    done
    sed -e "s|@HOSTNAME@|$(hostname -s)|g" -e "s|@CTLD_ADDR@|$MN_SUBNET.1|g" \
        -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$MN_SLURMD_PORT|g" \
        -e "s|@MUNGE_SOCKET@|$MN_MUNGE_DIR/munge.socket.2|g" -e "s|@RUN_DIR@|$MN_RUN_DIR|g" \
        -e "s|@LOG_DIR@|$MN_LOG_DIR|g" -e "s|@ROOT@|$MN_ROOT|g" \
        -e "s|@SLURM_DIR@|$(dirname "$MN_HERE")|g" "$MN_HERE/slurm.conf.in" |
        awk -v lines="$lines" -v prestage="$prestage" '
            $0 == "@NODE_LINES@" { printf "%s", lines; next }
            $0 == "@PRESTAGE_LINES@" { if (prestage != "") print prestage; next }
            { print }'
}

# deploy/slurm/slurm.env with this cluster's values: daemons from this checkout,
# caches on the nodes' own /tmp, root-owned state on their private tmpfs.
render_stager_env() {
    local line key
    local -A values=(
        [STAGER_BIN_DIR]=$MN_BIN_DIR
        [STAGER_SLURM_START]=1
        [STAGER_SLURM_RUNTIME_DIR]=/tmp/stager-%U
        [STAGER_SLURM_CACHE_DIR]=/tmp/stager-%U/cache
        [STAGER_SLURM_SERVE_ARGS]=$MN_SERVE_ARGS
        [STAGER_SLURM_TMPDIR]=/tmp/slurm-%j
        [STAGER_EPILOG_STOP]=0
        [STAGER_SLURM_LOG]=$MN_LOG_DIR/stager-slurm.log
        [STAGER_SLURM_STATE_DIR]=$MN_PRIVATE/stager-slurm
    )
    if [[ $MN_NODE_SERVICE == 1 ]]; then
        values[STAGER_NODE_SOCKET]=$MN_NODE_RUN/stager.sock
    fi
    printf '# Generated by deploy/slurm/multinode/up.sh from deploy/slurm/slurm.env.\n'
    while IFS= read -r line; do
        key=${line%%=*}
        if [[ $line =~ ^STAGER_[A-Z_]+= && -n ${values[$key]+set} ]]; then
            line="$key=$(printf '%q' "${values[$key]}")"
        fi
        printf '%s\n' "$line"
    done <"$(dirname "$MN_HERE")/slurm.env"
}

# The nodes run this checkout's stager, whatever the virtualenv was installed from.
write_wrappers() {
    local tool
    for tool in stager stager-client stager-train; do
        cat >"$MN_BIN_DIR/$tool" <<EOF
#!/bin/sh
# Generated by deploy/slurm/multinode/up.sh: the checkout that brought the cluster up.
PYTHONPATH=$MN_REPO\${PYTHONPATH:+:\$PYTHONPATH} exec $(dirname "$MN_PYTHON")/$tool "\$@"
EOF
        chmod 0755 "$MN_BIN_DIR/$tool"
    done
}

write_configs() {
    render_slurm_conf >"$MN_CONF_DIR/slurm.conf"
    if [[ $MN_PRESTAGE == 1 ]]; then
        # Beside slurm.conf, where slurmctld's job_submit/lua looks for it.
        install -m 0644 "$(dirname "$MN_HERE")/job_submit.lua" "$MN_CONF_DIR/job_submit.lua"
    fi
    printf 'CgroupPlugin=autodetect\n' >"$MN_CONF_DIR/cgroup.conf"
    render_stager_env >"$MN_STAGER_ETC/slurm.env"
    chmod 0644 "$MN_STAGER_ETC/slurm.env"
    {
        cat /etc/hosts
        printf '%s\t%s\n' "$(mn_storage_addr)" "mn-storage"
        local i
        for i in $(seq "$MN_NODES"); do
            printf '%s\t%s\n' "$(mn_node_addr "$i")" "$(mn_node_name "$i")"
        done
    } >"$MN_ROOT/etc/hosts"
    write_wrappers
}

# sftp-server behind socat in the storage namespace, one server process per node
# connection. -l INFO logs every file's close with the bytes read from it: the
# storage side's own count of what left it.
start_storage() {
    local ns_file=/run/netns/$MN_STORAGE_NS
    mn_spawn nsenter --net="$ns_file" setsid socat \
        "TCP-LISTEN:$MN_SFTP_PORT,fork,reuseaddr,bind=$(mn_storage_addr)" \
        "EXEC:/usr/lib/openssh/sftp-server -e -l INFO" \
        </dev/null >/dev/null 2>>"$MN_LOG_DIR/sftp-server.log" &
    echo $! >"$MN_RUN_DIR/storage.pid"
    for _ in $(seq 50); do
        nsenter --net="$ns_file" ss -Hltn "sport = :$MN_SFTP_PORT" | grep -q . && return 0
        sleep 0.1
    done
    mn_die "the storage's sftp server did not listen; see $MN_LOG_DIR/sftp-server.log"
}

start_slurmctld() {
    mn_say "starting slurmctld on $MN_SUBNET.1:$CTLD_PORT"
    SLURM_CONF=$MN_CONF_DIR/slurm.conf mn_spawn slurmctld -f "$MN_CONF_DIR/slurm.conf" -i
}

# The namespace files are bind mounts; their folder must be a private mount, or the
# kernel refuses to bind a mount namespace inside itself (what `ip netns` does too).
prepare_ns_dir() {
    mount --bind "$MN_NS_DIR" "$MN_NS_DIR"
    mount --make-private "$MN_NS_DIR"
}

start_nodes() {
    prepare_ns_dir
    local i
    for i in $(seq "$MN_NODES"); do
        touch "$MN_NS_DIR/mnt$i"
        mn_spawn unshare --mount="$MN_NS_DIR/mnt$i" --propagation private \
            nsenter --net="/run/netns/$(mn_node_ns "$i")" \
            "$MN_HERE/node.sh" "$i" >>"$MN_LOG_DIR/node$i.log" 2>&1 ||
            mn_die "node $i did not start; see $MN_LOG_DIR/node$i.log"
    done
    mn_say "started $MN_NODES slurmd, each in its own network and mount namespace"
}

wait_idle() {
    local deadline=$((SECONDS + UP_TIMEOUT)) states
    export SLURM_CONF=$MN_CONF_DIR/slurm.conf
    while ((SECONDS < deadline)); do
        states=$(sinfo --noheader --format '%n %t' 2>/dev/null || true)
        if [[ -n $states ]] && ! grep -qvE ' (idle|mix|alloc)$' <<<"$states"; then
            mn_say "all $MN_NODES nodes idle; SLURM_CONF=$SLURM_CONF (see $MN_ENV)"
            return 0
        fi
        sleep 0.5
    done
    mn_die "nodes not idle within ${UP_TIMEOUT}s: ${states//$'\n'/, }; see $MN_LOG_DIR"
}

main() {
    require_root
    mn_close_inherited_fds
    mn_lock
    install_packages
    MN_LOCK_HELD=1 "$MN_HERE/down.sh" --quiet
    check_inputs
    record_settings
    # From here on, a failure leaves parts behind: take them down again.
    trap undo_on_failure EXIT
    make_network
    start_munge
    write_configs
    start_storage
    start_slurmctld
    start_nodes
    wait_idle
    if [[ $MN_PRESTAGE == 1 ]]; then
        MN_LOCK_HELD=1 "$MN_HERE/planner.sh" start
    fi
    UP_DONE=1
}

UP_DONE=0
undo_on_failure() {
    ((UP_DONE)) && return 0
    mn_say "failed; taking down what was started (logs kept in $MN_LOG_DIR)"
    MN_LOCK_HELD=1 MN_KEEP_LOGS=1 "$MN_HERE/down.sh" --quiet || true
}

main "$@"
