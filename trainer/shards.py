"""Tar shards in the webdataset layout: the format, and reading them (``--dataset shards``).

A shard is a plain tar whose members come in groups sharing a key:
``<key>.jpg`` (the encoded image, byte-for-byte from the source when there is a
source file) followed by ``<key>.cls`` (the class index as ASCII). Samples are
shuffled across the whole dataset before writing (seeds/004: a shuffle buffer
after sorting leaves the first shards one class deep), and ``index.json``,
written last, lists the shards and their sample counts; its presence means the
set is complete.

``stager-train shard`` writes them (`trainer.shard_cmd`). Reading builds an
in-memory index of (shard, offset, size) from the tar headers and serves
random access with ``os.pread``. Shards exist so that the
stager moves a few large files instead of a million small ones; once they are
on node-local disk, random reads are cheap, and map-style access keeps the
trainer's exact DistributedSampler/resume semantics.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from trainer.decode import decode, pil_decode

INDEX_NAME = "index.json"
SHARD_PATTERN = "shard-{:06d}.tar"


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
        name = f"{self.shard_paths[self.entries[i][0]]}:{self.key(i)}"
        img: Any = decode(data, name) if self.pipeline == "fast" else pil_decode(data, name)
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
