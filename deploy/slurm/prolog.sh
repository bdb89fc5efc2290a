#!/usr/bin/env bash
# SLURM Prolog (slurm.conf: Prolog=, with PrologFlags=Alloc so it runs on every node
# of the allocation before the batch script). Runs as root (SlurmdUser) with
# SLURM_JOB_ID, SLURM_JOB_USER, SLURM_JOB_UID in the environment.
#
# 1. makes the job's node-local $SLURM_TMPDIR, owned by the user (if configured);
# 2. starts the user's stager daemon on this node unless one already answers;
# 3. records the job so the epilog knows when the user's last job here has ended.
#
# It always exits 0: a non-zero prolog drains the node and requeues the job, which
# is far worse than a job that starts without stager (the job's own `stager-client`
# call then fails with a sentence saying the daemon is unreachable). Every failure
# is logged to STAGER_SLURM_LOG instead.
set -Eeuo pipefail  # -E: the ERR trap also fires inside functions

SCRIPT_NAME=prolog
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/common.sh"

# shellcheck disable=SC2317  # called by the ERR trap
on_error() {
    log "failed at line $1 (exit $2); the job starts without stager's help"
    exit 0
}
trap 'on_error $LINENO $?' ERR

make_job_tmpdir() {
    [[ -n $JOB_TMPDIR ]] || return 0
    make_user_dir "$JOB_TMPDIR" 0700
    log "made SLURM_TMPDIR $JOB_TMPDIR"
}

start_daemon() {
    if [[ $NODE_SERVICE == 1 ]]; then
        log "the node service at $STAGER_NODE_SOCKET serves this job: no daemon of the user's own"
        return 0
    fi
    if [[ $STAGER_SLURM_START != 1 ]]; then
        log "STAGER_SLURM_START=$STAGER_SLURM_START: not starting a daemon (using $JOB_URL)"
        return 0
    fi
    local stager
    stager=$(stager_bin stager) || true
    if [[ -z $stager || ! -x $stager ]]; then
        log "no stager executable (STAGER_BIN_DIR=${STAGER_BIN_DIR:-unset}); set STAGER_BIN_DIR in $STAGER_SLURM_CONFIG"
        return 0
    fi
    local why
    why=$(why_user_cannot_run "$stager")
    if [[ -n $why ]]; then
        log "not starting the daemon: $why"
        return 0
    fi
    make_user_dir "$RUNTIME_DIR" 0700
    make_user_dir "$CACHE_DIR" 0700
    local -a serve_args
    read -r -a serve_args <<<"$STAGER_SLURM_SERVE_ARGS"
    local output
    # `serve --detach` is idempotent: with a healthy daemon it only says so. Its
    # answer tells which case this was, for the bookkeeping the epilog relies on.
    # The lock's descriptor is closed so the daemon cannot hold the lock forever.
    if ! output=$(as_job_user timeout 90 "$stager" serve --detach \
        --runtime-dir "$RUNTIME_DIR" --cache-dir "$CACHE_DIR" \
        "${serve_args[@]}" 2>&1 {LOCK_FD}>&-); then
        log "could not start the daemon: ${output//$'\n'/ | }"
        return 0
    fi
    case $output in
        *"already running"*)
            log "daemon already running: $output"
            ;;
        *)
            touch "$USER_STATE/started-by-prolog"
            log "started daemon: $output"
            ;;
    esac
}

main() {
    load_config
    load_job
    lock_user
    touch "$USER_STATE/jobs/$JOB_ID"
    make_job_tmpdir
    start_daemon
}

main "$@"
exit 0
