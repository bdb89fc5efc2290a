"""Which kernel mounts of an index image (:mod:`stager.image.index`) this kernel accepts.

    python -m bench.index_mounts [--work-dir /var/tmp/stager-index-mounts]   (root)

An index image names its blob (the tar) as its extra device (``device=``). Three ways
to give it to the kernel, each tried once over a small tar of odd members, and read
back against ``tar -xf`` of the same tar when it mounts:

* ``file+file``: the image mounted from its file (Linux 6.12+), the blob a file.
* ``loop+file``: the image through a loop device, the blob a file. Linux's
  ``erofs_init_device`` opens an extra device as a block device unless the image
  itself is file-backed (``bdev_file_open_by_path``: ENOTBLK, reported as EINVAL).
* ``loop+loop``: both through read-only loop devices (what a kernel before 6.12
  would need).

Every mount is taken down and every loop device detached before it ends.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import shutil
import subprocess
from pathlib import Path

from stager.image.index import build_indexed
from tests import tar_corpus


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work-dir", type=Path, default=Path("/var/tmp/stager-index-mounts"), help="scratch"
    )
    return parser


def _odd_tar(work: Path) -> Path:
    tree = work / "src"
    write = tar_corpus._write  # noqa: SLF001 - the corpus's own writer
    for size in (0, 1, 511, 512, 4095, 4096, 300_001):
        write(tree / "sizes" / f"f{size}", os.urandom(size))
    write(tree.joinpath("n" * 200, "m" * 255) / "deep", b"long names")
    os.symlink("../sizes/f512", tree / "sizes" / "up")
    os.symlink("t" * 1000, tree / "long-target")
    os.link(tree / "sizes" / "f4096", tree / "hard")
    archive = work / "odd.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree, ".")
    return archive


def _losetup(path: Path) -> str:
    done = subprocess.run(
        ["losetup", "-r", "-f", "--show", str(path)], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def _mount(source: str, target: Path, device: str) -> str | None:
    """None when mounted, else the kernel's error."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    options = f"device={device}".encode()
    if libc.mount(source.encode(), str(target).encode(), b"erofs", 1 | 2 | 4, options) == 0:
        return None
    return os.strerror(ctypes.get_errno())


def try_way(way: str, image: Path, blob: Path, target: Path, reference: Path) -> str:
    loops: list[str] = []
    try:
        source = str(image) if way.startswith("file") else _losetup(image)
        if not way.startswith("file"):
            loops.append(source)
        device = str(blob) if way.endswith("file") else _losetup(blob)
        if not way.endswith("file"):
            loops.append(device)
        error = _mount(source, target, device)
        if error is not None:
            return f"refused: {error}"
        try:
            same = tar_corpus.snapshot(target) == tar_corpus.snapshot(reference)
        finally:
            subprocess.run(["umount", str(target)], check=True)
        return "mounted, reads back as tar -xf" if same else "mounted, READS BACK DIFFERENTLY"
    finally:
        for loop in loops:
            subprocess.run(["losetup", "-d", loop], check=True)


def main(args: argparse.Namespace) -> int:
    work = args.work_dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        archive = _odd_tar(work)
        reference = work / "reference"
        reference.mkdir()
        tar_corpus.gnu_tar("--no-same-owner", "-xf", archive, "-C", reference)
        image, blob = work / "odd.erofs", work / "odd.blob"
        build_indexed(str(archive), str(blob), str(image))
        target = work / "mnt"
        target.mkdir()
        print(f"kernel {os.uname().release}")
        for way in ("file+file", "loop+file", "loop+loop"):
            print(f"{way}: {try_way(way, image, blob, target, reference)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(get_args_parser().parse_args()))
