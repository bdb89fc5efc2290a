#!/usr/bin/env bash
# One node of the multi-node test cluster: run by up.sh inside the node's own mount
# namespace (private propagation) and network namespace. Gives the node what a real
# compute node has, then starts its slurmd:
#
#   /tmp           its own local disk (a tmpfs of MN_LOCAL_SIZE): caches, sbcast files
#   $MN_SHARED     the shared storage, mounted over the network (sshfs to the storage
#                  namespace, through the rate-limited link)
#   /etc/slurm, /etc/stager, /etc/hosts, /run/munge   this cluster's, not the host's
#
# The storage folder itself is hidden under an empty mount: a node reads shared data
# only over the network, as on a real cluster.
set -euo pipefail

MN_SCRIPT=node.sh
# shellcheck source=lib.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh"
mn_load_recorded

index=${1:?usage: node.sh INDEX}
name=$(mn_node_name "$index")

mount -t tmpfs -o "size=$MN_LOCAL_SIZE,mode=1777" "local-$name" /tmp
mount -t tmpfs -o size=64m,mode=0755 "private-$name" "$MN_PRIVATE"
mount --bind "$MN_CONF_DIR" /etc/slurm
mount --bind "$MN_STAGER_ETC" /etc/stager
mount --bind "$MN_ROOT/etc/hosts" /etc/hosts
mount --bind "$MN_MUNGE_DIR" /run/munge
mount -t tmpfs -o size=1m,mode=0755,ro "hidden-storage" "$MN_STORAGE_DIR"

# directport: sftp straight to the storage's sftp-server, no ssh (and no crypto on
# these 2 cores). max_conns: parallel readers get parallel connections, like NFS.
sshfs -o "directport=$MN_SFTP_PORT,ro,allow_other,max_conns=4" \
    "$(mn_storage_addr):$MN_STORAGE_DIR" "$MN_SHARED"

if [[ ${MN_NODE_SERVICE:-0} == 1 ]]; then
    mn_start_node_service "$index"
fi

exec slurmd -f "$MN_CONF_DIR/slurm.conf" -N "$name"
