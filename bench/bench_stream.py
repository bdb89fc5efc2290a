"""Benchmark: an archive behind a URL, extracted as it downloads, against a shell pipe.

    python -m bench.bench_stream [--files 1500] [--repeat 3] [--rate-mbit 200]

Side by side, from one local HTTP server (``http.server`` in a process of its own, at
full speed or throttled to ``--rate-mbit``) serving a generated .tar.gz of
incompressible files (~80 MB at 1,500):

- ``curl URL | tar -xzf -``: the download and the extraction overlap in a pipe;
- stager's ``fetch`` then ``extract`` of the same URL, run as the staging runs
  them: overlapped (stager.staging.overlap), the default for these two steps;
- the same two steps one after the other (the whole download, then the
  extraction), as before the overlap;
- a real ``stager serve`` asked for an ``extract`` of the URL by stager's own client
  (``client.StagerClient``, made once, as a job holds it), from the POST to the wait
  that says ready (the staging process, the seal and the publish counted too; the
  eviction that follows is not).

``--trace`` runs the daemon alone, from a copy of ``stager/`` with trace points (as
``bench.bench_overhead --trace`` does), and says where its time goes: the POST, the
staging process, the first and the last byte of the download, the extraction's end,
the seal, the publish, the client seeing ready.

Candidates run interleaved so that load from other processes hits all alike, each
into a fresh folder, after ``sync``; stager runs in-process, as in the staging
process (no interpreter start-up counted). The table shows the median of the
repeats, the spread (max - min) / median, and each one's ratio to the pipe.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import bench_overhead
from bench.datagen import make_archives, make_tree, tree_bytes
from bench.timing import spread, timed
from client import StagerClient
from stager.ops import table
from stager.ops.base import OpContext
from stager.staging import overlap
from stager.wire.progress import Progress
from tests.daemon import Daemon

OPS = table.load(())
PIPE = "curl | tar -xzf -"
DAEMON = "daemon, extract URL"
# Where a staging of a URL's archive spends its time (--trace): the points of
# bench_overhead, then the download and the extraction's end, in the order they happen.
TRACE_POINTS = [
    *bench_overhead.TRACE_POINTS,
    (
        "stager/staging/blocking.py",
        "    process, counters, child_cancel, receiver = child\n",
        "handed",
    ),
    ("stager/ops/fetch.py", "        with self.client.stream(", "get-sent"),
    ("stager/ops/fetch.py", "            self._raise_for_status(response)\n", "headers"),
    ("stager/ops/fetch.py", "        if total is not None and position > total:\n", "last-byte"),
    ("stager/ops/fetch.py", "        ctx.progress.advance(0, 1)\n", "renamed"),
    ("stager/archive/growing.py", "                self.reached_end = True\n", "eof-read"),
    ("stager/archive/extractor.py", "            writer.flush()\n", "members-read"),
    ("stager/archive/extractor.py", "        writer.finish()\n", "+written"),
]


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/tmp/stager-bench"),
        help="where the generated tree, its archive and the outputs live",
    )
    parser.add_argument(
        "--files", type=int, default=1_500, help="files in the tree (1,500 is about 80 MB)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per candidate")
    parser.add_argument(
        "--rate-mbit",
        type=float,
        default=None,
        help="serve at this many Mbit/s (default: as fast as the loopback goes)",
    )
    parser.add_argument(
        "--trace", action="store_true", help="run the daemon alone; say where its time goes"
    )
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)  # the server process
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 2,
        help="threads stager may use (ctx.workers)",
    )
    return parser


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Throttled(http.server.SimpleHTTPRequestHandler):
    """Serves files at ``rate`` bytes/s: a link slower than the disk, as a cluster's
    storage is from one node."""

    rate = 0.0

    def log_message(self, *args: object) -> None:
        pass

    def copyfile(self, source, outputfile) -> None:  # noqa: ANN001 - the base's signature
        start, sent = time.monotonic(), 0
        while chunk := source.read(1 << 20):
            outputfile.write(chunk)
            sent += len(chunk)
            if (ahead := sent / self.rate - (time.monotonic() - start)) > 0:
                time.sleep(ahead)


def _serve_forever(folder: Path, port: int, rate: float) -> None:
    """The server process (``--serve``): at full speed, or throttled to ``rate``."""
    handler = _Throttled if rate else http.server.SimpleHTTPRequestHandler
    _Throttled.rate = rate
    bound = functools.partial(handler, directory=str(folder))
    http.server.ThreadingHTTPServer(("127.0.0.1", port), bound).serve_forever()


def _serve(folder: Path, rate_mbit: float | None) -> tuple[subprocess.Popen, str]:
    """An HTTP server process on ``folder``; returns it and its base URL once it answers."""
    port = _free_port()
    rate = str((rate_mbit or 0) * 1e6 / 8)
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_stream", "--serve", str(folder), str(port), rate],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise SystemExit(f"the HTTP server on port {port} did not start; is the port free?")


def _pipe(url: str) -> Callable[[Path], None]:
    def run(dest: Path) -> None:
        subprocess.run(f"curl -sSf {url} | tar -xzf - -C {dest}", shell=True, check=True)

    return run


def _stager(url: str, workers: int, overlapped: bool) -> Callable[[Path], None]:
    def run(dest: Path) -> None:
        steps = OPS.validate_steps(
            [
                {"op": "fetch", "url": url, "dst": "dl/tree.tar.gz"},
                {"op": "extract", "src": "dl/tree.tar.gz"},
            ]
        )
        ctx = OpContext(root=dest, progress=Progress(), workers=workers)
        if overlapped:
            assert OPS.overlaps(steps[0], steps[1], ctx)
            overlap.run_pair(OPS, steps[0], steps[1], ctx, downloaded=lambda: None)
        else:
            for step in steps:
                OPS.run(step, ctx)
        os.unlink(dest / "dl" / "tree.tar.gz")  # as the staging does without ``keep``

    return run


class _DaemonRuns:
    """A real ``stager serve``, asked by stager's client for an ``extract`` of the URL;
    a run is the POST and the wait that says ready. Each run asks for a new spec (a
    query string the server ignores), so each is a miss; the dataset is evicted after
    the timing (``evict``)."""

    def __init__(self, url: str, daemon: Daemon, trace: Path | None = None) -> None:
        self.url, self.trace = url, trace
        self.client = StagerClient(daemon.url)
        self.runs = 0

    def __call__(self, dest: Path) -> None:
        self.runs += 1
        name = f"s{self.runs}"
        self._note("asked")
        self.client.stage(name, steps=[{"op": "extract", "src": f"{self.url}?run={name}"}])
        status = self.client.wait(name, timeout=120)
        self._note("ready-seen")
        if status.state != "ready":
            raise SystemExit(f"staging {name} ended {status.state}: {status.error}")

    def evict(self) -> None:
        self.client.cancel(f"s{self.runs}")

    def _note(self, label: str) -> None:
        if self.trace is not None:
            with open(self.trace, "a") as log:
                log.write(f"TRACE {label} {time.perf_counter() * 1000:.3f}\n")


def main(args: argparse.Namespace) -> int:
    work = args.work_dir / f"stream-{args.files}"
    tree = make_tree(work / "tree", n_files=args.files)
    archive = make_archives(tree, work)["tar.gz"]
    server, base = _serve(work, args.rate_mbit)
    url = f"{base}/{archive.name}"
    if args.trace:
        try:
            return _trace(url, work, args.repeat)
        finally:
            server.terminate()
            server.wait(10)
    try:
        daemon = Daemon(cache_dir=work / "daemon-cache").start()
    except BaseException:
        server.terminate()  # the server process is ours to stop whatever happens
        server.wait(10)
        raise
    daemon_runs = _DaemonRuns(url, daemon)
    runners = {
        PIPE: _pipe(url),
        "stager overlapped": _stager(url, args.workers, overlapped=True),
        "stager one by one": _stager(url, args.workers, overlapped=False),
        DAEMON: daemon_runs,
    }
    after = {DAEMON: daemon_runs.evict}
    out = work / "out"
    try:
        print(
            f"tree: {args.files} files, {tree_bytes(tree) / 1e6:.0f} MB; archive "
            f"{archive.stat().st_size / 1e6:.0f} MB over HTTP from 127.0.0.1 at "
            f"{f'{args.rate_mbit:g} Mbit/s' if args.rate_mbit else 'full speed'}; "
            f"workers={args.workers}; median of {args.repeat}"
        )
        times: dict[str, list[float]] = {name: [] for name in runners}
        for name, runner in runners.items():
            timed(runner, out)  # warm-up: the archive in the page cache, code paths hot
            after.get(name, lambda: None)()
        for _ in range(args.repeat):
            for name, runner in runners.items():
                times[name].append(timed(runner, out))
                after.get(name, lambda: None)()
    finally:
        daemon_runs.client.close()
        daemon.stop()
        daemon.cleanup()
        server.terminate()
        server.wait(10)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work / "daemon-cache", ignore_errors=True)
    base_time = statistics.median(times[PIPE])
    header = f"{'candidate':<22}{'seconds':>9}{'spread':>8}{'ratio':>8}  runs"
    print(header)
    print("-" * len(header))
    for name, values in times.items():
        median = statistics.median(values)
        runs = " ".join(f"{v:.2f}" for v in values)
        print(f"{name:<22}{median:>9.3f}{spread(values):>8}{median / base_time:>8.2f}  {runs}")
    return 0


def _trace(url: str, work: Path, repeat: int) -> int:
    """The daemon's runs alone, from a copy of ``stager/`` with trace points: each
    phase's median in milliseconds (the first run, which starts the fork server, left
    out)."""
    scratch = Path(tempfile.mkdtemp(prefix="stager-stream-trace-"))
    code = bench_overhead.traced_copy(scratch / "code", TRACE_POINTS)
    os.chdir(code)  # `python -m stager` looks in its working folder first
    daemon = Daemon(cache_dir=scratch / "cache", extra_env={"PYTHONPATH": str(code)})
    runs: _DaemonRuns | None = None
    walls = []
    try:
        runs = _DaemonRuns(url, daemon.start(), trace=scratch / "client.log")
        for _ in range(repeat + 1):
            walls.append(timed(runs, scratch / "out"))
            runs.evict()
        log = daemon.log(limit=None) + (scratch / "client.log").read_text()
    finally:
        if runs is not None:
            runs.client.close()
        if daemon.process is not None and daemon.process.poll() is None:
            daemon.stop()
        daemon.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    # The points of several processes and threads, in the order they happened.
    lines = sorted(
        (float(line.split()[2]), line) for line in log.splitlines() if line.startswith("TRACE ")
    )
    found = bench_overhead.phases("\n".join(line for _, line in lines), first="asked")
    print(f"POST to ready, s: {' '.join(f'{w:.3f}' for w in walls[1:])} (first {walls[0]:.3f})")
    for name, values in found.items():
        steady = values[1:] or values
        print(f"  {name:32s} {statistics.median(steady):9.2f} ms")
    return 0


if __name__ == "__main__":
    parsed = get_args_parser().parse_args()
    if parsed.serve:
        _serve_forever(Path(parsed.serve[0]), int(parsed.serve[1]), float(parsed.serve[2]))
    sys.exit(main(parsed))
