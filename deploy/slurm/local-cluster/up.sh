#!/usr/bin/env bash
# Bring up a real one-node SLURM cluster on this Debian machine, wired with stager's
# prolog, epilog and task prolog, for tests and demos. Run as root.
#
# Idempotent and quick when already up: packages are installed only when missing,
# config files are rewritten only when their content changed (and only then are the
# SLURM daemons restarted), daemons are started only when not running.
#
# Environment:
#   STAGER_BIN_DIR   where `stager` lives (default: this checkout's .venv/bin)
#   STAGER_*         any key of deploy/slurm/slurm.env, to override it in
#                    /etc/stager/slurm.env (e.g. STAGER_EPILOG_STOP=1)
#   SLURM_UP_TIMEOUT seconds to wait for the node to become idle (default 90)
#
# Writes /etc/slurm/slurm.conf, /etc/slurm/cgroup.conf, /etc/stager/slurm.env;
# logs in /var/log/slurm/; stop it with down.sh.
set -euo pipefail

HERE=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
SLURM_DIR=$(cd "$HERE/.." && pwd)
REPO=$(cd "$SLURM_DIR/../.." && pwd)
STAGER_BIN_DIR=${STAGER_BIN_DIR:-$REPO/.venv/bin}
UP_TIMEOUT=${SLURM_UP_TIMEOUT:-90}
SLURM_CONF_DIR=/etc/slurm
STAGER_CONF=/etc/stager/slurm.env
PACKAGES=(slurm-wlm munge curl util-linux)

say() { printf 'up.sh: %s\n' "$*"; }
die() {
    printf 'up.sh: %s\n' "$*" >&2
    exit 1
}

require_root() {
    [[ $(id -u) == 0 ]] || die "run as root: it installs packages and starts slurmctld, slurmd and munged"
    command -v apt-get >/dev/null || die "needs a Debian-like system with apt-get (Debian's slurm-wlm)"
}

install_packages() {
    local missing=0 tool
    for tool in slurmctld slurmd sbatch scontrol munged mungekey curl setpriv; do
        command -v "$tool" >/dev/null || missing=1
    done
    ((missing)) || return 0
    say "installing ${PACKAGES[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Fresh machines have empty package lists; refresh only when needed (once).
    if ! compgen -G '/var/lib/apt/lists/*_Packages' >/dev/null; then
        apt-get update -qq
    fi
    if ! apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
    fi
}

# pid file -> running? (never matches processes by name: ours are known by pid file)
running() {
    local pidfile=$1 pid
    [[ -r $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null
}

stop_pidfile() {
    local pidfile=$1 name=$2 pid
    running "$pidfile" || return 0
    pid=$(<"$pidfile")
    say "stopping $name (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 150); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    die "$name (pid $pid) did not stop within 30s"
}

start_munge() {
    [[ -s /etc/munge/munge.key ]] || mungekey -c -f -k /etc/munge/munge.key
    install -d -m 0755 /run/munge /var/log/munge /var/lib/munge
    if ! running /run/munge/munged.pid; then
        say "starting munged"
        # --force: run although root starts it and the key's owner is the munge user.
        munged --force
    fi
    munge -n | unmunge >/dev/null || die "munge does not work; see /var/log/munge/munged.log"
}

# Write $2 to $1 if it differs; sets CHANGED=1 when it wrote.
write_if_changed() {
    local path=$1 content=$2
    if [[ -f $path && $(<"$path") == "$content" ]]; then
        return 0
    fi
    mkdir -p "$(dirname "$path")"
    printf '%s\n' "$content" >"$path.tmp"
    mv "$path.tmp" "$path"
    say "wrote $path"
    CHANGED=1
}

render_slurm_conf() {
    local host node_line real_mem cpus def_mem
    host=$(hostname -s)
    # slurmd -C measures this machine: CPUs, sockets/cores/threads and RealMemory.
    node_line=$(slurmd -C | head -n 1)
    [[ $node_line == NodeName=* ]] || die "slurmd -C printed '$node_line', not a node line"
    node_line="NodeName=$host ${node_line#NodeName=* }"
    cpus=$(grep -o 'CPUs=[0-9]*' <<<"$node_line" | cut -d= -f2)
    real_mem=$(grep -o 'RealMemory=[0-9]*' <<<"$node_line" | cut -d= -f2)
    # A job without --mem gets at most half a CPU's share, so two jobs fit at once.
    def_mem=$((real_mem / cpus / 2))
    if ((def_mem > 4096)); then def_mem=4096; fi
    sed -e "s|@HOSTNAME@|$host|g" -e "s|@NODE_LINE@|$node_line|g" \
        -e "s|@DEF_MEM_PER_CPU@|$def_mem|g" -e "s|@SLURM_DIR@|$SLURM_DIR|g" \
        "$HERE/slurm.conf.in"
}

# deploy/slurm/slurm.env with STAGER_BIN_DIR and any STAGER_* from the environment.
render_stager_env() {
    local line key
    while IFS= read -r line; do
        key=${line%%=*}
        if [[ $line =~ ^STAGER_[A-Z_]+= ]]; then
            if [[ $key == STAGER_BIN_DIR ]]; then
                line="STAGER_BIN_DIR=$STAGER_BIN_DIR"
            elif [[ -n ${!key+set} ]]; then
                # The file is sourced by bash: quote, so values with spaces survive.
                line="$key=$(printf '%q' "${!key}")"
            fi
        fi
        printf '%s\n' "$line"
    done <"$SLURM_DIR/slurm.env"
}

configure() {
    CHANGED=0
    [[ -x $STAGER_BIN_DIR/stager ]] ||
        say "warning: no $STAGER_BIN_DIR/stager yet (run \`make venv\`); jobs will start without a daemon"
    install -d -m 0755 /var/lib/slurm/slurmd /var/lib/slurm/slurmctld /var/log/slurm
    write_if_changed "$SLURM_CONF_DIR/slurm.conf" "$(render_slurm_conf)"
    write_if_changed "$SLURM_CONF_DIR/cgroup.conf" "$(<"$HERE/cgroup.conf.in")"
    # The stager file is read by every prolog run: a change needs no restart.
    local before=$CHANGED
    write_if_changed "$STAGER_CONF" "$(render_stager_env)"
    chmod 0644 "$STAGER_CONF"
    CHANGED=$before
}

start_slurm() {
    if ((CHANGED)); then
        stop_pidfile /run/slurmd.pid slurmd
        stop_pidfile /run/slurmctld.pid slurmctld
    fi
    if ! running /run/slurmctld.pid; then
        say "starting slurmctld"
        slurmctld
    fi
    if ! running /run/slurmd.pid; then
        say "starting slurmd"
        slurmd
    fi
}

wait_idle() {
    local host state deadline
    host=$(hostname -s)
    deadline=$((SECONDS + UP_TIMEOUT))
    while ((SECONDS < deadline)); do
        state=$(sinfo --noheader --nodes "$host" --format %t 2>/dev/null || true)
        case $state in
            idle | mix | alloc)
                say "node $host is $state; SLURM is up (sinfo, sbatch, squeue are ready)"
                return 0
                ;;
            drain* | drng | down*)
                # Left over from an earlier run (a failed prolog, a restart): clear it.
                scontrol update NodeName="$host" State=RESUME 2>/dev/null || true
                ;;
        esac
        sleep 1
    done
    die "node $host did not become idle within ${UP_TIMEOUT}s (state '${state:-none}'); see /var/log/slurm/slurmd.log and slurmctld.log"
}

# SLURM hands jobs their node names (SLURM_STEP_NODELIST) and DDP rendezvous on the
# first one, so this host's name must resolve; fresh CI machines sometimes lack it.
ensure_hostname_resolves() {
    local host
    host=$(hostname -s)
    getent hosts "$host" >/dev/null && return 0
    say "adding '127.0.1.1 $host' to /etc/hosts: the host name did not resolve"
    printf '127.0.1.1\t%s\n' "$host" >>/etc/hosts
}

main() {
    require_root
    ensure_hostname_resolves
    install_packages
    start_munge
    configure
    start_slurm
    wait_idle
}

main "$@"
