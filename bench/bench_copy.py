"""Benchmark: stager's copy and symlink-tree ops against cp and seeds/000's script.

    python -m bench.bench_copy                  # 20,000 files, ~1 GB (the real run)
    python -m bench.bench_copy --files 2000     # quick, while developing

Every candidate writes a fresh destination on the same filesystem as the source
tree. Before each timed run the page cache is dropped (as root) so every
candidate reads the source cold, as a job on a fresh node would; without root,
one untimed warm-up read puts the whole tree in cache so all candidates see it
warm. The output says which. Each candidate runs ``--repeat`` times,
interleaved with the others so background load hits all alike; ratios use the
median, and best-of-N is shown too because this machine is shared.
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
from dataclasses import dataclass, field
from multiprocessing import Pool
from pathlib import Path

from bench.datagen import make_tree, tree_bytes
from stager.ops import copy, symlink
from stager.ops.base import OpContext
from stager.ops.copy import CopyStep
from stager.ops.symlink import SymlinkStep
from stager.wire.progress import Progress

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
        copy.run(CopyStep(src=str(src), dst=dst.name), ctx)

    return candidate


def stager_symlink_tree(workers: int) -> Candidate:
    def candidate(src: Path, dst: Path) -> None:
        ctx = OpContext(root=dst.parent, progress=Progress(), workers=workers)
        symlink.run(SymlinkStep(src=str(src), dst=dst.name, mode="tree"), ctx)

    return candidate


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
    # Commit the removal (and, with -o discard, its discards) before the clock
    # starts, so one candidate's cleanup is not billed to the next.
    subprocess.run(["sync"], check=True)
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
    parser.add_argument("--min-kb", type=int, default=4, help="smallest generated file")
    parser.add_argument("--max-kb", type=int, default=100, help="largest generated file")
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


@dataclass
class Row:
    name: str
    run: Candidate
    goal: float | None = None  # max ratio vs the group's baseline; None: shown for information
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)


def build_groups(args: argparse.Namespace) -> dict[str, list[Row]]:
    """Per group, the baseline first."""
    return {
        "copy": [
            Row("cp -r", run_cp("-r")),
            Row(
                f"stager copy (workers={args.workers}, verify={args.verify})",
                stager_copy(args.workers, args.verify),
                # Large files are bandwidth: two cores copying beat one by a margin.
                goal=0.7 if args.min_kb >= 64 else 1.0,
            ),
            Row("cp -a (also keeps mtimes/modes, like stager)", run_cp("-a")),
        ],
        "symlink tree": [
            Row("cp -rs", run_cp("-rs")),
            Row(
                f"stager symlink tree (workers={args.workers})",
                stager_symlink_tree(args.workers),
                1.0,
            ),
            Row(f"seeds/000 data.py, fixed (Pool({args.workers}))", seed_script(args.workers)),
        ],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    src = make_tree(
        args.work_dir / f"tree-{args.files}-{args.min_kb}-{args.max_kb}",
        n_files=args.files,
        min_kb=args.min_kb,
        max_kb=args.max_kb,
    )
    out = args.work_dir / "out"
    out.mkdir(parents=True, exist_ok=True)
    cold = not args.warm and drop_caches()
    if not cold:
        warm(src)
    cache = (
        "cold (page cache dropped before every run)"
        if cold
        else "warm (tree read once untimed; every run sees it cached)"
    )
    print(f"tree: {src} ({args.files} files, {tree_bytes(src) / 1e9:.2f} GB)")
    print(f"cache: {cache}; {args.repeat} interleaved runs per candidate, order rotated")
    print(f"cpus: {os.cpu_count()}, load average before: {os.getloadavg()[0]:.1f}")
    groups = build_groups(args)
    expected = count_entries(src)
    for rows in groups.values():
        for turn in range(args.repeat):
            # Rotate who goes first: being first after the setup is not neutral.
            for row in rows[turn % len(rows) :] + rows[: turn % len(rows)]:
                dst = out / "dst"
                row.times.append(time_one(row.run, src, dst, cold))
                if count_entries(dst) != expected:
                    print(f"ERROR: {row.name} made {count_entries(dst)} files, not {expected}")
                    return 1
        shutil.rmtree(out / "dst")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print_table(groups)
    return 0


def print_table(groups: dict[str, list[Row]]) -> None:
    """Ratios use the median; best-of-N shows the cost without other users' noise."""
    print(
        f"\n{'candidate':<48} {'median s':>9} {'best s':>7} {'ratio':>6} {'best':>6}"
        f" {'goal':>7}  result"
    )
    for group, rows in groups.items():
        base = rows[0]
        print(f"-- {group} (baseline: {base.name})")
        for row in rows:
            verdict = "baseline" if row is base else "info"
            goal_text = "-"
            if row.goal is not None:
                verdict = "PASS" if row.median / base.median <= row.goal else "MISS"
                goal_text = f"<={row.goal:.1f}x"
            print(
                f"{row.name:<48} {row.median:>9.3f} {row.best:>7.3f}"
                f" {row.median / base.median:>5.2f}x {row.best / base.best:>5.2f}x"
                f" {goal_text:>7}  {verdict}"
            )
    # The status quo that stager replaces: the seed's own script.
    links = groups["symlink tree"]
    stager, seed = links[1], links[2]
    verdict = "PASS" if stager.median <= seed.median else "MISS"
    print(
        f"{'stager symlink tree vs seeds/000':<48} {'':>9} {'':>7}"
        f" {stager.median / seed.median:>5.2f}x {stager.best / seed.best:>5.2f}x"
        f" {'<=1.0x':>7}  {verdict}"
    )


if __name__ == "__main__":
    sys.exit(main())
