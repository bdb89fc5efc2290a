"""The node service under a hostile user: does another user still get served?

Issue 30's goal: with one user (alice) holding 20,000 half-sent requests, trickling
downloads in every staging slot she may use, and 300 queued requests, another user's
(bob's) one-file staging is ready in under 1 s, a status call answers in under
100 ms, and the service's memory stays flat.

A real node service (``stager serve --multi-user``, as root) and real users (made
with useradd for the run, as the tests make them; removed at the end). Phases, one
after the other on the same service, bob's probe run ``--runs`` times in each:

- ``quiet``: nothing else runs (the yardstick);
- ``flood``: alice sends ``--half-sent`` half-sent requests (tests/flood.py, as her)
  and holds what she may: each the service ends after holding it (its header
  timeout) she opens again at once. Then she stops it (her stagings need
  connections of her own);
- ``stagings``: alice stages one trickling download (a local server sending 2 KB/s)
  per staging slot, then ``--queued`` more downloads that queue;
- ``all``: her stagings stay, and she floods again, as in ``flood``;
- ``all + storm`` (``--storm``): besides, a second flood of alice's opens again at once
  every connection the service refuses: as many connections a second as it can refuse.

bob's probe (this file with ``--probe``, run as bob) times, each on a new connection
as ``stager-client`` makes it: status calls (``GET /v1/datasets``), and one staging
of a 13-byte file of his, POST to ready. The service's memory (VmRSS, VmHWM) is read
from /proc after each phase. Medians of the runs are printed, with min and max.

    sudo .venv/bin/python bench/bench_fairness.py [--runs 5] [--half-sent 20000]
        [--queued 300] [--wait 10] [--storm] [--daemon-src DIR] [--serve-arg=--max-workers=2 ...]

``--daemon-src DIR`` runs the service from another checkout's ``stager/`` (e.g. made
with ``git archive REV stager | tar -x -C DIR``), for the same measure of an older
revision.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.httpserver import Behaviour, serve_files  # noqa: E402
from tests.users import User, made_users, usable_by_everyone  # noqa: E402

FLOOD = REPO / "tests" / "flood.py"
TRICKLE_BYTES_PER_S = 2000
GOAL_READY_S, GOAL_STATUS_MS = 1.0, 100.0
LOG_KEPT = Path("/tmp/stager-bench-fairness.log")


# ---- what runs as the users ---------------------------------------------------------


# Made once: httpx would load the TLS authorities for each new client (~40 ms), which
# a Unix socket never uses.
TLS = ssl.create_default_context()


def client(socket_path: str, timeout: float) -> httpx.Client:
    transport = httpx.HTTPTransport(uds=socket_path, verify=TLS)
    return httpx.Client(transport=transport, base_url="http://stager", timeout=timeout)


GIVE_UP_S = 20.0  # a request that gets no answer this long counts as unanswered


def call(
    socket_path: str, method: str, path: str, timeout: float, **kwargs: object
) -> tuple[httpx.Response | None, int]:
    """One request on a new connection, as a CLI makes it: (its response, or None when
    none came within GIVE_UP_S; connects retried while the service's listening queue
    was full, which makes a connect fail at once)."""
    retries, deadline = 0, time.monotonic() + GIVE_UP_S
    while True:
        try:
            with client(socket_path, timeout) as c:
                return c.request(method, path, **kwargs), retries  # type: ignore[arg-type]
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                return None, retries
            retries += 1
            time.sleep(0.01)
        except httpx.TransportError:
            return None, retries


def probe(socket_path: str, source: str, name: str, status_calls: int, wait_s: float) -> dict:
    """bob's view: status calls, then a one-file staging from POST to ready."""
    call(socket_path, "GET", "/readyz", 10)  # this process's first request pays its imports
    status_ms: list[float | None] = []
    retries = 0
    for _ in range(status_calls):
        t0 = time.perf_counter()
        response, tried = call(socket_path, "GET", "/v1/datasets", 10)
        answered = response is not None and response.status_code == 200
        status_ms.append((time.perf_counter() - t0) * 1000 if answered else None)
        retries += tried
    t0 = time.perf_counter()
    body = {"name": name, "steps": [{"op": "copy", "src": source}]}
    response, tried = call(socket_path, "POST", "/v1/datasets", 10, json=body)
    retries += tried
    state = response.json().get("state", "refused") if response is not None else "unanswered"
    if state in ("queued", "staging"):
        path, params = f"/v1/datasets/{name}/wait", {"timeout": wait_s}
        waited, tried = call(socket_path, "GET", path, wait_s + 10, params=params)
        retries += tried
        state = waited.json().get("state") if waited is not None else "unanswered"
    ready_s = time.perf_counter() - t0
    return {"status_ms": status_ms, "ready_s": ready_s, "state": state, "retries": retries}


def attack(socket_path: str, base: str, trickles: int, queued: int) -> dict:
    """alice's stagings: a trickling download for each slot, then more that queue."""
    codes: dict[str, int] = {}
    for i in range(trickles + queued):
        body = {"name": f"t{i}", "steps": [{"op": "fetch", "url": f"{base}/t{i}", "dst": "t"}]}
        response, _ = call(socket_path, "POST", "/v1/datasets", 30, json=body)
        code = str(response.status_code) if response is not None else "unanswered"
        codes[code] = codes.get(code, 0) + 1
        if i == trickles - 1:
            time.sleep(1.0)  # the trickles take the slots before the rest queues
    return codes


# ---- the service and the measures, as root ------------------------------------------


class Service:
    def __init__(self, work: Path, daemon_src: str | None, serve_args: list[str]) -> None:
        self.runtime = work / "run"
        self.runtime.mkdir(mode=0o755)
        self.socket = self.runtime / "stager.sock"
        self.log = work / "service.log"
        env = {**os.environ, "STAGER_MIN_FREE_BYTES": "0"}
        if daemon_src:  # first on the path: `python -m` puts the working folder there
            env["PYTHONPATH"] = daemon_src
        argv = [sys.executable, "-m", "stager", "serve", "--multi-user"]
        argv += ["--runtime-dir", str(self.runtime), "--cache-dir", str(work / "cache")]
        argv += ["--log-level", "warning", *serve_args]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=daemon_src
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with client(str(self.socket), 2) as c:
                    if c.get("/readyz").status_code == 200:
                        return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError(f"the service did not start; see {self.log}")

    def memory_mib(self) -> dict[str, float]:
        fields = {}
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
        return fields

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def as_user(user: User, *args: str, timeout: float = 600) -> dict:
    done = user.run([sys.executable, str(Path(__file__).resolve()), *args], timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{user.name}'s part failed:\n{done.stderr}")
    return json.loads(done.stdout)


def probe_runs(
    bob: User, service: Service, files: Path, phase: str, args: argparse.Namespace
) -> list:
    runs = []
    for i in range(args.runs):
        source = files / f"bob-{phase}-{i}.txt"
        source.write_text(f"{phase} {i:03d}\n"[:13].ljust(13))  # 13 bytes, new each run
        source.chmod(0o644)
        probe_args = [str(service.socket), str(source), f"{phase}-{i}"]
        probe_args += [str(args.status_calls), str(args.wait)]
        runs.append(as_user(bob, "--probe", *probe_args))
    return runs


def flood_sent(flood: subprocess.Popen[str]) -> dict:
    """What the flood reports once it has sent every half request."""
    assert flood.stdout is not None
    return json.loads(flood.stdout.readline() or "{}")


def stop(floods: list[subprocess.Popen[str]]) -> None:
    while floods:
        flood = floods.pop()
        flood.kill()
        flood.wait()


def summary(runs: list[dict]) -> dict[str, str]:
    def mmm(values: list[float], unit: str, digits: int) -> str:
        low, mid, high = min(values), statistics.median(values), max(values)
        return f"{mid:.{digits}f} {unit} ({low:.{digits}f}-{high:.{digits}f})"

    ready = [r["ready_s"] for r in runs]
    answered = [[ms for ms in r["status_ms"] if ms is not None] for r in runs]
    unanswered = sum(len(r["status_ms"]) - len(ms) for r, ms in zip(runs, answered, strict=True))
    states = sorted({r["state"] for r in runs})
    lines = {"bob's staging, POST to ready": mmm(ready, "s", 3) + f", states {states}"}
    if all(answered):
        lines["bob's status call (median of a run)"] = mmm(
            [statistics.median(ms) for ms in answered], "ms", 1
        )
        lines["bob's status call (slowest of a run)"] = mmm([max(ms) for ms in answered], "ms", 1)
    lines["status calls unanswered"] = f"{unanswered} of {sum(len(r['status_ms']) for r in runs)}"
    lines["connects retried (queue full)"] = str(sum(r["retries"] for r in runs))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="probes per phase (default 5)")
    parser.add_argument("--half-sent", type=int, default=20_000)
    parser.add_argument("--queued", type=int, default=300)
    parser.add_argument("--slots", type=int, default=2, help="the service's --max-workers")
    parser.add_argument("--status-calls", type=int, default=20, help="per probe (default 20)")
    parser.add_argument("--wait", type=float, default=10.0, help="bob's wait for ready, s")
    parser.add_argument("--daemon-src", help="run the service from this checkout")
    parser.add_argument("--serve-arg", action="append", default=[], help="more serve flags")
    parser.add_argument(
        "--storm",
        action="store_true",
        help="then also a phase where alice reopens every refused connection at once",
    )
    parser.add_argument("--probe", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--attack", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        socket_path, source, name, calls, wait_s = args.probe
        print(json.dumps(probe(socket_path, source, name, int(calls), float(wait_s))))
        return
    if args.attack:
        socket_path, base, trickles, queued = args.attack
        print(json.dumps(attack(socket_path, base, int(trickles), int(queued))))
        return
    if os.geteuid() != 0:
        sys.exit("bench_fairness.py runs the node service and makes users: run it as root")
    run(args)


def run(args: argparse.Namespace) -> None:
    blob = bytes(100 << 20)  # never sent whole: 2 KB/s
    n = args.slots + args.queued
    behaviour = Behaviour(
        files={f"/t{i}": blob for i in range(n)}, bytes_per_s=TRICKLE_BYTES_PER_S, piece=200
    )
    work = Path(tempfile.mkdtemp(prefix="stager-fair-", dir="/tmp"))
    work.chmod(0o755)
    files = work / "files"
    files.mkdir(mode=0o755)
    floods: list[subprocess.Popen[str]] = []
    results: dict[str, dict] = {}
    memory: dict[str, dict] = {}
    with made_users() as (alice, bob), usable_by_everyone(), serve_files(behaviour) as base:
        service = Service(work, args.daemon_src, [f"--max-workers={args.slots}", *args.serve_arg])
        try:
            memory["start"] = service.memory_mib()
            results["quiet"] = summary(probe_runs(bob, service, files, "quiet", args))
            memory["quiet"] = service.memory_mib()
            argv = [sys.executable, str(FLOOD), str(service.socket), str(args.half_sent)]
            floods.append(flood := alice.popen([*argv, "3600", "--keep"]))
            sent = flood_sent(flood)
            memory["flood sent"] = service.memory_mib()
            results["flood"] = summary(probe_runs(bob, service, files, "flood", args))
            memory["flood"] = service.memory_mib()
            stop(floods)  # her stagings need connections of hers
            t0 = time.perf_counter()
            codes = as_user(
                alice, "--attack", str(service.socket), base, str(args.slots), str(args.queued)
            )
            attack_s = time.perf_counter() - t0
            results["stagings"] = summary(probe_runs(bob, service, files, "stagings", args))
            memory["stagings"] = service.memory_mib()
            floods.append(flood := alice.popen([*argv, "3600", "--keep"]))
            sent = flood_sent(flood)
            results["all"] = summary(probe_runs(bob, service, files, "all", args))
            memory["all"] = service.memory_mib()
            if args.storm:
                floods.append(alice.popen([*argv[:-1], "64", "3600", "--reopen"]))
                results["all + storm"] = summary(probe_runs(bob, service, files, "storm", args))
                memory["all + storm"] = service.memory_mib()
        finally:
            stop(floods)
            service.stop()
            log_bytes = service.log.stat().st_size
            log_lines = service.log.read_text(errors="replace").count("\n")
            shutil.copy(service.log, LOG_KEPT)
            shutil.rmtree(work, ignore_errors=True)
    report(args, sent, codes, attack_s, results, memory, log_bytes, log_lines)


def report(
    args: argparse.Namespace,
    sent: dict,
    codes: dict,
    attack_s: float,
    results: dict[str, dict],
    memory: dict[str, dict],
    log_bytes: int,
    log_lines: int,
) -> None:
    goals = f"ready < {GOAL_READY_S:g} s, status < {GOAL_STATUS_MS:g} ms, memory flat"
    print(f"node service, {args.slots} slots; {args.runs} probes a phase; goals: {goals}")
    if args.daemon_src:
        print(f"service from {args.daemon_src}")
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"\nalice's flood: {json.dumps({k: v for k, v in sent.items() if k != 'answers'})}")
    for status, answer in sent.get("answers", {}).items():
        print(f"  first {status}: {answer.rpartition(chr(10))[2][:200]}")
    stagings = f"alice's {args.slots} trickles + {args.queued} queued"
    print(f"{stagings}, answered {codes} in {attack_s:.1f} s")
    for phase, lines in results.items():
        print(f"\n[{phase}]")
        for key, value in lines.items():
            print(f"  {key:40s} {value}")
    print("\nservice memory (MiB):")
    for when, fields in memory.items():
        print(f"  {when:12s} " + "  ".join(f"{k} {v:.1f}" for k, v in fields.items()))
    print(f"service log: {log_bytes} bytes, {log_lines} lines (kept in {LOG_KEPT})")


if __name__ == "__main__":
    main()
