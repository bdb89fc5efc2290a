"""Benchmark: an archive behind a URL, extracted as it downloads, against a shell pipe.

    python -m bench.bench_stream [--files 1500] [--repeat 3] [--rate-mbit 200]

Side by side, from one local HTTP server (``http.server`` in a process of its own, at
full speed or throttled to ``--rate-mbit``) serving a generated .tar.gz of
incompressible files (~80 MB at 1,500):

- ``curl URL | tar -xzf -``: the download and the extraction overlap in a pipe;
- stager's ``fetch`` then ``extract`` of the same URL, run as the staging runs
  them: overlapped (stager.overlap), the default for these two steps;
- the same two steps one after the other (the whole download, then the
  extraction), as before the overlap;
- a real ``stager serve`` asked for an ``extract`` of the URL, from the POST to
  ready (the staging process, the seal and the publish counted too).

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
import time
from collections.abc import Callable
from pathlib import Path

from bench.datagen import make_archives, make_tree, tree_bytes
from bench.timing import spread, timed
from stager import overlap
from stager.ops import table
from stager.ops.base import OpContext
from stager.progress import Progress
from tests.daemon import Daemon

OPS = table.load(())
PIPE = "curl | tar -xzf -"


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


def _daemon(url: str, daemon: Daemon) -> Callable[[Path], None]:
    """A real ``stager serve``: POST an ``extract`` of the URL, wait for ready, evict it.
    Each run asks for a new spec (a query string the server ignores), so each is a miss."""
    runs = iter(range(1 << 30))

    def run(dest: Path) -> None:
        name = f"s{next(runs)}"
        step = {"op": "extract", "src": f"{url}?run={name}"}
        with daemon.client(timeout=120) as client:
            client.post("/v1/datasets", json={"name": name, "steps": [step]})
            status = client.get(f"/v1/datasets/{name}/wait", params={"timeout": 120}).json()
            if status["state"] != "ready":
                raise SystemExit(f"staging {name} ended {status['state']}: {status['error']}")
            client.delete(f"/v1/datasets/{name}")

    return run


def main(args: argparse.Namespace) -> int:
    work = args.work_dir / f"stream-{args.files}"
    tree = make_tree(work / "tree", n_files=args.files)
    archive = make_archives(tree, work)["tar.gz"]
    server, base = _serve(work, args.rate_mbit)
    url = f"{base}/{archive.name}"
    daemon = Daemon(cache_dir=work / "daemon-cache").start()
    runners = {
        PIPE: _pipe(url),
        "stager overlapped": _stager(url, args.workers, overlapped=True),
        "stager one by one": _stager(url, args.workers, overlapped=False),
        "daemon, extract URL": _daemon(url, daemon),
    }
    out = work / "out"
    try:
        print(
            f"tree: {args.files} files, {tree_bytes(tree) / 1e6:.0f} MB; archive "
            f"{archive.stat().st_size / 1e6:.0f} MB over HTTP from 127.0.0.1 at "
            f"{f'{args.rate_mbit:g} Mbit/s' if args.rate_mbit else 'full speed'}; "
            f"workers={args.workers}; median of {args.repeat}"
        )
        times: dict[str, list[float]] = {name: [] for name in runners}
        for runner in runners.values():
            timed(runner, out)  # warm-up: the archive in the page cache, code paths hot
        for _ in range(args.repeat):
            for name, runner in runners.items():
                times[name].append(timed(runner, out))
    finally:
        daemon.stop()
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


if __name__ == "__main__":
    parsed = get_args_parser().parse_args()
    if parsed.serve:
        _serve_forever(Path(parsed.serve[0]), int(parsed.serve[1]), float(parsed.serve[2]))
    sys.exit(main(parsed))
