"""Tar shards in the webdataset layout: writing (``stager-train shard``) and reading.

A shard is a plain tar whose members come in groups sharing a key:
``<key>.jpg`` (the encoded image, byte-for-byte from the source when there is a
source file) followed by ``<key>.cls`` (the class index as ASCII). Samples are
shuffled across the whole dataset before writing (seeds/004: a shuffle buffer
after sorting leaves the first shards one class deep), and ``index.json``,
written last, lists the shards and their sample counts; its presence means the
set is complete.

Reading builds an in-memory index of (shard, offset, size) from the tar
headers and serves random access with ``os.pread``. Shards exist so that the
stager moves a few large files instead of a million small ones; once they are
on node-local disk, random reads are cheap, and map-style access keeps the
trainer's exact DistributedSampler/resume semantics.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from trainer.data import SortedINaturalist, decode_bytes

INDEX_NAME = "index.json"
SHARD_PATTERN = "shard-{:06d}.tar"
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'512M' / '1G' / '1000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text.upper())
    if m is None:
        raise ValueError(f"cannot read size {text!r}; use a number with an optional K/M/G suffix")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


# --------------------------------------------------------------------------- writing


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
        "num_classes": _num_classes(dataset),
        "classes": [str(c) for c in classes] if classes is not None else None,
        "shards": shards,
    }
    tmp = out_dir / (INDEX_NAME + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out_dir / INDEX_NAME)
    return index


def _num_classes(dataset: Dataset) -> int:
    from trainer.data import num_classes

    return num_classes(dataset)


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


# --------------------------------------------------------------------------- reading


class ShardDataset(Dataset):
    """Map-style view of a shard folder: ``dataset[i] -> (image, target)``."""

    def __init__(
        self, folder: Path, transform: Callable | None = None, pipeline: str = "fast"
    ) -> None:
        self.folder = Path(folder)
        self.transform = transform
        self.pipeline = pipeline
        index_path = self.folder / INDEX_NAME
        if index_path.exists():
            meta = json.loads(index_path.read_text())
            names = [s["name"] for s in meta["shards"]]
        else:
            meta = {}
            names = sorted(p.name for p in self.folder.glob("*.tar"))
        if not names:
            raise FileNotFoundError(f"no shards (*.tar or {INDEX_NAME}) in {self.folder}")
        self.shard_paths = [str(self.folder / name) for name in names]
        # (shard number, offset, size, key, target)
        self.entries: list[tuple[int, int, int, str, int]] = []
        for number, path in enumerate(self.shard_paths):
            self.entries.extend(_scan(number, path))
        n_classes = meta.get("num_classes") or (1 + max(e[4] for e in self.entries))
        self.classes = meta.get("classes") or [str(c) for c in range(n_classes)]
        self._fds: dict[int, int] = {}
        self._pid = -1

    def __len__(self) -> int:
        return len(self.entries)

    def key(self, i: int) -> str:
        return self.entries[i][3]

    def read(self, i: int) -> bytes:
        number, offset, size, _, _ = self.entries[i]
        if self._pid != os.getpid():  # descriptors do not survive into forked workers cleanly
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(number)
        if fd is None:
            fd = self._fds[number] = os.open(self.shard_paths[number], os.O_RDONLY)
        # pread: no shared file offset, so threads and forks cannot interfere.
        return os.pread(fd, size, offset)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        data = self.read(i)
        if self.pipeline == "fast":
            img: Any = decode_bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        else:
            img = Image.open(io.BytesIO(data)).convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        return img, self.entries[i][4]

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for fd in self._fds.values():
                os.close(fd)


def _scan(number: int, path: str) -> Iterator[tuple[int, int, int, str, int]]:
    """Group a shard's members by key; an image member plus a .cls member is one sample."""
    pending: dict[str, dict[str, Any]] = {}
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            base = member.name.rsplit("/", 1)[-1]
            key, _, ext = base.partition(".")
            entry = pending.setdefault(key, {})
            if ext == "cls":
                entry["cls"] = int(tar.extractfile(member).read())  # type: ignore[union-attr]
            else:
                entry["img"] = (member.offset_data, member.size)
            if "cls" in entry and "img" in entry:
                offset, size = entry["img"]
                yield number, offset, size, key, entry["cls"]
                del pending[key]
    if pending:
        raise ValueError(f"shard {path} has incomplete samples: {sorted(pending)[:3]}")
