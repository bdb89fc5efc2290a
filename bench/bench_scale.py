"""Million-file stagings through a real daemon, side by side with coreutils.

For each size (default 100,000 and 1,000,000 files of 512 B in 1,000 folders, on
tmpfs), in one run, ``--repeat`` rounds with the order rotated:

- copy: ``cp -r`` against a copy step staged by a real ``stager serve`` (POST to
  ready over its Unix socket, the staging process's start included);
- symlink farm: ``cp -rs`` against a symlink step with ``mode: tree``;
- evict: ``rm -rf`` of ``cp -r``'s output against ``DELETE`` of the staged copy until
  its background delete has removed the last file;
- while each staging runs: the peak RSS of the daemon plus every process under it
  (sampled every 50 ms from /proc), and the latency of ``GET /v1/datasets/{name}``
  sent every 20 ms;
- fingerprint, cheap and deep, in-process (deep against ``find -printf`` of the
  same stat fields).

Then growth: each op's median at the largest size over its median at the smallest.
At most the source tree plus one destination exist at a time (/dev/shm's inodes are
shared); everything is deleted at the end unless ``--keep-tree``.

    flock /tmp/stager-bench.lock python -m bench.bench_scale               # the real run
    python -m bench.bench_scale --files 20000 --repeat 1                  # while developing
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.bench_api import make_client, percentile, start_daemon, time_status
from bench.datagen import make_small_tree
from stager.ops.copy import CopyStep
from stager.request.fingerprint import sources_fingerprint

GOALS = {"copy": 1.0, "symlink farm": 1.0, "evict": 1.0}
GROWTH_GOAL = 11.0
RSS_GOAL_MB = 300.0


# --- what a staging costs the machine ---------------------------------------------


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def tree_rss_mb(pid: int) -> float:
    """RSS of ``pid`` and every process under it, in MB (shared pages counted in each)."""
    children = _children()
    total_kb, stack = 0, [pid]
    while stack:
        current = stack.pop()
        stack.extend(children.get(current, ()))
        try:
            with open(f"/proc/{current}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total_kb += int(line.split()[1])
        except OSError:
            continue
    return total_kb / 1024


@dataclass
class Watch:
    """Samples RSS and status latency on threads while a staging runs."""

    daemon_pid: int
    run_dir: Path
    name: str
    peak_mb: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Watch:
        self._threads = [
            threading.Thread(target=self._rss, daemon=True),
            threading.Thread(target=self._status, daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _rss(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_mb = max(self.peak_mb, tree_rss_mb(self.daemon_pid))

    def _status(self) -> None:
        # Started before the request is sent: its check (a walk of the source) runs in
        # the daemon too. Until the name exists the answer is a 404, as quick to give.
        with make_client(self.run_dir) as client:
            while not self._stop.wait(0.02):
                t0 = time.perf_counter()
                code = client.get(f"/v1/datasets/{self.name}").status_code
                self.latencies_ms.append((time.perf_counter() - t0) * 1000)
                assert code in (200, 404), code


# --- candidates ------------------------------------------------------------------


@dataclass
class Daemon:
    process: subprocess.Popen
    run_dir: Path
    cache_dir: Path
    client: httpx.Client
    watches: dict[str, list[Watch]] = field(default_factory=dict)
    post_s: dict[str, list[float]] = field(default_factory=dict)  # request answered

    def stage(self, label: str, step: dict) -> tuple[float, float]:
        name = label.replace(" ", "-")
        body = {"name": name, "steps": [step]}
        with Watch(self.process.pid, self.run_dir, name) as watch:
            t0, cpu0 = time.perf_counter(), process_cpu(self.process.pid)
            self.client.post("/v1/datasets", json=body).raise_for_status()
            self.post_s.setdefault(label, []).append(time.perf_counter() - t0)
            reply = self.client.get(
                f"/v1/datasets/{name}/wait", params={"timeout": 3600}, timeout=3700
            )
            elapsed = time.perf_counter() - t0
        state = reply.json()
        if state["state"] != "ready":
            raise SystemExit(f"{label} ended {state['state']}: {state['error']}")
        self.watches.setdefault(label, []).append(watch)
        return elapsed, process_cpu(self.process.pid) - cpu0

    def evict(self, label: str) -> tuple[float, float]:
        """DELETE, then wait for the background delete to finish."""
        name = label.replace(" ", "-")
        t0, cpu0 = time.perf_counter(), process_cpu(self.process.pid)
        self.client.delete(f"/v1/datasets/{name}").raise_for_status()
        partial = self.cache_dir / "partial"
        while any(p.name.startswith("discarded-") for p in partial.iterdir()):
            time.sleep(0.005)
        return time.perf_counter() - t0, process_cpu(self.process.pid) - cpu0

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(60)


def timed(command: list[str], quiet: bool = False) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of a command."""
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL if quiet else None)
    r1, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - t0
    return wall, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)


def process_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and every live process under it, each with the children it
    has reaped: the daemon's staging processes are forked (and reaped) by its fork
    server, which lives under the daemon; a staging's workers are reaped by it."""
    ticks, stack = 0, [pid]
    children = _children()
    while stack:
        current = stack.pop()
        stack.extend(children.get(current, ()))
        try:
            with open(f"/proc/{current}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += sum(int(v) for v in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Line:
    op: str
    baseline: str
    times: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def add(self, who: str, measured: tuple[float, float]) -> None:
        self.times.setdefault(who, []).append(measured[0])
        self.cpu.setdefault(who, []).append(measured[1])

    def median(self, who: str) -> float:
        return statistics.median(self.times[who])

    def cpu_median(self, who: str) -> float:
        return statistics.median(self.cpu[who])


def count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def run_size(n: int, args: argparse.Namespace) -> dict[str, Line]:
    work: Path = args.work_dir
    src = make_small_tree(work / f"tree-{n}", n)
    (src / ".complete").unlink()  # not part of what is compared; rewritten at the end
    out = work / "out"
    run_dir = Path(tempfile.mkdtemp(prefix="stg-scale-"))
    cache_dir = work / "cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    process = start_daemon(run_dir, cache_dir, nice=args.staging_nice)
    daemon = Daemon(process, run_dir, cache_dir, make_client(run_dir))
    idle = time_status(daemon.client, "/v1/datasets", 200)
    IDLE_P99[n] = percentile(idle, 99)
    lines = {
        "copy": Line("copy", "cp -r"),
        "symlink farm": Line("symlink farm", "cp -rs"),
        "evict": Line("evict", "rm -rf"),
    }
    try:
        for turn in range(args.repeat):
            _copy_pair(lines, daemon, src, out, turn)
            _link_pair(lines, daemon, src, out, turn)
            print(f"  round {turn + 1}/{args.repeat} done, load {os.getloadavg()[0]:.1f}")
        lines.update(fingerprint_lines(src, args.repeat))
    finally:
        daemon.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(cache_dir, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        (src / ".complete").write_text(f"small,{n},1000,512,0")
    memory_and_api(n, daemon)
    return lines


def _copy_pair(lines: dict[str, Line], daemon: Daemon, src: Path, out: Path, turn: int) -> None:
    order = ["cp", "stager"] if turn % 2 == 0 else ["stager", "cp"]
    for who in order:
        if who == "cp":
            lines["copy"].add("cp -r", timed(["cp", "-r", str(src), str(out)]))
            _check_copy(src, out)
            lines["evict"].add("rm -rf", timed(["rm", "-rf", str(out)]))
        else:
            lines["copy"].add("stager", daemon.stage("copy", {"op": "copy", "src": str(src)}))
            _check_copy(src, _published(daemon))
            lines["evict"].add("stager", daemon.evict("copy"))


def _link_pair(lines: dict[str, Line], daemon: Daemon, src: Path, out: Path, turn: int) -> None:
    order = ["cp", "stager"] if turn % 2 == 0 else ["stager", "cp"]
    step = {"op": "symlink", "src": str(src), "mode": "tree"}
    for who in order:
        if who == "cp":
            lines["symlink farm"].add("cp -rs", timed(["cp", "-rs", str(src), str(out)]))
            shutil.rmtree(out)
        else:
            lines["symlink farm"].add("stager", daemon.stage("symlink farm", step))
            daemon.evict("symlink farm")


def _published(daemon: Daemon) -> Path:
    (tree,) = (daemon.cache_dir / "data").iterdir()
    return tree


def _check_copy(src: Path, dst: Path) -> None:
    """Same number of files: a benchmark of a copy that skipped files means nothing."""
    want, got = count_files(src), count_files(dst)
    if want != got:
        raise SystemExit(f"{dst} has {got} files, the source {want}")


def fingerprint_lines(src: Path, repeat: int) -> dict[str, Line]:
    step = [CopyStep(src=str(src))]
    find = ["find", str(src), "-printf", "%p %s %T@ %i\n"]
    lines = {"fingerprint, deep": Line("fingerprint, deep", "find -printf"),
             "fingerprint, cheap": Line("fingerprint, cheap", "")}  # fmt: skip
    for _ in range(repeat):
        lines["fingerprint, deep"].add("find -printf", timed(find, quiet=True))
        for deep, label in ((True, "fingerprint, deep"), (False, "fingerprint, cheap")):
            t0, cpu0 = time.perf_counter(), time.process_time()
            sources_fingerprint(step, deep=deep)
            lines[label].add("stager", (time.perf_counter() - t0, time.process_time() - cpu0))
    return lines


MEMORY: dict[int, dict[str, tuple[float, float, int]]] = {}
IDLE_P99: dict[int, float] = {}


def memory_and_api(n: int, daemon: Daemon) -> None:
    MEMORY[n] = {}
    for label, watches in daemon.watches.items():
        latencies = [ms for watch in watches for ms in watch.latencies_ms]
        peak = max(watch.peak_mb for watch in watches)
        MEMORY[n][label] = (peak, percentile(latencies, 99), len(latencies))
        print(f"  POST {label} answered after {statistics.median(daemon.post_s[label]):.3f} s")


# --- report -----------------------------------------------------------------------


def report(results: dict[int, dict[str, Line]], sizes: list[int]) -> None:
    for n in sizes:
        print(f"\n-- {n:,} files of 512 B in 1,000 folders (median of runs; ratio stager/baseline)")
        print(
            f"{'op':<20}{'baseline':<14}{'base s':>9}{'stager s':>10}{'ratio':>7}  goal"
            "  [cpu s: base / stager]"
        )
        for line in results[n].values():
            stager = line.median("stager")
            if not line.baseline:
                print(f"{line.op:<20}{'-':<14}{'':>9}{stager:>10.3f}")
                continue
            base = line.median(line.baseline)
            cpu = f"[cpu {line.cpu_median(line.baseline):.2f} / {line.cpu_median('stager'):.2f}]"
            goal = GOALS.get(line.op)
            verdict = (
                ""
                if goal is None
                else f"<= {goal}x " + ("PASS" if stager / base <= goal else "MISS")
            )
            runs = "/".join(f"{t:.2f}" for t in line.times["stager"])
            print(
                f"{line.op:<20}{line.baseline:<14}{base:>9.3f}{stager:>10.3f}"
                f"{stager / base:>6.2f}x  {verdict}  {cpu}  (stager runs {runs})"
            )
        print(f"{'':<20}idle daemon: status p99 {IDLE_P99[n]:.1f} ms (machine load shows here)")
        for label, (peak, p99, count) in MEMORY[n].items():
            rss = "PASS" if peak <= RSS_GOAL_MB else "MISS"
            api = "PASS" if p99 < 20 else "MISS"
            print(
                f"{'':<20}during {label}: peak RSS daemon+children {peak:.0f} MB "
                f"(<= {RSS_GOAL_MB:.0f} {rss}); status p99 {p99:.1f} ms over {count} "
                f"(< 20 {api})"
            )


def report_growth(results: dict[int, dict[str, Line]]) -> None:
    sizes = sorted(results)
    if len(sizes) > 1:
        small, big = sizes[0], sizes[-1]
        factor = big / small
        print(f"\n-- growth {big:,} / {small:,} files (goal <= {GROWTH_GOAL:g} for x{factor:g})")
        for op, line in results[big].items():
            growth = line.median("stager") / results[small][op].median("stager")
            verdict = "PASS" if growth <= GROWTH_GOAL * factor / 10 else "MISS"
            print(f"{op:<20}{growth:>8.2f}  {verdict}")
        for label in MEMORY[big]:
            ratio = MEMORY[big][label][0] / MEMORY[small][label][0]
            verdict = "PASS" if ratio <= 1.10 else "MISS"
            print(f"{'RSS, ' + label:<20}{ratio:>8.2f}  (<= 1.10 {verdict})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default="100000,1000000", help="comma-separated sizes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path("/dev/shm/stager-scale"))
    parser.add_argument("--keep-tree", action="store_true", help="keep the generated trees")
    parser.add_argument(
        "--staging-nice",
        type=int,
        default=None,
        help="the daemon's --staging-nice (default: its own, 10); 0 shows what the ops cost "
        "on a machine others are loading, where a niced staging waits for their processes",
    )
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.files.split(",")]
    print(f"cpus: {os.cpu_count()}; load before: {os.getloadavg()}")
    results = {}
    try:
        for n in sizes:
            print(f"{n:,} files ...", flush=True)
            results[n] = run_size(n, args)
            report(results, [n])
            print(f"load: {os.getloadavg()}", flush=True)
            if not args.keep_tree:
                shutil.rmtree(args.work_dir / f"tree-{n}")
    finally:
        if not args.keep_tree:
            shutil.rmtree(args.work_dir, ignore_errors=True)
    report_growth(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
