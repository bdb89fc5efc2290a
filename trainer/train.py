"""``main(args)``: wire data, model, optimizer and the loop together (the reference's train.py)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer import checkpoint, data, engine, optim
from trainer import distributed as dist_utils
from trainer.distributed import World
from trainer.metrics import MetricsLog
from trainer.models import build_model
from trainer.preempt import EXIT_PREEMPTED, Preemption, requeue

log = logging.getLogger("trainer")


def setup_logging(world: World) -> None:
    # Only rank 0 talks at INFO; the others report warnings and errors.
    level = logging.INFO if world.is_main else logging.WARNING
    fmt = (
        "%(asctime)s %(message)s"
        if world.world_size == 1
        else f"%(asctime)s [{world.rank}] %(message)s"
    )
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True)


def resolve_device(name: str, world: World) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but no CUDA device is visible; use --device cpu")
        return torch.device("cuda", world.local_rank % torch.cuda.device_count())
    if name == "auto":
        return resolve_device("cuda" if torch.cuda.is_available() else "cpu", world)
    return torch.device("cpu")


def amp_dtype(name: str, device: torch.device) -> torch.dtype | None:
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "none"
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[name]


@dataclass
class Setup:
    """Everything `main` builds before the loop; shared with the LR finder."""

    world: World
    device: torch.device
    model: nn.Module  # unwrapped
    train_model: nn.Module  # DDP-wrapped and/or compiled
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    train_set: data.Indexed
    train_sampler: data.ResumableSampler
    train_loader: Any
    val_loader: Any | None
    num_classes: int
    prepare: data.DeviceNormalize
    amp: torch.dtype | None


def data_root(args: argparse.Namespace, world: World) -> Path:
    if not args.stager_wait:
        if args.data_root is None and args.dataset != "fake":
            raise ValueError("--data-root is required (or --stager-wait NAME)")
        return Path(args.data_root or ".")
    from trainer.staging import wait_for_dataset

    staged = wait_for_dataset(args.stager_wait, args.stager_timeout, world)
    # A relative --data-root names a folder inside the staged dataset.
    if args.data_root and not Path(args.data_root).is_absolute():
        return staged / args.data_root
    return staged


def build(args: argparse.Namespace, world: World, device: torch.device) -> Setup:
    torch.manual_seed(args.seed)  # same initial weights on every rank
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    cfg = data.DataConfig.from_args(
        args,
        root=data_root(args, world),
        pipeline=args.pipeline,
        crop=args.crop_size,
        val_resize=args.val_resize_size,
    )
    train_raw = data.build_dataset(
        cfg,
        "train",
        data.train_transform(
            args.pipeline, args.crop_size, args.augment == "rrc-flip", args.val_resize_size
        ),
    )
    val_raw = None
    if not args.no_eval:
        val_tf = data.eval_transform(args.pipeline, args.val_resize_size, args.crop_size)
        val_raw = data.build_dataset(cfg, "val", val_tf)
    n_classes = args.num_classes or data.num_classes(train_raw)
    train_set = data.Indexed(train_raw, seed=args.seed)
    workers = args.workers
    if workers is None:
        workers = data.default_workers(world.cpus_per_task, world.local_world_size, world.launcher)
    pin = device.type == "cuda"
    sampler = data.ResumableSampler(train_set, world.world_size, world.rank, seed=args.seed)
    train_loader = data.make_loader(
        train_set,
        sampler,
        args.batch_size,
        workers,
        pin,
        drop_last=True,
        prefetch_factor=args.prefetch,
    )
    val_loader = None
    if val_raw is not None:
        val_set = data.Indexed(val_raw, seed=args.seed)
        val_sampler = data.ShardedEvalSampler(len(val_set), world.world_size, world.rank)
        val_loader = data.make_loader(
            val_set,
            val_sampler,
            args.val_batch_size or args.batch_size,
            workers,
            pin,
            drop_last=False,
        )
    log.info(
        "data: %s train=%d val=%s classes=%d workers=%d pipeline=%s",
        args.dataset, len(train_set), len(val_raw) if val_raw is not None else "-",
        n_classes, workers, args.pipeline,
    )  # fmt: skip

    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    channels = data.input_channels(cfg)
    model = build_model(args.arch, n_classes, channels)
    model = model.to(device, memory_format=memory_format)
    train_model: nn.Module = model
    if world.distributed:
        train_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if args.compile:
        train_model = torch.compile(train_model)
    groups = optim.make_param_groups(
        model, args.lr, args.weight_decay, optim.parse_overrides(args.lr_override),
        decay_norm_and_bias=args.decay_norm_and_bias,
    )  # fmt: skip
    optimizer = optim.build_optimizer(args.opt, groups, args.lr, args.momentum, args.weight_decay)
    return Setup(
        world=world,
        device=device,
        model=model,
        train_model=train_model,
        optimizer=optimizer,
        criterion=nn.CrossEntropyLoss(label_smoothing=args.label_smoothing),
        train_set=train_set,
        train_sampler=sampler,
        train_loader=train_loader,
        val_loader=val_loader,
        num_classes=n_classes,
        prepare=data.DeviceNormalize(device, args.channels_last, channels),
        amp=amp_dtype(args.amp, device),
    )


def run(args: argparse.Namespace, fn) -> int:
    """Detect the world, join the group, call ``fn(args, world, device)``, always leave."""
    world = World.detect()
    setup_logging(world)
    device = resolve_device(args.device, world)
    dist_utils.init(world, device)
    try:
        return fn(args, world, device)
    finally:
        dist_utils.destroy()


def main(args: argparse.Namespace) -> int:
    return run(args, train)


def train(args: argparse.Namespace, world: World, device: torch.device) -> int:
    s = build(args, world, device)
    accum = args.accum_steps
    steps_per_epoch = len(s.train_loader) // accum
    if steps_per_epoch == 0:
        raise ValueError(
            f"one optimizer step needs {accum} x {args.batch_size} samples per rank but the "
            f"training split gives each of {world.world_size} ranks {len(s.train_sampler)}; "
            "lower --batch-size or --accum-steps"
        )
    epochs = args.epochs
    if args.iterations:
        epochs = math.ceil(args.iterations / steps_per_epoch)
    per_iter = args.sched_unit == "iter"
    unit = steps_per_epoch if per_iter else 1
    total_units = args.iterations if (args.iterations and per_iter) else epochs * unit
    warmup = (
        args.warmup_iters if (per_iter and args.warmup_iters) else round(args.warmup_epochs * unit)
    )
    scheduler = optim.build_scheduler(
        s.optimizer, args.sched, total_units, warmup, args.warmup_start_factor,
        round(args.step_size * unit), args.gamma, args.min_lr_factor,
    )  # fmt: skip
    scaler = torch.amp.GradScaler(device.type) if s.amp is torch.float16 else None
    out = Path(args.output_dir)
    ckpt_dir = out / "checkpoints"
    pos = engine.Position()
    if args.resume:
        _resume(args, s, scheduler, scaler, pos, ckpt_dir)
    if args.iterations and pos.iteration >= args.iterations:
        log.info(
            "checkpoint at iteration %d of %d: nothing to train", pos.iteration, args.iterations
        )
        return 0

    metrics = MetricsLog(out if world.is_main else None, tensorboard=args.tensorboard)

    def save() -> None:
        if world.is_main:
            state = {
                "model": s.model.state_dict(),
                "optimizer": s.optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "position": asdict(pos),
                "world_size": world.world_size,
                "batch_size": args.batch_size,
                "rng": checkpoint.rng_state(),
                "args": vars(args),
            }
            path = checkpoint.save(state, ckpt_dir, keep=args.keep_checkpoints)
            log.info("saved %s", path)
        dist_utils.barrier()  # nobody runs ahead (or exits) before the file exists

    preemption = Preemption()
    preemption.install()
    ckpt_every = args.ckpt_every_iters or (
        max(1, round(args.ckpt_every_epochs * steps_per_epoch)) if args.ckpt_every_epochs else None
    )
    step_cfg = engine.StepConfig(
        accum_steps=accum,
        amp_dtype=s.amp,
        clip_grad_norm=args.clip_grad_norm,
        sched_per_iter=per_iter,
        max_iters=args.iterations,
        print_freq=args.print_freq,
        checkpoint_every=ckpt_every,
        progress_bar=world.is_main and args.progress == "bar",
    )
    profiler = _profiler(args, world, device, out)
    hooks = engine.Hooks(
        save_checkpoint=save,
        preempted=preemption.requested,
        after_step=_after_step(args, pos, profiler),
        record_indices=_recorder(args, world, pos),
        log_row=metrics.row,
    )
    log.info(
        "training %s for %s on %d process(es) via %s; %d steps/epoch; output %s",
        args.arch, f"{args.iterations} iterations" if args.iterations else f"{epochs} epochs",
        world.world_size, world.launcher, steps_per_epoch, out,
    )  # fmt: skip
    status = 0
    with profiler if profiler is not None else nullcontext():
        while pos.epoch < epochs:
            s.train_sampler.set_epoch(pos.epoch)
            s.train_sampler.set_start(pos.batch_in_epoch * args.batch_size)
            result = engine.train_one_epoch(
                s.train_model, s.criterion, s.optimizer, scheduler, scaler, s.train_loader,
                s.prepare, device, pos, step_cfg, hooks, world.world_size,
            )  # fmt: skip
            if result.stopped == "preempted":
                save()
                requeued = world.is_main and not args.no_requeue and requeue(world.slurm_job_id)
                log.warning(
                    "preempted at iteration %d (epoch %d); checkpoint saved%s",
                    pos.iteration, pos.epoch, "; job requeued" if requeued else "",
                )  # fmt: skip
                status = EXIT_PREEMPTED
                break
            epoch_done = result.stopped is None
            if epoch_done:
                if not per_iter:
                    scheduler.step()
                pos.epoch += 1
                pos.batch_in_epoch = 0
            row = {"epoch": pos.epoch - 1 if epoch_done else pos.epoch, "iteration": pos.iteration}
            row |= {"train_loss": result.loss, "train_acc": result.acc}
            if s.val_loader is not None and (epoch_done or result.stopped == "max_iters"):
                row |= engine.evaluate(
                    s.model, s.val_loader, s.prepare, device, s.num_classes, s.amp
                )
            row |= result.throughput
            row["lr"] = s.optimizer.param_groups[0]["lr"]
            _log_epoch(row)
            metrics.row("epochs", row, pos.iteration)
            save()
            if result.stopped == "max_iters":
                break
    metrics.close()
    return status


def _resume(args, s: Setup, scheduler, scaler, pos: engine.Position, ckpt_dir: Path) -> None:
    path = checkpoint.latest(ckpt_dir) if args.resume == "auto" else Path(args.resume)
    if path is None:
        log.info("no checkpoint in %s; starting from scratch", ckpt_dir)
        return
    # On the CPU: RNG states must stay CPU byte tensors (torch.set_rng_state
    # rejects CUDA ones); model and optimizer state are copied to their
    # parameters' device by load_state_dict.
    state = checkpoint.load(path, map_location="cpu")
    s.model.load_state_dict(state["model"])
    s.optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    for key, value in state["position"].items():
        setattr(pos, key, value)
    same_split = (
        state["world_size"] == s.world.world_size and state["batch_size"] == args.batch_size
    )
    if pos.batch_in_epoch and not same_split:
        # The saved position counts this rank's batches under the old layout;
        # under a new one it would point elsewhere, so redo the epoch instead.
        log.warning(
            "checkpoint was written with world size %d / batch %d, now %d / %d: "
            "restarting epoch %d from its beginning",
            state["world_size"], state["batch_size"], s.world.world_size, args.batch_size,
            pos.epoch,
        )  # fmt: skip
        pos.batch_in_epoch = 0
    checkpoint.restore_rng(state["rng"])
    log.info("resumed from %s at epoch %d, iteration %d", path, pos.epoch, pos.iteration)


def _log_epoch(row: dict[str, Any]) -> None:
    parts = [
        f"epoch {row['epoch']}",
        f"train loss {row['train_loss']:.4f} acc {row['train_acc']:.3f}",
    ]
    if "top1" in row:
        parts.append(
            f"val loss {row['val_loss']:.4f} top1 {row['top1']:.3f} top5 {row['top5']:.3f} "
            f"mean-class {row['mean_class_acc']:.3f} (n={row['count']})"
        )
    parts.append(
        f"{row['img_s_mean']:.1f}±{row['img_s_std']:.1f} img/s, "
        f"data wait {row['data_wait_pct']:.1f}%"
    )
    log.info(" | ".join(parts))


def _profiler(args, world: World, device: torch.device, out: Path):
    if not args.profile:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        # Skip start-up (worker spawn, cudnn autotune), then record a few steps.
        schedule=torch.profiler.schedule(wait=2, warmup=1, active=5, repeat=1),
        activities=activities,
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            str(out / "profile"), worker_name=f"rank{world.rank}"
        ),
        record_shapes=True,
    )


def _after_step(args, pos: engine.Position, profiler):
    def hook() -> None:
        if profiler is not None:
            profiler.step()
        if args.debug_signal_at_iter and pos.iteration == args.debug_signal_at_iter:
            os.kill(os.getpid(), signal.SIGUSR1)

    return hook


def _recorder(args, world: World, pos: engine.Position):
    if not args.record_samples:
        return None
    directory = Path(args.record_samples)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"samples-rank{world.rank}.txt"

    def record(indices: torch.Tensor) -> None:
        with open(path, "a") as f:
            f.writelines(f"{pos.epoch} {i}\n" for i in indices.tolist())

    return record
