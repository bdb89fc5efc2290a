"""``stager-train shard``: any supported dataset -> shuffled webdataset shards.

The format is `trainer.shards`' (which also reads it back). Encoded images are
copied byte for byte where the dataset has source files; anything else is
re-encoded losslessly (PNG).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from trainer.datasets import DataConfig, SortedINaturalist, build_dataset, num_classes
from trainer.shards import INDEX_NAME, SHARD_PATTERN

log = logging.getLogger("trainer")
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'512M' / '1G' / '1000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text.upper())
    if m is None:
        raise ValueError(f"cannot read size {text!r}; use a number with an optional K/M/G suffix")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def raw_sample(dataset: Dataset, i: int) -> tuple[bytes, str, int]:
    """(encoded image, extension, target) of sample i without re-encoding when possible."""
    if isinstance(dataset, SortedINaturalist):
        path = dataset.file_path(i)
        cat_id, _ = dataset.index[i]
        (kind,) = dataset.target_type
        target = cat_id if kind == "full" else dataset.categories_map[cat_id][kind]
        return Path(path).read_bytes(), _ext(path), int(target)
    samples = getattr(dataset, "samples", None)  # ImageFolder, ImageNet
    if samples is not None:
        path, target = samples[i]
        return Path(path).read_bytes(), _ext(path), int(target)
    img, target = dataset[i]
    if isinstance(img, torch.Tensor):
        img = Image.fromarray(img.permute(1, 2, 0).numpy())
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="PNG")  # lossless: shards hold exactly the source pixels
    return buf.getvalue(), "png", int(target)


def _ext(path: str) -> str:
    ext = Path(path).suffix.lower().lstrip(".")
    return "jpg" if ext in ("jpeg", "jpg") else ext or "bin"


def write_shards(
    dataset: Dataset,
    out_dir: Path,
    shard_bytes: int,
    max_count: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Write ``dataset`` (transform None) as shuffled shards; return the index."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(dataset)  # type: ignore[arg-type]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    shards: list[dict[str, Any]] = []
    writer = _ShardWriter(out_dir)
    for done, i in enumerate(order, 1):
        data, ext, target = raw_sample(dataset, i)
        full = writer.count and (
            writer.bytes + len(data) > shard_bytes or (max_count and writer.count >= max_count)
        )
        if full:
            shards.append(writer.close())
        writer.add(f"s{i:09d}", ext, data, target)
        if progress:
            progress(done, n)
    if writer.count:
        shards.append(writer.close())
    classes = getattr(dataset, "classes", None)
    index = {
        "format": "webdataset",
        "samples": n,
        "seed": seed,
        "num_classes": num_classes(dataset),
        "classes": [str(c) for c in classes] if classes is not None else None,
        "shards": shards,
    }
    tmp = out_dir / (INDEX_NAME + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out_dir / INDEX_NAME)
    return index


class _ShardWriter:
    """One open shard at a time, written to ``.tmp`` and renamed when closed."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.number = 0
        self.tar: tarfile.TarFile | None = None
        self.count = 0
        self.bytes = 0

    def add(self, key: str, ext: str, data: bytes, target: int) -> None:
        if self.tar is None:
            self.path = self.out_dir / SHARD_PATTERN.format(self.number)
            self.tar = tarfile.open(
                self.path.with_suffix(".tar.tmp"), "w", format=tarfile.USTAR_FORMAT
            )
        for name, payload in ((f"{key}.{ext}", data), (f"{key}.cls", str(target).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            info.mode = 0o444
            self.tar.addfile(info, io.BytesIO(payload))
        self.count += 1
        self.bytes += len(data)

    def close(self) -> dict[str, Any]:
        assert self.tar is not None
        self.tar.close()
        os.replace(self.path.with_suffix(".tar.tmp"), self.path)
        entry = {"name": self.path.name, "count": self.count, "bytes": self.path.stat().st_size}
        self.tar, self.count, self.bytes = None, 0, 0
        self.number += 1
        return entry


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
    cfg = DataConfig.from_args(args, root=Path(args.data_root or "."), pipeline="pil")
    shard_bytes = parse_size(args.shard_size)
    for split in [s.strip() for s in args.splits.split(",") if s.strip()]:
        dataset = build_dataset(cfg, split, transform=None)
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
