#!/usr/bin/env bash
# Restart the multi-node test cluster's slurmctld, keeping its state (jobs, plans are
# recomputed), as an admin's `systemctl restart slurmctld` would: for the tests that
# prove a restart never holds a job (docs/prestaging.md).
#
#   slurmctld.sh restart
set -euo pipefail

MN_SCRIPT=slurmctld.sh
# shellcheck source=lib.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh"
mn_load_recorded

[[ ${1:-} == restart ]] || mn_die "usage: slurmctld.sh restart"
export SLURM_CONF=$MN_CONF_DIR/slurm.conf
mn_stop_pidfile "$MN_RUN_DIR/slurmctld.pid"
mn_close_inherited_fds
slurmctld -f "$SLURM_CONF"
for _ in $(seq 100); do
    scontrol ping 2>/dev/null | grep -q UP && exit 0
    sleep 0.2
done
mn_die "slurmctld did not answer within 20 s of its restart; see $MN_LOG_DIR/slurmctld.log"
