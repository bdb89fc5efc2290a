#!/usr/bin/env bash
# The multi-node test cluster's pre-staging planner (`stager plan`, docs/prestaging.md),
# as deploy/systemd/stager-plan.service runs it on a controller: root (this cluster's
# SlurmUser), in the root namespace beside slurmctld, with the cluster's SLURM_CONF and
# munged, one interval per backfill interval (MN_PLAN_INTERVAL), its orders sent to
# each node's address. Only on a cluster brought up with MN_PRESTAGE=1.
#
#   planner.sh start | stop | restart | status
#
# Its log: $MN_ROOT/log/planner.log; its pid: $MN_ROOT/run/planner.pid. down.sh stops it.
set -euo pipefail

MN_SCRIPT=planner.sh
# shellcheck source=lib.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh"
mn_load_recorded

PIDFILE=$MN_RUN_DIR/planner.pid

node_addresses() {
    local i out=()
    for i in $(seq "$MN_NODES"); do
        out+=("$(mn_node_name "$i")=$(mn_node_addr "$i"):$MN_PREFETCH_PORT")
    done
    (IFS=,; printf '%s\n' "${out[*]}")
}

start() {
    [[ ${MN_PRESTAGE:-0} == 1 ]] || mn_die "the cluster was brought up without MN_PRESTAGE=1"
    if running "$PIDFILE"; then
        mn_say "the planner runs already (pid $(<"$PIDFILE"))"
        return 0
    fi
    mn_close_inherited_fds
    # setsid: not in the caller's process group (a test's Ctrl-C, a shell's exit).
    SLURM_CONF=$MN_CONF_DIR/slurm.conf \
        STAGER_MUNGE_SOCKET=$MN_MUNGE_DIR/munge.socket.2 \
        STAGER_PLAN_INTERVAL=$MN_PLAN_INTERVAL \
        STAGER_PLAN_NODE_ADDRESSES=$(node_addresses) \
        setsid "$MN_BIN_DIR/stager" plan </dev/null >>"$MN_LOG_DIR/planner.log" 2>&1 &
    echo $! >"$PIDFILE"
    sleep 0.5
    running "$PIDFILE" || mn_die "the planner exited at once; see $MN_LOG_DIR/planner.log"
    mn_say "planner started (pid $(<"$PIDFILE")), every ${MN_PLAN_INTERVAL}s; log $MN_LOG_DIR/planner.log"
}

stop() {
    mn_stop_pidfile "$PIDFILE"
    rm -f "$PIDFILE"
}

case ${1:-} in
start) start ;;
stop) stop ;;
restart) stop && start ;;
status) running "$PIDFILE" && echo "running $(<"$PIDFILE")" || echo stopped ;;
*) mn_die "usage: planner.sh start|stop|restart|status" ;;
esac
