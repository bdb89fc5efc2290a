"""``main(args)``: wire data, model, optimizer and the loop together (the reference's train.py)."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer import checkpoint, data, engine, exit_status, mixing, optim
from trainer import distributed as dist_utils
from trainer.datasets import DataConfig, build_dataset, input_channels, num_classes
from trainer.distributed import World
from trainer.ema import Ema, adjusted_decay
from trainer.metrics import MetricsLog
from trainer.models import build_model
from trainer.preempt import EXIT_PREEMPTED, Preemption, requeue
from trainer.transforms import Augment, DeviceNormalize, eval_transform, train_transform

log = logging.getLogger("trainer")
# Libraries whose INFO lines are not training progress (httpx logs every request
# --stager-wait makes).
QUIET_LOGGERS = ("httpx", "httpcore")


def setup_logging(world: World) -> None:
    # Only rank 0 talks at INFO; the others report warnings and errors.
    level = logging.INFO if world.is_main else logging.WARNING
    fmt = (
        "%(asctime)s %(message)s"
        if world.world_size == 1
        else f"%(asctime)s [{world.rank}] %(message)s"
    )
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


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
    order: data.EpochOrder
    train_sampler: data.ResumableSampler
    train_loader: Any
    val_loader: Any | None
    num_classes: int
    prepare: DeviceNormalize
    amp: torch.dtype | None
    mix: mixing.BatchMix | None


def staged_data(args: argparse.Namespace, world: World) -> tuple[Path, list[dict]]:
    """The data root, and the staged dataset's torchvision usage (empty if none)."""
    if not args.stager_wait:
        if args.data_root is None and args.dataset != "fake":
            raise ValueError("--data-root is required (or --stager-wait NAME)")
        if args.dataset is None:
            raise ValueError("--dataset is required without --stager-wait")
        return Path(args.data_root or "."), []
    from trainer.staging import wait_for_dataset

    staged = wait_for_dataset(args.stager_wait, args.stager_timeout, world)
    # A relative --data-root names a folder inside the staged dataset: the
    # dataset's own usage describes the whole of it, so it no longer applies.
    if args.data_root and not Path(args.data_root).is_absolute():
        return staged.path / args.data_root, []
    return staged.path, staged.usage


def build(args: argparse.Namespace, world: World, device: torch.device) -> Setup:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    root, usage = staged_data(args, world)
    cfg = DataConfig.from_args(args, root=root, pipeline=args.pipeline, usage=usage)
    aug = Augment(
        crop=args.train_crop_size,
        auto_augment=args.auto_augment,
        ra_magnitude=args.ra_magnitude,
        augmix_severity=args.augmix_severity,
        random_erase=args.random_erase,
        enabled=args.augment != "none",
    )
    train_tf = train_transform(args.pipeline, aug, args.val_resize_size)
    train_raw = build_dataset(cfg, "train", train_tf)
    val_crop = args.val_crop_size or args.train_crop_size
    val_raw = None
    if not args.no_eval:
        val_tf = eval_transform(args.pipeline, args.val_resize_size, val_crop)
        val_raw = build_dataset(cfg, "val", val_tf)
    n_classes = args.num_classes or num_classes(train_raw)
    train_set = data.Indexed(train_raw, seed=args.seed, bad_images=args.bad_images)
    workers = args.workers
    if workers is None:
        workers = data.default_workers(world.cpus_per_task, world.local_world_size, world.launcher)
    pin = device.type == "cuda"
    reps = args.ra_reps if args.ra_sampler else 1
    order = data.EpochOrder(len(train_set), args.seed, reps)
    sampler = data.ResumableSampler(
        order, world.world_size, world.rank, args.batch_size, args.accum_steps
    )
    train_loader = data.make_loader(
        train_set, sampler, args.batch_size, workers, pin, drop_last=True,
        prefetch_factor=args.prefetch,
    )  # fmt: skip
    val_loader = None
    if val_raw is not None:
        val_set = data.Indexed(val_raw, bad_images=args.bad_images)
        val_sampler = data.ShardedEvalSampler(len(val_set), world.world_size, world.rank)
        val_loader = data.make_loader(
            val_set, val_sampler, args.val_batch_size or args.batch_size, workers, pin,
            drop_last=False,
        )  # fmt: skip
    log.info(
        "data: %s train=%d val=%s classes=%d workers=%d pipeline=%s",
        cfg.describe(), len(train_set), len(val_raw) if val_raw is not None else "-",
        n_classes, workers, args.pipeline,
    )  # fmt: skip

    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    channels = input_channels(cfg)
    model = build_model(args.arch, n_classes, channels)
    model = _sync_batchnorm(model, args.sync_bn, world, device)
    model = model.to(device, memory_format=memory_format)
    train_model: nn.Module = model
    if world.distributed:
        train_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if args.compile:
        train_model = _compile(train_model)
    groups = optim.make_param_groups(
        model, args.lr, args.weight_decay, optim.parse_overrides(args.lr_override),
        norm_weight_decay=args.norm_weight_decay, bias_weight_decay=args.bias_weight_decay,
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
        order=order,
        train_sampler=sampler,
        train_loader=train_loader,
        val_loader=val_loader,
        num_classes=n_classes,
        prepare=DeviceNormalize(device, args.channels_last, channels),
        amp=amp_dtype(args.amp, device),
        mix=mixing.make(n_classes, args.mixup_alpha, args.cutmix_alpha),
    )


def _sync_batchnorm(model: nn.Module, wanted: bool, world: World, device: torch.device):
    if not wanted:
        return model
    if not world.distributed:
        log.info("--sync-bn: one process, nothing to synchronise")
        return model
    if device.type != "cuda":
        raise ValueError(
            "--sync-bn needs GPUs: torch's SyncBatchNorm does not run on the CPU; drop --sync-bn"
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def _compile(model: nn.Module) -> nn.Module:
    import torch._dynamo

    # Where compilation fails (no C compiler, an unsupported op or platform),
    # run that code eagerly with a warning instead of failing the run.
    torch._dynamo.config.suppress_errors = True
    return torch.compile(model)


def run(args: argparse.Namespace, fn, world: World | None = None) -> int:
    """Detect the world, join the group, call ``fn(args, world, device)``, always leave."""
    world = world or World.detect()
    setup_logging(world)
    device = resolve_device(args.device, world)
    dist_utils.init(world, device)
    try:
        return fn(args, world, device)
    finally:
        dist_utils.destroy()


def main(args: argparse.Namespace) -> int:
    """Train, with the outcome recorded in OUTPUT/exit-status.json (`trainer.exit_status`)."""
    world = World.detect()
    recorder = exit_status.Recorder(
        Path(args.output_dir), args.run_id, enabled=world.is_main,
        launcher=world.launcher, world_size=world.world_size,
    )  # fmt: skip
    recorder.start()
    try:
        code = run(args, partial(train, recorder=recorder), world)
    except BaseException as exc:
        # Whatever ends rank 0 (an error, Ctrl-C) is this run's outcome; a kill -9
        # leaves "running", which the reader also takes as broken.
        recorder.failed(exc)
        raise
    recorder.finish(code)
    return code


@dataclass
class Plan:
    """How long to train and the schedule, fixed in samples when training first starts."""

    global_batch0: int  # samples per step of the run that started training
    epochs: int | None  # --epochs, or None with --iterations
    max_samples: int | None  # --iterations x global_batch0
    schedule: optim.Schedule

    @classmethod
    def make(cls, args: argparse.Namespace, global_batch0: int, epoch_length: int) -> Plan:
        per_epoch = epoch_length / global_batch0  # steps per epoch, as a float
        if args.iterations:
            total = args.iterations / per_epoch
            epochs, max_samples = None, args.iterations * global_batch0
        else:
            total, epochs, max_samples = float(args.epochs), args.epochs, None
        warmup = args.lr_warmup_epochs
        if args.lr_warmup_iters:
            warmup = args.lr_warmup_iters / per_epoch
        schedule = optim.Schedule(
            kind=optim.SCHEDULES.get(args.lr_scheduler, args.lr_scheduler),
            total=total,
            warmup=warmup,
            warmup_method=args.lr_warmup_method,
            warmup_decay=args.lr_warmup_decay,
            step_size=args.lr_step_size,
            gamma=args.lr_gamma,
            min_factor=args.min_lr_factor,
            per_epoch=args.sched_unit == "epoch",
        )
        return cls(global_batch0, epochs, max_samples, schedule)

    def done(self, pos: engine.Position) -> bool:
        if self.max_samples is not None:
            return pos.samples >= self.max_samples
        return pos.epoch >= (self.epochs or 0)


def train(
    args: argparse.Namespace,
    world: World,
    device: torch.device,
    recorder: exit_status.Recorder | None = None,
) -> int:
    s = build(args, world, device)
    global_batch = world.world_size * args.batch_size * args.accum_steps
    if s.train_sampler.steps(0) == 0:
        raise ValueError(
            f"one optimizer step needs {args.accum_steps} x {args.batch_size} samples on each "
            f"of {world.world_size} ranks, but the training split has {len(s.order)}; "
            "lower --batch-size or --accum-steps"
        )
    out = Path(args.output_dir)
    ckpt_dir = out / "checkpoints"
    attempt = checkpoint.next_attempt(ckpt_dir) if world.is_main else 0
    pos = engine.Position()
    state = _load_resume_state(args, world, ckpt_dir)
    plan = Plan.make(
        args, state.get("global_batch0", global_batch) if state else global_batch, len(s.order)
    )
    ema = None
    if args.model_ema:
        decay = adjusted_decay(
            args.model_ema_decay, world.world_size, args.batch_size * args.accum_steps,
            args.model_ema_steps, plan.schedule.total,
        )  # fmt: skip
        ema = Ema(s.model, decay, args.model_ema_steps, device)
    scaler = torch.amp.GradScaler(device.type) if s.amp is torch.float16 else None
    if state:
        _restore(state, s, scaler, ema, pos, world, args)
    if plan.done(pos):
        log.info("checkpoint at epoch %d, sample %d: nothing to train", pos.epoch, pos.samples)
        return 0

    metrics = MetricsLog(out if world.is_main else None, tensorboard=args.tensorboard)

    def save() -> None:
        if world.is_main:
            snapshot = {
                "model": s.model.state_dict(),
                "model_ema": ema.state_dict() if ema is not None else None,
                "optimizer": s.optimizer.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "position": asdict(pos),
                "global_batch0": plan.global_batch0,
                "world_size": world.world_size,
                "batch_size": args.batch_size,
                "accum_steps": args.accum_steps,
                "args": vars(args),
            }
            path = checkpoint.save(snapshot, ckpt_dir, attempt, keep=args.keep_checkpoints)
            log.info("saved %s", path)
            if recorder is not None:
                recorder.saved(path, pos.epoch, pos.iteration, pos.samples)
        dist_utils.barrier()  # nobody runs ahead (or exits) before the file exists

    preemption = Preemption()
    preemption.install()
    steps_per_epoch = s.train_sampler.steps(0)
    ckpt_every = args.ckpt_every_iters or (
        max(1, round(args.ckpt_every_epochs * steps_per_epoch)) if args.ckpt_every_epochs else None
    )
    step_cfg = engine.StepConfig(
        accum_steps=args.accum_steps,
        amp_dtype=s.amp,
        clip_grad_norm=args.clip_grad_norm,
        max_samples=plan.max_samples,
        print_freq=args.print_freq,
        checkpoint_every=ckpt_every,
        progress_bar=world.is_main and args.progress == "bar",
        global_batch=global_batch,
        seed=args.seed,
        rank=world.rank,
    )
    parts = engine.Parts(
        model=s.train_model, raw=s.model, criterion=s.criterion, optimizer=s.optimizer,
        prepare=s.prepare, device=device, scaler=scaler, schedule=plan.schedule,
        epoch_length=len(s.order), mix=s.mix, ema=ema,
    )  # fmt: skip
    profiler = _profiler(args, world, device, out)
    hooks = engine.Hooks(
        save_checkpoint=save,
        preempted=preemption.requested,
        after_step=_after_step(args, pos, profiler),
        record=_recorder(args, world, pos),
        log_row=metrics.row,
    )
    log.info(
        "training %s for %s on %d process(es) via %s; %d steps/epoch of %d samples; output %s",
        args.arch, f"{args.iterations} iterations" if args.iterations else f"{args.epochs} epochs",
        world.world_size, world.launcher, steps_per_epoch, global_batch, out,
    )  # fmt: skip
    status = 0
    with profiler if profiler is not None else nullcontext():
        while not plan.done(pos):
            s.train_sampler.set_epoch(pos.epoch)
            s.train_sampler.set_start(pos.samples_in_epoch)
            result = engine.train_one_epoch(
                parts, s.train_loader, pos, step_cfg, hooks, world.world_size
            )
            if result.stopped == "preempted":
                save()
                requeued = world.is_main and not args.no_requeue and requeue(world.slurm_job_id)
                log.warning(
                    "preempted at iteration %d (epoch %d, sample %d); checkpoint saved%s",
                    pos.iteration, pos.epoch, pos.samples, "; job requeued" if requeued else "",
                )  # fmt: skip
                status = EXIT_PREEMPTED
                break
            epoch_done = result.stopped is None
            if epoch_done:
                pos.epoch += 1
                pos.samples_in_epoch = 0
            row = {"epoch": pos.epoch - 1 if epoch_done else pos.epoch}
            row |= {"iteration": pos.iteration, "samples": pos.samples}
            row |= {"train_loss": result.loss, "train_acc": result.acc}
            if s.val_loader is not None and (epoch_done or result.stopped == "max_iters"):
                row |= engine.evaluate(
                    s.model, s.val_loader, s.prepare, device, s.num_classes, s.amp
                )
                if ema is not None:
                    scores = engine.evaluate(
                        ema.module, s.val_loader, s.prepare, device, s.num_classes, s.amp
                    )
                    row |= {f"ema_{key}": value for key, value in scores.items()}
            row |= result.throughput
            row["lr"] = s.optimizer.param_groups[0]["lr"]
            _log_epoch(row)
            metrics.row("epochs", row, pos.iteration)
            save()
    metrics.close()
    return status


def _load_resume_state(args, world: World, ckpt_dir: Path) -> dict[str, Any] | None:
    """The checkpoint to resume from (rank 0 chooses, every rank reads the same file)."""
    if not args.resume:
        if world.is_main and checkpoint.latest(ckpt_dir) is not None:
            log.warning(
                "%s holds checkpoints of an earlier run; starting afresh (pass --resume to "
                "continue it); this run's checkpoints rank after them and replace them",
                ckpt_dir,
            )
        return None
    chosen: str | None = None
    state = None
    if world.is_main:
        if args.resume == "auto":
            found = checkpoint.load_latest(ckpt_dir)
            if found is None:
                log.info("no checkpoint in %s; starting from scratch", ckpt_dir)
            else:
                chosen, state = str(found[0]), found[1]
        else:
            chosen, state = args.resume, checkpoint.load(Path(args.resume))
    chosen = dist_utils.broadcast_object(chosen)  # type: ignore[assignment]
    if chosen is None:
        return None
    if state is None:
        state = checkpoint.load(Path(chosen))
    if "samples" not in state.get("position", {}):
        raise ValueError(
            f"checkpoint {chosen} was written by an older stager-train (no sample count); "
            "resume it with that version, or start afresh in a new --output-dir"
        )
    state["path"] = chosen
    return state


def _restore(state, s: Setup, scaler, ema, pos: engine.Position, world: World, args) -> None:
    # Model and optimizer state are copied to their parameters' device by load_state_dict.
    s.model.load_state_dict(state["model"])
    s.optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if ema is not None:
        if state.get("model_ema"):
            ema.load_state_dict(state["model_ema"])
        else:
            log.warning("checkpoint has no EMA weights; the average starts from the weights")
            ema.model.module.load_state_dict(s.model.state_dict())
    for key, value in state["position"].items():
        setattr(pos, key, value)
    layout = (state["world_size"], state["batch_size"], state.get("accum_steps", 1))
    now = (world.world_size, args.batch_size, args.accum_steps)
    if layout != now:
        log.warning(
            "checkpoint was written with world size %d, batch %d, accumulation %d; now %d, %d, "
            "%d: epoch %d continues after its first %d samples in the same order, and the LR "
            "follows the same schedule in samples",
            *layout, *now, pos.epoch, pos.samples_in_epoch,
        )  # fmt: skip
    log.info(
        "resumed from %s at epoch %d, sample %d (iteration %d)",
        state["path"], pos.epoch, pos.samples, pos.iteration,
    )  # fmt: skip


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
    if "ema_top1" in row:
        parts.append(f"EMA val loss {row['ema_val_loss']:.4f} top1 {row['ema_top1']:.3f}")
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
    """--record-samples: each sample index trained, and a digest of each micro-batch.

    ``samples-rank<R>.txt``: "<epoch> <index>" per sample. ``inputs-rank<R>.txt``:
    "<samples seen> <sha256>" per micro-batch, over the network's input after
    augmentation and mixing and the (soft) targets: equal digests mean equal
    augmentations, so tests can compare ranks and resumed runs draw by draw.
    """
    if not args.record_samples:
        return None
    directory = Path(args.record_samples)
    directory.mkdir(parents=True, exist_ok=True)
    samples = directory / f"samples-rank{world.rank}.txt"
    inputs = directory / f"inputs-rank{world.rank}.txt"

    def record(indices: torch.Tensor, images: torch.Tensor, targets: torch.Tensor) -> None:
        with open(samples, "a") as f:
            f.writelines(f"{pos.epoch} {i}\n" for i in indices.tolist())
        digest = hashlib.sha256()
        for t in (images, targets):
            digest.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        with open(inputs, "a") as f:
            f.write(f"{pos.samples} {digest.hexdigest()}\n")

    return record
