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

Candidates run interleaved, each into a fresh folder on the same filesystem;
one untimed warm-up per candidate puts the archives in the page cache for all,
``sync`` before each timed run keeps writeback out of the next one. stager runs
its steps in-process, as the daemon's staging process does. The machine is
pinned to at most ``--cores`` CPUs (the goal is stated for 2).
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

from stager import recipes
from stager.ops import table
from stager.ops.base import OpContext
from stager.progress import Progress
from stager.schemas import DatasetCreate
from stager.settings import Settings
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
    candidates: dict[str, Callable[[Path], None]], out: Path, repeat: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for round_ in range(repeat + 1):  # round 0 is the untimed warm-up
        for name, run in candidates.items():
            dest = out / name
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            subprocess.run(["sync"], check=True)
            start = time.perf_counter()
            run(dest)
            elapsed = time.perf_counter() - start
            if round_:
                times[name].append(elapsed)
            print(f"  {'warm-up' if not round_ else f'run {round_}'}: {name} {elapsed:.2f} s")
    return times


def report(title: str, times: dict[str, list[float]], ours: str, goal: float) -> None:
    print(f"\n{title}")
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        spread = (max(t) - min(t)) / median[name] if median[name] else 0.0
        print(f"  {name:<34} median {median[name]:7.2f} s  (spread {spread:.0%})")
    for name in times:
        if name != ours:
            ratio = median[name] / median[ours]
            verdict = "meets" if ratio >= goal else "misses"
            print(f"  ratio {name} / {ours}: {ratio:.2f}x ({verdict} the {goal:g}x goal)")


def check_same_files(out: Path, names: list[str]) -> None:
    """Every candidate must have produced the same files, or the race is void."""
    stats = {n: tree_stats(out / n) for n in names}
    print("  files and bytes per candidate (archives included; meta.bin by content):")
    for name, (files, size) in stats.items():
        print(f"    {name:<32} {files:7d} files {size / 1e6:9.1f} MB")
    metas = [_meta(out / n / "meta.bin") for n in names]
    if len(set(stats.values())) != 1 or any(meta != metas[0] for meta in metas):
        raise SystemExit(f"the candidates produced different trees ({stats}); no comparison")


def _meta(path: Path) -> object:
    import torch

    return torch.load(path, weights_only=True) if path.exists() else None


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
        candidates = {
            "stager imagenet recipe": stager_recipe("imagenet", source, args.workers),
            "torchvision parse_*_archive": torchvision_imagenet(source, check_md5=True),
            "torchvision parse_*, no md5": torchvision_imagenet(source, check_md5=False),
            "shell loop of tar -xf": tar_loop_imagenet(source),
        }
        times = time_candidates(candidates, out, args.repeat)
        check_same_files(out, list(candidates)[:3])
        report("imagenet", times, "stager imagenet recipe", goal=3.0)
    if args.only in (None, "inat2021"):
        source = inat_source(args)
        size = sum(p.stat().st_size for p in source.iterdir() if p.is_file())
        print(
            f"\niNat 2021 fake: {args.classes} classes, {args.inat_images} images, "
            f"{size / 1e6:.0f} MB"
        )
        candidates = {
            "stager inat2021 recipe": stager_recipe("inat2021", source, args.workers),
            "seeds/000 (rename + download=True)": seeds_inat(source),
        }
        times = time_candidates(candidates, out, args.repeat)
        check_same_files(out, list(candidates))
        report("inat2021", times, "stager inat2021 recipe", goal=1.0)
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main(get_args_parser().parse_args())
