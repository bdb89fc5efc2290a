"""``stager-train``: train (default), ``find-lr`` and ``shard``.

``stager-train --dataset fake ...`` trains; a first argument naming a
subcommand selects it. argparse subparsers would make the command mandatory,
so dispatch is done by hand on argv[0].

Exit codes: 0 done, 1 error (message on stderr), 2 bad usage, 75 preempted
(checkpoint saved; resume with --resume).
"""

from __future__ import annotations

import argparse
import logging
import sys

from trainer.data import DATASETS
from trainer.preempt import EXIT_PREEMPTED

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
__all__ = ["EXIT_ERROR", "EXIT_OK", "EXIT_PREEMPTED", "EXIT_USAGE", "main"]

SUBCOMMANDS = ("train", "find-lr", "shard")
EPILOG = """subcommands:
  stager-train [train] ...   train (this page)
  stager-train find-lr ...   LR range test: CSV + PNG + suggested LR (see find-lr --help)
  stager-train shard ...     write a dataset as shuffled webdataset tar shards (see shard --help)

launch: one process as is; torchrun --nproc-per-node N -m trainer ...; or under
SLURM `srun python -m trainer ...` (ranks from SLURM_PROCID/SLURM_LOCALID/
SLURM_STEP_NUM_TASKS, rendezvous on the step's first node, port from the job id).
exit codes: 0 done, 1 error, 2 usage, 75 preempted (checkpoint saved; rerun with --resume)."""


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--dataset",
        required=True,
        choices=DATASETS,
        help="dataset type (inat2021 is an alias of inat; multifolder: aligned views "
        "under DATA_ROOT/{train,val}/<view>/<class>/, see --views)",
    )
    g.add_argument(
        "--data-root",
        help="dataset root (as torchvision expects it); with "
        "--stager-wait, a relative path is taken inside the staged dataset",
    )
    g.add_argument(
        "--stager-wait",
        metavar="NAME",
        help="wait for the node's stager to report dataset NAME ready and read it "
        "from the staged path (local rank 0 waits, the others wait for it)",
    )
    g.add_argument(
        "--stager-timeout",
        type=float,
        default=24 * 3600,
        help="seconds to wait for --stager-wait before failing (default 1 day); the "
        "other ranks wait as long, plus two minutes, for local rank 0",
    )
    g.add_argument(
        "--inat-version",
        default="2021_train",
        help="INaturalist version for training: 2017, 2018, 2019, 2021_train, "
        "2021_train_mini (default 2021_train)",
    )
    g.add_argument(
        "--inat-val-version",
        default=None,
        help="INaturalist version for validation (default 2021_valid for 2021 "
        "versions when present; 'none' to skip)",
    )
    g.add_argument(
        "--target-type",
        default="full",
        help="INaturalist target: full, or kingdom..genus (2021), super (2017-2019)",
    )
    g.add_argument(
        "--pipeline",
        choices=("fast", "pil"),
        default="fast",
        help="fast: tensor JPEG decode, uint8 to the device, normalise there; "
        "pil: torchvision-reference PIL transforms (default fast)",
    )
    g.add_argument(
        "--augment",
        choices=("rrc-flip", "none"),
        default="rrc-flip",
        help="training augmentation: RandomResizedCrop + flip, or none (the "
        "validation resize + centre crop; for overfitting checks)",
    )
    g.add_argument("--crop-size", type=int, default=224, help="training and validation crop")
    g.add_argument(
        "--val-resize-size", type=int, default=256, help="validation resize before the centre crop"
    )
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        help="loader workers per process (default: SLURM_CPUS_PER_TASK, shared by "
        "torchrun's local processes, else CPU affinity / local processes; minus one)",
    )
    g.add_argument(
        "--views",
        metavar="NAME[,NAME...]",
        help="multifolder: view folders to stack, e.g. rgb,depth; each is an ImageFolder "
        "tree, decoded as RGB and stacked along channels (the model gets 3 per view)",
    )
    g.add_argument(
        "--align",
        choices=("stem", "order"),
        default="stem",
        help="multifolder: match a sample's views by file name without extension (stem), "
        "or by sorted position (order) when names differ (default stem)",
    )
    g.add_argument("--prefetch", type=int, default=4, help="batches prefetched per worker")
    g.add_argument("--fake-size", type=int, default=1000, help="FakeData training samples")
    g.add_argument("--fake-val-size", type=int, default=100, help="FakeData validation samples")
    g.add_argument("--fake-image-size", type=int, default=64, help="FakeData image side")


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and optimisation")
    g.add_argument(
        "--arch",
        default="resnet50",
        help="torchvision model name (resnet50, vit_b_16, ...) or tinynet",
    )
    g.add_argument(
        "--num-classes",
        type=int,
        default=None,
        help="classifier outputs (default: from the dataset)",
    )
    g.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda uses GPU local_rank and NCCL; cpu uses gloo (default auto)",
    )
    g.add_argument("--batch-size", type=int, default=32, help="samples per process per micro-batch")
    g.add_argument(
        "--accum-steps",
        type=int,
        default=1,
        help="micro-batches per optimizer step (seeds/003's iter_size)",
    )
    g.add_argument("--opt", choices=("sgd", "adamw"), default="sgd", help="optimizer")
    g.add_argument("--lr", type=float, default=0.1, help="base learning rate")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--weight-decay", type=float, default=1e-4, help="weight decay")
    g.add_argument(
        "--decay-norm-and-bias",
        action="store_true",
        help="also decay norm weights and biases (off by default)",
    )
    g.add_argument(
        "--lr-override",
        action="append",
        metavar="NAME=LR",
        help="per-parameter LR by name or glob, e.g. 'fc.*=0.01' (repeatable)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for weights, order, augmentation")
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels (slower; exact resume on GPU)",
    )


def _train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("schedule")
    g.add_argument("--epochs", type=int, default=90, help="epochs to train")
    g.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="train this many optimizer steps instead of --epochs",
    )
    g.add_argument(
        "--sched",
        choices=("cosine", "step", "constant"),
        default="cosine",
        help="LR schedule after warmup",
    )
    g.add_argument(
        "--sched-unit",
        choices=("iter", "epoch"),
        default="iter",
        help="step the schedule every iteration or every epoch",
    )
    g.add_argument("--warmup-epochs", type=float, default=0.0, help="linear warmup length")
    g.add_argument(
        "--warmup-iters",
        type=int,
        default=0,
        help="warmup length in iterations (overrides --warmup-epochs, iter unit)",
    )
    g.add_argument(
        "--warmup-start-factor",
        type=float,
        default=0.01,
        help="warmup starts at this fraction of the LR",
    )
    g.add_argument("--step-size", type=float, default=30, help="epochs between step decays")
    g.add_argument("--gamma", type=float, default=0.1, help="step decay factor")
    g.add_argument(
        "--min-lr-factor", type=float, default=0.0, help="cosine floor as a fraction of the LR"
    )
    g.add_argument("--label-smoothing", type=float, default=0.0, help="cross-entropy smoothing")
    g.add_argument("--clip-grad-norm", type=float, default=None, help="clip gradient norm")
    g.add_argument(
        "--amp",
        choices=("auto", "bf16", "fp16", "none"),
        default="auto",
        help="autocast dtype (auto: bf16 on GPU, none on CPU); fp16 adds a GradScaler",
    )
    g.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--val-batch-size", type=int, default=None, help="default: --batch-size")
    g.add_argument("--no-eval", action="store_true", help="skip validation")

    g = p.add_argument_group("checkpoints, preemption and logs")
    g.add_argument("--output-dir", default="output", help="checkpoints, CSV, TensorBoard, traces")
    g.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="PATH",
        help="resume from PATH, or with no value the latest in OUTPUT/checkpoints",
    )
    g.add_argument(
        "--ckpt-every-iters", type=int, default=None, help="also checkpoint every N optimizer steps"
    )
    g.add_argument(
        "--ckpt-every-epochs",
        type=float,
        default=None,
        help="also checkpoint every fraction of an epoch (e.g. 0.25)",
    )
    g.add_argument("--keep-checkpoints", type=int, default=2, help="checkpoints kept on disk")
    g.add_argument(
        "--no-requeue",
        action="store_true",
        help="on SIGUSR1/SIGTERM save and exit 75 without scontrol requeue",
    )
    g.add_argument("--print-freq", type=int, default=20, help="log every N optimizer steps")
    g.add_argument(
        "--progress",
        choices=("bar", "log"),
        default=None,
        help="tqdm bar or log lines (default: bar on a terminal)",
    )
    g.add_argument(
        "--no-tensorboard", dest="tensorboard", action="store_false", help="CSV logs only"
    )
    g.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler trace of a few steps to OUTPUT/profile",
    )
    g.add_argument(
        "--record-samples",
        metavar="DIR",
        help="testing aid: append every training sample index to DIR/samples-rank<R>.txt",
    )
    g.add_argument(
        "--debug-signal-at-iter",
        type=int,
        default=None,
        metavar="N",
        help="testing aid: send SIGUSR1 to this process after step N",
    )


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stager-train",
        description="DDP image-classification trainer that reads stager-staged data.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _data_args(p)
    _model_args(p)
    _train_args(p)
    return p


def get_find_lr_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stager-train find-lr",
        description="LR range test: for each LR of an exponential sweep, restart from the "
        "same weights and the same batches, train a few steps, record the loss.",
    )
    _data_args(p)
    _model_args(p)
    g = p.add_argument_group("sweep")
    g.add_argument("--min-lr", type=float, default=1e-6, help="first LR of the sweep")
    g.add_argument("--max-lr", type=float, default=1.0, help="last LR of the sweep")
    g.add_argument("--num-runs", type=int, default=20, help="LRs tried (log-spaced)")
    g.add_argument("--iters-per-run", type=int, default=20, help="optimizer steps per LR")
    g.add_argument("--label-smoothing", type=float, default=0.0, help="cross-entropy smoothing")
    g.add_argument(
        "--amp",
        choices=("auto", "bf16", "fp16", "none"),
        default="auto",
        help="autocast dtype (auto: bf16 on GPU)",
    )
    g.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    g.add_argument("--output-dir", default="output", help="where lr_find.csv / lr_find.png go")
    p.set_defaults(no_eval=True, compile=False, prefetch=4, tensorboard=False)
    return p


def get_shard_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stager-train shard",
        description="Write a dataset's splits as shuffled webdataset tar shards "
        "(<key>.jpg + <key>.cls) into OUTPUT/train and OUTPUT/val, with index.json.",
    )
    _data_args(p)
    p.add_argument("--output-dir", required=True, help="folder for train/ and val/ shards")
    p.add_argument("--shard-size", default="1G", help="target bytes per shard (K/M/G suffix)")
    p.add_argument("--shard-max-count", type=int, default=None, help="also cap samples per shard")
    p.add_argument("--splits", default="train,val", help="comma-separated splits to write")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.add_argument("--num-classes", type=int, default=None, help="FakeData classes")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "train"
    if command == "train":
        args = get_args_parser().parse_args(argv)
        if args.progress is None:
            args.progress = "bar" if sys.stderr.isatty() else "log"
        if args.accum_steps < 1:
            get_args_parser().error("--accum-steps must be >= 1")
        from trainer.train import main as run_command
    elif command == "find-lr":
        args = get_find_lr_parser().parse_args(argv)
        from trainer.lr_finder import main as run_command
    else:
        args = get_shard_parser().parse_args(argv)
        from trainer.shard_cmd import main as run_command
    try:
        return run_command(args)
    except (ValueError, RuntimeError, OSError) as exc:
        # Known failure kinds get one readable line; anything else keeps its traceback.
        logging.getLogger("trainer").debug("failed", exc_info=True)
        print(f"stager-train {command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
