"""A staging starts in a spare: a staging process the fork server forked before its
job, once the previous staging ended (stager.staging.blocking). The spare runs the next job
as a process forked for it would (niced, batch-scheduled); a dead spare is passed
over; Ctrl-C does not kill it; a daemon gone leaves none behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from stager.core.processes import SPARE_NAME, STAGE_NAME
from tests.daemon import Daemon, stage, stage_ready
from tests.httpserver import Behaviour, serve_files
from tests.processes import children_of
from tests.trees import digest

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py


def forked(daemon: Daemon) -> dict[int, str]:
    """What the daemon's fork server forked, by pid, with its name (comm)."""
    assert daemon.process is not None
    found = {}
    for server in children_of(daemon.process.pid):
        try:
            if b"forkserver" not in Path(f"/proc/{server}/cmdline").read_bytes():
                continue
        except OSError:
            continue
        for pid in children_of(server):
            try:
                found[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                pass  # gone meanwhile
    return found


def wait_for_spare(daemon: Daemon) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        spares = [pid for pid, name in forked(daemon).items() if name == SPARE_NAME]
        if spares:
            assert len(spares) == 1, spares
            return spares[0]
        time.sleep(0.02)
    raise AssertionError("no spare staging process after a staging ended")


def small_tree(folder: Path, files: int = 20) -> Path:
    for i in range(files):
        (folder / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (folder / f"d{i % 3}" / f"f{i}").write_bytes(os.urandom(100 + i))
    return folder


def test_the_next_staging_runs_in_the_spare(daemon: Daemon, tmp_path: Path) -> None:
    first = small_tree(tmp_path / "first")
    with daemon.client() as client:
        stage_ready(client, {"name": "first", "steps": [{"op": "copy", "src": str(first)}]})
        spare = wait_for_spare(daemon)
        # A download held after its headers keeps the second staging running while the
        # processes are looked at.
        hold = threading.Event()
        with serve_files(Behaviour(files={"/blob": b"x" * (1 << 20)}, hold=hold)) as url:
            body = {"name": "held", "steps": [{"op": "fetch", "url": f"{url}/blob", "dst": "b"}]}
            assert stage(client, body).status_code == 202
            deadline = time.monotonic() + 20
            while forked(daemon).get(spare) != STAGE_NAME and time.monotonic() < deadline:
                time.sleep(0.02)
            assert forked(daemon).get(spare) == STAGE_NAME, "the spare should run the job"
            stagings = [p for p, name in forked(daemon).items() if name == STAGE_NAME]
            assert stagings == [spare], f"one staging process, the spare: {forked(daemon)}"
            # /proc/PID/stat after the name: field 19 is the nice, 41 the policy.
            fields = Path(f"/proc/{spare}/stat").read_text().rsplit(")", 1)[1].split()
            assert (fields[16], fields[38]) == ("10", str(os.SCHED_BATCH)), fields
            hold.set()
            waited = client.get("/v1/datasets/held/wait", params={"timeout": 30}).json()
        assert waited["state"] == "ready", waited
        assert Path(waited["path"], "b").read_bytes() == b"x" * (1 << 20)
        # The spare's own job done, it is gone; the next spare is another process.
        assert wait_for_spare(daemon) != spare
        third = small_tree(tmp_path / "third", files=50)
        body = {"name": "third", "steps": [{"op": "copy", "src": str(third)}]}
        status = stage_ready(client, body)
    assert digest(Path(status.path)) == digest(third)


def test_ctrl_c_leaves_the_spare_alone(daemon: Daemon, tmp_path: Path) -> None:
    """Ctrl-C in a terminal reaches the daemon's whole process group: the daemon
    cancels its stagings and stops its spare itself; the spare neither dies of it nor
    prints a traceback."""
    tree = small_tree(tmp_path / "tree")
    with daemon.client() as client:
        stage_ready(client, {"name": "a", "steps": [{"op": "copy", "src": str(tree)}]})
        spare = wait_for_spare(daemon)
        os.kill(spare, signal.SIGINT)
        time.sleep(0.3)
        assert not _gone(spare), "the spare died of SIGINT"
        assert "KeyboardInterrupt" not in daemon.log(limit=None)
        other = small_tree(tmp_path / "other", files=5)
        status = stage_ready(client, {"name": "b", "steps": [{"op": "copy", "src": str(other)}]})
        assert digest(Path(status.path)) == digest(other)


def test_a_dead_spare_is_passed_over(daemon: Daemon, tmp_path: Path) -> None:
    tree = small_tree(tmp_path / "tree")
    with daemon.client() as client:
        stage_ready(client, {"name": "a", "steps": [{"op": "copy", "src": str(tree)}]})
        os.kill(wait_for_spare(daemon), signal.SIGKILL)
        other = small_tree(tmp_path / "other", files=7)
        status = stage_ready(client, {"name": "b", "steps": [{"op": "copy", "src": str(other)}]})
        assert digest(Path(status.path)) == digest(other)
        wait_for_spare(daemon)  # and a spare again for the one after


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_daemon_gone_leaves_no_spare(daemon_factory, tmp_path: Path, how: int) -> None:
    daemon: Daemon = daemon_factory()
    tree = small_tree(tmp_path / "tree")
    with daemon.client() as client:
        stage_ready(client, {"name": "a", "steps": [{"op": "copy", "src": str(tree)}]})
    spare = wait_for_spare(daemon)
    daemon.stop(how)
    # Stopped, the daemon ends it; killed, the spare sees it gone (its pidfd) and dies.
    deadline = time.monotonic() + (0 if how == signal.SIGTERM else 10)
    while not _gone(spare) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(spare), "the spare outlived the daemon"


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
