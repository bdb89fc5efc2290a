"""Which dataset to read: by ``--dataset``, or from the staged dataset's ``usage``.

A recipe-staged dataset comes with its torchvision call (``usage``: a class of
``torchvision.datasets``, its root inside the staged folder and its keyword
arguments, one per split). `from_usage` builds exactly that, so any recipe
trains without code here; ``--dataset`` is the fallback for data staged from
raw steps (and for data not staged at all).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset
from torchvision import datasets as tvd

from trainer.decode import load_pil, load_tensor

log = logging.getLogger(__name__)

DATASETS = (
    "inat", "inat2021", "imagenet", "imagefolder", "cifar10", "fake", "shards", "multifolder",
)  # fmt: skip
INAT_VAL_DEFAULT = {"2021_train": "2021_valid", "2021_train_mini": "2021_valid"}
# Words that mark a usage entry (its kwargs or its root) as the validation split.
_VAL_WORDS = ("val", "valid", "validation", "test")


class DataError(RuntimeError):
    """A dataset cannot be built from what is on disk; the message names the fix."""


class SortedINaturalist(tvd.INaturalist):
    """torchvision's INaturalist with a file order that is the same on every node.

    Upstream builds its index from ``os.listdir``, whose order depends on the
    filesystem; each node stages its own copy, so ranks on different nodes could
    disagree about what index 17 is and the sampler would silently duplicate
    and skip samples. Sorting fixes the order.
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
    dataset: str | None
    root: Path
    pipeline: str = "fast"
    inat_version: str = "2021_train"
    inat_val_version: str | None = None
    target_type: str = "full"
    fake_size: int = 1000
    fake_val_size: int = 100
    fake_image_size: int = 64
    fake_classes: int = 10
    views: tuple[str, ...] = ()  # multifolder: one folder per view
    align: str = "stem"
    # The staged dataset's torchvision calls (``DatasetPublic.usage`` as dicts).
    usage: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def from_args(
        cls, args: Any, root: Path, pipeline: str, usage: Sequence[Mapping[str, Any]] = ()
    ) -> DataConfig:
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
            usage=tuple(usage),
        )

    @property
    def loader(self) -> Callable[[str], Any]:
        return load_tensor if self.pipeline == "fast" else load_pil

    def describe(self) -> str:
        if self.usage:
            return "staged usage " + "; ".join(_call_text(u) for u in self.usage)
        return str(self.dataset)


def build_dataset(cfg: DataConfig, split: str, transform: Callable | None) -> Dataset | None:
    """One split ("train" or "val"); None if the dataset has no such split."""
    try:
        if cfg.usage:
            return from_usage(cfg, split, transform)
        return _by_name(cfg, split, transform)
    except (RuntimeError, FileNotFoundError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(
            f"cannot load the {cfg.describe()} {split} split from {cfg.root}: {exc}; "
            "check --data-root (or --stager-wait) and the dataset layout"
        ) from exc


def _by_name(cfg: DataConfig, split: str, transform: Callable | None) -> Dataset | None:
    root = Path(cfg.root)
    name = cfg.dataset
    if name is None:
        raise DataError(
            "no --dataset given and the staged dataset carries no torchvision usage "
            "(it was staged from raw steps); pass --dataset"
        )
    if name in ("inat", "inat2021"):
        version = cfg.inat_version if split == "train" else _inat_val_version(cfg)
        if version is None:
            return None
        return SortedINaturalist(
            str(root), version=version, target_type=cfg.target_type,
            transform=transform, loader=cfg.loader,
        )  # fmt: skip
    if name == "imagenet":
        return tvd.ImageNet(str(root), split=split, transform=transform, loader=cfg.loader)
    if name == "imagefolder":
        folder = root / split
        if split != "train" and not folder.is_dir():
            return None
        return tvd.ImageFolder(str(folder), transform=transform, loader=cfg.loader)
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
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


# --------------------------------------------------------------------------- usage


def split_of(usage: Mapping[str, Any]) -> str:
    """ "val" if a usage entry loads a validation/test split, else "train".

    Recipes say it in torchvision's own words: ``split="val"`` (ImageNet),
    ``train=False`` (CIFAR), ``version="2021_valid"`` (iNaturalist), a ``val/``
    root (ImageFolder).
    """
    kwargs = usage.get("kwargs") or {}
    if kwargs.get("train") is False:
        return "val"
    words = [str(v).lower() for k, v in kwargs.items() if k in ("split", "version")]
    words.append(Path(str(usage.get("root") or ".")).name.lower())
    for word in words:
        if word in _VAL_WORDS or any(word.endswith("_" + w) for w in _VAL_WORDS):
            return "val"
    return "train"


def from_usage(cfg: DataConfig, split: str, transform: Callable | None) -> Dataset | None:
    entries = [u for u in cfg.usage if split_of(u) == split]
    if not entries:
        if split == "train":
            raise DataError(
                f"the staged dataset has no training split among its usage "
                f"({'; '.join(_call_text(u) for u in cfg.usage)}); stage a training split"
            )
        return None
    if len(entries) > 1:
        log.warning(
            "the staged dataset offers %d %s splits; training on the first (%s)",
            len(entries), split, _call_text(entries[0]),
        )  # fmt: skip
    return _construct(cfg, entries[0], transform)


def _construct(cfg: DataConfig, usage: Mapping[str, Any], transform: Callable | None) -> Dataset:
    dotted = str(usage.get("class") or usage.get("class_") or "")
    module, _, name = dotted.rpartition(".")
    cls = getattr(tvd, name, None) if module in ("torchvision.datasets", "") else None
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        raise DataError(
            f"the staged dataset's usage names {dotted!r}, which is not a torchvision.datasets "
            "class; pass --dataset to say how to read it"
        )
    if cls is tvd.INaturalist:
        cls = SortedINaturalist  # the same files in the same order on every node
    kwargs = dict(usage.get("kwargs") or {})
    params = inspect.signature(cls.__init__).parameters
    if "loader" in params:
        kwargs["loader"] = cfg.loader
    if "target_type" in params and "target_type" not in kwargs:
        kwargs["target_type"] = cfg.target_type
    root = Path(cfg.root) / str(usage.get("root") or ".")
    return cls(str(root), transform=transform, **kwargs)


def _call_text(usage: Mapping[str, Any]) -> str:
    args = "".join(f", {k}={v!r}" for k, v in (usage.get("kwargs") or {}).items())
    root = usage.get("root") or "."
    where = "root" if root in ("", ".") else f"root/{root}"
    return f"{usage.get('class') or usage.get('class_')}({where}{args})"


# --------------------------------------------------------------------------- helpers


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
    return 3 * len(cfg.views) if cfg.dataset == "multifolder" and not cfg.usage else 3


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
