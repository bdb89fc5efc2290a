#!/bin/bash
# Train on iNaturalist 2021 read from node-local disk, staged by stager.
#
# What seeds/000's job.sh and data.py did by hand (link the archives, rename them,
# let torchvision extract) is one `stager-client stage` per node here: the node's
# daemon extracts into its cache (once: later jobs on the node get a cache hit),
# links the result at $SLURM_TMPDIR/data/$DATASET and pins it with a lease until
# the job ends.
#
#   sbatch deploy/slurm/job.sh
#   INAT_SOURCE=/my/inat ARCH=resnet18 EPOCHS=1 sbatch deploy/slurm/job.sh
#   sbatch --gpus-per-task=0 --cpus-per-task=2 deploy/slurm/job.sh   # CPU only
#
# Time limits and preemption: SLURM sends this script SIGUSR1 two minutes before the
# time limit (--signal=B:USR1@120); SIGTERM comes with a preemption, a time limit
# reached without warning, or scancel. The script passes the signal on to the training
# step; every rank stops at the same step, rank 0 writes one checkpoint, and the step
# exits 75. After SIGUSR1, a time limit or a preemption the job requeues itself
# (scontrol requeue; a plain scancel is left cancelled), and the requeued job runs this
# script again: the data is a cache hit, and --resume continues from the latest
# complete checkpoint in $OUTPUT_DIR. `scancel --signal=USR1 --batch JOBID` asks a
# running job to checkpoint and requeue by hand. srun exits with the ranks' code (75);
# a script that launches torchrun instead gets torchrun's 1 and runs
# `stager-train exit-status --output-dir "$OUTPUT_DIR" --launcher-exit $?` after it for the
# run's own code (docs/trainer.md, "Exit codes"): rank 0 records it in
# $OUTPUT_DIR/exit-status.json under $STAGER_TRAIN_RUN_ID, set below.
#
# Settings (environment; sbatch passes the submitting shell's environment on):
#   INAT_SOURCE  folder with train.tar.gz, val.tar.gz (default /network/datasets/inat)
#   DATASET      the dataset's name on the node (default inat2021)
#   ARCH EPOCHS BATCH_SIZE DEVICE   stager-train's --arch --epochs --batch-size --device
#   OUTPUT_DIR   checkpoints and logs (default $SLURM_SUBMIT_DIR/runs/$SLURM_JOB_ID)
#   TRAIN_ARGS   more stager-train flags, e.g. "--crop-size 160 --amp bf16"
#   STAGE_ARGS   more stager-client stage flags, e.g. "--param splits=[\"2021_train_mini\"]"
#   FANOUT       1 (default): a multi-node job reads the shared storage once (sbcast);
#                0: every node stages from the storage itself
#   STAGER_VENV  a virtualenv to activate that has stager installed
#
#SBATCH --job-name=inat-stager
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=4
#SBATCH --mem=32G
#SBATCH --time=01:30:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail

# Signals that arrive before training starts are remembered and acted on after staging.
interrupted=
train_pid=
# shellcheck disable=SC2317  # called by the traps
on_signal() {
    interrupted=$1
    echo "$(date '+%F %T') got SIG$1: asking training to checkpoint and stop"
    if [[ -n $train_pid ]]; then
        # srun passes the signal on to every task of the step.
        kill -s "$1" "$train_pid" 2>/dev/null || true
    fi
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

# Requeue after the warning signal, a time limit or a preemption, not after a
# plain scancel (which leaves the job COMPLETING for reason None).
requeue_if_asked() {
    local info
    info=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null || true)
    if [[ $interrupted == USR1 ]] || grep -qE 'Reason=(TimeLimit|Preempt)|JobState=(TIMEOUT|PREEMPTED)' <<<"$info"; then
        echo "$(date '+%F %T') requeueing job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0})"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
}

echo "Date:     $(date) (restart ${SLURM_RESTART_COUNT:-0})"
echo "Hostname: $(hostname)"
echo "Nodes:    ${SLURM_JOB_NODELIST:-?} (${SLURM_NTASKS:-?} tasks)"

if [[ -n ${STAGER_VENV:-} ]]; then
    # shellcheck source=/dev/null
    source "$STAGER_VENV/bin/activate"
fi
# Exit 5, as stager-client does when it cannot reach a daemon: stager cannot serve this
# job. A program whose interpreter users cannot execute (a Python in root's home) would
# otherwise fail with the shell's 126 and a bare "Permission denied".
for tool in stager stager-client stager-train; do
    if ! path=$(command -v "$tool"); then
        echo "error: $tool is not on PATH; activate the environment stager is installed in," \
            "or set STAGER_VENV" >&2
        exit 2
    fi
    interpreter=
    IFS= read -r first <"$path" 2>/dev/null || first=
    if [[ $first == '#!'* ]]; then
        read -r interpreter _ <<<"${first#\#!}"
    fi
    if [[ ! -x $path || (-n $interpreter && ! -x $interpreter) ]]; then
        what=$path${interpreter:+ (its interpreter: $interpreter)}
        echo "error: $(id -un) cannot execute $what: a folder above it is closed to users;" \
            "ask your admins to reinstall stager with deploy/install.sh, which picks an" \
            "interpreter every user can run" >&2
        exit 5
    fi
done

export INAT_SOURCE=${INAT_SOURCE:-/network/datasets/inat}
export DATASET=${DATASET:-inat2021}
ARCH=${ARCH:-resnet50}
EPOCHS=${EPOCHS:-10}
BATCH_SIZE=${BATCH_SIZE:-64}
DEVICE=${DEVICE:-auto}
OUTPUT_DIR=${OUTPUT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/runs/$SLURM_JOB_ID}
# Names this launch's record in $OUTPUT_DIR/exit-status.json: one per launch, so set here
# (a value from the submitting shell would be the same for every requeue).
export STAGER_TRAIN_RUN_ID=$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}
read -r -a train_args <<<"${TRAIN_ARGS:-}"
read -r -a stage_args <<<"${STAGE_ARGS:-}"
NODES=${SLURM_JOB_NUM_NODES:-1}
# Since Slurm 22.05 srun no longer inherits the job's --cpus-per-task: without this each
# task is given 1 CPU, and training's data-loader workers share it.
CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}

# The cluster's task prolog exports STAGER_URL when its prolog started a daemon on
# every node. Without it (a cluster without stager's prolog), start one per node
# ourselves: `serve --detach` returns at once if one already runs.
if [[ -z ${STAGER_URL:-} ]]; then
    echo "No STAGER_URL from the cluster's prolog: starting a stager daemon on each node"
    srun --ntasks="$NODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_TASK" \
        stager serve --detach
fi
if [[ -z ${SLURM_TMPDIR:-} ]]; then
    echo "error: SLURM_TMPDIR is not set: this cluster gives jobs no node-local folder;" \
        "ask your admins, or see deploy/slurm/README.md" >&2
    exit 2
fi

# Stage on every node. On more than one node, one command in this script does it while
# the shared storage is read once: one node stages (or already holds) the data and
# SLURM's sbcast sends it to the others (docs/multinode.md; FANOUT=0 turns it off).
# $SLURM_TMPDIR is the same path on every node of a job, so the link is too. --lease
# pins the data for this job; the epilog releases it.
echo "Staging $DATASET from $INAT_SOURCE on $NODES node(s)"
# The link's fallback, on every node: a requeued job keeps its job id, so it asks for
# the same link again after the epilog removed it; the daemon may consider that link
# made already. $1: the staged path (the same on every node: same cache path and key).
# shellcheck disable=SC2016  # expanded by the task's bash, on purpose
ensure_link='
    link=$SLURM_TMPDIR/data/$DATASET
    if [[ ! -e $link ]]; then
        mkdir -p "$(dirname "$link")"
        ln -sfn "$1" "$link"
    fi
    echo "$(hostname -s): $link -> $(readlink "$link")"'
if ((NODES > 1)) && [[ ${FANOUT:-1} == 1 ]]; then
    path=$(stager-client stage "$DATASET" --recipe inat2021 --source "$INAT_SOURCE" \
        --link "$SLURM_TMPDIR/data/$DATASET" --lease "slurm-job-$SLURM_JOB_ID" \
        --peers slurm "${stage_args[@]}")
    srun --ntasks="$NODES" --ntasks-per-node=1 bash -c "set -euo pipefail; $ensure_link" link "$path"
else
    # One task per node. The single quotes matter: $SLURM_TMPDIR must be expanded on
    # each node, not here on the first one (seeds/000's data.py makes the same point).
    # shellcheck disable=SC2016  # expanded by the task's bash, on purpose
    srun --ntasks="$NODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_TASK" bash -c '
        set -euo pipefail
        path=$(stager-client stage "$DATASET" --recipe inat2021 --source "$INAT_SOURCE" \
            --link "$SLURM_TMPDIR/data/$DATASET" --lease "slurm-job-$SLURM_JOB_ID" \
            --wait --progress log "$@")
        echo "$path"
        set -- "$path"'"$ensure_link" stage "${stage_args[@]}"
fi

if [[ -n $interrupted ]]; then
    requeue_if_asked
    exit 1
fi

# One training process per task; stager-train reads its rank from srun's variables.
# --resume: the latest complete checkpoint in $OUTPUT_DIR, if any (a requeued job).
# In the background, so that this script can pass signals on while it waits.
# shellcheck disable=SC2016  # as above: each task expands its own $SLURM_TMPDIR
srun --cpus-per-task="$CPUS_PER_TASK" \
    bash -c 'exec stager-train --data-root "$SLURM_TMPDIR/data/$DATASET" "$@"' train \
    --dataset inat2021 \
    --arch "$ARCH" \
    --epochs "$EPOCHS" \
    --batch-size "$BATCH_SIZE" \
    --device "$DEVICE" \
    --output-dir "$OUTPUT_DIR" \
    --resume \
    --no-requeue \
    "${train_args[@]}" &
train_pid=$!
status=0
while :; do
    wait "$train_pid" && status=0 || status=$?
    # A trapped signal ends `wait` early; keep waiting while the step still runs.
    kill -0 "$train_pid" 2>/dev/null || break
done
if [[ $status == 75 ]]; then
    echo "$(date '+%F %T') training stopped at a checkpoint"
    requeue_if_asked
fi
echo "Done: $(date) (exit $status)"
exit "$status"
