"""CPU throughput of the trainer's input pipeline against two baselines.

Same generated JPEGs (500x375), same training augmentation (RandomResizedCrop
224 + flip + ImageNet normalisation), same batch size and worker count:

- reference: torchvision references/classification style: ImageFolder with the
  PIL loader, PIL transforms, float normalisation in the workers, DataLoader.
- threaded: seeds/001's loader: worker *threads* decode and transform into an
  image queue, a collector thread stacks batches into a batch queue.
- trainer: ``trainer.data`` as ``stager-train`` builds it (``--pipeline fast``):
  tensor decode, uint8 crop/flip in the workers, uint8 batches, normalisation
  after the batch arrives (on the device; here the CPU, and it is timed).

Run: ``.venv/bin/python bench/input_pipeline.py [--images 2048 --workers 2]``.
Only the CPU part: no GPU is lent to this task, so host-to-device copies and
on-GPU normalisation are not measured.
"""

from __future__ import annotations

import argparse
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
from torch.utils.data import DataLoader
from torchvision import datasets as tvd
from torchvision import transforms as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.jpegs import make_jpegs  # noqa: E402
from trainer import data  # noqa: E402

# torchvision 0.29 deprecates its image decoders in favour of TorchCodec; the
# warning would be printed once per worker and says nothing about speed.
warnings.filterwarnings("ignore", category=DeprecationWarning)


def reference_transform(crop: int) -> Callable:
    return T.Compose(
        [
            T.RandomResizedCrop(crop),
            T.RandomHorizontalFlip(),
            T.PILToTensor(),
            T.ConvertImageDtype(torch.float),
            T.Normalize(data.IMAGENET_MEAN, data.IMAGENET_STD),
        ]
    )


def reference_batches(root: Path, batch: int, workers: int, crop: int) -> Iterator[torch.Tensor]:
    ds = tvd.ImageFolder(str(root / "train"), transform=reference_transform(crop))
    loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)
    for images, _ in loader:
        yield images


class ThreadedLoader:
    """seeds/001's design: loader threads -> image queue -> collector thread -> batch queue."""

    def __init__(self, files: list[tuple[str, int]], transform, batch: int, threads: int):
        self.files, self.transform, self.batch = files, transform, batch
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

    def _load(self, part: list[tuple[str, int]]) -> None:
        i = 0
        while not self.stop.is_set():
            path, target = part[i % len(part)]
            img = self.transform(data.pil_loader(path))
            while not self.stop.is_set():
                try:
                    self.images.put((img, target), timeout=0.5)
                    break
                except queue.Full:
                    pass
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
                imgs = torch.stack([x for x, _ in items])
                targets = torch.tensor([t for _, t in items])
                while not self.stop.is_set():
                    try:
                        self.batches.put((imgs, targets), timeout=0.5)
                        break
                    except queue.Full:
                        pass

    def __iter__(self):
        while True:
            yield self.batches.get(timeout=60)[0]

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def threaded_batches(root: Path, batch: int, workers: int, crop: int) -> Iterator[torch.Tensor]:
    files = tvd.ImageFolder(str(root / "train")).samples
    loader = ThreadedLoader(files, reference_transform(crop), batch, workers)
    try:
        yield from loader
    finally:
        loader.close()


def trainer_batches(root: Path, batch: int, workers: int, crop: int) -> Iterator[torch.Tensor]:
    cfg = data.DataConfig(dataset="imagefolder", root=root, pipeline="fast", crop=crop)
    ds = data.Indexed(data.build_dataset(cfg, "train", data.train_transform("fast", crop)))
    sampler = data.ResumableSampler(ds, 1, 0, seed=0)
    loader = data.make_loader(ds, sampler, batch, workers, pin_memory=False, drop_last=True)
    normalize = data.DeviceNormalize(torch.device("cpu"))
    for images, _, _ in loader:
        yield normalize(images)  # what the training step does on arrival


def trainer_uint8_batches(
    root: Path, batch: int, workers: int, crop: int
) -> Iterator[torch.Tensor]:
    """The GPU configuration's host side: batches stop at uint8 (normalised on the GPU)."""
    cfg = data.DataConfig(dataset="imagefolder", root=root, pipeline="fast", crop=crop)
    ds = data.Indexed(data.build_dataset(cfg, "train", data.train_transform("fast", crop)))
    sampler = data.ResumableSampler(ds, 1, 0, seed=0)
    loader = data.make_loader(ds, sampler, batch, workers, pin_memory=False, drop_last=True)
    for images, _, _ in loader:
        yield images


PIPELINES = {
    "reference": reference_batches,
    "threaded": threaded_batches,
    "trainer": trainer_batches,
    "trainer-u8": trainer_uint8_batches,  # informational; not part of the goal
}


def measure(make, root: Path, images: int, batch: int, workers: int, crop: int) -> float:
    """img/s over ``images`` images after two warm-up batches (worker start-up)."""
    batches = make(root, batch, workers, crop)
    for _ in range(2):
        next(batches)
    n, start = 0, time.perf_counter()
    while n < images:
        x = next(batches)
        assert x.shape[-1] == crop
        n += x.shape[0]
    rate = n / (time.perf_counter() - start)
    batches.close()
    return rate


def main() -> int:
    cpus = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--root", default="/tmp/stager-bench-jpegs", help="JPEG folder (made if missing)"
    )
    p.add_argument("--num-files", type=int, default=3000, help="JPEGs to generate")
    p.add_argument("--images", type=int, default=1536, help="images timed per run")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=cpus, help="processes/threads per pipeline")
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--repeats", type=int, default=3, help="runs per pipeline (median reported)")
    args = p.parse_args()
    torch.set_num_threads(1)  # the main process only collates/normalises
    root = make_jpegs(Path(args.root), args.num_files)
    rates: dict[str, list[float]] = {name: [] for name in PIPELINES}
    # Interleaved repeats: a noisy neighbour slows every pipeline alike.
    for _ in range(args.repeats):
        for name, make in PIPELINES.items():
            rate = measure(make, root, args.images, args.batch_size, args.workers, args.crop)
            rates[name].append(rate)
    print(
        f"{args.num_files} JPEGs 500x375 in {root}; {args.images} images/run, batch "
        f"{args.batch_size}, {args.workers} workers, {cpus} CPUs, crop {args.crop}"
    )
    med = {name: statistics.median(r) for name, r in rates.items()}
    for name, r in rates.items():
        print(f"  {name:10s} {med[name]:8.1f} img/s  (runs: {', '.join(f'{x:.0f}' for x in r)})")
    ok = True
    for base in ("reference", "threaded"):
        ratio = med["trainer"] / med[base]
        ok &= ratio >= 1.3
        print(f"  trainer / {base:9s} = {ratio:.2f}x  (goal >= 1.3x)")
    print("  trainer-u8 = host side of the GPU configuration (uint8 batches, normalised on GPU)")
    print("GPU part (H2D copy, on-device normalisation) not measured: no GPU lent to this task.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
