"""Benchmark: stager's recipes against torchvision's own archive handling.

    python -m bench.bench_recipes [--classes 50] [--images 20000] [--repeat 3]

1. ``imagenet``: the recipe (devkit -> meta.bin, nested parallel extraction of
   the train tar-of-tars, val extraction + sorting) against
   ``torchvision.datasets.imagenet.parse_devkit_archive`` + ``parse_train_archive``
   + ``parse_val_archive`` on the same fake release files. torchvision checks
   each archive's md5 before extracting; the fakes cannot match the release's
   md5, so its table is pointed at the fakes' md5s (computed untimed): it does
   exactly the work it does on real files. A second line shows torchvision with
   its md5 checks skipped, to separate the two costs. A third is the shell loop a
   user would write (``tar -xf`` the train tar, then each inner tar into its class
   folder, then ``tar -xf`` val): less work than the others (no meta.bin, val not
   sorted into classes), so it is left out of the same-files check.
   ``--per-class 1281 50 --classes 1000`` is the release's full shape.
2. ``inat2021``: the recipe (train + valid) against the seeds/000 way: link the
   archives into the destination (with the symlink arguments the right way
   round), rename them to ``2021_train.tgz``/``2021_valid.tgz`` and call
   ``INaturalist(download=True)``, which md5-checks and extracts them.

Candidates run interleaved, each into a fresh folder on the same filesystem
(``--out-dir``: a tmpfs measures the candidates, not a disk's writeback). Only one
output tree exists at a time: each is counted (first counted round) and deleted
right after its run, outside the timing, since at the full shape a tree is 1.33M
inodes and a shared /dev/shm holds about 3M. ``--warmup`` untimed rounds come
first (1 by default: it puts archives on a disk in the page cache for all;
archives on a tmpfs need none). ``sync`` before each run keeps writeback out of
the next one. stager runs its steps in-process, as the daemon's staging process
does. The machine is pinned to at most ``--cores`` CPUs (the goal is stated for 2).

The full shape, archives and outputs on tmpfs (about 2.4 GB of archives, 1.33M
files per output tree)::

    python -m bench.bench_recipes --only imagenet --classes 1000 --per-class 1281 50 \
        --image-size 32 24 --warmup 0 --work-dir /dev/shm/bench-recipes
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from stager.core.settings import Settings
from stager.ops import table
from stager.ops.base import OpContext
from stager.request import recipes
from stager.wire.progress import Progress
from stager.wire.schemas import DatasetCreate
from tests.stager.recipes import fakes


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/stager-bench-recipes"))
    parser.add_argument("--classes", type=int, default=50, help="ImageNet and iNat classes")
    parser.add_argument(
        "--images", type=int, default=20_000, help="ImageNet images (train + val, 9:1)"
    )
    parser.add_argument(
        "--inat-images", type=int, default=10_000, help="iNat images (train + valid, 4:1)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per candidate")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed rounds before the timed ones"
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="CANDIDATE",
        help="leave out a candidate by (a prefix of) its name, e.g. 'torchvision parse_*, no'",
    )
    parser.add_argument("--workers", type=int, default=8, help="stager's op threads")
    parser.add_argument("--cores", type=int, default=2, help="CPUs this process may use")
    parser.add_argument(
        "--image-size", type=int, nargs=2, default=(200, 150), help="fake JPEG width height"
    )
    parser.add_argument(
        "--per-class",
        type=int,
        nargs=2,
        metavar=("TRAIN", "VAL"),
        help="ImageNet train and val images per class (instead of --images)",
    )
    parser.add_argument("--only", choices=["imagenet", "inat2021"], help="run one comparison")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where every candidate writes (default <work-dir>/out); a tmpfs here measures "
        "the candidates rather than a disk that throttles writeback",
    )
    return parser


# -- data ------------------------------------------------------------------------


def imagenet_source(args: argparse.Namespace) -> Path:
    source = args.work_dir / "imagenet-src"
    tag = f"{args.classes},{args.images},{args.per_class},{args.image_size}"
    marker = source / ".complete"
    if not (marker.exists() and marker.read_text() == tag):
        shutil.rmtree(source, ignore_errors=True)
        if args.per_class:
            train, val = args.per_class
        else:
            train = args.images * 9 // 10 // args.classes
            val = (args.images - train * args.classes) // args.classes
        fakes.make_imagenet(source, args.classes, train, val, image_size=tuple(args.image_size))
        marker.write_text(tag)
    return source


def inat_source(args: argparse.Namespace) -> Path:
    source = args.work_dir / "inat-src"
    tag = f"{args.classes},{args.inat_images},{args.image_size}"
    marker = source / ".complete"
    if not (marker.exists() and marker.read_text() == tag):
        shutil.rmtree(source, ignore_errors=True)
        per_class = args.inat_images // args.classes
        fakes.make_inat2021(
            source, ["2021_train"], args.classes, per_class * 4 // 5, 0, tuple(args.image_size)
        )
        fakes.make_inat2021(
            source, ["2021_valid"], args.classes, per_class // 5, 1, tuple(args.image_size)
        )
        marker.write_text(tag)
    return source


def md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as stream:
        while chunk := stream.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def tree_stats(root: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                files += 1
                # torch.save's zip records carry the name it was written under (stager
                # writes meta.bin under a temporary name): its content is compared apart.
                size += os.path.getsize(path) if name != "meta.bin" else 0
    return files, size


# -- candidates ------------------------------------------------------------------


def stager_recipe(recipe: str, source: Path, workers: int) -> Callable[[Path], None]:
    request = DatasetCreate(name="bench", recipe=recipe, source=str(source))
    steps = recipes.expand(request, Settings()).steps
    ops = table.load()

    def run(dest: Path) -> None:
        ctx = OpContext(root=dest, progress=Progress(), workers=workers)
        for step in steps:
            ops.run(step, ctx)

    return run


def link_archives(source: Path, dest: Path, names: dict[str, str]) -> None:
    for src_name, dst_name in names.items():
        (dest / dst_name).symlink_to(source / src_name)


def torchvision_imagenet(source: Path, check_md5: bool) -> Callable[[Path], None]:
    import torchvision.datasets.imagenet as tv

    names = {a: a for a in (fakes.IMAGENET_TRAIN, fakes.IMAGENET_VAL, fakes.IMAGENET_DEVKIT)}
    meta = {key: (name, md5_of(source / name)) for key, (name, _) in tv.ARCHIVE_META.items()}

    def run(dest: Path) -> None:
        link_archives(source, dest, names)
        with mock.patch.dict(tv.ARCHIVE_META, meta):
            if check_md5:
                _parse_imagenet(tv, dest)
            else:
                with mock.patch.object(tv, "_verify_archive", lambda *a: None):
                    _parse_imagenet(tv, dest)

    return run


def time_md5_checks(source: Path, repeat: int) -> list[float]:
    """What torchvision's md5 checks alone cost: each archive read once through its own
    ``calculate_md5``, as ``_verify_archive`` does. With it the md5-free torchvision
    line can be left out (``--skip``) where a full round is long."""
    from torchvision.datasets.utils import calculate_md5

    archives = [
        source / a for a in (fakes.IMAGENET_DEVKIT, fakes.IMAGENET_TRAIN, fakes.IMAGENET_VAL)
    ]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for archive in archives:
            calculate_md5(archive)
        times.append(time.perf_counter() - start)
    return times


def tar_loop_imagenet(source: Path) -> Callable[[Path], None]:
    """The shell loop: train tar, each class tar into its folder, val tar."""
    script = (
        'set -e; cd "$1"; mkdir train val; tar -xf "$2" -C train; cd train; '
        'for f in *.tar; do mkdir "${f%.tar}"; tar -xf "$f" -C "${f%.tar}"; rm "$f"; done; '
        'cd ..; tar -xf "$3" -C val'
    )

    def run(dest: Path) -> None:
        train, val = source / fakes.IMAGENET_TRAIN, source / fakes.IMAGENET_VAL
        subprocess.run(["sh", "-c", script, "sh", str(dest), str(train), str(val)], check=True)

    return run


def _parse_imagenet(tv, dest: Path) -> None:  # noqa: ANN001 - the torchvision module
    tv.parse_devkit_archive(str(dest))
    tv.parse_train_archive(str(dest))
    tv.parse_val_archive(str(dest))


def seeds_inat(source: Path) -> Callable[[Path], None]:
    """seeds/000's data.py, its link_file arguments fixed, md5s pointed at the fakes."""
    import torchvision.datasets.inaturalist as tv

    md5 = {
        "2021_train": md5_of(source / "train.tar.gz"),
        "2021_valid": md5_of(source / "val.tar.gz"),
    }

    def run(dest: Path) -> None:
        link_archives(source, dest, {"train.tar.gz": "train.tar.gz", "val.tar.gz": "val.tar.gz"})
        shutil.move(dest / "train.tar.gz", dest / "2021_train.tgz")
        shutil.move(dest / "val.tar.gz", dest / "2021_valid.tgz")
        with mock.patch.dict(tv.DATASET_MD5, md5):
            tv.INaturalist(root=str(dest), version="2021_train", download=True)
            tv.INaturalist(root=str(dest), version="2021_valid", download=True)

    return run


# -- timing ----------------------------------------------------------------------


def time_candidates(
    candidates: dict[str, Callable[[Path], None]], out: Path, repeat: int, warmup: int = 1
) -> tuple[dict[str, list[float]], dict[str, tuple[tuple[int, int], object]]]:
    """Each candidate's timed runs, and what its first counted run produced
    (``tree_stats`` and meta.bin's content), in rounds of one run per candidate.

    A candidate's tree is counted and deleted right after its run, outside the
    timing: never two trees at once."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    produced: dict[str, tuple[tuple[int, int], object]] = {}
    for round_ in range(warmup + repeat):
        timed = round_ >= warmup
        for name, run in candidates.items():
            dest = out / name
            remove_tree(dest)
            dest.mkdir(parents=True)
            subprocess.run(["sync"], check=True)
            start = time.perf_counter()
            run(dest)
            elapsed = time.perf_counter() - start
            label = f"run {round_ - warmup + 1}" if timed else "warm-up"
            print(f"  {label}: {name} {elapsed:.2f} s", flush=True)
            if timed:
                times[name].append(elapsed)
                if name not in produced:
                    produced[name] = (tree_stats(dest), _meta(dest / "meta.bin"))
            remove_tree(dest)
    return times, produced


def remove_tree(path: Path) -> None:
    # rm -rf: GNU rm unlinks a million files several times faster than shutil.rmtree.
    subprocess.run(["rm", "-rf", "--", str(path)], check=True)


def report(
    title: str, times: dict[str, list[float]], ours: str, goal: float, against: list[str]
) -> None:
    """Median and min-max per candidate, then each other candidate's ratio to ours
    (the goal applies to the ``against`` ones; the others are for information)."""
    print(f"\n{title}")
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        runs = ", ".join(f"{x:.1f}" for x in t)
        print(
            f"  {name:<34} median {median[name]:7.2f} s  "
            f"(min-max {min(t):.2f}-{max(t):.2f}; runs {runs})"
        )
    for name in times:
        if name != ours:
            ratio = median[name] / median[ours]
            if name in against:
                verdict = f"{'meets' if ratio >= goal else 'misses'} the {goal:g}x goal"
            else:
                verdict = "for information"
            print(f"  ratio {name} / {ours}: {ratio:.2f}x ({verdict})")


def check_same_files(produced: dict[str, tuple[tuple[int, int], object]]) -> None:
    """Every candidate must have produced the same files, or the race is void."""
    print("  files and bytes per candidate (archives included; meta.bin by content):")
    for name, ((files, size), _meta_bin) in produced.items():
        print(f"    {name:<32} {files:7d} files {size / 1e6:9.1f} MB")
    stats = {name: tree for name, (tree, _meta_bin) in produced.items()}
    metas = [meta_bin for _tree, meta_bin in produced.values()]
    if len(set(stats.values())) != 1 or any(meta != metas[0] for meta in metas):
        raise SystemExit(f"the candidates produced different trees ({stats}); no comparison")


def _meta(path: Path) -> object:
    import torch

    return torch.load(path, weights_only=True) if path.exists() else None


def skip(
    candidates: dict[str, Callable[[Path], None]], prefixes: list[str]
) -> dict[str, Callable[[Path], None]]:
    """``candidates`` less those named by a ``--skip`` prefix (stager's own never)."""
    return {
        name: run
        for name, run in candidates.items()
        if name.startswith("stager") or not any(name.startswith(p) for p in prefixes)
    }


def main(args: argparse.Namespace) -> None:
    if hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))[: args.cores]
        os.sched_setaffinity(0, allowed)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir or args.work_dir / "out"
    print(f"cores: {len(os.sched_getaffinity(0))}, stager op threads: {args.workers}")
    if args.only in (None, "imagenet"):
        source = imagenet_source(args)
        size = sum(p.stat().st_size for p in source.iterdir() if p.is_file())
        shape = args.per_class or f"{args.images} images"
        print(f"\nImageNet fake: {args.classes} classes, {shape}, {size / 1e6:.0f} MB")
        candidates = skip(
            {
                "stager imagenet recipe": stager_recipe("imagenet", source, args.workers),
                "torchvision parse_*_archive": torchvision_imagenet(source, check_md5=True),
                "torchvision parse_*, no md5": torchvision_imagenet(source, check_md5=False),
                "shell loop of tar -xf": tar_loop_imagenet(source),
            },
            args.skip,
        )
        times, produced = time_candidates(candidates, out, args.repeat, args.warmup)
        # The tar loop does less (no meta.bin, val not sorted): not the same files.
        check_same_files({n: p for n, p in produced.items() if not n.startswith("shell")})
        torchvision = [n for n in candidates if n.startswith("torchvision")]
        report("imagenet", times, "stager imagenet recipe", goal=3.0, against=torchvision)
        md5 = time_md5_checks(source, args.repeat)
        print(
            f"  of torchvision's time, its md5 checks alone: median {statistics.median(md5):.2f} s "
            f"(min-max {min(md5):.2f}-{max(md5):.2f}; stager does not check md5s by default)"
        )
    if args.only in (None, "inat2021"):
        source = inat_source(args)
        size = sum(p.stat().st_size for p in source.iterdir() if p.is_file())
        print(
            f"\niNat 2021 fake: {args.classes} classes, {args.inat_images} images, "
            f"{size / 1e6:.0f} MB"
        )
        candidates = skip(
            {
                "stager inat2021 recipe": stager_recipe("inat2021", source, args.workers),
                "seeds/000 (rename + download=True)": seeds_inat(source),
            },
            args.skip,
        )
        times, produced = time_candidates(candidates, out, args.repeat, args.warmup)
        check_same_files(produced)
        seeds = [n for n in candidates if n.startswith("seeds")]
        report("inat2021", times, "stager inat2021 recipe", goal=1.0, against=seeds)
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main(get_args_parser().parse_args())
