"""Small real trees and archives for tests, a content digest to compare them, and a
wait for background deletes."""

from __future__ import annotations

import hashlib
import os
import random
import tarfile
import time
from pathlib import Path


def write_tree(root: Path, n_files: int = 30, seed: int = 0, max_size: int = 20_000) -> Path:
    rng = random.Random(seed)
    for i in range(n_files):
        path = root / f"class_{i % 3}" / f"img_{i:04d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(rng.randint(1, max_size)))
    return root


def digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file (following file symlinks), dirs implied."""
    out = {}
    for dirpath, _dirs, files in os.walk(root, followlinks=True):
        for name in files:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def make_tar(src: Path, archive: Path, arcname: str | None = None) -> Path:
    mode = "w:gz" if archive.name.endswith((".tar.gz", ".tgz")) else "w"
    with tarfile.open(archive, mode) as tar:
        tar.add(src, arcname=arcname or src.name)
    return archive


def wait_until_empty(folder: Path, timeout: float = 10) -> None:
    """Discarded data (failed, cancelled, evicted) is deleted in the background."""
    deadline = time.monotonic() + timeout
    while list(folder.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(folder.iterdir()) == []
