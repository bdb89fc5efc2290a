"""train_one_epoch and evaluate (torchvision references' engine, done exactly)."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer import distributed as dist_utils
from trainer.ema import Ema
from trainer.metrics import Throughput
from trainer.mixing import BatchMix
from trainer.optim import Schedule
from trainer.seeding import seed_step

log = logging.getLogger(__name__)


@dataclass
class Position:
    """Where training stands; saved in checkpoints.

    Counted in samples (all ranks together), so it means the same under any
    world size, batch size or accumulation: the samples consumed in ``epoch``
    are the first ``samples_in_epoch`` of its order (`trainer.data`).
    """

    epoch: int = 0
    samples_in_epoch: int = 0
    samples: int = 0  # since the start of training
    iteration: int = 0  # optimizer steps since the start (for logs)

    def progress(self, epoch_length: int) -> float:
        """Epochs done, as a float: what the LR schedule and EMA warmup follow."""
        return self.epoch + self.samples_in_epoch / max(epoch_length, 1)


@dataclass
class StepConfig:
    accum_steps: int = 1
    amp_dtype: torch.dtype | None = None
    clip_grad_norm: float | None = None
    max_samples: int | None = None  # --iterations, in samples
    print_freq: int = 10
    checkpoint_every: int | None = None  # optimizer steps
    progress_bar: bool = False
    global_batch: int = 1  # samples per optimizer step, all ranks
    seed: int = 0
    rank: int = 0


@dataclass
class Parts:
    """What one training step uses."""

    model: nn.Module  # what trains: DDP-wrapped and/or compiled
    raw: nn.Module  # the same weights unwrapped (EMA source, checkpoints)
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    prepare: Callable[[torch.Tensor], torch.Tensor]
    device: torch.device
    scaler: torch.amp.GradScaler | None = None
    schedule: Schedule | None = None
    epoch_length: int = 1  # samples in one epoch's order
    mix: BatchMix | None = None
    ema: Ema | None = None


@dataclass
class Hooks:
    """Side effects the loop triggers at step boundaries (all optional)."""

    save_checkpoint: Callable[[], None] | None = None
    preempted: Callable[[], bool] | None = None
    after_step: Callable[[], None] | None = None  # profiler.step, debug signals
    # Testing aid: (indices, network input, targets) of every micro-batch.
    record: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    log_row: Callable[[str, dict[str, Any], int], None] | None = None


@dataclass
class EpochResult:
    loss: float
    acc: float
    stopped: str | None  # None (epoch done) | "preempted" | "max_iters"
    throughput: dict[str, float] = field(default_factory=dict)


def train_one_epoch(
    parts: Parts,
    loader: Any,
    pos: Position,
    cfg: StepConfig,
    hooks: Hooks,
    world_size: int = 1,
) -> EpochResult:
    """The rest of ``pos.epoch``: ``len(loader)`` micro-batches, all of them whole steps."""
    model, optimizer, device = parts.model, parts.optimizer, parts.device
    model.train()
    accum = cfg.accum_steps
    steps = len(loader) // accum
    first_step = pos.samples_in_epoch // cfg.global_batch
    meter = Throughput()
    # Sums stay on the device: calling .item() every step would stall the GPU.
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.float64)
    seen = torch.zeros((), device=device, dtype=torch.float64)
    bar = _progress(cfg.progress_bar, steps, pos.epoch)
    batches = iter(loader)
    stopped = None
    # The LR is set for the position before every step, so at any moment the
    # optimizer holds the LR of the current sample count (what the logs show).
    _set_lr(parts, pos)
    for _ in range(steps):
        # Checked before the step too: a run resumed from its final checkpoint
        # must not take one more step.
        if _reached(cfg.max_samples, pos):
            stopped = "max_iters"
            break
        for micro in range(accum):
            t0 = time.perf_counter()
            images, targets, indices = next(batches)
            meter.add_data_wait(time.perf_counter() - t0)
            seed_step(cfg.seed, cfg.rank, pos.samples, micro, device)
            images = parts.prepare(images)
            targets = targets.to(device, non_blocking=True)
            soft = targets
            if parts.mix is not None:
                images, soft = parts.mix(images, targets)
            # no_sync on all but the last micro-batch: gradients accumulate
            # locally and are all-reduced once per optimizer step.
            last = micro == accum - 1
            sync = (
                contextlib.nullcontext()
                if last or not hasattr(model, "no_sync")
                else model.no_sync()
            )
            with sync:
                with _autocast(device, cfg.amp_dtype):
                    output = model(images)
                    loss = parts.criterion(output, soft)
                scaled = loss / accum
                (parts.scaler.scale(scaled) if parts.scaler is not None else scaled).backward()
            n = targets.numel()
            loss_sum += loss.detach().double() * n
            # Accuracy against each sample's own class, mixed or not.
            correct += (output.detach().argmax(1) == targets).sum()
            seen += n
            meter.add_images(n * world_size)
            if hooks.record is not None:
                hooks.record(indices, images, soft)
        warming_up = (
            parts.schedule is not None and pos.progress(parts.epoch_length) < parts.schedule.warmup
        )
        _optimizer_step(model, optimizer, parts.scaler, cfg.clip_grad_norm)
        pos.iteration += 1
        pos.samples += cfg.global_batch
        pos.samples_in_epoch += cfg.global_batch
        if parts.ema is not None:
            parts.ema.after_step(parts.raw, pos.iteration, warming_up)
        _set_lr(parts, pos)
        if hooks.after_step is not None:
            hooks.after_step()
        if bar is not None:
            bar.update(1)
        if pos.iteration % cfg.print_freq == 0:
            rate = meter.interval()
            _report(bar, pos, loss_sum, correct, seen, rate, optimizer, hooks,
                    first_step + steps, cfg.global_batch)  # fmt: skip
        if _reached(cfg.max_samples, pos):
            stopped = "max_iters"
            break
        if hooks.preempted is not None and hooks.preempted():
            stopped = "preempted"
            break
        if cfg.checkpoint_every and pos.iteration % cfg.checkpoint_every == 0:
            if hooks.save_checkpoint is not None:
                hooks.save_checkpoint()
    if bar is not None:
        bar.close()
    stats = dist_utils.all_reduce_sum(torch.stack([loss_sum, correct, seen]))
    total = max(stats[2].item(), 1.0)
    return EpochResult(
        loss=stats[0].item() / total,
        acc=stats[1].item() / total,
        stopped=stopped,
        throughput=meter.summary(),
    )


def _set_lr(parts: Parts, pos: Position) -> None:
    if parts.schedule is not None:
        parts.schedule.apply(parts.optimizer, pos.progress(parts.epoch_length))


def _reached(max_samples: int | None, pos: Position) -> bool:
    return max_samples is not None and pos.samples >= max_samples


def _optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    clip: float | None,
) -> None:
    if scaler is not None:
        if clip:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
    else:
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _progress(enabled: bool, total: int, epoch: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"epoch {epoch}", file=sys.stderr, dynamic_ncols=True)


def _report(bar, pos, loss_sum, correct, seen, rate, optimizer, hooks, steps_in_epoch, batch):
    # Local (this rank's) running means: a per-interval all-reduce would add a
    # sync point for numbers that only decorate the log.
    n = max(seen.item(), 1.0)
    values = {
        "epoch": pos.epoch,
        "iteration": pos.iteration,
        "samples": pos.samples,
        "samples_in_epoch": pos.samples_in_epoch,
        "loss": loss_sum.item() / n,
        "acc": correct.item() / n,
        "img_s": rate,
        "lr": optimizer.param_groups[0]["lr"],
    }
    if bar is not None:
        bar.set_postfix(
            loss=f"{values['loss']:.4f}", acc=f"{values['acc']:.3f}", img_s=f"{rate:.0f}"
        )
    else:
        log.info(
            "epoch %d step %d/%d  loss %.4f  acc %.3f  %.0f img/s  lr %.3g",
            pos.epoch, pos.samples_in_epoch // batch, steps_in_epoch, values["loss"],
            values["acc"], rate, values["lr"],
        )  # fmt: skip
    if hooks.log_row is not None:
        hooks.log_row("train_steps", values, pos.iteration)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Any,
    prepare: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    num_classes: int,
    amp_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Exact metrics over the whole split, whatever the world size.

    ``model`` must be the unwrapped module: DDP's forward broadcasts buffers,
    a collective that would hang when ranks hold different numbers of batches,
    which they do here because the sampler does not pad. Sums (not batch
    means) are reduced, so the loss is a true per-sample mean. Rank 0's
    buffers (BatchNorm statistics) are copied to all ranks first, so every
    rank evaluates the model rank 0 saves.
    """
    dist_utils.broadcast_buffers(model)
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    top1 = torch.zeros((), device=device, dtype=torch.float64)
    top5 = torch.zeros((), device=device, dtype=torch.float64)
    class_correct = torch.zeros(num_classes, device=device, dtype=torch.float64)
    class_total = torch.zeros(num_classes, device=device, dtype=torch.float64)
    k = min(5, num_classes)
    for images, targets, _ in loader:
        images = prepare(images)
        targets = targets.to(device, non_blocking=True)
        with _autocast(device, amp_dtype):
            output = model(images)
        output = output.float()
        loss_sum += F.cross_entropy(output, targets, reduction="sum").double()
        topk = output.topk(k, dim=1).indices
        hit1 = topk[:, 0] == targets
        top1 += hit1.sum()
        top5 += (topk == targets[:, None]).any(dim=1).sum()
        class_total.index_add_(0, targets, torch.ones_like(targets, dtype=torch.float64))
        class_correct.index_add_(0, targets, hit1.double())
    flat = torch.cat([torch.stack([loss_sum, top1, top5]), class_correct, class_total])
    flat = dist_utils.all_reduce_sum(flat)
    loss_sum, top1, top5 = flat[0].item(), flat[1].item(), flat[2].item()
    class_correct, class_total = flat[3 : 3 + num_classes], flat[3 + num_classes :]
    count = class_total.sum().item()
    present = class_total > 0
    per_class = (class_correct[present] / class_total[present]).mean().item() if count else 0.0
    denom = max(count, 1.0)
    return {
        "val_loss": loss_sum / denom,
        "top1": top1 / denom,
        "top5": top5 / denom,
        "mean_class_acc": per_class,
        "count": int(count),
    }
