# shellcheck shell=bash
# shellcheck disable=SC2034  # the variables set here are read by the scripts that source this file
# Shared by prolog.sh, epilog.sh and task-prolog.sh: configuration, per-job paths,
# logging, and running commands as the job's user. Sourced, never executed.

STAGER_SLURM_CONFIG=${STAGER_SLURM_CONFIG:-/etc/stager/slurm.env}

# Defaults match deploy/slurm/slurm.env, so a node without the file still works.
load_config() {
    STAGER_BIN_DIR=
    STAGER_SLURM_START=1
    STAGER_SLURM_RUNTIME_DIR=/tmp/stager-%U
    STAGER_SLURM_CACHE_DIR=/tmp/stager-%U/cache
    STAGER_SLURM_SERVE_ARGS=
    STAGER_SLURM_URL=
    STAGER_NODE_SOCKET=/run/stager/stager.sock
    STAGER_SLURM_TMPDIR=/tmp/slurm-%j
    STAGER_EPILOG_STOP=0
    STAGER_SLURM_LOG=/var/log/stager-slurm.log
    STAGER_SLURM_STATE_DIR=/run/stager-slurm
    if [[ -r $STAGER_SLURM_CONFIG ]]; then
        # shellcheck source=slurm.env
        source "$STAGER_SLURM_CONFIG"
    fi
}

# The job's identity, from the variables slurmd gives prologs and epilogs.
load_job() {
    JOB_ID=${SLURM_JOB_ID:?SLURM_JOB_ID is not set; run this as a SLURM prolog/epilog}
    JOB_USER=${SLURM_JOB_USER:-$(id -un)}
    JOB_UID=${SLURM_JOB_UID:-$(id -u "$JOB_USER")}
    JOB_GID=${SLURM_JOB_GID:-$(id -g "$JOB_USER")}
    RUNTIME_DIR=$(expand_pattern "$STAGER_SLURM_RUNTIME_DIR")
    CACHE_DIR=$(expand_pattern "$STAGER_SLURM_CACHE_DIR")
    JOB_TMPDIR=$(expand_pattern "$STAGER_SLURM_TMPDIR")
    STAGER_SOCKET=
    NODE_SERVICE=0
    if [[ -n $STAGER_SLURM_URL ]]; then
        JOB_URL=$STAGER_SLURM_URL
    elif node_service_answers; then
        # The node service (stager serve --multi-user, as root) serves every user here.
        JOB_URL=unix://$STAGER_NODE_SOCKET
        NODE_SERVICE=1
    else
        JOB_URL=unix://$RUNTIME_DIR/stager.sock
    fi
    if [[ $JOB_URL == unix://* ]]; then
        STAGER_SOCKET=${JOB_URL#unix://}
    fi
    USER_STATE=$STAGER_SLURM_STATE_DIR/users/$JOB_UID
    HOLDER=slurm-job-$JOB_ID
}

# Whether the node service answers on its socket (a quick health check).
node_service_answers() {
    [[ -n $STAGER_NODE_SOCKET && -S $STAGER_NODE_SOCKET ]] || return 1
    curl --silent --max-time 5 --output /dev/null --fail \
        --unix-socket "$STAGER_NODE_SOCKET" http://stager/healthz 2>/dev/null
}

# %u user name, %U uid, %j job id: the same letters sbatch uses in --output.
expand_pattern() {
    local value=$1
    value=${value//%u/$JOB_USER}
    value=${value//%U/$JOB_UID}
    value=${value//%j/$JOB_ID}
    printf '%s\n' "$value"
}

# One line per action; the tests and admins read this file.
log() {
    local line
    line="$(date '+%Y-%m-%dT%H:%M:%S%z') $(hostname -s) ${SCRIPT_NAME:-stager-slurm} job=${JOB_ID:-?} user=${JOB_USER:-?}: $*"
    if ! { printf '%s\n' "$line" >>"$STAGER_SLURM_LOG"; } 2>/dev/null; then
        printf '%s\n' "$line" >&2
    fi
}

stager_bin() {
    if [[ -n $STAGER_BIN_DIR ]]; then
        printf '%s\n' "$STAGER_BIN_DIR/$1"
    else
        command -v "$1"
    fi
}

# Run a command as the job's user with a clean environment: the daemon outlives the
# job, so it must not inherit the prolog's variables or root's supplementary groups.
as_job_user() {
    local home
    home=$(getent passwd "$JOB_USER" | cut -d: -f6)
    local -a clean_env=(env -i -C / "PATH=/usr/local/bin:/usr/bin:/bin" "HOME=${home:-/}"
        "USER=$JOB_USER" "LOGNAME=$JOB_USER" "LANG=C.UTF-8")
    if [[ $(id -u) != 0 || $JOB_UID == 0 ]]; then
        "${clean_env[@]}" "$@"
    elif command -v setpriv >/dev/null; then
        setpriv --reuid "$JOB_UID" --regid "$JOB_GID" --init-groups -- "${clean_env[@]}" "$@"
    else
        runuser -u "$JOB_USER" -- "${clean_env[@]}" "$@"
    fi
}

# Why the job's user cannot execute the program $1, or nothing when they can. A script
# whose interpreter lies in a folder users cannot enter (a Python in root's home) fails
# with the shell's 126 and "Permission denied", naming neither.
why_user_cannot_run() {
    local program=$1 first interpreter
    if ! as_job_user test -x "$program"; then
        printf '%s cannot execute %s (its mode, or a folder above it)\n' "$JOB_USER" "$program"
        return 0
    fi
    IFS= read -r first <"$program" || return 0
    [[ $first == '#!'* ]] || return 0
    read -r interpreter _ <<<"${first#\#!}"
    if ! as_job_user test -x "$interpreter"; then
        printf '%s cannot execute %s: its interpreter %s is in a folder users cannot enter; reinstall stager with deploy/install.sh, which picks an interpreter every user can run\n' \
            "$JOB_USER" "$program" "$interpreter"
    fi
}

# A folder owned by the job's user; parents are made as root with default modes.
# Refuses a folder another user owns: they could read the socket or the data.
make_user_dir() {
    local dir=$1 mode=$2
    if [[ -e $dir ]]; then
        local owner
        owner=$(stat -c %u "$dir")
        if [[ $owner != "$JOB_UID" ]]; then
            log "$dir belongs to uid $owner, not $JOB_USER; remove it or change the pattern in $STAGER_SLURM_CONFIG"
            return 1
        fi
        chmod "$mode" "$dir"
    else
        mkdir -p "$(dirname "$dir")"
        install -d -m "$mode" -o "$JOB_UID" -g "$JOB_GID" "$dir"
    fi
}

# Serialise prologs and epilogs of one user on this node (two jobs starting at once
# must not start two daemons). The lock is released when the script exits.
lock_user() {
    mkdir -p "$USER_STATE/jobs"
    exec {LOCK_FD}>"$USER_STATE/lock"
    if ! flock -w 120 "$LOCK_FD"; then
        log "waited 120s for $USER_STATE/lock; going on without it"
    fi
}

# The daemon's HTTP API over its Unix socket, as root (root passes the 0700 folder).
daemon_request() {
    local method=$1 path=$2
    curl --silent --show-error --max-time 30 --unix-socket "$STAGER_SOCKET" \
        --request "$method" --write-out '\n%{http_code}' "http://stager$path"
}
