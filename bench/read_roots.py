"""The trainer's input pipeline over several dataset roots, alternated: images per second.

    python -m bench.read_roots ROOT [ROOT ...] [--repeats 5] [--images 1536] [--workers N]

Each ROOT is an ImageFolder dataset (``ROOT/train/class_*/*.jpg``), read by
``stager-train --pipeline fast``'s own pipeline (bench.input_pipeline's
``trainer_pipeline``: the trainer's dataset, sampler, DataLoader and workers), with the
trainer's default workers (trainer.data.default_workers) unless ``--workers`` says.
Every image of each ROOT is read once first (warm: the page cache, and a FUSE
server's own); each run times ``--images`` images after two warm-up batches. The
roots take turns (A B A B ...), so a neighbour's load slows each alike. Prints one
JSON line: each root's runs in img/s. bench.bench_squash_user runs it as the daemon's
user, who alone may read that user's FUSE mounts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.input_pipeline import end_to_end, trainer_pipeline  # noqa: E402
from trainer import data  # noqa: E402


def warm(root: Path) -> None:
    """Every image of ``root`` read once."""
    for folder, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), "rb") as file:
                while file.read(1 << 20):
                    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--images", type=int, default=1536, help="images timed per run")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=data.default_workers(None))
    parser.add_argument("--crop", type=int, default=224)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as bench.input_pipeline: the main process only collates
    rates: dict[str, list[float]] = {str(root): [] for root in args.roots}
    for root in args.roots:
        warm(root)
    try:
        for _ in range(args.repeats):
            for root in args.roots:
                rate = end_to_end(trainer_pipeline, root, args.images, args.batch_size,
                                  args.workers, args.crop)  # fmt: skip
                rates[str(root)].append(rate)
    finally:
        data.stop_loader_server()
    print(json.dumps({"workers": args.workers, "rates": rates}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
