#!/usr/bin/env bash
# SLURM TaskProlog (slurm.conf: TaskProlog=). Runs as the job's user before every
# task, the batch script included; each `export NAME=VALUE` line it prints is set in
# the task's environment. It tells jobs where their scratch and their daemon are:
#
#   SLURM_TMPDIR  the per-job node-local folder the prolog made
#   STAGER_URL    the daemon the prolog started, so `stager-client` finds it even
#                 when the submitting shell's XDG_RUNTIME_DIR (which sbatch exports)
#                 points somewhere that does not exist on the compute node
#
# Nothing else goes to stdout: slurmstepd reads it as commands.
set -euo pipefail

SCRIPT_NAME=task-prolog
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/common.sh"

main() {
    load_config
    load_job
    if [[ -n $JOB_TMPDIR && -d $JOB_TMPDIR ]]; then
        printf 'export SLURM_TMPDIR=%s\n' "$JOB_TMPDIR"
    fi
    printf 'export STAGER_URL=%s\n' "$JOB_URL"
}

# A broken task prolog must not break the task: say nothing and let the job run.
main "$@" 2>/dev/null || true
