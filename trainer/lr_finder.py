"""LR range test (``stager-train find-lr``), seeds/003's find_lr made DDP-safe.

Each LR of an exponential sweep starts from the same weights and optimizer
state and sees the same batches (the sampler is reset to epoch 0 every run),
so the runs differ only in the LR. Losses are averaged over all ranks, so every
rank takes the same early-stop decision and the collectives stay matched.
"""

from __future__ import annotations

import argparse
import copy
import csv
import logging
import math
from pathlib import Path

import torch

from trainer import engine
from trainer.distributed import World
from trainer.train import build, run

log = logging.getLogger("trainer")
DIVERGED = 4.0  # stop once the loss exceeds this multiple of the best seen


def main(args: argparse.Namespace) -> int:
    return run(args, find_lr)


def sweep_lrs(min_lr: float, max_lr: float, n: int) -> list[float]:
    if n < 2 or not 0 < min_lr < max_lr:
        raise ValueError("find-lr needs 0 < --min-lr < --max-lr and --num-runs >= 2")
    ratio = (max_lr / min_lr) ** (1 / (n - 1))
    return [min_lr * ratio**i for i in range(n)]


def suggest(lrs: list[float], losses: list[float]) -> float | None:
    """LR of the steepest loss descent (per log-LR) on the finite part of the curve."""
    pts = [
        (math.log10(lr), loss) for lr, loss in zip(lrs, losses, strict=True) if math.isfinite(loss)
    ]
    if len(pts) < 3:
        return None
    # Light smoothing: single runs are noisy and the slope amplifies noise.
    smooth = [pts[0][1]] + [
        (a[1] + b[1] + c[1]) / 3 for a, b, c in zip(pts, pts[1:], pts[2:], strict=False)
    ]
    smooth.append(pts[-1][1])
    slopes = [
        (smooth[i + 1] - smooth[i]) / (pts[i + 1][0] - pts[i][0]) for i in range(len(pts) - 1)
    ]
    best = min(range(len(slopes)), key=slopes.__getitem__)
    return 10 ** pts[best][0]


def find_lr(args: argparse.Namespace, world: World, device: torch.device) -> int:
    s = build(args, world, device)
    start_model = copy.deepcopy(s.model.state_dict())
    start_opt = copy.deepcopy(s.optimizer.state_dict())
    # Per-parameter overrides keep their ratio to the base LR during the sweep.
    ratios = [g["lr"] / args.lr for g in s.optimizer.param_groups]
    global_batch = world.world_size * args.batch_size * args.accum_steps
    cfg = engine.StepConfig(
        accum_steps=args.accum_steps, amp_dtype=s.amp, print_freq=10**9,
        max_samples=args.iters_per_run * global_batch, global_batch=global_batch,
        seed=args.seed, rank=world.rank,
    )  # fmt: skip
    parts = engine.Parts(
        model=s.train_model, raw=s.model, criterion=s.criterion, optimizer=s.optimizer,
        prepare=s.prepare, device=device,
    )  # fmt: skip
    lrs = sweep_lrs(args.min_lr, args.max_lr, args.num_runs)
    losses: list[float] = []
    best = math.inf
    for lr in lrs:
        s.model.load_state_dict(start_model)
        s.optimizer.load_state_dict(start_opt)
        for group, ratio in zip(s.optimizer.param_groups, ratios, strict=True):
            group["lr"] = lr * ratio
        s.train_sampler.set_epoch(0)  # the same batches for every LR
        result = engine.train_one_epoch(
            parts, s.train_loader, engine.Position(), cfg, engine.Hooks(), world.world_size
        )
        losses.append(result.loss)
        log.info("lr %.3g: loss %.4f", lr, result.loss)
        best = min(best, result.loss)
        if not math.isfinite(result.loss) or result.loss > DIVERGED * best:
            log.info("loss diverged; stopping the sweep")
            break
    lrs = lrs[: len(losses)]
    suggestion = suggest(lrs, losses)
    if world.is_main:
        out = Path(args.output_dir)
        write_outputs(out, lrs, losses, suggestion)
        text = f"{suggestion:.3g}" if suggestion else "none (too few finite points)"
        print(f"suggested LR: {text}  (csv: {out / 'lr_find.csv'}, plot: {out / 'lr_find.png'})")
    return 0


def write_outputs(
    out: Path, lrs: list[float], losses: list[float], suggestion: float | None
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lr_find.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["lr", "loss"])
        w.writerows(zip(lrs, losses, strict=True))
    import matplotlib

    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lrs, losses, marker="o")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("mean training loss")
    if suggestion:
        ax.axvline(suggestion, color="red", linestyle="--", label=f"suggested {suggestion:.2g}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "lr_find.png", dpi=100)
    plt.close(fig)
