"""tests/daemon_zygote.py, on which the crash-point tests stand: a daemon it forks
serves, reads as a daemon to the suite's check for daemons left running, ends with the
status a kill gives it, and nothing it forked outlives the zygote."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.daemon import Daemon, Zygote
from tests.processes import descendants, fork_server_of
from tests.slurm_cluster import DAEMON_PATTERN


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_forked_daemon_serves_and_dies_of_its_kill(tmp_path: Path) -> None:
    zygote = Zygote()
    try:
        daemon = Daemon(cache_dir=tmp_path / "cache", zygote=zygote).start()
        with daemon.client() as client:
            assert client.get("/readyz").status_code == 200
        assert DAEMON_PATTERN.search(cmdline(daemon.process.pid)), cmdline(daemon.process.pid)
        assert daemon.process.poll() is None
        daemon.kill()
        assert daemon.process.returncode == -signal.SIGKILL
        # A stop by SIGTERM: the daemon's own exit status, as from `python -m stager`.
        second = Daemon(cache_dir=tmp_path / "cache2", zygote=zygote).start()
        assert second.stop() == 0, second.log()
    finally:
        zygote.close()


def test_closing_the_zygote_ends_what_it_forked(tmp_path: Path) -> None:
    zygote = Zygote()
    try:
        daemon = Daemon(cache_dir=tmp_path / "cache", zygote=zygote).start()
        pid = daemon.process.pid
        server = fork_server_of(pid)
        assert server is not None, descendants(pid)
    finally:
        zygote.close()
    assert gone(pid)
    # The daemon's fork server ends as its alive pipe closes.
    deadline = time.monotonic() + 10
    while not gone(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(server), cmdline(server)
