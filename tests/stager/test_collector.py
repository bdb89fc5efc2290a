"""``python -m stager`` loads with the garbage collector off (stager/__main__.py) and
turns it back on: a command at once, ``stager serve`` once it has frozen what it
loaded. A daemon left with it off would keep every reference cycle it makes for as
long as it serves.

The real daemon and a real command run with a ``sitecustomize`` of the test's on their
path, which writes the collector's state to a file: the daemon's on SIGUSR1, once it
answers; a command's as it exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.daemon import Daemon

SITECUSTOMIZE = """
import atexit
import gc
import json
import os
import signal

_OUT = os.environ["STAGER_TEST_COLLECTOR"]


def _write(*_):
    with open(f"{_OUT}.{os.getpid()}", "w") as out:
        json.dump({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}, out)


signal.signal(signal.SIGUSR1, _write)
atexit.register(_write)
"""


def _hook(tmp_path: Path) -> dict[str, str]:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"PYTHONPATH": str(hook), "STAGER_TEST_COLLECTOR": str(tmp_path / "collector")}


def _state(path: Path, timeout: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"the hook wrote no {path}"
        time.sleep(0.02)
    return json.loads(path.read_text())


def test_a_serving_daemon_collects_and_has_frozen_what_it_loaded(tmp_path: Path) -> None:
    env = _hook(tmp_path)
    daemon = Daemon(cache_dir=tmp_path / "cache", extra_env=env).start()
    try:
        assert daemon.process is not None
        os.kill(daemon.process.pid, signal.SIGUSR1)
        state = _state(tmp_path / f"collector.{daemon.process.pid}")
    finally:
        daemon.stop()
        daemon.cleanup()
    assert state["enabled"], state
    assert state["frozen"] > 10_000, state  # the modules and the app, out of its sight


def test_a_command_collects(tmp_path: Path) -> None:
    env = {**os.environ, **_hook(tmp_path), "STAGER_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "stager", "recipes", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert _state(tmp_path / f"collector.{_pid_of(tmp_path)}")["enabled"]


def _pid_of(tmp_path: Path) -> str:
    """The pid of the one process that wrote its state (the command)."""
    written = [p.name.rpartition(".")[2] for p in tmp_path.glob("collector.*")]
    assert len(written) == 1, written
    return written[0]


# The fork server imports its preload as multiprocessing.forkserver.main does: an
# ImportError is passed over, and the server forks every staging process on.
FORK_SERVER_PRELOAD = """
import gc
import sys

sys.modules["stager.archive.split_tar"] = None  # an import the preload makes fails
try:
    __import__("stager.engine.preload")
except ImportError:
    pass
print(gc.isenabled())
"""


def test_a_fork_server_whose_preload_failed_still_collects() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FORK_SERVER_PRELOAD],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # Off, each staging and user process forked from the server would keep every
    # reference cycle it made for as long as it ran.
    assert done.stdout.strip() == "True", done.stdout
