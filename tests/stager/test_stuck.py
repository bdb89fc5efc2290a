"""No staging holds a worker forever: a cancel ends a staging stuck in a system call
within seconds, and a staging whose progress stands still fails with a sentence.

The stuck system call here is a read from an HTTP server that sent its headers and
then nothing (``Behaviour.hold``): the same as a hung network filesystem or a FIFO,
as far as the staging process can tell.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.daemon import Daemon, stage
from tests.httpserver import Behaviour, serve_files
from tests.processes import staging_processes

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

BLOB = bytes(1 << 20)


def children(daemon: Daemon) -> set[int]:
    """The daemon's staging processes."""
    assert daemon.process is not None
    return set(staging_processes(daemon.process.pid))


def wait_for_step(daemon: Daemon, name: str, step: str) -> None:
    deadline = time.monotonic() + 20
    with daemon.client() as client:
        while time.monotonic() < deadline:
            if client.get(f"/v1/datasets/{name}").json()["progress"]["step"] == step:
                return
            time.sleep(0.05)
    raise AssertionError(f"{name} never reached its {step} step")


def test_cancel_ends_a_staging_stuck_in_a_system_call(daemon_factory) -> None:
    daemon: Daemon = daemon_factory(env={"STAGER_CANCEL_GRACE": "1"})
    hold = threading.Event()
    with serve_files(Behaviour(files={"/blob": BLOB}, hold=hold)) as url:
        before = children(daemon)
        with daemon.client() as client:
            body = {"name": "stuck", "steps": [{"op": "fetch", "url": f"{url}/blob", "dst": "b"}]}
            assert stage(client, body).status_code == 202
            wait_for_step(daemon, "stuck", "fetch")
            staging = children(daemon) - before
            assert staging, "the staging should run in its own process"
            t0 = time.monotonic()
            cancelled = client.delete("/v1/datasets/stuck").json()
            took = time.monotonic() - t0
        hold.set()
    assert cancelled["state"] == "cancelled", cancelled
    assert took < 5, f"cancel took {took:.1f} s"
    # That process, by pid: a spare forked for the next staging may have come since.
    assert children(daemon) & staging == set(), "the stuck staging process is still running"


def test_a_staging_that_makes_no_progress_fails_naming_its_step(daemon_factory) -> None:
    # Long enough for the staging process to start on a loaded machine (before its
    # first step, a stall would be reported "in its start").
    daemon: Daemon = daemon_factory(env={"STAGER_STALL_TIMEOUT": "4"})
    hold = threading.Event()
    with serve_files(Behaviour(files={"/blob": BLOB}, hold=hold)) as url, daemon.client() as c:
        body = {"name": "hung", "steps": [{"op": "fetch", "url": f"{url}/blob", "dst": "b"}]}
        assert stage(c, body).status_code == 202
        status = c.get("/v1/datasets/hung/wait", params={"timeout": 20}).json()
        hold.set()
        assert status["state"] == "failed", status
        assert status["error"]["type"] == "stalled"
        assert "no progress for 4 s in step 1 (fetch)" in status["error"]["message"]
        # The worker slot is free again: the next staging runs.
        again = {"name": "next", "steps": [{"op": "fetch", "url": f"{url}/blob", "dst": "b"}]}
        assert stage(c, again).status_code == 202
        assert c.get("/v1/datasets/next/wait", params={"timeout": 20}).json()["state"] == "ready"


def test_a_staging_process_killed_midway_fails_its_dataset_at_once(daemon_factory) -> None:
    """The daemon awaits the outcome on the child's pipe: a child that dies without a
    word closes it, and the dataset fails with the sentence, not after a poll or a
    timeout; the worker slot is free again."""
    daemon: Daemon = daemon_factory()
    hold = threading.Event()
    with serve_files(Behaviour(files={"/blob": BLOB}, hold=hold)) as url, daemon.client() as c:
        before = children(daemon)
        body = {"name": "killed", "steps": [{"op": "fetch", "url": f"{url}/blob", "dst": "b"}]}
        assert stage(c, body).status_code == 202
        wait_for_step(daemon, "killed", "fetch")
        for pid in children(daemon) - before:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        status = c.get("/v1/datasets/killed/wait", params={"timeout": 20}).json()
        took = time.monotonic() - t0
        hold.set()
        assert status["state"] == "failed", status
        assert "the staging process died with exit code -9" in status["error"]["message"]
        assert took < 5, f"the death was noticed after {took:.1f} s"
        again = {"name": "next", "steps": [{"op": "fetch", "url": f"{url}/blob", "dst": "b"}]}
        assert stage(c, again).status_code == 202
        assert c.get("/v1/datasets/next/wait", params={"timeout": 20}).json()["state"] == "ready"
