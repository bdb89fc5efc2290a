"""``stager-train``: train (default), ``find-lr``, ``shard`` and ``exit-status``.

``stager-train --dataset fake ...`` trains; a first argument naming a
subcommand selects it. argparse subparsers would make the command mandatory,
so dispatch is done by hand on argv[0].

Exit codes: 0 done, 1 error (message on stderr), 2 bad usage, 75 preempted
(checkpoint saved; resume with --resume). Under torchrun the launcher exits 1
instead of 75; ``exit-status`` gives the run's own code back (`trainer.exit_status`).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import logging
import os
import sys

# The trainer's modules need the `train` extra (torch, torchvision, ...), which the node
# service's venv has not: there, --help still answers (without the lists those modules
# give), and a run says the one thing to do instead of a traceback.
try:
    from trainer.data import BAD_IMAGES
    from trainer.datasets import DATASETS
    from trainer.exit_status import RUN_ID_ENV, error_sentence
    from trainer.optim import SCHEDULES
    from trainer.preempt import EXIT_PREEMPTED
    from trainer.presets import PRESETS
    from trainer.transforms import AUTO_AUGMENT

    MISSING: str | None = None
except ModuleNotFoundError as exc:
    if (exc.name or "trainer").partition(".")[0] in ("trainer", "stager", "client"):
        raise  # one of ours: a real bug, with its traceback
    MISSING = exc.name
    BAD_IMAGES = DATASETS = AUTO_AUGMENT = None  # type: ignore[assignment]
    SCHEDULES, PRESETS = (), {}  # type: ignore[assignment]
    RUN_ID_ENV, EXIT_PREEMPTED = "STAGER_TRAIN_RUN_ID", 75  # trainer.exit_status's, .preempt's
    error_sentence = str  # type: ignore[assignment]
else:
    # At exit the interpreter's last collections skip what is alive then: tearing down
    # the objects of torch's ~2,300 modules took ~1.2 s of CPU at every rank's exit,
    # after everything a run keeps was written (checkpoints are renamed into place,
    # logs flushed). The atexit handlers themselves all still run.
    atexit.register(gc.freeze)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
__all__ = ["EXIT_ERROR", "EXIT_OK", "EXIT_PREEMPTED", "EXIT_USAGE", "main"]

SUBCOMMANDS = ("train", "find-lr", "shard", "exit-status", "completion")
# Old spellings of --lr-scheduler values.
SCHEDULE_ALIASES = {"cosine": "cosineannealinglr", "step": "steplr"}
EPILOG = """subcommands:
  stager-train [train] ...   train (this page)
  stager-train find-lr ...   LR range test: CSV + PNG + suggested LR (see find-lr --help)
  stager-train shard ...     write a dataset as shuffled webdataset tar shards (see shard --help)
  stager-train exit-status   exit as a run ended (75 preempted, 0 completed), after torchrun
                             returns (see exit-status --help)
  stager-train completion SHELL   a completion script for bash, zsh or tcsh

launch: one process as is; torchrun --nproc-per-node N -m trainer ...; or under
SLURM `srun python -m trainer ...` (ranks from SLURM_PROCID/SLURM_LOCALID/
SLURM_STEP_NUM_TASKS, rendezvous on the step's first node, port from the job id).
preemption: SIGUSR1 or SIGTERM (SLURM's warning signal, time limit, scancel) on any
rank: every rank stops at the same step, rank 0 writes one checkpoint, the run exits
75 (and requeues its SLURM job unless --no-requeue); --resume continues it, also with
another world size or batch size. Under torchrun set
TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 so that torchrun
passes SIGUSR1 on to the ranks instead of dying of it (it then waits 30 s for them).
exit codes: 0 done, 1 error, 2 usage, 75 preempted (checkpoint saved; rerun with --resume).
torchrun exits 1 when a signal stopped it, even if every rank saved and exited 75: rank 0
records how the run ended in OUTPUT/exit-status.json under --run-id, and
`stager-train exit-status --output-dir OUTPUT --run-id ID --launcher-exit $?` exits with it."""


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--dataset",
        choices=DATASETS,
        default=None,
        help="dataset type (inat2021 is an alias of inat; multifolder: aligned views "
        "under DATA_ROOT/{train,val}/<view>/<class>/, see --views). With --stager-wait, a "
        "dataset staged by a recipe is read as its usage says (the torchvision class and "
        "arguments the daemon reports) and --dataset is only the fallback",
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
    g.add_argument(
        "--train-crop-size",
        "--crop-size",
        dest="train_crop_size",
        type=int,
        default=224,
        help="training crop (RandomResizedCrop); also the validation crop unless --val-crop-size",
    )
    g.add_argument("--val-crop-size", type=int, default=None, help="validation centre crop")
    g.add_argument(
        "--val-resize-size", type=int, default=256, help="validation resize before the centre crop"
    )
    g.add_argument(
        "--auto-augment",
        choices=AUTO_AUGMENT,
        default=None,
        help="automatic augmentation after crop and flip: ra (RandAugment), ta_wide "
        "(TrivialAugmentWide), augmix, or an AutoAugment policy (imagenet, cifar10, svhn)",
    )
    g.add_argument("--ra-magnitude", type=int, default=9, help="RandAugment magnitude")
    g.add_argument("--augmix-severity", type=int, default=3, help="AugMix severity")
    g.add_argument(
        "--random-erase", type=float, default=0.0, help="random erasing probability per sample"
    )
    g.add_argument(
        "--ra-sampler",
        action="store_true",
        help="repeated augmentation: each sample --ra-reps times in a row per epoch, on "
        "different ranks with different augmentations (the epoch keeps its length)",
    )
    g.add_argument("--ra-reps", type=int, default=3, help="repeats per sample with --ra-sampler")
    g.add_argument(
        "--bad-images",
        choices=BAD_IMAGES,
        default="error",
        help="an image no decoder can read (truncated, not an image): stop with an error "
        "naming it (default), or skip it with a warning naming it (its batch slot goes to "
        "the next readable sample)",
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
        "--model",
        dest="arch",
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
    g.add_argument(
        "--weight-decay", "--wd", dest="weight_decay", type=float, default=1e-4,
        help="weight decay",
    )  # fmt: skip
    g.add_argument(
        "--norm-weight-decay",
        type=float,
        default=None,
        help="weight decay of normalisation layers' parameters (default: --weight-decay; "
        "0 for none)",
    )
    g.add_argument(
        "--bias-weight-decay",
        type=float,
        default=None,
        help="weight decay of biases (default: --weight-decay; 0 for none)",
    )
    g.add_argument(
        "--sync-bn",
        action="store_true",
        help="SyncBatchNorm: batch statistics over all ranks (GPUs only)",
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
        "--lr-scheduler",
        "--sched",
        dest="lr_scheduler",
        choices=(*SCHEDULES, *SCHEDULE_ALIASES) if SCHEDULES else None,
        default="cosineannealinglr",
        help="LR schedule after warmup, as a function of samples seen (so it survives "
        "a change of world size or batch size on resume)",
    )
    g.add_argument(
        "--sched-unit",
        choices=("iter", "epoch"),
        default="iter",
        help="change the LR at every step, or only at epoch boundaries (torchvision's way)",
    )
    g.add_argument(
        "--lr-warmup-epochs",
        "--warmup-epochs",
        dest="lr_warmup_epochs",
        type=float,
        default=0.0,
        help="warmup length in epochs",
    )
    g.add_argument(
        "--lr-warmup-iters",
        "--warmup-iters",
        dest="lr_warmup_iters",
        type=int,
        default=0,
        help="warmup length in steps of the first run's global batch (overrides "
        "--lr-warmup-epochs)",
    )
    g.add_argument(
        "--lr-warmup-method",
        choices=("linear", "constant"),
        default="linear",
        help="warmup: linear from --lr-warmup-decay x LR, or constant at it",
    )
    g.add_argument(
        "--lr-warmup-decay",
        "--warmup-start-factor",
        dest="lr_warmup_decay",
        type=float,
        default=0.01,
        help="warmup starts at this fraction of the LR",
    )
    g.add_argument(
        "--lr-step-size",
        "--step-size",
        dest="lr_step_size",
        type=float,
        default=30,
        help="epochs between step decays",
    )
    g.add_argument(
        "--lr-gamma", "--gamma", dest="lr_gamma", type=float, default=0.1,
        help="step decay factor",
    )  # fmt: skip
    g.add_argument(
        "--min-lr-factor", type=float, default=0.0, help="cosine floor as a fraction of the LR"
    )
    g.add_argument("--label-smoothing", type=float, default=0.0, help="cross-entropy smoothing")
    g.add_argument(
        "--mixup-alpha", type=float, default=0.0, help="mixup Beta(alpha, alpha); 0: off"
    )
    g.add_argument(
        "--cutmix-alpha",
        type=float,
        default=0.0,
        help="cutmix Beta(alpha, alpha); 0: off (with mixup: one of the two per batch)",
    )
    g.add_argument(
        "--model-ema",
        action="store_true",
        help="keep an exponential moving average of the weights and evaluate it too "
        "(ema_* metrics)",
    )
    g.add_argument(
        "--model-ema-steps", type=int, default=32, help="optimizer steps between EMA updates"
    )
    g.add_argument(
        "--model-ema-decay",
        type=float,
        default=0.99998,
        help="EMA decay, adjusted for batch size, world size and epochs as torchvision does",
    )
    g.add_argument("--clip-grad-norm", type=float, default=None, help="clip gradient norm")
    g.add_argument(
        "--amp",
        choices=("auto", "bf16", "fp16", "none"),
        default="auto",
        help="autocast dtype (auto: bf16 on GPU, none on CPU); fp16 adds a GradScaler",
    )
    g.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model; parts that fail to compile run eagerly (with a warning)",
    )
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
        "--run-id",
        default=os.environ.get(RUN_ID_ENV),
        metavar="ID",
        help="this run's name in OUTPUT/exit-status.json, where rank 0 records how the run "
        f"ended (default ${RUN_ID_ENV}, else a random one); `stager-train exit-status "
        "--run-id ID` reads it back after torchrun returns",
    )
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
    p.add_argument("--version", action="version", version=f"stager-train {_version()}")
    p.add_argument(
        "--recipe",
        choices=sorted(PRESETS) or None,
        default=None,
        help="set the flags of a published recipe (explicit flags still win): "
        "resnet50-torchvision-v2 is torchvision's 80.8%% ResNet-50 (see docs/trainer.md)",
    )
    _data_args(p)
    _model_args(p)
    _train_args(p)
    return p


def _version() -> str:
    from stager.wire.cli_common import __version__

    return __version__


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    """Parse, with a --recipe's values as the defaults (so explicit flags override them)."""
    parser = get_args_parser()
    known, _ = parser.parse_known_args(argv)
    if known.recipe:
        parser.set_defaults(**PRESETS[known.recipe])
    args = parser.parse_args(argv)
    args.lr_scheduler = SCHEDULE_ALIASES.get(args.lr_scheduler, args.lr_scheduler)
    if args.progress is None:
        args.progress = "bar" if sys.stderr.isatty() else "log"
    if args.accum_steps < 1:
        parser.error("--accum-steps must be >= 1")
    if args.ra_reps < 1:
        parser.error("--ra-reps must be >= 1")
    if args.dataset is None and not args.stager_wait:
        parser.error("--dataset is required (or --stager-wait NAME for a recipe-staged dataset)")
    return args


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
    # What `build` reads that the sweep keeps plain: no augmentation extras, no mixing.
    p.set_defaults(
        no_eval=True, compile=False, prefetch=4, tensorboard=False, auto_augment=None,
        random_erase=0.0, ra_sampler=False, ra_reps=1, ra_magnitude=9, augmix_severity=3,
        mixup_alpha=0.0, cutmix_alpha=0.0, val_crop_size=None, bad_images="error",
    )  # fmt: skip
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
    if MISSING is not None and command != "completion":
        return _without_train_extra(command, argv)
    if command == "train":
        args = parse_train_args(argv)
        from trainer.train import main as run_command
    elif command == "exit-status":
        from trainer.exit_status import main as run_command
        from trainer.exit_status import parse_args

        args = parse_args(argv)
    elif command == "completion":
        completion = argparse.ArgumentParser(prog="stager-train completion")
        completion.add_argument("shell", choices=["bash", "zsh", "tcsh"])
        import shtab

        print(shtab.complete(get_args_parser(), shell=completion.parse_args(argv).shell))
        return EXIT_OK
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
        print(f"stager-train {command}: error: {error_sentence(exc)}", file=sys.stderr)
        return EXIT_ERROR


def _without_train_extra(command: str, argv: list[str]) -> int:
    """--help and --version answered; anything else, the sentence naming the fix."""
    parse = {"train": parse_train_args, "find-lr": get_find_lr_parser().parse_args,
             "shard": get_shard_parser().parse_args}.get(command)  # fmt: skip
    if parse is not None and {"-h", "--help", "--version"} & set(argv):
        parse(argv)  # prints and exits 0
    print(
        f"stager-train {command}: error: the trainer needs {MISSING}, which {sys.executable} "
        "cannot import; install the trainer's packages there: pip install 'stager[train]'",
        file=sys.stderr,
    )
    return EXIT_ERROR
