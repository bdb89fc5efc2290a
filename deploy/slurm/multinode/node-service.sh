#!/usr/bin/env bash
# Stop or start node N's node service (MN_NODE_SERVICE=1), as an admin's systemctl
# would: for the tests that prove a job never waits on it (docs/prestaging.md).
#
#   node-service.sh N stop | start
set -euo pipefail

MN_SCRIPT=node-service.sh
# shellcheck source=lib.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh"
mn_load_recorded

inside=0
if [[ ${1:-} == --inside ]]; then
    inside=1
    shift
fi
index=${1:?usage: node-service.sh N stop|start}
action=${2:?usage: node-service.sh N stop|start}
[[ ${MN_NODE_SERVICE:-0} == 1 ]] || mn_die "the cluster runs no node services (MN_NODE_SERVICE=0)"
# Run again inside the node's namespaces: its /tmp (the cache), its private runtime
# folder. (The namespace's file is a plain file from inside, so say so instead.)
if ((!inside)); then
    exec "$MN_HERE/on-node.sh" "$index" "$MN_HERE/node-service.sh" --inside "$index" "$action"
fi
case $action in
stop) "$MN_BIN_DIR/stager" stop --multi-user --runtime-dir "$MN_NODE_RUN" ;;
start) mn_start_node_service "$index" ;;
*) mn_die "usage: node-service.sh N stop|start" ;;
esac
