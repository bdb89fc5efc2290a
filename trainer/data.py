"""Datasets, transforms, samplers and loaders.

Two input paths produce the same batches in different places:

- ``pil``: what torchvision's reference does: PIL decode, PIL resize, float
  conversion and normalisation in the worker; float32 batches cross the
  worker->main queue (4 bytes a pixel).
- ``fast`` (default): libjpeg-turbo decode straight into a uint8 tensor
  (``torchvision.io.decode_image``), uint8 resize/crop/flip with the v2 kernels,
  uint8 batches (1 byte a pixel) to the device, and the float conversion and
  normalisation there (`DeviceNormalize`), where it is nearly free.

Every training sample is drawn with an RNG seeded from (seed, epoch, index), so
augmentation does not depend on which worker loaded it or on where a resumed
run started; that is what makes resume bit-exact.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchvision import datasets as tvd
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DATASETS = (
    "inat", "inat2021", "imagenet", "imagefolder", "cifar10", "fake", "shards", "multifolder",
)  # fmt: skip
INAT_VAL_DEFAULT = {"2021_train": "2021_valid", "2021_train_mini": "2021_valid"}


class DataError(RuntimeError):
    """A dataset cannot be built from what is on disk; the message names the fix."""


# --------------------------------------------------------------------------- decoding


def pil_loader(path: str | os.PathLike) -> Image.Image:
    # convert("RGB") matters: iNat and ImageNet hold a few CMYK and greyscale
    # JPEGs, and torchvision's INaturalist returns them unconverted.
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


def tensor_loader(path: str | os.PathLike) -> torch.Tensor:
    """File -> uint8 CHW RGB tensor via libjpeg-turbo/libpng (no PIL object)."""
    return decode_bytes(torchvision.io.read_file(str(path)))


def decode_bytes(data: torch.Tensor) -> torch.Tensor:
    return decode_image(data, mode=ImageReadMode.RGB)


def to_uint8_tensor(img: Any) -> torch.Tensor:
    """Datasets that yield PIL images (FakeData, CIFAR) enter the fast path here."""
    if isinstance(img, torch.Tensor):
        return img
    return v2.functional.pil_to_tensor(img.convert("RGB"))


# --------------------------------------------------------------------------- transforms


def train_transform(pipeline: str, crop: int, augment: bool = True, resize: int = 256) -> Callable:
    if not augment:
        # Overfitting checks and smoke runs: the deterministic eval view.
        return eval_transform(pipeline, resize, crop)
    if pipeline == "pil":
        return v2.Compose(
            [
                v2.RandomResizedCrop(crop, antialias=True),
                v2.RandomHorizontalFlip(),
                v2.PILToTensor(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )
    return v2.Compose(
        [
            to_uint8_tensor,
            v2.RandomResizedCrop(crop, antialias=True),
            v2.RandomHorizontalFlip(),
        ]
    )


def eval_transform(pipeline: str, resize: int, crop: int) -> Callable:
    if pipeline == "pil":
        return v2.Compose(
            [
                v2.Resize(resize, antialias=True),
                v2.CenterCrop(crop),
                v2.PILToTensor(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )
    return v2.Compose([to_uint8_tensor, v2.Resize(resize, antialias=True), v2.CenterCrop(crop)])


class DeviceNormalize:
    """uint8 NCHW batch on the device -> normalised float (no-op on float input).

    On CPU the float output goes into one of two reused buffers: a fresh 38 MB
    tensor per batch costs more in page faults than the arithmetic itself
    (glibc hands large blocks back to the OS on free). A result therefore
    stays valid until the call after next, which is all a training or
    evaluation step needs. CUDA's caching allocator makes fresh tensors cheap,
    so there each call allocates.
    """

    def __init__(
        self, device: torch.device, channels_last: bool = False, channels: int = 3
    ) -> None:
        # Stacked RGB views (--dataset multifolder) get the RGB statistics per view.
        views = channels // 3
        mean = torch.tensor(IMAGENET_MEAN, device=device).repeat(views).view(1, channels, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=device).repeat(views).view(1, channels, 1, 1)
        self.mean = mean * 255
        self.inv_std = 1.0 / (std * 255)
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self._ring: list[torch.Tensor] = []
        self._turn = 0

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            out = self._buffer(images)
            out.copy_(images)
            images = out.sub_(self.mean).mul_(self.inv_std)
        return images.contiguous(memory_format=self.memory_format)

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.empty(like.shape, device=self.device, memory_format=self.memory_format)
        if not self._ring or self._ring[0].shape != like.shape:
            self._ring = [
                torch.empty(like.shape, memory_format=self.memory_format) for _ in range(2)
            ]
        self._turn ^= 1
        return self._ring[self._turn]


# --------------------------------------------------------------------------- datasets


class SortedINaturalist(tvd.INaturalist):
    """torchvision's INaturalist with a file order that is the same on every node.

    Upstream builds its index from ``os.listdir``, whose order depends on the
    filesystem; each node stages its own copy, so ranks on different nodes could
    disagree about what index 17 is and DistributedSampler would silently
    duplicate and skip samples. Sorting fixes the order.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.index.sort()

    def num_classes(self) -> int:
        (kind,) = self.target_type
        return len(self.all_categories) if kind == "full" else len(self.categories_index[kind])

    def file_path(self, i: int) -> str:
        cat_id, fname = self.index[i]
        return os.path.join(self.root, self.all_categories[cat_id], fname)


@dataclass
class DataConfig:
    dataset: str
    root: Path
    pipeline: str = "fast"
    crop: int = 224
    val_resize: int = 256
    inat_version: str = "2021_train"
    inat_val_version: str | None = None
    target_type: str = "full"
    fake_size: int = 1000
    fake_val_size: int = 100
    fake_image_size: int = 64
    fake_classes: int = 10
    views: tuple[str, ...] = ()  # multifolder: one folder per view
    align: str = "stem"

    @classmethod
    def from_args(cls, args: Any, root: Path, pipeline: str, **overrides: Any) -> DataConfig:
        """The dataset flags every ``stager-train`` command shares (train, shard)."""
        return cls(
            dataset=args.dataset,
            root=root,
            pipeline=pipeline,
            inat_version=args.inat_version,
            inat_val_version=args.inat_val_version,
            target_type=args.target_type,
            fake_size=args.fake_size,
            fake_val_size=args.fake_val_size,
            fake_image_size=args.fake_image_size,
            fake_classes=args.num_classes or 10,
            views=tuple(v.strip() for v in (args.views or "").split(",") if v.strip()),
            align=args.align,
            **overrides,
        )


def build_dataset(cfg: DataConfig, split: str, transform: Callable | None) -> Dataset | None:
    """One split of ``cfg.dataset``; None if the dataset has no such split."""
    loader = tensor_loader if cfg.pipeline == "fast" else pil_loader
    root = Path(cfg.root)
    name = cfg.dataset
    try:
        if name in ("inat", "inat2021"):
            version = cfg.inat_version if split == "train" else _inat_val_version(cfg)
            if version is None:
                return None
            return SortedINaturalist(
                str(root), version=version, target_type=cfg.target_type,
                transform=transform, loader=loader,
            )  # fmt: skip
        if name == "imagenet":
            return tvd.ImageNet(str(root), split=split, transform=transform, loader=loader)
        if name == "imagefolder":
            folder = root / split
            if split != "train" and not folder.is_dir():
                return None
            return tvd.ImageFolder(str(folder), transform=transform, loader=loader)
        if name == "cifar10":
            return tvd.CIFAR10(str(root), train=split == "train", transform=transform)
        if name == "fake":
            size = cfg.fake_size if split == "train" else cfg.fake_val_size
            s = cfg.fake_image_size
            # A different offset makes the validation images differ from training ones.
            offset = 0 if split == "train" else 10**6
            return tvd.FakeData(size, (3, s, s), cfg.fake_classes, transform, random_offset=offset)
        if name == "shards":
            from trainer.shards import ShardDataset

            folder = root / split
            if split != "train" and not folder.is_dir():
                return None
            return ShardDataset(folder, transform=transform, pipeline=cfg.pipeline)
        if name == "multifolder":
            return _multifolder(cfg, split, transform)
    except (RuntimeError, FileNotFoundError) as exc:
        raise DataError(
            f"cannot load the {name} {split} split from {root}: {exc}; "
            "check --data-root (or --stager-wait) and the dataset layout"
        ) from exc
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def _multifolder(cfg: DataConfig, split: str, transform: Callable | None) -> Dataset | None:
    from trainer.multifolder import MultiViewFolder

    if cfg.pipeline != "fast":
        # The PIL transforms normalise 3 channels in the worker; stacked views need 3 x N.
        raise DataError("--dataset multifolder reads with the fast pipeline; drop --pipeline pil")
    folder = Path(cfg.root) / split
    if split != "train" and not folder.is_dir():
        return None
    return MultiViewFolder(folder, cfg.views, transform, cfg.align)


def input_channels(cfg: DataConfig) -> int:
    """Channels of one input sample: 3 (RGB), or 3 per view for multifolder."""
    return 3 * len(cfg.views) if cfg.dataset == "multifolder" else 3


def _inat_val_version(cfg: DataConfig) -> str | None:
    if cfg.inat_val_version:
        return None if cfg.inat_val_version == "none" else cfg.inat_val_version
    version = INAT_VAL_DEFAULT.get(cfg.inat_version)
    if version and (Path(cfg.root) / version).is_dir():
        return version
    return None


def num_classes(dataset: Dataset) -> int:
    if isinstance(dataset, SortedINaturalist):
        return dataset.num_classes()
    if isinstance(dataset, tvd.FakeData):
        return dataset.num_classes
    if hasattr(dataset, "classes"):
        return len(dataset.classes)
    raise DataError(f"cannot infer the number of classes of {type(dataset).__name__}")


# --------------------------------------------------------------------------- sampling


class Indexed(Dataset):
    """Adds the sample index to each item and seeds augmentation per sample.

    Keys are ints (evaluation) or ``(epoch, index)`` tuples from `ResumableSampler`.
    The index travels with the batch so evaluation and tests can account for
    every sample exactly.
    """

    def __init__(self, dataset: Dataset, seed: int = 0) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Any, Any, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        # fork_rng keeps the caller's stream untouched when num_workers=0.
        with torch.random.fork_rng(devices=[]):
            state = random.getstate()
            sample_seed = (self.seed * 1_000_003 + epoch) * 10_000_019 + index
            torch.manual_seed(sample_seed % (2**63))
            random.seed(sample_seed)
            try:
                img, target = self.dataset[index]
            finally:
                random.setstate(state)
        return img, target, index


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way through.

    It yields ``(epoch, index)`` so `Indexed` can seed per sample. After a
    resume, `set_start(k)` skips the first k indices of this rank's epoch
    permutation; the permutation depends only on (seed, epoch), so the rest of
    the epoch is exactly what the uninterrupted run would have seen.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        # drop_last: ranks get equal counts without repeating samples; the few
        # dropped ones change every epoch with the permutation.
        super().__init__(dataset, num_replicas, rank, shuffle=True, seed=seed, drop_last=True)
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def set_start(self, start: int) -> None:
        self.start = start

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        indices = list(super().__iter__())[self.start :]
        return iter([(self.epoch, i) for i in indices])

    def __len__(self) -> int:
        return self.num_samples - self.start


class ShardedEvalSampler(Sampler[int]):
    """rank::world of range(n) with no padding, so every sample counts once."""

    def __init__(self, n: int, num_replicas: int, rank: int) -> None:
        self.indices = list(range(rank, n, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def default_workers(
    cpus_per_task: int | None, local_world_size: int = 1, launcher: str = "single"
) -> int:
    """Loader workers per process: SLURM's allocation, else this process's CPU affinity.

    SLURM_CPUS_PER_TASK counts the CPUs of one SLURM task. srun starts one
    trainer per task, so each has them all; torchrun inside a task starts
    ``local_world_size`` trainers that share them. One core is left for the
    process driving the GPU.
    """
    if cpus_per_task:
        sharing = local_world_size if launcher == "torchrun" else 1
        cpus = cpus_per_task // max(sharing, 1)
    else:
        cpus = len(os.sched_getaffinity(0)) // max(local_world_size, 1)
    return max(1, min(cpus - 1, 16))


def collate(
    batch: Sequence[tuple[Any, Any, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    images, targets, indices = zip(*batch, strict=True)
    return (
        torch.stack(images),
        torch.as_tensor(targets, dtype=torch.long),
        torch.as_tensor(indices, dtype=torch.long),
    )


def make_loader(
    dataset: Dataset,
    sampler: Sampler,
    batch_size: int,
    num_workers: int,
    pin_memory: bool,
    drop_last: bool,
    prefetch_factor: int = 4,
    seed: int = 0,
) -> DataLoader:
    extra: dict[str, Any] = {}
    if num_workers > 0:
        # persistent: worker start-up (fork + dataset copy) is paid once, not per epoch.
        extra = {"persistent_workers": True, "prefetch_factor": prefetch_factor}
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=drop_last,
        collate_fn=collate,
        # Own generator: worker seeding must not consume (and so depend on)
        # the global RNG, whose state a resumed run restores.
        generator=torch.Generator().manual_seed(seed),
        **extra,
    )
