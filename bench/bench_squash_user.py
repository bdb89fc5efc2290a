"""Benchmark: a per-user daemon's squashfs image datasets, against ``cp``, side by side.

    python -m bench.bench_squash_user [--work-dir /var/tmp/stager-bench-squash]
        [--user nobody] [--repeat 3] [--small-files 200000]

A daemon started as ``--user`` as a login would (``runuser -u USER --``), where no FUSE
reader of EROFS is (Debian 12): ``"image": true`` is the squashfs kind
(stager.kinds.squash), built by tar2sqfs and mounted by squashfuse_ll as the user.
/dev/fuse is made 0666 for the run, as Debian's udev leaves it, and given its mode back.

- **ready**: request to ready (``POST`` then ``GET .../wait``) against ``cp`` of the
  archive to the same disk, made durable (an fsync), alternated A B A B: the 20,000
  files of 4-100 KB (bench.datagen) and ``--small-files`` files of 512 B, each a
  ``.tar``; medians and the pairwise ratios.
- **evict**: ``DELETE`` of the ready ``--small-files`` image (unmount, delete a file).
- **writer**: the 20,000 files' image by ``tar2sqfs`` from the tar, against
  ``tar -x`` then ``mksquashfs`` (squashfs-tools 4.5.1 reads no tar), as root.
- **read**: every file of the 20,000 read through squashfuse_ll as the user
  (``tar -cf - . | cat``, warm: twice, the second timed), the lz4 image tar2sqfs
  wrote against one mksquashfs wrote uncompressed (``-noI -noD -noF -noX``).

The load average is printed with each section: the machine is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import shutil
import stat
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.bench_image import alternate, row
from bench.bench_image_daemon import Stager, copied, extract, load
from bench.datagen import make_archives, make_small_tar, make_tree
from stager.image import mount
from tests.daemon import Daemon, unmount_under
from tests.users import usable_by_everyone


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/var/tmp/stager-bench-squash"))
    parser.add_argument("--user", default="nobody", help="the daemon's user")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per candidate")
    parser.add_argument("--small-files", type=int, default=200_000)
    parser.add_argument("--sections", default="ready,evict,writer,read")
    return parser


@contextlib.contextmanager
def fuse_for_users() -> Iterator[None]:
    """/dev/fuse 0666 (Debian's mode) for the run, its own mode back after."""
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", mode | 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", mode)


class UserStager(Stager):
    """Stager's bench daemon, started as ``user`` through runuser."""

    def __init__(self, work: Path, user: str) -> None:
        shutil.rmtree(work / "cache", ignore_errors=True)
        wrapper = ["runuser", "-u", user, "--"]
        env = {"STAGER_LOG_LEVEL": "warning"}
        self.daemon = Daemon(cache_dir=work / "cache", extra_env=env, wrapper=wrapper)
        entry = pwd.getpwnam(user)
        os.chown(self.daemon.runtime_dir, entry.pw_uid, entry.pw_gid)
        self.daemon.start()


def ready_section(work: Path, stager: Stager, inputs: dict[str, Path], repeat: int) -> None:
    print(f"\n## Request to ready, per-user squashfs vs cp (durable), load {load()}\n")
    print("| case | stager | cp | ratio |")
    print("|---|---:|---:|---:|")
    for label, tar in (("20k files 4-100 KB", inputs["tar"]), (inputs["count"], inputs["small"])):
        body = {"name": "r", "steps": [extract(tar)], "image": True}

        def staged(body: dict = body) -> float:
            elapsed, _ = stager.ready(body)
            stager.delete("r")
            return elapsed

        candidates = {"stager": staged, "cp": copied(["cp", str(tar)], work / "copy.tar")}
        times = alternate(candidates, repeat)
        print(row(f"{label} files, .tar", times, "stager", "cp"))
    (work / "copy.tar").unlink(missing_ok=True)


def evict_section(stager: Stager, small: Path, count: str, repeat: int) -> None:
    print(f"\n## Eviction of a {count}-file squashfs dataset (DELETE), load {load()}\n")
    times = []
    for _ in range(repeat):
        stager.ready({"name": "e", "steps": [extract(small)], "image": True})
        times.append(stager.delete("e"))
        assert not mount.mounts_under(str(stager.daemon.cache_dir)), "DELETE left a mount"
    print(f"DELETE: median {statistics.median(times):.3f} s ({min(times):.3f}-{max(times):.3f})")


def _timed(argv: list[str] | str, user: str | None = None) -> float:
    command = ["sh", "-c", argv] if isinstance(argv, str) else argv
    if user is not None:
        command = ["runuser", "-u", user, "--", *command]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def writer_section(work: Path, tar: Path, repeat: int) -> dict[str, Path]:
    print(f"\n## Writer, 20k files 4-100 KB, as root, load {load()}\n")
    lz4, none, tree = work / "w-lz4.sqfs", work / "w-none.sqfs", work / "w-tree"
    jobs = str(os.cpu_count() or 1)

    def tar2sqfs() -> float:
        return _timed(f"tar2sqfs -q -f -s -c lz4 -j {jobs} {lz4} < {tar}")

    def mksquashfs() -> float:
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir()
        return _timed(
            f"tar -xf {tar} -C {tree} && mksquashfs {tree} {none} -noappend -quiet "
            f"-no-progress -noI -noD -noF -noX -processors {jobs}"
        )

    times = alternate({"tar2sqfs": tar2sqfs, "mksquashfs": mksquashfs}, repeat)
    print("| case | tar2sqfs (lz4) | tar -x + mksquashfs (none) | ratio |")
    print("|---|---:|---:|---:|")
    print(row("tar to image", times, "tar2sqfs", "mksquashfs"))
    shutil.rmtree(tree, ignore_errors=True)
    return {"lz4": lz4, "none": none}


def read_section(work: Path, images: dict[str, Path], user: str, repeat: int) -> None:
    print(f"\n## Reads through squashfuse_ll as {user}, 20k files, warm, load {load()}\n")
    targets = {name: work / f"m-{name}" for name in images}
    entry = pwd.getpwnam(user)
    for name, image in images.items():
        targets[name].mkdir(exist_ok=True)
        os.chown(targets[name], entry.pw_uid, entry.pw_gid)
        os.chmod(image, 0o644)
        _timed(["squashfuse_ll", "-o", "ro", str(image), str(targets[name])], user)
    try:

        def reader(target: Path) -> Any:
            def run() -> float:
                _timed(f"tar -cf - -C {target} . | cat", user)  # warmed
                return _timed(f"tar -cf - -C {target} . | cat", user)

            return run

        times = alternate({name: reader(t) for name, t in targets.items()}, repeat)
        print("| case | lz4 (tar2sqfs) | none (mksquashfs) | ratio |")
        print("|---|---:|---:|---:|")
        print(row("read every file", times, "lz4", "none"))
    finally:
        for target in targets.values():
            subprocess.run(["runuser", "-u", user, "--", "fusermount3", "-u", str(target)])


def main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("bench_squash_user: needs root (runuser, /dev/fuse's mode)", file=sys.stderr)
        return 2
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# bench_squash_user, {now}, load {load()}")
    sections = set(args.sections.split(","))
    tree = make_tree(work / "tree")
    archives = make_archives(tree, work)
    small = make_small_tar(work / f"small-{args.small_files}.tar", args.small_files)
    inputs = {**archives, "small": small, "count": f"{args.small_files:,}"}
    entry = pwd.getpwnam(args.user)
    for path in (work, *inputs.values()):
        if isinstance(path, Path):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    with usable_by_everyone(), fuse_for_users():
        stager = UserStager(work, args.user)
        try:
            if "ready" in sections:
                ready_section(work, stager, inputs, args.repeat)
            if "evict" in sections:
                evict_section(stager, small, inputs["count"], args.repeat)
        finally:
            stager.close()
            left = mount.mounts_under(str(work))
            unmount_under(work)
        print(f"\nFUSE mounts left after the daemon's stop: {len(left)}")
        if {"writer", "read"} & sections:
            images = writer_section(work, archives["tar"], args.repeat)
            if "read" in sections:
                read_section(work, images, args.user, args.repeat)
    print(f"\nload at the end {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(get_args_parser().parse_args()))
