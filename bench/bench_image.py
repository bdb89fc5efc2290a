"""Benchmark: image mode against the one-file copies and the extracted tree it replaces.

    python -m bench.bench_image [--work-dir /var/tmp/stager-bench-image] [--repeat 3]
                                [--small-files 1000000] [--sections ready,read-20k,...]

Ready time: an EROFS image built from a ``.tar`` (and a ``.tar.gz``) by
``stager.image.build`` in this process, as a staging process would run it, against
``cp archive.tar`` and ``zcat archive.tar.gz > file`` to the same disk; each once
as it is (the page cache holds the result) and once made durable (the image's
fsync, ``cp`` followed by an fsync of the copy). Runs alternate (A B A B ...) and
the table shows medians and the spread. Inputs: the 20,000 files of 4-100 KB of
``bench.datagen.make_tree`` and ``--small-files`` files of 512 B in 1,000 folders.

Read speed: every file read once in a seeded random order (one process, 1 MiB
reads), through the kernel's mount of the image and from the same tree extracted
by GNU tar on the same disk; warm (after an untimed pass) and cold (the page cache
dropped before each run: root only). FUSE too where its tools are installed:
``squashfuse_ll`` over a squashfs that ``sqfstar -no-duplicates`` built (Debian
12 has no FUSE reader of EROFS).

Index images (``--sections index``, :mod:`stager.image.index`): the ``.tar`` copied
whole, as the blob beside the image or into the image itself (embedded, a plain tar's
default), while an image of its metadata is built, against ``cp`` and against the
ordinary image, all alternated, fsync'd or not; and the index image's reads (its
mount with the blob as ``device=``, warm and cold) in the read sections. With
``--reference-mkfs CMD`` (an erofs-utils 1.7+ ``mkfs.erofs``, which Debian 12 lacks),
its ``--tar=i`` (the same index, written in C, the tar left where it is: no copy) is
timed beside them.

Eviction: a mounted million-file image unmounted and deleted, against ``rm -rf``
of its tree once. Peak memory: the build's RSS (a ``stager image build`` process) at
20,000 and at ``--small-files`` files.

The load average is printed before and after: the machine is shared. Extracted
trees are deleted as soon as their section ends (/dev/shm holds ~3M inodes).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.datagen import make_archives, make_small_tar, make_tree
from bench.timing import spread
from stager.image import mount
from stager.image.build import BuildOptions, build_image
from stager.image.index import build_indexed


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/var/tmp/stager-bench-image"),
        help="inputs, images and extracted trees (on the disk being measured)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per candidate")
    parser.add_argument(
        "--small-files", type=int, default=1_000_000, help="512-byte files of the large case"
    )
    parser.add_argument(
        "--sections",
        default="ready,index,read-20k,read-small,evict,memory",
        help="which sections to run, comma-separated (default: all)",
    )
    parser.add_argument(
        "--fuse-max-files",
        type=int,
        default=200_000,
        help="read through FUSE only in cases of at most this many files: squashfuse_ll "
        "reads a small file by decompressing its whole fragment block, minutes a pass at 1M",
    )
    parser.add_argument(
        "--reference-mkfs",
        default="",
        help="the index section times this erofs-utils 1.7+ mkfs.erofs command's --tar=i "
        "beside stager's (a command line: e.g. a newer release's binary run through its "
        "own loader)",
    )
    return parser


# -- timing -----------------------------------------------------------------------


def alternate(candidates: dict[str, Callable[[], float]], repeat: int) -> dict[str, list[float]]:
    """Each candidate ``repeat`` times, in turn; each returns its own seconds."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeat):
        for name, run in candidates.items():
            os.sync()
            times[name].append(run())
    return times


def row(label: str, times: dict[str, list[float]], a: str, b: str) -> str:
    ma, mb = statistics.median(times[a]), statistics.median(times[b])
    pairs = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
    return (
        f"| {label} | {ma:.2f} s ({spread(times[a])}) | {mb:.2f} s ({spread(times[b])}) "
        f"| {ma / mb:.2f}x (pairs {pairs[0]:.2f}-{pairs[-1]:.2f}) |"
    )


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed_build(source: Path, output: Path, sync: bool) -> Callable[[], float]:
    def run() -> float:
        output.unlink(missing_ok=True)
        start = time.perf_counter()
        build_image(str(source), str(output), BuildOptions(sync=sync))
        return time.perf_counter() - start

    return run


def timed_indexed(source: Path, blob: Path | None, output: Path, sync: bool) -> Callable[[], float]:
    """The index image of ``source``, its blob at ``blob`` (None: embedded in it)."""

    def run() -> float:
        output.unlink(missing_ok=True)
        if blob is not None:
            blob.unlink(missing_ok=True)
        start = time.perf_counter()
        into = str(blob) if blob is not None else None
        build_indexed(str(source), into, str(output), BuildOptions(sync=sync))
        return time.perf_counter() - start

    return run


def timed_command(
    argv: list[str], output: Path, sync: bool, stdout: bool = False, tail: tuple[str, ...] = ()
) -> Callable[[], float]:
    """``argv OUTPUT *tail`` (or ``argv > OUTPUT``), timed."""

    def run() -> float:
        output.unlink(missing_ok=True)
        start = time.perf_counter()
        if stdout:
            with open(output, "wb") as out:
                subprocess.run(argv, stdout=out, check=True)
        else:
            subprocess.run([*argv, str(output), *tail], check=True)
        if sync:
            _fsync_path(output)
        return time.perf_counter() - start

    return run


# -- ready time -----------------------------------------------------------------------


def ready_section(work: Path, archives: dict[str, Path], small: Path, repeat: int) -> None:
    print("\n## Ready time: image built from the archive vs one-file copy, same disk\n")
    print("| case | image build | baseline | ratio (median; pairwise range) |")
    print("|---|---:|---:|---:|")
    out, copy = work / "bench.erofs", work / "copy.bin"
    for label, source, baseline, as_stdout in (
        ("20k files 4-100 KB, .tar vs cp", archives["tar"], ["cp", str(archives["tar"])], False),
        (
            "20k files 4-100 KB, .tar.gz vs zcat > file",
            archives["tar.gz"],
            ["zcat", str(archives["tar.gz"])],
            True,
        ),
        (f"{_count(small)} files of 512 B, .tar vs cp", small, ["cp", str(small)], False),
    ):
        for sync in (False, True):
            times = alternate(
                {
                    "image": timed_build(source, out, sync),
                    "base": timed_command(baseline, copy, sync, as_stdout),
                },
                repeat,
            )
            print(row(f"{label}{' (durable: fsync)' if sync else ''}", times, "image", "base"))
            sys.stdout.flush()
    out.unlink(missing_ok=True)
    copy.unlink(missing_ok=True)


def index_section(
    work: Path, archives: dict[str, Path], small: Path, repeat: int, reference: str
) -> None:
    print("\n## Ready time: index image (tar copied + metadata image) vs cp, same disk\n")
    print("| case | candidate | baseline | ratio (median; pairwise range) |")
    print("|---|---:|---:|---:|")
    out, blob, copy = work / "index.erofs", work / "index.blob", work / "copy.bin"
    image, embedded, made = work / "bench.erofs", work / "embedded.erofs", work / "mkfs.erofs"
    for label, source in (
        ("20k files 4-100 KB, .tar", archives["tar"]),
        (f"{_count(small)} files of 512 B, .tar", small),
    ):
        for sync in (False, True):
            candidates = {
                "embedded": timed_indexed(source, None, embedded, sync),
                "index": timed_indexed(source, blob, out, sync),
                "image": timed_build(source, image, sync),
                "cp": timed_command(["cp", str(source)], copy, sync),
            }
            if reference:  # mkfs.erofs OUTPUT TAR: the output first
                argv = [*shlex.split(reference), "--quiet", "--tar=i"]
                candidates["mkfs"] = timed_command(argv, made, sync, tail=(str(source),))
            times = alternate(candidates, repeat)
            durable = " (durable: fsync)" if sync else ""
            for name, what in (
                ("embedded", "the tar embedded"),
                ("index", "index, blob apart"),
                ("image", "ordinary image"),
                ("mkfs", "mkfs.erofs --tar=i (no copy)"),
            ):
                if name in times:
                    print(row(f"{label}: {what} vs cp{durable}", times, name, "cp"))
            sys.stdout.flush()
        print(
            f"| {label}: index image's own size | {out.stat().st_size:,} B | "
            f"blob {blob.stat().st_size:,} B | |"
        )
    for path in (out, blob, copy, image, embedded, made):
        path.unlink(missing_ok=True)


def _count(small: Path) -> str:
    return f"{int(small.with_name(small.name + '.complete').read_text().split(',')[0]):,}"


# -- read speed -----------------------------------------------------------------------


def listing(root: Path) -> list[str]:
    names = [
        os.path.relpath(os.path.join(folder, name), root)
        for folder, _, files in os.walk(root)
        for name in files
    ]
    random.Random(1).shuffle(names)
    return names


def read_all(root: Path, names: list[str]) -> float:
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    start = time.perf_counter()
    for name in names:
        fd = os.open(os.path.join(root, name), os.O_RDONLY)
        while os.readv(fd, [view]) == len(buffer):
            pass
        os.close(fd)
    return time.perf_counter() - start


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as control:
        control.write("3\n")


@contextlib.contextmanager
def mounted(
    image: Path, target: Path, how: str = "loop", device: Path | None = None
) -> Iterator[Path]:
    """Mounted by the kernel (``how``: "loop" or "file"; an index image with its blob
    as ``device``) or by FUSE ("fuse")."""
    target.mkdir(parents=True, exist_ok=True)
    if how == "fuse":
        mount.mount_fuse(str(image), str(target))
    else:
        blob = str(device) if device is not None else None
        mount.mount_kernel(str(image), str(target), backing=how, device=blob)
    try:
        yield target
    finally:
        mount.unmount(str(target))


def read_section(
    work: Path, label: str, archive: Path, top: str, repeat: int, with_fuse: bool
) -> None:
    print(f"\n## Read speed, {label}: all files in random order\n")
    tree = work / "extracted"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir()
    subprocess.run(["tar", "-xf", str(archive), "-C", str(tree)], check=True)
    image = work / "read.erofs"
    build_image(str(archive), str(image))
    index, blob = work / "read-index.erofs", work / "read-index.blob"
    build_indexed(str(archive), str(blob), str(index))
    embedded = work / "read-embedded.erofs"  # the daemon's image of a plain tar
    build_indexed(str(archive), None, str(embedded))
    squashfs = work / "read.sqfs"
    tools = shutil.which("sqfstar") and shutil.which("squashfuse_ll")
    fuse = with_fuse and tools and os.path.exists("/dev/fuse")
    if fuse:
        squashfs.unlink(missing_ok=True)
        sqfstar = ["sqfstar", "-quiet", "-no-progress", "-no-duplicates", str(squashfs)]
        with open(archive, "rb") as stream:
            subprocess.run(sqfstar, stdin=stream, check=True)
    names = listing(tree / top)
    try:
        with contextlib.ExitStack() as stack:
            roots = {"tree": tree / top}
            for how in ("loop", "file"):
                at = stack.enter_context(mounted(image, work / f"mnt-erofs-{how}", how))
                roots[f"kernel erofs ({how})"] = at / top
            for how in ("file", "loop"):
                at = stack.enter_context(mounted(index, work / f"mnt-index-{how}", how, blob))
                roots[f"kernel erofs index + blob ({how})"] = at / top
            at = stack.enter_context(mounted(embedded, work / "mnt-embedded", "file"))
            roots["kernel erofs, tar embedded (file)"] = at / top
            if fuse:
                fused = stack.enter_context(mounted(squashfs, work / "mnt-sqfs", "fuse"))
                roots["FUSE squashfuse_ll"] = fused / top
            for root in roots.values():
                read_all(root, names)  # warm every candidate once
            warm = alternate(
                {n: (lambda r=r: read_all(r, names)) for n, r in roots.items()}, repeat
            )
            cold: dict[str, list[float]] = {}
            if os.geteuid() == 0:

                def cold_read(root: Path) -> float:
                    drop_caches()
                    return read_all(root, names)

                cold = alternate({n: (lambda r=r: cold_read(r)) for n, r in roots.items()}, repeat)
        print("| reader | warm | vs tree | cold (caches dropped) | vs tree |")
        print("|---|---:|---:|---:|---:|")
        for name in roots:
            w = statistics.median(warm[name])
            tree_warm = statistics.median(warm["tree"])
            line = f"| {name} | {w:.2f} s ({spread(warm[name])}) | {tree_warm / w:.2f}x |"
            if cold:
                c, tree_cold = statistics.median(cold[name]), statistics.median(cold["tree"])
                line += f" {c:.2f} s ({spread(cold[name])}) | {tree_cold / c:.2f}x |"
            print(line)
        print("\n(vs tree: the tree's time / this reader's; above 1 is faster than the tree)")
    finally:
        shutil.rmtree(tree, ignore_errors=True)
        for path in (image, index, blob, embedded, squashfs):
            path.unlink(missing_ok=True)


# -- eviction and memory -----------------------------------------------------------------


def evict_section(work: Path, small: Path, repeat: int) -> None:
    print(f"\n## Eviction of a {_count(small)}-file dataset\n")
    image = work / "evict.erofs"
    build_image(str(small), str(image))
    times = []
    for index in range(repeat):
        copy = work / f"evict-{index}.erofs"
        shutil.copyfile(image, copy)
        os.sync()
        target = work / "mnt-evict"
        target.mkdir(exist_ok=True)
        mount.mount_kernel(str(copy), str(target))
        read_all(target / "data", ["class_0000/img_0000000.jpg"])  # in use once, as a job would
        start = time.perf_counter()
        mount.unmount(str(target))
        copy.unlink()
        times.append(time.perf_counter() - start)
    image.unlink()
    tree = work / "evict-tree"
    tree.mkdir(exist_ok=True)
    subprocess.run(["tar", "-xf", str(small), "-C", str(tree)], check=True)
    os.sync()
    start = time.perf_counter()
    subprocess.run(["rm", "-rf", str(tree)], check=True)
    rm = time.perf_counter() - start
    print("| | seconds |")
    print("|---|---:|")
    median = statistics.median(times)
    print(f"| image: unmount + delete (median of {repeat}) | {median:.3f} ({spread(times)}) |")
    print(f"| tree: rm -rf (once) | {rm:.2f} |")


def peak_rss(source: Path, output: Path) -> float:
    """MiB of peak RSS of a ``stager image build`` process."""
    output.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "stager",
        "image",
        "build",
        "--quiet",
        str(source),
        "-o",
        str(output),
    ]
    child = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed")
    output.unlink()
    return usage.ru_maxrss / 1024


def memory_section(work: Path, small: Path) -> None:
    print("\n## Peak memory of a build (one `stager image build` process)\n")
    twenty = make_small_tar(work / "small-20k.tar", 20_000)
    low, high = peak_rss(twenty, work / "m.erofs"), peak_rss(small, work / "m.erofs")
    print("| files of 512 B | peak RSS |")
    print("|---:|---:|")
    print(f"| 20,000 | {low:.0f} MiB |")
    print(f"| {_count(small)} | {high:.0f} MiB ({high / low:.2f}x) |")


def main(args: argparse.Namespace) -> int:
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# bench_image, {now}, load {os.getloadavg()}")
    print(f"work dir {work}; repeat {args.repeat}; cores {os.cpu_count()}")
    tree = make_tree(work / "tree20k" / "data")
    archives = make_archives(tree, work / "archives")
    small = make_small_tar(work / f"small-{args.small_files}.tar", args.small_files)
    sections = set(args.sections.split(","))
    if "ready" in sections:
        ready_section(work, archives, small, args.repeat)
    if "index" in sections:
        index_section(work, archives, small, args.repeat, args.reference_mkfs)
    if "read-20k" in sections:
        read_section(work, "20,000 files of 4-100 KB", archives["tar"], "data", args.repeat, True)
    if "read-small" in sections:
        with_fuse = args.small_files <= args.fuse_max_files
        label = f"{_count(small)} files of 512 B"
        read_section(work, label, small, "data", args.repeat, with_fuse)
    if "evict" in sections:
        evict_section(work, small, args.repeat)
    if "memory" in sections:
        memory_section(work, small)
    print(f"\nload after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(get_args_parser().parse_args()))
