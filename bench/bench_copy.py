"""Benchmark: stager's copy and symlink-tree ops against cp and seeds/000's script.

    python -m bench.bench_copy                  # 20,000 files, ~1 GB (the real run)
    python -m bench.bench_copy --files 2000     # quick, while developing

Every candidate writes a fresh destination on the same filesystem as the source
tree. Before each timed run the page cache is dropped (as root) so every
candidate reads the source cold, as a job on a fresh node would; without root,
one untimed warm-up read puts the whole tree in cache so all candidates see it
warm. The output says which. Each candidate runs ``--repeat`` times,
interleaved with the others so background load hits all alike; the median counts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing import Pool
from pathlib import Path

from bench.datagen import make_tree, tree_bytes
from stager.ops import copy, symlink
from stager.ops.base import OpContext
from stager.progress import Progress
from stager.schemas import CopyStep, SymlinkStep

Candidate = Callable[[Path, Path], None]


# --- seeds/000 data.py, reimplemented for comparison -------------------------
# The seed's link_files() walked the tree and handed each directory's files to a
# multiprocessing Pool via starmap. Its link_file() called Path(src).symlink_to(dest),
# arguments reversed, so it failed on the first file; this copy fixes only that.


def seed_link_file(src: str, dest: str) -> None:
    Path(dest).symlink_to(src)  # corrected: the link is dest, pointing at src


def seed_link_files(src: Path, dest: Path, workers: int = 4) -> None:
    os.makedirs(dest, exist_ok=True)
    with Pool(processes=workers) as pool:
        for path, dnames, fnames in os.walk(str(src)):
            rel_path = Path(path).relative_to(src)
            for d in dnames:
                os.makedirs(str(dest / rel_path / d), exist_ok=True)
            pool.starmap(
                seed_link_file, [(src / rel_path / f, dest / rel_path / f) for f in fnames]
            )


# --- candidates ----------------------------------------------------------------


def run_cp(*flags: str) -> Candidate:
    def candidate(src: Path, dst: Path) -> None:
        # "cp -r src dst" with dst absent copies src's contents into dst, like the op.
        subprocess.run(["cp", *flags, str(src), str(dst)], check=True)

    return candidate


def stager_copy(workers: int, verify: str) -> Candidate:
    def candidate(src: Path, dst: Path) -> None:
        ctx = OpContext(root=dst.parent, progress=Progress(), workers=workers, verify=verify)
        copy.run(CopyStep(op="copy", src=str(src), dst=dst.name), ctx)

    return candidate


def stager_symlink_tree(src: Path, dst: Path) -> None:
    ctx = OpContext(root=dst.parent, progress=Progress())
    symlink.run(SymlinkStep(op="symlink", src=str(src), dst=dst.name, mode="tree"), ctx)


def seed_script(workers: int) -> Candidate:
    def candidate(src: Path, dst: Path) -> None:
        seed_link_files(src, dst, workers)

    return candidate


# --- measurement ---------------------------------------------------------------


def drop_caches() -> bool:
    """Flush dirty pages, then drop page/dentry/inode caches; False when not allowed."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def warm(src: Path) -> None:
    for path in src.rglob("*"):
        if path.is_file():
            path.read_bytes()


def time_one(candidate: Candidate, src: Path, dst: Path, cold: bool) -> float:
    if dst.exists():
        shutil.rmtree(dst)
    if cold:
        drop_caches()
    start = time.perf_counter()
    candidate(src, dst)
    return time.perf_counter() - start


def count_entries(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/tmp/stager-bench"),
        help="where the source tree and destinations live (same filesystem)",
    )
    parser.add_argument(
        "--files", type=int, default=20_000, help="files in the generated tree (4-100 KB each)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=4,
        help="threads for stager copy; processes for the seed script",
    )
    parser.add_argument(
        "--verify",
        choices=("size", "sha256", "none"),
        default="size",
        help="stager copy's verify mode (the API's default is size)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per candidate; median counts")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="do not drop caches: warm everything once and time warm runs",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    src = make_tree(args.work_dir / f"tree-{args.files}", n_files=args.files)
    out = args.work_dir / "out"
    out.mkdir(parents=True, exist_ok=True)

    cold = not args.warm and drop_caches()
    if not cold:
        warm(src)
    cache = (
        "cold: page cache dropped before every run"
        if cold
        else ("warm: the tree was read once untimed; every run sees it cached")
    )

    groups: list[tuple[str, list[tuple[str, Candidate, float | None]]]] = [
        (
            "copy",
            [
                ("cp -r", run_cp("-r"), None),
                (
                    f"stager copy (workers={args.workers}, verify={args.verify})",
                    stager_copy(args.workers, args.verify),
                    1.0,
                ),
                ("cp -a (info: also keeps mtimes)", run_cp("-a"), None),
            ],
        ),
        (
            "symlink tree",
            [
                ("cp -rs", run_cp("-rs"), None),
                ("stager symlink tree", stager_symlink_tree, 1.2),
                (
                    f"seeds/000 data.py, fixed (Pool({args.workers}))",
                    seed_script(args.workers),
                    None,
                ),
            ],
        ),
    ]

    print(f"tree: {src} ({args.files} files, {tree_bytes(src) / 1e9:.2f} GB)")
    print(f"cache: {cache}; median of {args.repeat} interleaved runs; cpus: {os.cpu_count()}")
    expected = count_entries(src)
    results: dict[str, float] = {}
    for _group, candidates in groups:
        times: dict[str, list[float]] = {name: [] for name, _, _ in candidates}
        for _ in range(args.repeat):
            for name, candidate, _ in candidates:
                dst = out / "dst"
                times[name].append(time_one(candidate, src, dst, cold))
                if count_entries(dst) != expected:
                    print(f"ERROR: {name} produced {count_entries(dst)} files, not {expected}")
                    return 1
        results.update({name: statistics.median(t) for name, t in times.items()})
        shutil.rmtree(out / "dst")

    print_table(groups, results)
    return 0


def print_table(
    groups: list[tuple[str, list[tuple[str, Candidate, float | None]]]],
    results: dict[str, float],
) -> None:
    print(f"\n{'candidate':<48} {'seconds':>8} {'ratio':>7} {'goal':>7}  result")
    for group, candidates in groups:
        baseline = candidates[0][0]
        print(f"-- {group} (baseline: {baseline})")
        for name, _, goal in candidates:
            ratio = results[name] / results[baseline]
            if name == baseline:
                verdict, goal_text = "baseline", "-"
            elif goal is None:
                verdict, goal_text = "info", "-"
            else:
                verdict = "PASS" if ratio <= goal else "MISS"
                goal_text = f"<={goal:.1f}x"
            print(f"{name:<48} {results[name]:>8.3f} {ratio:>6.2f}x {goal_text:>7}  {verdict}")
        # stager vs the seed script, the status quo it replaces.
        if group == "symlink tree":
            seed = candidates[2][0]
            ratio = results["stager symlink tree"] / results[seed]
            verdict = "PASS" if ratio <= 1.0 else "MISS"
            print(
                f"{'stager symlink tree vs seeds/000':<48} {'':>8} {ratio:>6.2f}x "
                f"{'<=1.0x':>7}  {verdict}"
            )


if __name__ == "__main__":
    sys.exit(main())
