"""Benchmark: stager's extract against GNU tar, side by side.

    python -m bench.bench_extract [--files 20000] [--work-dir /tmp/stager-bench] [--repeat 5]

Candidates run interleaved (tar, stager, tar, stager, ...) so that load from
other processes hits both alike. Each run gets a fresh destination on the same
filesystem as the archive. Caches: one untimed warm-up per candidate puts the
archive in the page cache for all of them, and ``sync`` before every timed run
keeps the previous run's writeback out of the next measurement. stager runs
in-process, as it does inside the daemon (no interpreter start-up counted).
The table shows the median of the repeats and the spread (max - min) / median.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.datagen import make_archives, make_tree, tree_bytes
from bench.timing import spread, timed
from stager.ops import extract
from stager.ops.base import OpContext
from stager.ops.extract import ExtractStep
from stager.wire.progress import Progress


@dataclass
class Pair:
    fmt: str
    baseline: str
    goal: float  # stager's time must be at most goal x the baseline's


PAIRS = (Pair("tar", "tar -xf", 1.0), Pair("tar.gz", "tar -xzf", 0.7))


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/tmp/stager-bench"),
        help="where the generated tree, archives and outputs live",
    )
    parser.add_argument(
        "--files",
        type=int,
        default=20_000,
        help="files in the generated tree (20,000 is about 1 GB)",
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per candidate")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where both candidates extract to (default: beside the archives). On a VM whose "
        "disk throttles writeback, a tmpfs here measures the extractors, not the disk",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 2,
        help="threads stager may use (ctx.workers)",
    )
    return parser


def _tar_runner(flags: str, archive: Path) -> Callable[[Path], None]:
    def run(dest: Path) -> None:
        subprocess.run(["tar", flags, str(archive), "-C", str(dest)], check=True)

    return run


def _stager_runner(archive: Path, workers: int) -> Callable[[Path], None]:
    def run(dest: Path) -> None:
        ctx = OpContext(root=dest, progress=Progress(), workers=workers)
        extract.run(ExtractStep(src=str(archive)), ctx)

    return run


def _measure(runners: dict[str, Callable[[Path], None]], out: Path, repeat: int):
    times: dict[str, list[float]] = {name: [] for name in runners}
    for runner in runners.values():
        timed(runner, out)  # warm-up: archive into the page cache, code paths hot
    for _ in range(repeat):
        for name, runner in runners.items():
            times[name].append(timed(runner, out))
    shutil.rmtree(out, ignore_errors=True)
    return times


def main(args: argparse.Namespace) -> int:
    work = args.work_dir / f"files-{args.files}"
    tree = make_tree(work / "tree", n_files=args.files)
    archives = make_archives(tree, work)
    print(
        f"tree: {args.files} files, {tree_bytes(tree) / 1e9:.2f} GB; workers={args.workers}; "
        f"median of {args.repeat}; extracting to {args.out_dir or work / 'out'}"
    )
    header = f"{'candidate':<22}{'seconds':>9}{'spread':>8}{'ratio':>8}{'goal':>7}  result"
    print(header)
    print("-" * len(header))
    missed = 0
    for pair in PAIRS:
        archive = archives[pair.fmt]
        flags = pair.baseline.split()[1]
        runners = {
            pair.baseline: _tar_runner(flags, archive),
            f"stager {pair.fmt}": _stager_runner(archive, args.workers),
        }
        times = _measure(runners, args.out_dir or work / "out", args.repeat)
        base = statistics.median(times[pair.baseline])
        for name, values in times.items():
            median = statistics.median(values)
            if name == pair.baseline:
                print(f"{name:<22}{median:>9.3f}{spread(values):>8}{1.0:>8.2f}{'':>7}  baseline")
                continue
            ratio = median / base
            verdict = "PASS" if ratio <= pair.goal else "MISS"
            missed += verdict == "MISS"
            print(
                f"{name:<22}{median:>9.3f}{spread(values):>8}{ratio:>8.2f}"
                f"{pair.goal:>7.1f}  {verdict}"
            )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(get_args_parser().parse_args()))
