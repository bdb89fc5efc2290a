"""Statuses recorded from a real daemon, for tests of what the client renders.

Hand-built statuses let the client and the daemon disagree unnoticed (a 0-based
``step_index`` in the tests, a 1-based one on the wire). These come off a real
``stager serve`` staging a three-step request (fetch a .tar.gz over HTTP, extract
it, rename), held in its first step by a stalled HTTP server, with a second
request queued behind it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.daemon import Daemon
from tests.httpserver import Behaviour, serve_files
from tests.trees import make_tar, write_tree


@dataclass
class Recorded:
    queued: dict[str, Any]  # waiting for a worker: no step started
    first_step: dict[str, Any]  # step 1 of 3 (fetch) running
    ready: dict[str, Any]
    steps_total: int


def _poll(client: httpx.Client, name: str, until: Any, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get(f"/v1/datasets/{name}").json()
        if until(status):
            return status
        time.sleep(0.02)
    raise TimeoutError(f"{name} never reached the state wanted: {status}")


def record(workdir: Path) -> Recorded:
    tree = write_tree(workdir / "tree", n_files=6, max_size=2000)
    archive = make_tar(tree, workdir / "imgs.tar.gz", arcname="imgs").read_bytes()
    hold = threading.Event()
    behaviour = Behaviour(files={"/imgs.tar.gz": archive}, hold=hold)
    daemon = Daemon(cache_dir=workdir / "cache", extra_env={"STAGER_MAX_WORKERS": "1"})
    try:
        with serve_files(behaviour) as base:
            daemon.start()
            steps = [
                {"op": "fetch", "url": f"{base}/imgs.tar.gz", "dst": "imgs.tar.gz"},
                {"op": "extract", "src": "imgs.tar.gz"},
                {"op": "rename", "src": "imgs", "dst": "train"},
            ]
            with daemon.client() as client:
                client.post("/v1/datasets", json={"name": "held", "steps": steps})
                first = _poll(client, "held", lambda s: s["progress"]["step_index"] >= 1)
                behind = [{"op": "copy", "src": str(tree)}]
                client.post("/v1/datasets", json={"name": "behind", "steps": behind})
                queued = _poll(client, "behind", lambda s: s["state"] == "queued")
                hold.set()
                ready = _poll(client, "held", lambda s: s["state"] == "ready")
    finally:
        hold.set()
        daemon.cleanup()
    return Recorded(queued=queued, first_step=first, ready=ready, steps_total=len(steps))
