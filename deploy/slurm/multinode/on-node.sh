#!/usr/bin/env bash
# Run a command on node N of the multi-node test cluster: inside its mount namespace
# (its own /tmp, the shared storage at $MN_SHARED) and its network namespace.
#
#   deploy/slurm/multinode/on-node.sh 2 ls /tmp/stager-0/cache/data
set -euo pipefail

MN_SCRIPT=on-node.sh
# shellcheck source=lib.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh"
mn_load_recorded

index=${1:?usage: on-node.sh N COMMAND [ARG...]}
shift
[[ -e $MN_NS_DIR/mnt$index ]] || mn_die "node $index is not up (no $MN_NS_DIR/mnt$index); run up.sh"
exec nsenter --mount="$MN_NS_DIR/mnt$index" --net="/run/netns/$(mn_node_ns "$index")" -- "$@"
