"""Generated inputs for the benchmarks: a tree of many small files and its archives.

The default mirrors a slice of an image dataset: 20,000 files of 4-100 KB in
class folders, about 1 GB, with incompressible contents like JPEGs have.
"""

from __future__ import annotations

import io
import os
import random
import subprocess
import tarfile
from pathlib import Path


def make_tree(
    root: Path,
    n_files: int = 20_000,
    min_kb: int = 4,
    max_kb: int = 100,
    n_dirs: int = 100,
    seed: int = 0,
) -> Path:
    """Write ``n_files`` random files under ``root/class_XXX/``; reuse it if complete."""
    root = Path(root)
    marker = root / ".complete"
    if marker.exists() and marker.read_text() == f"{n_files},{min_kb},{max_kb},{n_dirs},{seed}":
        return root
    rng = random.Random(seed)
    pool = os.urandom(max_kb * 1024 * 4)  # sliced at random offsets: fast and incompressible
    for i in range(n_files):
        folder = root / f"class_{i % n_dirs:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        size = rng.randint(min_kb * 1024, max_kb * 1024)
        start = rng.randint(0, len(pool) - size)
        (folder / f"img_{i:06d}.jpg").write_bytes(pool[start : start + size])
    marker.write_text(f"{n_files},{min_kb},{max_kb},{n_dirs},{seed}")
    return root


def make_archives(tree: Path, out_dir: Path) -> dict[str, Path]:
    """``tree.tar`` and ``tree.tar.gz`` of ``tree``, made by the system tar (reused if present)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tar_path, tgz_path = out_dir / "tree.tar", out_dir / "tree.tar.gz"
    if not tar_path.exists():
        subprocess.run(
            [
                "tar",
                "-cf",
                str(tar_path),
                "--exclude=.complete",
                "-C",
                str(tree.parent),
                tree.name,
            ],  # fmt: skip
            check=True,
        )
    if not tgz_path.exists():
        subprocess.run(
            [
                "tar",
                "-czf",
                str(tgz_path),
                "--exclude=.complete",
                "-C",
                str(tree.parent),
                tree.name,
            ],  # fmt: skip
            check=True,
        )
    return {"tar": tar_path, "tar.gz": tgz_path}


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def make_small_tree(
    root: Path, n_files: int, n_dirs: int = 1_000, size: int = 512, seed: int = 0
) -> Path:
    """``n_files`` files of ``size`` bytes in ``n_dirs`` folders (ImageNet's shape at
    ImageNet's count, with tiny files so the per-file cost shows); reused if complete.
    Written with raw descriptors: a million files take ~15 s on tmpfs."""
    root = Path(root)
    marker = root / ".complete"
    stamp = f"small,{n_files},{n_dirs},{size},{seed}"
    if marker.exists() and marker.read_text() == stamp:
        return root
    pool = random.Random(seed).randbytes(size * 64)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for d in range(n_dirs):
        folder = root / f"n{d:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        fd_dir = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(d, n_files, n_dirs):
                fd = os.open(f"img_{i:07d}.JPEG", flags, 0o644, dir_fd=fd_dir)
                start = i % (len(pool) - size)
                os.write(fd, pool[start : start + size])
                os.close(fd)
        finally:
            os.close(fd_dir)
    marker.write_text(stamp)
    return root


def make_small_tar(
    path: Path, n_files: int, size: int = 512, n_dirs: int = 1000, seed: int = 0
) -> Path:
    """A plain tar of ``n_files`` files of ``size`` bytes in ``n_dirs`` folders (ustar
    headers, as GNU tar writes them), streamed: no tree of a million files is made on
    the way. Reused if complete."""
    path = Path(path)
    marker = path.with_name(path.name + ".complete")
    tag = f"{n_files},{size},{n_dirs},{seed}"
    if path.exists() and marker.exists() and marker.read_text() == tag:
        return path
    rng = random.Random(seed)
    pool = rng.randbytes(size * 64)
    per_dir = -(-n_files // n_dirs)
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(n_files):
            folder = f"data/class_{i // per_dir:04d}"
            if i % per_dir == 0:
                info = tarfile.TarInfo(folder)
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_600_000_000
                tar.addfile(info)
            info = tarfile.TarInfo(f"{folder}/img_{i:07d}.jpg")
            info.size, info.mode, info.mtime = size, 0o644, 1_600_000_000
            start = (i * 131) % (len(pool) - size)
            tar.addfile(info, io.BytesIO(pool[start : start + size]))
    marker.write_text(tag)
    return path
