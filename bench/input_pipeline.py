"""The trainer's input pipeline, stage by stage and end to end, against the fairest reference.

Same generated JPEGs (500x375, photo-like), same training augmentation
(RandomResizedCrop 224 + horizontal flip, ImageNet normalisation), same batch.

Pipelines:

- ``tv-published``: torchvision's references/classification as published: PIL
  decode, PIL crop/flip, float conversion and normalisation per image in the
  workers, float32 batches across the worker queue.
- ``fair-ref``: the same PIL decode and crop/flip, but uint8 batches, normalised
  after batching (what the trainer does, and what anyone could write with
  torchvision: ``PILToTensor`` in the transform, normalise on arrival).
- ``seeds-001``: seeds/001's threaded loader (worker threads decode and
  transform into an image queue, a collector thread stacks batches), with the
  published float-per-image transform, as seeds/001 has it.
- ``trainer``: ``stager-train --pipeline fast``: libjpeg-turbo decode into a
  tensor, v2 crop/flip on uint8, the per-sample seeding that makes resume
  exact, uint8 batches normalised after batching.

Per stage (one process, one thread, files in the page cache): microseconds an
image and images per second per core, for read, decode, augment (crop + flip
to a uint8 tensor), seed (trainer only), normalise (per image for
tv-published, per batch otherwise), collate. End to end: a DataLoader with
``--workers`` processes (threads for seeds-001), img/s and img/s per core.
Every figure is the median of ``--repeats`` interleaved runs.

Run: ``.venv/bin/python bench/input_pipeline.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import io
import os
import queue
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets as tvd
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.jpegs import make_jpegs  # noqa: E402
from trainer import data, decode  # noqa: E402
from trainer.datasets import DataConfig, build_dataset  # noqa: E402
from trainer.seeding import seed_sample  # noqa: E402
from trainer.transforms import (  # noqa: E402
    IMAGENET_MEAN,
    IMAGENET_STD,
    Augment,
    DeviceNormalize,
    train_transform,
)

# torchvision deprecates its image decoders in favour of TorchCodec; the warning
# would be printed once per worker and says nothing about speed.
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torchvision")


# ------------------------------------------------------------------ transforms


def pil_crop_flip(crop: int) -> v2.Compose:
    """Reference crop + flip on a PIL image, to a uint8 tensor (the fair reference's transform)."""
    return v2.Compose([v2.RandomResizedCrop(crop), v2.RandomHorizontalFlip(), v2.PILToTensor()])


def published_transform(crop: int) -> v2.Compose:
    """references/classification's ClassificationPresetTrain: float, normalised per image."""
    return v2.Compose(
        [
            v2.RandomResizedCrop(crop),
            v2.RandomHorizontalFlip(),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def per_image_normalise() -> v2.Compose:
    return v2.Compose(
        [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )


# ------------------------------------------------------------------ stages


def _per_image(fn: Callable[[int], object], n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - start) / n * 1e6


def stage_times(files: list[str], crop: int, batch: int) -> dict[tuple[str, str], float]:
    """Microseconds an image, per (stage, pipeline), single thread."""
    n = len(files)
    blobs = [Path(f).read_bytes() for f in files]  # warm the page cache
    pils = [decode.pil_decode(b, f) for b, f in zip(blobs, files, strict=True)]
    tensors = [decode.decode(b, f) for b, f in zip(blobs, files, strict=True)]
    ref_aug, fast_aug = pil_crop_flip(crop), train_transform("fast", Augment(crop=crop))
    crops = [ref_aug(p) for p in pils]
    floats = [per_image_normalise()(c) for c in crops]
    to_float = per_image_normalise()
    normalise = DeviceNormalize(torch.device("cpu"))
    batches = [crops[i : i + batch] for i in range(0, n - batch + 1, batch)]
    fbatches = [floats[i : i + batch] for i in range(0, n - batch + 1, batch)]
    stacked = [torch.stack(b) for b in batches]
    in_batches = len(batches) * batch

    def per_batch(fn, items) -> float:
        start = time.perf_counter()
        for item in items:
            fn(item)
        return (time.perf_counter() - start) / in_batches * 1e6

    t = {}
    t["read", "all"] = _per_image(lambda i: Path(files[i]).read_bytes(), n)
    t["decode", "PIL"] = _per_image(
        lambda i: Image.open(io.BytesIO(blobs[i])).convert("RGB"), n
    )  # fmt: skip
    t["decode", "trainer"] = _per_image(lambda i: decode.decode(blobs[i], files[i]), n)
    t["augment", "PIL"] = _per_image(lambda i: ref_aug(pils[i]), n)
    t["augment", "trainer"] = _per_image(lambda i: fast_aug(tensors[i]), n)
    t["seed", "trainer"] = _per_image(lambda i: seed_sample(0, 0, i), n)
    t["seed", "torch.manual_seed"] = _per_image(lambda i: torch.manual_seed(i), n)
    t["normalise", "per image"] = _per_image(lambda i: to_float(crops[i]), n)
    t["normalise", "per batch"] = per_batch(normalise, stacked)
    t["collate", "float32"] = per_batch(torch.stack, fbatches)
    t["collate", "uint8"] = per_batch(torch.stack, batches)
    return t


# Which stage variant each pipeline runs, per image.
STAGES = {
    "tv-published": [("read", "all"), ("decode", "PIL"), ("augment", "PIL"),
                     ("normalise", "per image"), ("collate", "float32")],
    "fair-ref": [("read", "all"), ("decode", "PIL"), ("augment", "PIL"),
                 ("normalise", "per batch"), ("collate", "uint8")],
    "trainer": [("read", "all"), ("decode", "trainer"), ("augment", "trainer"),
                ("seed", "trainer"), ("normalise", "per batch"), ("collate", "uint8")],
}  # fmt: skip


# ------------------------------------------------------------------ end to end


def _loader_batches(ds, batch: int, workers: int, collate=None) -> Iterator:
    loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                        drop_last=True, persistent_workers=workers > 0,
                        collate_fn=collate)  # fmt: skip
    while True:
        yield from loader


def tv_published(root: Path, batch: int, workers: int, crop: int) -> Iterator[torch.Tensor]:
    ds = tvd.ImageFolder(str(root / "train"), transform=published_transform(crop))
    for images, _ in _loader_batches(ds, batch, workers):
        yield images


def fair_reference(root: Path, batch: int, workers: int, crop: int) -> Iterator[torch.Tensor]:
    ds = tvd.ImageFolder(str(root / "train"), transform=pil_crop_flip(crop))
    normalise = DeviceNormalize(torch.device("cpu"))
    for images, _ in _loader_batches(ds, batch, workers):
        yield normalise(images)


class ThreadedLoader:
    """seeds/001's design: loader threads -> image queue -> collector thread -> batch queue."""

    def __init__(self, files: list[tuple[str, int]], transform, batch: int, threads: int):
        self.transform, self.batch = transform, batch
        self.images: queue.Queue = queue.Queue(maxsize=2 * batch * threads)
        self.batches: queue.Queue = queue.Queue(maxsize=4)
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._load, args=(files[i::threads],), daemon=True)
            for i in range(threads)
        ]
        self.threads.append(threading.Thread(target=self._collect, daemon=True))
        for t in self.threads:
            t.start()

    def _put(self, q: queue.Queue, item) -> None:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.5)
                return
            except queue.Full:
                pass

    def _load(self, part: list[tuple[str, int]]) -> None:
        i = 0
        while not self.stop.is_set():
            path, target = part[i % len(part)]
            with Image.open(path) as img:
                self._put(self.images, (self.transform(img.convert("RGB")), target))
            i += 1

    def _collect(self) -> None:
        while not self.stop.is_set():
            items = []
            while len(items) < self.batch and not self.stop.is_set():
                try:
                    items.append(self.images.get(timeout=0.5))
                except queue.Empty:
                    pass
            if len(items) == self.batch:
                images = torch.stack([x for x, _ in items])
                self._put(self.batches, (images, torch.tensor([t for _, t in items])))

    def __iter__(self):
        while True:
            yield self.batches.get(timeout=120)[0]

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def seeds_001(root: Path, batch: int, workers: int, crop: int) -> Iterator[torch.Tensor]:
    files = tvd.ImageFolder(str(root / "train")).samples
    loader = ThreadedLoader(files, published_transform(crop), batch, workers)
    try:
        yield from loader
    finally:
        loader.close()


def trainer_pipeline(root: Path, batch: int, workers: int, crop: int) -> Iterator[torch.Tensor]:
    cfg = DataConfig(dataset="imagefolder", root=root, pipeline="fast")
    train = build_dataset(cfg, "train", train_transform("fast", Augment(crop=crop)))
    ds = data.Indexed(train, seed=0)
    order = data.EpochOrder(len(ds), seed=0)
    sampler = data.ResumableSampler(order, 1, 0, batch)
    loader = data.make_loader(ds, sampler, batch, workers, pin_memory=False, drop_last=True)
    normalise = DeviceNormalize(torch.device("cpu"))  # what the training step does on arrival
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for images, _, _ in loader:
            yield normalise(images)
        epoch += 1


PIPELINES = {
    "tv-published": tv_published,
    "fair-ref": fair_reference,
    "seeds-001": seeds_001,
    "trainer": trainer_pipeline,
}


def end_to_end(make, root: Path, images: int, batch: int, workers: int, crop: int) -> float:
    """img/s over ``images`` images after two warm-up batches (worker start-up)."""
    batches = make(root, batch, workers, crop)
    for _ in range(2):
        next(batches)
    n, start = 0, time.perf_counter()
    while n < images:
        x = next(batches)
        assert x.shape[-1] == crop and x.dtype == torch.float32
        n += x.shape[0]
    rate = n / (time.perf_counter() - start)
    batches.close()
    return rate


# ------------------------------------------------------------------ report


def main(argv: list[str] | None = None) -> int:
    cpus = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="/tmp/stager-bench-jpegs", help="JPEGs (made if missing)")
    p.add_argument("--num-files", type=int, default=3000, help="JPEGs to generate")
    p.add_argument("--images", type=int, default=1536, help="images timed per end-to-end run")
    p.add_argument("--stage-images", type=int, default=256, help="images timed per stage run")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=cpus, help="processes/threads per pipeline")
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--repeats", type=int, default=3, help="runs (the median is reported)")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, one repeat")
    args = p.parse_args(argv)
    if args.quick:  # sizes given explicitly still win
        given = set(argv if argv is not None else sys.argv[1:])
        for flag, value in (("--num-files", 64), ("--images", 64), ("--stage-images", 32),
                            ("--batch-size", 16), ("--repeats", 1), ("--workers", 1)):  # fmt: skip
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
    torch.set_num_threads(1)  # the main process only collates/normalises
    root = make_jpegs(Path(args.root), args.num_files)
    files = [path for path, _ in tvd.ImageFolder(str(root / "train")).samples]
    files = files[: args.stage_images]
    print(f"{args.num_files} JPEGs 500x375 in {root}; crop {args.crop}, batch "
          f"{args.batch_size}, {args.workers} workers, {cpus} CPUs; median of "
          f"{args.repeats}")  # fmt: skip

    runs = [stage_times(files, args.crop, args.batch_size) for _ in range(args.repeats)]
    stage = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    print("\nper stage, one thread (us/image, img/s per core):")
    for (name, variant), us in stage.items():
        print(f"  {name:9s} {variant:17s} {us:8.1f} us  {1e6 / us:9.0f} img/s")
    totals = {pipe: sum(stage[k] for k in keys) for pipe, keys in STAGES.items()}
    print("\nsum of stages per pipeline (us/image, img/s per core):")
    for pipe, us in totals.items():
        print(f"  {pipe:13s} {us:8.1f} us  {1e6 / us:7.0f} img/s per core")

    rates: dict[str, list[float]] = {name: [] for name in PIPELINES}
    try:
        for _ in range(args.repeats):  # interleaved: a noisy neighbour slows every one alike
            for name, make in PIPELINES.items():
                rate = end_to_end(make, root, args.images, args.batch_size, args.workers, args.crop)
                rates[name].append(rate)
    finally:
        data.stop_loader_server()  # the trainer's loaders' forkserver: this run started it
    med = {name: statistics.median(r) for name, r in rates.items()}
    print(f"\nend to end, {args.workers} workers on {cpus} CPUs:")
    for name, r in rates.items():
        runs_text = ", ".join(f"{x:.0f}" for x in r)
        ratio = med["trainer"] / med[name]
        print(f"  {name:13s} {med[name]:7.0f} img/s  {med[name] / cpus:6.0f} img/s per core"
              f"  trainer/this {ratio:5.2f}x  (runs: {runs_text})")  # fmt: skip

    fair, ours = totals["fair-ref"], totals["trainer"]
    print("\nwhere the trainer's gain over the fair reference comes from (us/image saved):")
    for label, ref_key, our_key in (
        ("decode (libjpeg-turbo to tensor vs PIL)", ("decode", "PIL"), ("decode", "trainer")),
        ("augment (v2 on uint8 tensor vs PIL)", ("augment", "PIL"), ("augment", "trainer")),
    ):
        print(f"  {label:42s} {stage[ref_key] - stage[our_key]:+8.1f}")
    print(f"  {'per-sample seeding (exact resume)':42s} {-stage['seed', 'trainer']:+8.1f}")
    print(f"  predicted from stages: {fair / ours:.2f}x; measured end to end: "
          f"{med['trainer'] / med['fair-ref']:.2f}x")  # fmt: skip
    published = totals["tv-published"]
    print(f"  tv-published -> fair-ref (uint8 batches, normalise after batching): "
          f"{published / fair:.2f}x from stages, {med['fair-ref'] / med['tv-published']:.2f}x "
          f"end to end (the rest: 4x fewer bytes through the worker queue)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
