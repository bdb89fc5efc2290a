"""``stager-train shard``: any supported dataset -> shuffled webdataset shards."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from trainer import data
from trainer.shards import parse_size, write_shards

log = logging.getLogger("trainer")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.data_root is None and args.dataset != "fake":
        raise ValueError("--data-root is required")
    if args.dataset == "multifolder":
        # A shard sample is one image file; several views would need a new format.
        raise ValueError(
            "shards hold one image per sample; --dataset multifolder cannot be sharded"
        )
    # Raw bytes are copied where a source file exists; PIL decodes otherwise.
    cfg = data.DataConfig.from_args(args, root=Path(args.data_root or "."), pipeline="pil")
    shard_bytes = parse_size(args.shard_size)
    for split in [s.strip() for s in args.splits.split(",") if s.strip()]:
        dataset = data.build_dataset(cfg, split, transform=None)
        if dataset is None:
            log.info("%s: no %s split; skipped", args.dataset, split)
            continue
        out = Path(args.output_dir) / split
        start = time.perf_counter()
        last = [start]

        def progress(done: int, total: int, split: str = split, last: list = last) -> None:
            now = time.perf_counter()
            if now - last[0] > 5 or done == total:
                last[0] = now
                log.info("%s: %d/%d samples", split, done, total)

        index = write_shards(
            dataset, out, shard_bytes, args.shard_max_count, seed=args.seed, progress=progress
        )
        log.info(
            "%s: %d samples in %d shards under %s (%.1fs)",
            split, index["samples"], len(index["shards"]), out, time.perf_counter() - start,
        )  # fmt: skip
    return 0
