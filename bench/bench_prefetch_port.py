"""What the node service's prefetch port costs a node, and an order's time end to end.

As root: a private munged, two node services side by side (`stager serve --multi-user`),
one with `--prefetch-listen 127.0.0.1:PORT` and one without; each one's resident memory
once ready, and its CPU while idle over ``--idle`` seconds. Then the planner's own
sender (stager.prestage.plan.service.Sender) sends orders to the port, one at a time: each one a
fresh credential (`munge`), the POST, the node's `unmunge` and its record of spent
credentials written, the answer. Cancels (nothing to stage) and stages of a 5-file tree
as the user nobody; median and 95th percentile, and `munge` alone for comparison. Last,
a burst of ``--burst`` cancels sent as the service sends them (32 at once).

    sudo python -m bench.bench_prefetch_port
    sudo python -m bench.bench_prefetch_port --idle 60 --orders 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pwd
import statistics
import tempfile
import time
from pathlib import Path

from stager.core import vouch
from stager.core.settings import Settings
from stager.prestage.plan.service import Order, Sender
from tests.daemon import Daemon, free_privileged_port
from tests.munge import private_munged

TICK = os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def service(folder: Path, munge: Path, *args: str) -> Daemon:
    daemon = Daemon(
        cache_dir=folder / "cache",
        args=["--multi-user", *args],
        extra_env={"STAGER_MUNGE_SOCKET": str(munge), "STAGER_NODE_NAME": "node1"},
    )
    daemon.runtime_dir.chmod(0o755)
    return daemon.start()


def body(action: str, job: int, tree: Path) -> bytes:
    nobody = pwd.getpwnam("nobody")
    order = {"action": action, "job": job, "uid": nobody.pw_uid, "gid": nobody.pw_gid}
    order["node"] = "node1"
    if action == "stage":
        order["request"] = {"name": f"d{job}", "steps": [{"op": "copy", "src": str(tree)}]}
    return json.dumps(order).encode()


async def timed(sender: Sender, orders: list[Order]) -> list[float]:
    took = []
    for order in orders:
        began = time.perf_counter()
        outcome, why = await sender.send(order)
        assert outcome == "sent", why
        took.append((time.perf_counter() - began) * 1000)
    return took


async def burst(sender: Sender, orders: list[Order]) -> float:
    began = time.perf_counter()
    outcomes = await asyncio.gather(*(sender.send(o) for o in orders))
    assert all(outcome == "sent" for outcome, _ in outcomes), outcomes[:3]
    return time.perf_counter() - began


def summary(name: str, took: list[float]) -> str:
    p95 = statistics.quantiles(took, n=20)[-1]
    return f"{name}: median {statistics.median(took):.1f} ms, p95 {p95:.1f} ms (n={len(took)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of idle measured")
    parser.add_argument("--orders", type=int, default=50, help="orders of each kind timed")
    parser.add_argument("--burst", type=int, default=500, help="cancels sent at once")
    args = parser.parse_args()
    with private_munged() as munge, tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        root.chmod(0o755)
        tree = root / "tree"
        tree.mkdir()
        for i in range(5):
            (tree / f"f{i}").write_bytes(os.urandom(4096))
        port = free_privileged_port()
        plain = service(root / "plain", munge)
        listening = service(root / "port", munge, "--prefetch-listen", f"127.0.0.1:{port}")
        try:
            time.sleep(2.0)
            pids = {"without": plain.process.pid, "with": listening.process.pid}
            before = {k: cpu_s(p) for k, p in pids.items()}
            time.sleep(args.idle)
            for kind, pid in pids.items():
                idle = (cpu_s(pid) - before[kind]) / args.idle * 100
                print(f"{kind} the port: RSS {rss_mib(pid):.1f} MiB, idle CPU {idle:.3f}%")
            settings = Settings(munge_socket=munge, plan_node_addresses=[f"node1=127.0.0.1:{port}"])

            async def run() -> None:
                sender = Sender(settings)
                payload = json.dumps({"what": "stager prefetch", "sha256": "0" * 64})
                took = []
                for _ in range(args.orders):
                    began = time.perf_counter()
                    vouch.encode(payload, munge, 60)
                    took.append((time.perf_counter() - began) * 1000)
                print(summary("munge alone (the planner's credential)", took))
                cancels = [Order("node1", body("cancel", 1, tree), "1", None)] * args.orders
                print(summary("cancel order, end to end", await timed(sender, cancels)))
                stages = [
                    Order("node1", body("stage", 1000 + n, tree), str(1000 + n), None)
                    for n in range(args.orders)
                ]
                print(summary("stage order, end to end", await timed(sender, stages)))
                many = [Order("node1", body("cancel", 2, tree), "2", None)] * args.burst
                took_s = await burst(sender, many)
                print(f"{args.burst} cancels, 32 at once: {took_s:.2f} s, "
                      f"{args.burst / took_s:.0f} orders/s")  # fmt: skip
                await sender.close()

            asyncio.run(run())
            pid = listening.process.pid
            print(f"with the port, after the orders: RSS {rss_mib(pid):.1f} MiB")
        finally:
            for daemon in (plain, listening):
                daemon.stop()
                daemon.cleanup()


if __name__ == "__main__":
    main()
