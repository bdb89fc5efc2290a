#!/usr/bin/env bash
# SLURM Epilog (slurm.conf: Epilog=). Runs as root on every node of the job when it
# ends, with SLURM_JOB_ID, SLURM_JOB_USER, SLURM_JOB_UID in the environment.
#
# 1. releases every lease the job holds on this node's daemon (holder
#    slurm-job-$SLURM_JOB_ID), so its datasets become evictable again at once
#    instead of when the daemon's sweep notices the job is gone;
# 2. removes the job's $SLURM_TMPDIR (only the links into the cache live there; the
#    staged data stays cached for the next job);
# 3. drops what a multi-node staging (--peers slurm, docs/multinode.md) of the job
#    left in the cache: deliveries not adopted, packed copies not removed (a job
#    killed mid-broadcast); the daemon would expire them within the hour;
# 4. with STAGER_EPILOG_STOP=1, stops the daemon the prolog started once no other
#    job of the user runs on the node.
#
# Exits 0 on every stager problem (logged): a failing epilog drains the node.
set -Eeuo pipefail  # -E: the ERR trap also fires inside functions

SCRIPT_NAME=epilog
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/common.sh"

# shellcheck disable=SC2317  # called by the ERR trap
on_error() {
    log "failed at line $1 (exit $2)"
    exit 0
}
trap 'on_error $LINENO $?' ERR

release_leases() {
    if [[ -z $STAGER_SOCKET ]]; then
        log "STAGER_URL $JOB_URL is not a Unix socket; leases of $HOLDER end with the daemon's sweep"
        return 0
    fi
    if [[ ! -S $STAGER_SOCKET ]]; then
        log "no daemon socket at $STAGER_SOCKET; nothing to release"
        return 0
    fi
    local reply code body
    if ! reply=$(daemon_request DELETE "/v1/leases?holder=$HOLDER" 2>&1); then
        log "releasing leases of $HOLDER failed: ${reply//$'\n'/ | }"
        return 0
    fi
    code=${reply##*$'\n'}
    body=${reply%$'\n'*}
    if [[ $code != 200 ]]; then
        log "releasing leases of $HOLDER: HTTP $code: $body"
        return 0
    fi
    # The reply is a JSON list of the released leases; count them by their ids.
    local count
    count=$(grep -o '"id"' <<<"$body" | wc -l || true)
    log "released $count lease(s) of $HOLDER"
}

# Deliveries and exports are folders named job<id>-<key> under the cache's incoming/
# and outgoing/; the daemon releases them (and frees their room in its admission).
drop_broadcast_leftovers() {
    [[ -n $STAGER_SOCKET && -S $STAGER_SOCKET ]] || return 0
    local folder kind label reply code
    for folder in "$CACHE_DIR/incoming/job$JOB_ID"-* "$CACHE_DIR/outgoing/job$JOB_ID"-*; do
        [[ -d $folder ]] || continue
        label=$(basename "$folder")
        kind=incoming
        [[ $folder == "$CACHE_DIR"/outgoing/* ]] && kind=exports
        reply=$(daemon_request DELETE "/v1/$kind/$label" 2>&1) || true
        code=${reply##*$'\n'}
        if [[ $code == 404 ]]; then
            # Unknown to the daemon (it restarted): nothing will adopt it.
            rm -rf --one-file-system -- "$folder"
        fi
        log "dropped broadcast leftover $folder (HTTP ${code:-?})"
    done
}

remove_job_tmpdir() {
    [[ -n $JOB_TMPDIR ]] || return 0
    # Guard against a pattern that expands to something that is not per-job.
    if [[ $JOB_TMPDIR != *"$JOB_ID"* || $JOB_TMPDIR == / ]]; then
        log "not removing $JOB_TMPDIR: STAGER_SLURM_TMPDIR must contain %j"
        return 0
    fi
    if [[ -e $JOB_TMPDIR ]]; then
        # --one-file-system: a bind mount a job left behind is not ours to empty. Links
        # into the cache are removed, never followed.
        rm -rf --one-file-system -- "$JOB_TMPDIR"
        log "removed SLURM_TMPDIR $JOB_TMPDIR"
    fi
}

maybe_stop_daemon() {
    [[ $STAGER_EPILOG_STOP == 1 ]] || return 0
    local others
    others=$(find "$USER_STATE/jobs" -mindepth 1 -maxdepth 1 | wc -l)
    if ((others > 0)); then
        log "keeping the daemon: $others other job(s) of $JOB_USER on this node"
        return 0
    fi
    if [[ ! -e $USER_STATE/started-by-prolog ]]; then
        log "keeping the daemon: the prolog did not start it"
        return 0
    fi
    local stager output
    stager=$(stager_bin stager) || true
    if [[ -z $stager || ! -x $stager ]]; then
        log "cannot stop the daemon: no stager executable (STAGER_BIN_DIR=${STAGER_BIN_DIR:-unset})"
        return 0
    fi
    if output=$(as_job_user timeout 60 "$stager" stop --runtime-dir "$RUNTIME_DIR" 2>&1 {LOCK_FD}>&-); then
        rm -f "$USER_STATE/started-by-prolog"
        log "stopped daemon (STAGER_EPILOG_STOP=1, last job of $JOB_USER here): $output"
    else
        log "stopping the daemon failed: ${output//$'\n'/ | }"
    fi
}

main() {
    load_config
    load_job
    lock_user
    rm -f "$USER_STATE/jobs/$JOB_ID"
    release_leases
    drop_broadcast_leftovers
    remove_job_tmpdir
    maybe_stop_daemon
    log "finished"
}

main "$@"
exit 0
