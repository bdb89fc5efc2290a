"""What a staging costs whatever its size: POST to ready for a one-file dataset.

Starts a real ``stager serve``, then stages one small file at a time, each a miss
(a new file per request), and prints the median and range of the time from the
POST to the answer of ``GET .../wait`` saying ready (the first staging, which
starts the fork server, is reported apart).

``--trace`` says where the milliseconds go: it copies ``stager/`` to a scratch
folder, adds ``perf_counter`` trace points at each phase boundary (the daemon's
admission, the attempt, the request to the fork server, the child's start, its
steps, its seal, the outcome reaching the daemon, the publish), runs the daemon
from that copy and prints each phase's median. The code under test is unchanged;
the trace points cost microseconds.

    python bench/bench_overhead.py [--runs 30] [--trace]

``--tar-files N`` times instead an extraction of a plain ``.tar`` of N files of 512 B
through the daemon, POST to ready, against ``tar -xf`` of the same archive into a
fresh folder on the same disk, alternating, ``--runs`` rounds (each staging reads
its own hard link of the archive, so none is a cache hit); with ``--trace``, where
its time goes. GNU tar run by root also gives each file its owner and exact mode
(an ``fchown`` and an ``fchmod`` per file), which a user's tar does not and stager
does not either (its files are created 0444, owned by the daemon): each round also
times ``tar -xf --no-same-owner --no-same-permissions`` (what a user's tar does)
when run as root, and both ratios are printed.

    python bench/bench_overhead.py --tar-files 200000 --runs 3 [--trace]

``--copy-files N`` times a copy of a tree of N files of 512 B (in folders of 1,000)
through the daemon, POST to ready, against ``cp -r`` of the same tree on the same disk,
alternating (each staging copies to a destination of its own: a miss); with
``--trace``, where its time goes. Put the scratch on tmpfs with ``TMPDIR=/dev/shm``.

    TMPDIR=/dev/shm python bench/bench_overhead.py --copy-files 200000 --runs 3 --trace
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.daemon import Daemon  # noqa: E402

# (file, the text the trace point goes before, label: after it with a "+"), in the order
# they happen.
TRACE_POINTS = [
    (
        "stager/engine/requests.py",
        "        resolved = await self._resolve(request, caller)\n",
        "post",
    ),
    (
        "stager/engine/requests.py",
        "        view = self.names.view(handle)\n",
        "admitted",
    ),
    ("stager/engine/scheduler.py", "        attempt = await reg.start(entry)\n", "queued"),
    (
        "stager/engine/scheduler.py",
        "        attempt = await reg.start(entry)\n",
        "+attempt-started",
    ),
    ("stager/staging/blocking.py", "    child = processes.take_spare(job)\n", "job-built"),
    ("stager/staging/worker.py", "        job = jobs.recv()\n", "+spare-given"),  # a spare's job
    ("stager/staging/worker.py", "    ops = table.load(job.op_modules)\n", "child-ready"),
    ("stager/staging/worker.py", "    done = attempt.steps_done()\n", "steps-validated"),
    (
        "stager/staging/worker.py",
        "                write_atomically(attempt.marker, str(done))\n",
        "op-done",
    ),
    (
        "stager/staging/worker.py",
        "                write_atomically(attempt.marker, str(done))\n"
        "                crash.reached(Durable.STEP_DONE)\n",
        "+marker-written",
    ),
    # The tree sealed from the op's count and a listing, or by a walk of every file.
    ("stager/kinds/tree.py", "            return seal_listed(tree, made)\n", "steps-done"),
    ("stager/kinds/tree.py", "        return seal_tree(tree, self.workers)\n", "steps-done"),
    ("stager/fs/seal.py", "    return seal\n", "sealed"),  # once later stamps are later
    (
        "stager/staging/blocking.py",
        "    progress.mirror(counters)\n    outcome = _outcome(message, job.final.name)",
        "outcome-read",
    ),
    (
        "stager/engine/scheduler.py",
        "                await reg.publish(entry, seal)\n",
        "publishing",
    ),
    (
        "stager/engine/scheduler.py",
        "                await reg.publish(entry, seal)\n",
        "+published",
    ),  # after
]


def traced_copy(scratch: Path, points: list[tuple[str, str, str]] = TRACE_POINTS) -> Path:
    """``stager/`` copied with a trace line at each point (before it, or after it for a
    label with a "+"); returns the copy's root."""
    shutil.copytree(REPO / "stager", scratch / "stager")
    for relative, anchor, label in points:
        path = scratch / relative
        text = path.read_text()
        # Whole lines only: an anchor must not match the tail of a more indented line.
        if "\n" + anchor not in text:
            raise SystemExit(f"trace point {label!r} not found in {relative}; update TRACE_POINTS")
        after, label = label.startswith("+"), label.removeprefix("+")
        indent = anchor[: len(anchor) - len(anchor.lstrip())]
        line = (
            f"{indent}__import__('sys').stderr.write('TRACE {label} %.3f\\n' % "
            "(__import__('time').perf_counter() * 1000))\n"
        )
        text = text.replace("\n" + anchor, "\n" + (anchor + line if after else line + anchor), 1)
        path.write_text(text)
    return scratch


def one_file_stagings(daemon: Daemon, source: Path, runs: int) -> list[float]:
    times = []
    with daemon.client() as client:
        for i in range(runs + 1):
            path = source / f"file-{i}"
            path.write_bytes(os.urandom(1000))
            start = time.perf_counter()
            client.post(
                "/v1/datasets", json={"name": f"d{i}", "steps": [{"op": "copy", "src": str(path)}]}
            )
            status = client.get(f"/v1/datasets/d{i}/wait", params={"timeout": 60}).json()
            if status["state"] != "ready":
                raise SystemExit(f"staging d{i} ended {status['state']}: {status['error']}")
            times.append((time.perf_counter() - start) * 1000)
    return times


def make_tar(folder: Path, files: int) -> Path:
    """A plain tar of ``files`` files of 512 B in folders of 1,000, by GNU tar."""
    tree = folder / "tree"
    for i in range(files):
        path = tree / f"d{i // 1000:04d}" / f"f{i:07d}"
        if i % 1000 == 0:
            path.parent.mkdir(parents=True)
        path.write_bytes(os.urandom(512))
    archive = folder / "tree.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(tree), "."], check=True)
    shutil.rmtree(tree)
    return archive


def make_tree(folder: Path, files: int) -> Path:
    """``files`` files of 512 B in folders of 1,000."""
    tree = folder / "tree"
    for i in range(files):
        path = tree / f"d{i // 1000:04d}" / f"f{i:07d}"
        if i % 1000 == 0:
            path.parent.mkdir(parents=True)
        path.write_bytes(os.urandom(512))
    return tree


def timed_cp(tree: Path, out: Path) -> float:
    """Seconds of a ``cp -r`` of ``tree`` to a fresh ``out`` (removed after)."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(tree), str(out)], check=True)
    took = time.perf_counter() - start
    shutil.rmtree(out)
    return took


def copy_against_daemon(
    daemon: Daemon, tree: Path, out: Path, runs: int
) -> tuple[list[float], list[float]]:
    """(cp -r seconds, daemon POST-to-ready seconds) of each round, alternating, after a
    first staging that starts the fork server."""
    by_cp: list[float] = []

    def baseline() -> None:
        by_cp.append(timed_cp(tree, out))

    def body(i: int) -> dict:  # a destination of its own: a miss
        return {"name": f"c{i}", "steps": [{"op": "copy", "src": str(tree), "dst": f"r{i}"}]}

    by_daemon = rounds_against_daemon(daemon, runs, baseline, body, tree.parent)
    return by_cp, by_daemon


def rounds_against_daemon(
    daemon: Daemon,
    runs: int,
    baseline: Callable[[], None],
    body: Callable[[int], dict],
    scratch: Path,
) -> list[float]:
    """Daemon POST-to-ready seconds of ``body(i)`` each round, after ``baseline()``
    (which times itself), after a first staging (of a file in ``scratch``) that starts
    the fork server."""
    one_file_stagings(daemon, scratch, 0)
    by_daemon = []
    with daemon.client(timeout=600) as client:
        for i in range(runs):
            baseline()
            request = body(i)
            os.sync()
            start = time.perf_counter()
            client.post("/v1/datasets", json=request)
            name = request["name"]
            status = client.get(f"/v1/datasets/{name}/wait", params={"timeout": 600}).json()
            by_daemon.append(time.perf_counter() - start)
            if status["state"] != "ready":
                raise SystemExit(f"staging {name} ended {status['state']}: {status['error']}")
            client.delete(f"/v1/datasets/{name}")
    return by_daemon


# What a user's tar does as root: no owner, no exact mode per file.
AS_A_USER = ("--no-same-owner", "--no-same-permissions")


def timed_tar(archive: Path, out: Path, flags: tuple[str, ...] = ()) -> float:
    """Seconds of a ``tar -xf`` of ``archive`` into a fresh ``out`` (removed after)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    os.sync()
    start = time.perf_counter()
    subprocess.run(["tar", *flags, "-xf", str(archive), "-C", str(out)], check=True)
    took = time.perf_counter() - start
    shutil.rmtree(out)
    return took


def tar_against_daemon(
    daemon: Daemon, archive: Path, out: Path, runs: int
) -> tuple[list[float], list[float], list[float]]:
    """(tar -xf seconds, the same as a user's tar as root, daemon POST-to-ready seconds)
    of each round, alternating, after a first staging that starts the fork server."""
    by_tar: list[float] = []
    by_user_tar: list[float] = []

    def baseline() -> None:
        by_tar.append(timed_tar(archive, out))
        if os.geteuid() == 0:
            by_user_tar.append(timed_tar(archive, out, AS_A_USER))

    def body(i: int) -> dict:  # a hard link of its own: a miss
        link = archive.with_name(f"run-{i}.tar")
        os.link(archive, link)
        return {"name": f"x{i}", "steps": [{"op": "extract", "src": str(link)}]}

    by_daemon = rounds_against_daemon(daemon, runs, baseline, body, archive.parent)
    return by_tar, by_user_tar, by_daemon


def phases(log: str, first: str = "post") -> dict[str, list[float]]:
    """Per phase (named by the point that ends it), its milliseconds in each staging;
    a staging's trace begins at the point ``first``."""
    out: dict[str, list[float]] = {}
    previous: tuple[str, float] | None = None
    for line in log.splitlines():
        if not line.startswith("TRACE "):
            continue
        _, label, ms = line.split()
        if label == first:
            previous = (label, float(ms))
            continue
        if previous is not None:
            out.setdefault(f"{previous[0]} -> {label}", []).append(float(ms) - previous[1])
            previous = (label, float(ms))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="one-file stagings (after a first)")
    parser.add_argument("--trace", action="store_true", help="say where each millisecond goes")
    parser.add_argument(
        "--tar-files", type=int, default=0, help="time an extraction of a tar of N files instead"
    )
    parser.add_argument(
        "--copy-files", type=int, default=0, help="time a copy of a tree of N files instead"
    )
    parser.add_argument(
        "--staging-nice",
        type=int,
        default=None,
        help="the daemon's staging_nice (default 10: stagings yield the CPU to every "
        "process at nice 0, tar included, so on a loaded machine 0 compares like with like)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stager-overhead-") as scratch:
        scratch_dir = Path(scratch)
        env = {}
        if args.staging_nice is not None:
            env["STAGER_STAGING_NICE"] = str(args.staging_nice)
        if args.trace:
            # `python -m stager` looks in its working folder first: run it from the copy.
            code = traced_copy(scratch_dir / "code")
            env["PYTHONPATH"] = str(code)
            os.chdir(code)
        source = scratch_dir / "source"
        source.mkdir()
        daemon = Daemon(cache_dir=scratch_dir / "cache", extra_env=env)
        daemon.start()
        try:
            if args.copy_files:
                tree = make_tree(source, args.copy_files)
                by_cp, by_daemon = copy_against_daemon(daemon, tree, scratch_dir / "out", args.runs)
                log = daemon.log(limit=None)
            elif args.tar_files:
                archive = make_tar(source, args.tar_files)
                by_tar, by_user_tar, by_daemon = tar_against_daemon(
                    daemon, archive, scratch_dir / "out", args.runs
                )
                log = daemon.log(limit=None)
            else:
                times = one_file_stagings(daemon, source, args.runs)
                log = daemon.log(limit=None)
        finally:
            daemon.stop()
        if args.copy_files:
            ratios = [d / c for c, d in zip(by_cp, by_daemon, strict=True)]
            print(
                f"{args.copy_files} files: cp -r median {statistics.median(by_cp):.2f} s, "
                f"the daemon's copy, POST to ready, {statistics.median(by_daemon):.2f} s; "
                f"pairwise ratio median {statistics.median(ratios):.2f} "
                f"({', '.join(f'{r:.2f}' for r in ratios)})"
            )
            if args.trace:
                for name, values in phases(log).items():
                    print(f"  {name:34s} {statistics.median(values):9.2f} ms")
            return
        if args.tar_files:
            ratios = [d / t for t, d in zip(by_tar, by_daemon, strict=True)]
            print(
                f"{args.tar_files} files: tar -xf median {statistics.median(by_tar):.2f} s, "
                f"the daemon's extract, POST to ready, {statistics.median(by_daemon):.2f} s; "
                f"pairwise ratio median {statistics.median(ratios):.2f} "
                f"({', '.join(f'{r:.2f}' for r in ratios)})"
            )
            if by_user_tar:
                ratios = [d / t for t, d in zip(by_user_tar, by_daemon, strict=True)]
                print(
                    f"  against tar {' '.join(AS_A_USER)} -xf (a user's tar, run as root): "
                    f"median {statistics.median(by_user_tar):.2f} s; pairwise ratio median "
                    f"{statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
                )
            if args.trace:
                for name, values in phases(log).items():
                    print(f"  {name:34s} {statistics.median(values):9.2f} ms")
            return
        steady = times[1:]
        print(
            f"one-file staging, POST to ready: median {statistics.median(steady):.1f} ms "
            f"(min {min(steady):.1f}, max {max(steady):.1f}, {len(steady)} runs); "
            f"the first (starts the fork server) {times[0]:.0f} ms"
        )
        if args.trace:
            found = phases(log)
            for name, values in found.items():
                steady_values = values[1:] or values
                print(f"  {name:34s} {statistics.median(steady_values):6.2f} ms")


if __name__ == "__main__":
    main()
