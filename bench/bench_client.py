"""Client latency: ready -> ``wait`` returns (goal p99 < 100 ms over 50 runs), and status cost.

Starts a real ``stager serve`` on a Unix socket. For each run it stages a small
copy under a new name, calls ``StagerClient.wait`` at once, and takes the delay
between the daemon marking the dataset ready (its ``updated_at``) and ``wait``
returning in this process (both wall clocks of this node). A run where ``wait``
started only after the dataset was already ready would not measure the
long-poll, so such runs are replaced by new stagings until ``--runs`` samples are in.

Then it times ``status`` through the client against raw httpx on the same socket
(the client's own cost is the difference), and ``stager-client status`` as a
process, which is what a job script pays.

    python bench/bench_client.py [--runs 50] [--requests 200] [--work-dir /tmp/stager-bench]
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from client import DaemonUnavailable, StagerClient  # noqa: E402


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def describe(label: str, samples: list[float]) -> str:
    return (
        f"{label:<34} p50 {percentile(samples, 50):7.2f} ms   p99 {percentile(samples, 99):7.2f} ms"
        f"   max {max(samples):7.2f} ms   (n={len(samples)})"
    )


def start_daemon(run_dir: Path, cache_dir: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    env = {
        **os.environ,
        "STAGER_RUNTIME_DIR": str(run_dir),
        "STAGER_CACHE_DIR": str(cache_dir),
        "STAGER_MIN_FREE_BYTES": "0",
        "STAGER_URL": f"unix://{run_dir}/stager.sock",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "stager", "serve", "--log-level", "warning"], env=env
    )
    with StagerClient(env["STAGER_URL"]) as client:
        for _ in range(600):
            try:
                client.health()
                return process, env
            except DaemonUnavailable:
                time.sleep(0.05)
    raise RuntimeError("daemon did not start")


def make_source(work: Path) -> Path:
    source = work / "source"
    source.mkdir(parents=True, exist_ok=True)
    for i in range(20):
        (source / f"f{i}.bin").write_bytes(os.urandom(50_000))
    return source


# If nearly every staging is done before wait() starts, more tries will not help.
MAX_STAGINGS_PER_RUN = 10


def ready_delays(client: StagerClient, source: Path, runs: int) -> tuple[list[float], int]:
    """`runs` delays, and how many stagings it took to get them."""
    delays: list[float] = []
    stagings = 0
    while len(delays) < runs:
        if stagings == runs * MAX_STAGINGS_PER_RUN:
            raise RuntimeError(
                f"only {len(delays)} of {stagings} stagings were still running when wait() "
                "started; make the source in make_source() larger"
            )
        delay = one_delay(client, source, stagings)
        stagings += 1
        if delay is not None:
            delays.append(delay)
    return delays, stagings


def one_delay(client: StagerClient, source: Path, i: int) -> float | None:
    """ms from ready to wait() returning; None if it was ready before wait() began."""
    name = f"run-{i}"
    # A new dst per run makes a new spec, so each run really stages (no cache hit).
    client.stage(name, steps=[{"op": "copy", "src": str(source), "dst": f"d{i}"}])
    started = time.time()
    status = client.wait(name, timeout=60)
    returned = time.time()
    ready_at = status.updated_at.timestamp()
    return None if ready_at < started else (returned - ready_at) * 1000


def status_costs(client: StagerClient, raw: httpx.Client, n: int) -> tuple[list, list]:
    via_client, via_raw = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        client.status("run-0")
        via_client.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        raw.get("/v1/datasets/run-0").raise_for_status()
        via_raw.append((time.perf_counter() - t0) * 1000)
    return via_client, via_raw


def cli_costs(env: dict[str, str], n: int) -> list[float]:
    out = []
    command = [sys.executable, "-m", "client.cli", "status", "run-0", "--json"]
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(command, env=env, check=True, capture_output=True)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="stagings to wait for")
    parser.add_argument("--requests", type=int, default=200, help="status calls to time")
    parser.add_argument("--cli-runs", type=int, default=10, help="`stager-client status` runs")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/stager-bench"))
    args = parser.parse_args()

    work = args.work_dir / "client"
    shutil.rmtree(work, ignore_errors=True)
    source = make_source(work)
    run_dir = Path(tempfile.mkdtemp(prefix="stg-bench-"))
    process, env = start_daemon(run_dir, work / "cache")
    try:
        with StagerClient(env["STAGER_URL"]) as client:
            delays, stagings = ready_delays(client, source, args.runs)
            transport = httpx.HTTPTransport(uds=str(run_dir / "stager.sock"))
            with httpx.Client(transport=transport, base_url="http://stager") as raw:
                via_client, via_raw = status_costs(client, raw, args.requests)
        via_cli = cli_costs(env, args.cli_runs)
    finally:
        process.terminate()
        process.wait(timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)

    print(describe("ready -> wait() returns", delays))
    print(
        f"  n={len(delays)} from {stagings} stagings; {stagings - len(delays)} left out "
        "(ready before wait() was called)"
    )
    p99 = percentile(delays, 99)
    print(f"  goal p99 < 100 ms: {'met' if p99 < 100 else 'NOT met'} ({p99:.1f} ms)")
    print(describe("status via StagerClient", via_client))
    print(describe("status via raw httpx", via_raw))
    overhead = statistics.median(via_client) / statistics.median(via_raw)
    print(f"  client / raw httpx (p50): {overhead:.2f}x")
    print(describe("`stager-client status` process", via_cli))


if __name__ == "__main__":
    main()
