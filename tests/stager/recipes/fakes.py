"""Tiny fake datasets in the exact release formats the recipes read.

Each builder writes the archives under the release's own file names, top
folders and inner layout, with valid JPEGs, and returns what a loader must find:
``Expected(files, classes)`` where ``files`` maps every image's file name to its
class (a folder name, a WordNet id, or a CIFAR label). File names are unique
across a dataset so a sample's class can be checked from its name alone.

Used by the recipe tests (a few classes, a few images) and by
bench/bench_recipes.py (ImageNet at 50 classes and 20,000 images).
"""

from __future__ import annotations

import io
import pickle
import random
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

MTIME = 1_700_000_000


@dataclass
class Expected:
    files: dict[str, str] = field(default_factory=dict)  # image file name -> class
    classes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # class -> names


def jpeg(rng: random.Random, size: tuple[int, int] = (12, 8)) -> bytes:
    """A small valid JPEG with random content."""
    image = Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=80)
    return out.getvalue()


class JpegPool:
    """Reuses a few hundred encoded JPEGs: encoding 20,000 would dominate a benchmark."""

    def __init__(self, rng: random.Random, size: tuple[int, int], count: int = 256) -> None:
        self.images = [jpeg(rng, size) for _ in range(count)]
        self.rng = rng

    def __call__(self) -> bytes:
        return self.rng.choice(self.images)


def add_file(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, MTIME
    tar.addfile(info, io.BytesIO(data))


def add_dir(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, MTIME
    tar.addfile(info)


def write_tree_tar(path: Path, top: str, tree: dict[str, list[tuple[str, bytes]]]) -> None:
    """``tree``: folder (relative to ``top``) -> [(file name, bytes)]; gzip by suffix."""
    mode = "w:gz" if path.name.endswith((".gz", ".tgz")) else "w"
    with tarfile.open(path, mode, **({"compresslevel": 1} if mode == "w:gz" else {})) as tar:
        add_dir(tar, top)
        for folder, files in tree.items():
            add_dir(tar, f"{top}/{folder}")
            for name, data in files:
                add_file(tar, f"{top}/{folder}/{name}", data)


# -- iNaturalist ---------------------------------------------------------------

INAT2021_TOPS = {"2021_train": "train", "2021_train_mini": "train_mini", "2021_valid": "val"}
INAT_PRE2021_TOPS = {"2017": "train_val_images", "2018": "train_val2018", "2019": "train_val2019"}


def inat2021_class(index: int) -> str:
    # torchvision splits on "_" into 8 pieces and wants the id to be the sorted position.
    return f"{index:05d}_Animalia_Chordata_Aves_Passeriformes_Fam{index % 2}_Gen{index}_sp{index}"


def make_inat2021(
    out: Path,
    splits: Iterable[str],
    classes: int = 3,
    per_class: int = 3,
    seed: int = 0,
    image_size: tuple[int, int] = (12, 8),
) -> dict[str, Expected]:
    """``train.tar.gz``/``train_mini.tar.gz``/``val.tar.gz`` with top folders of those names."""
    rng = random.Random(seed)
    pool = JpegPool(rng, image_size, count=min(256, classes * per_class))
    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    for split in splits:
        top = INAT2021_TOPS[split]
        exp = Expected()
        tree = {}
        for c in range(classes):
            name = inat2021_class(c)
            files = [(f"{top}_{c:05d}_{n}.jpg", pool()) for n in range(per_class)]
            tree[name] = files
            exp.files.update({f: name for f, _ in files})
            exp.classes[name] = (name,)
        write_tree_tar(out / f"{top}.tar.gz", top, tree)
        expected[split] = exp
    return expected


def make_inat_pre2021(out: Path, year: str, per_class: int = 2, seed: int = 0) -> Expected:
    """The 2017/2018/2019 archive: ``<top>/<super category>/<category>/<image>.jpg``.

    2017 names categories by species; 2018 and 2019 by numeric ids that must
    cover 0..N-1 across super categories (torchvision checks).
    """
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    top = INAT_PRE2021_TOPS[year]
    layout = {"Amphibia": 2, "Plantae": 3}
    tree: dict[str, list[tuple[str, bytes]]] = {}
    exp = Expected()
    next_id = 0
    for super_name, count in layout.items():
        for k in range(count):
            category = f"Species {super_name} {k}" if year == "2017" else str(next_id)
            next_id += 1
            folder = f"{super_name}/{category}"
            files = [(f"img_{year}_{next_id}_{n}.jpg", jpeg(rng)) for n in range(per_class)]
            tree[folder] = files
            exp.files.update({f: folder for f, _ in files})
            exp.classes[folder] = (folder,)
    # A super category's own folder entry, like the real archive has.
    write_tree_tar(out / f"{top}.tar.gz", top, {s: [] for s in layout} | tree)
    return exp


# -- ImageNet ------------------------------------------------------------------

IMAGENET_TRAIN = "ILSVRC2012_img_train.tar"
IMAGENET_VAL = "ILSVRC2012_img_val.tar"
IMAGENET_DEVKIT = "ILSVRC2012_devkit_t12.tar.gz"


def imagenet_wnids(count: int) -> list[str]:
    return [f"n{1440764 + 37 * i:08d}" for i in range(count)]


def make_imagenet(
    out: Path,
    classes: int = 3,
    train_per_class: int = 3,
    val_per_class: int = 2,
    seed: int = 0,
    image_size: tuple[int, int] = (12, 8),
) -> dict[str, Expected]:
    """The three release files: train (tar of per-class tars), val (flat), devkit."""
    rng = random.Random(seed)
    pool = JpegPool(rng, image_size, count=min(256, classes * train_per_class))
    out.mkdir(parents=True, exist_ok=True)
    wnids = imagenet_wnids(classes)
    words = {w: (f"class {i}", f"Genus{i} species{i}") for i, w in enumerate(wnids)}
    train = _imagenet_train(out / IMAGENET_TRAIN, wnids, train_per_class, pool)
    val_labels = [w for w in wnids for _ in range(val_per_class)]
    rng.shuffle(val_labels)  # the ground truth, in file-name order
    val = Expected(classes=dict(words))
    with tarfile.open(out / IMAGENET_VAL, "w") as tar:
        for i, wnid in enumerate(val_labels, start=1):
            name = f"ILSVRC2012_val_{i:08d}.JPEG"
            add_file(tar, name, pool())
            val.files[name] = wnid
    _imagenet_devkit(out / IMAGENET_DEVKIT, wnids, words, val_labels, rng)
    train.classes = dict(words)
    return {"train": train, "val": val}


def _imagenet_train(path: Path, wnids: list[str], per_class: int, pool: JpegPool) -> Expected:
    exp = Expected()
    with tarfile.open(path, "w") as outer:
        for wnid in wnids:
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as tar:
                for n in range(per_class):
                    name = f"{wnid}_{n}.JPEG"
                    add_file(tar, name, pool())
                    exp.files[name] = wnid
            add_file(outer, f"{wnid}.tar", inner.getvalue())
    return exp


def _imagenet_devkit(
    path: Path,
    wnids: list[str],
    words: dict[str, tuple[str, ...]],
    val_labels: list[str],
    rng: random.Random,
) -> None:
    """``data/meta.mat`` (leaf and non-leaf synsets, fields in the release's order) and
    ``data/ILSVRC2012_validation_ground_truth.txt`` (one ILSVRC2012_ID per val image)."""
    from scipy.io import savemat

    order = list(wnids)
    rng.shuffle(order)  # ILSVRC2012_IDs are not in WordNet-id order in the release
    ids = {wnid: i for i, wnid in enumerate(order, start=1)}
    fields = [
        "ILSVRC2012_ID",
        "WNID",
        "words",
        "gloss",
        "num_children",
        "children",
        "wordnet_height",
        "num_train_images",
    ]
    rows = [(ids[w], w, ", ".join(words[w]), "a leaf", 0, np.zeros((0,)), 0, 3) for w in order]
    # Two inner nodes of the hierarchy, which torchvision skips (num_children > 0).
    leaf_ids = np.array([float(ids[w]) for w in order])
    rows.append((len(order) + 1, "n00001740", "entity", "root", len(order), leaf_ids, 5, 0))
    rows.append((len(order) + 2, "n00002137", "abstraction", "inner", 1, leaf_ids[:1], 4, 0))
    synsets = np.zeros((len(rows),), dtype=[(f, object) for f in fields])
    for i, row in enumerate(rows):
        synsets[i] = row
    meta = io.BytesIO()
    savemat(meta, {"synsets": synsets})
    truth = "".join(f"{ids[w]}\n" for w in val_labels).encode()
    top = "ILSVRC2012_devkit_t12"
    with tarfile.open(path, "w:gz") as tar:
        for folder in (top, f"{top}/data", f"{top}/evaluation"):
            add_dir(tar, folder)
        add_file(tar, f"{top}/data/meta.mat", meta.getvalue())
        add_file(tar, f"{top}/data/ILSVRC2012_validation_ground_truth.txt", truth)
        add_file(tar, f"{top}/readme.txt", b"fake devkit for tests\n")


# -- CIFAR ---------------------------------------------------------------------


@dataclass
class CifarExpected:
    data: dict[str, np.ndarray]  # split -> (N, 32, 32, 3) uint8, as torchvision exposes it
    targets: dict[str, list[int]]
    classes: list[str]
    md5: dict[str, str]  # member file name -> md5 of the fake (torchvision checks md5s)


CIFAR_LAYOUT = {
    10: {
        "archive": "cifar-10-python.tar.gz",
        "top": "cifar-10-batches-py",
        "train": [f"data_batch_{i}" for i in range(1, 6)],
        "test": ["test_batch"],
        "meta": ("batches.meta", "label_names"),
        "labels": "labels",
    },
    100: {
        "archive": "cifar-100-python.tar.gz",
        "top": "cifar-100-python",
        "train": ["train"],
        "test": ["test"],
        "meta": ("meta", "fine_label_names"),
        "labels": "fine_labels",
    },
}


def make_cifar(out: Path, which: int, per_file: int = 4, seed: int = 0) -> CifarExpected:
    """The python tarball: pickled dicts of row-major CHW uint8 rows plus a meta file."""
    import hashlib

    layout = CIFAR_LAYOUT[which]
    rng = np.random.default_rng(seed)
    classes = [f"label_{i}" for i in range(which)]
    exp = CifarExpected(data={}, targets={}, classes=classes, md5={})
    members: dict[str, bytes] = {}
    for split in ("train", "test"):
        rows, targets = [], []
        for name in layout[split]:
            data = rng.integers(0, 256, (per_file, 3 * 32 * 32), dtype=np.uint8)
            labels = [int(x) for x in rng.integers(0, which, per_file)]
            members[name] = pickle.dumps({"data": data, layout["labels"]: labels})
            rows.append(data)
            targets.extend(labels)
        exp.data[split] = np.vstack(rows).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        exp.targets[split] = targets
    meta_name, meta_key = layout["meta"]
    members[meta_name] = pickle.dumps({meta_key: classes})
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / layout["archive"], "w:gz") as tar:
        add_dir(tar, layout["top"])
        for name, blob in members.items():
            add_file(tar, f"{layout['top']}/{name}", blob)
            exp.md5[name] = hashlib.md5(blob).hexdigest()
    return exp


# -- ImageFolder ---------------------------------------------------------------


def make_imagefolder(
    root: Path, splits: Iterable[str] | None, classes: int = 3, per_class: int = 2, seed: int = 0
) -> dict[str, Expected]:
    """A folder of class folders (``splits=None``), or of ``<split>/<class>/`` folders."""
    rng = random.Random(seed)
    expected = {}
    for split in splits or ["all"]:
        base = root if splits is None else root / split
        exp = Expected()
        for c in range(classes):
            name = f"class_{c}"
            (base / name).mkdir(parents=True, exist_ok=True)
            for n in range(per_class):
                fname = f"{split}_{c}_{n}.png" if n % 2 else f"{split}_{c}_{n}.jpg"
                data = jpeg(rng) if fname.endswith(".jpg") else _png(rng)
                (base / name / fname).write_bytes(data)
                exp.files[fname] = name
            exp.classes[name] = (name,)
        expected[split] = exp
    return expected


def _png(rng: random.Random) -> bytes:
    image = Image.frombytes("RGB", (6, 6), rng.randbytes(6 * 6 * 3))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
