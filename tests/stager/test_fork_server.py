"""A daemon's fork server is a fork of the daemon, not a new interpreter
(stager.core.processes._fork_or_spawn): ``ps`` names it; it holds none of the
daemon's descriptors nor Python signal handlers; it ends with the daemon, killed -9
too, and runs none of the daemon's exit handlers (multiprocessing's would remove the
daemon's folder that holds the server's socket)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from stager.core import daemons
from stager.core.processes import FORK_SERVER_TITLE, TEMP_PREFIX, pid_alive
from tests.daemon import Daemon
from tests.processes import comm, descendants, fork_server_of
from tests.slurm_cluster import DAEMON_PATTERN


def _heap_start(pid: int) -> str:
    """Where process ``pid``'s heap begins: a fork's is its parent's; an exec places a
    new one (address-space randomization)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.endswith("[heap]"):
            return line.split("-", 1)[0]
    raise AssertionError(f"process {pid} has no heap")


def _wait_for(what: str, check, timeout_s: float = 15.0):  # noqa: ANN001, ANN202 - a test helper
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError(f"{what} after {timeout_s:g} s")


def _randomized() -> bool:
    return Path("/proc/sys/kernel/randomize_va_space").read_text().strip() == "2"


def test_the_fork_server_is_a_fork_of_the_daemon_and_ps_names_it(daemon: Daemon) -> None:
    assert daemon.process is not None
    pid = daemon.process.pid
    server = _wait_for("no fork server", lambda: fork_server_of(pid))
    title = FORK_SERVER_TITLE.format(pid=pid)
    args = subprocess.run(
        ["ps", "-o", "pid=,args=", "-p", f"{pid},{server}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    shown = dict(line.strip().split(maxsplit=1) for line in args.splitlines())
    assert shown[str(server)] == title, args
    assert "stager serve" in shown[str(pid)], args
    assert comm(server) == title[:15]  # what top and `ps -e` show
    # A fork: the daemon's interpreter and its heap's place (a new interpreter's would
    # be placed anew), not a `python -c` of its own.
    assert os.readlink(f"/proc/{server}/exe") == os.readlink(f"/proc/{pid}/exe")
    if _randomized():
        assert _heap_start(server) == _heap_start(pid)
    # `stager stop` and the suite's checks take no fork server for a daemon.
    assert [d.pid for d in daemons.running() if d.pid in (pid, server)] == [pid]


def test_a_daemon_killed_9_takes_its_fork_server_along_and_keeps_its_folder(
    daemon: Daemon,
) -> None:
    assert daemon.process is not None
    pid = daemon.process.pid
    server = _wait_for("no fork server", lambda: fork_server_of(pid))
    below = [server, *descendants(server)]  # the walker and a spare, at least
    assert len(below) >= 2, below
    folder = daemon.runtime_dir / f"{TEMP_PREFIX}{pid}"
    assert folder.is_dir()
    daemon.kill()
    _wait_for(
        f"processes of the killed daemon still run: {below}",
        lambda: not any(pid_alive(p) for p in below),
    )
    # The server ended (its alive pipe closed) without the daemon's exit handlers: the
    # next start of a daemon removes the folder, not the server's end.
    assert folder.is_dir(), "the fork server's end removed the daemon's folder"


# A process that is not the daemon but sets up what a fork would copy: a Python handler
# for SIGTERM and SIGUSR1, a wakeup descriptor, a file open, an exit handler; then the
# fork server.
FORKED_FROM_A_PROCESS_WITH_STATE = """
import atexit, multiprocessing.forkserver, os, signal, sys
from pathlib import Path
from stager.core.processes import start_fork_server

signal.signal(signal.SIGTERM, lambda *_: None)
signal.signal(signal.SIGUSR1, lambda *_: None)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
held = open(sys.argv[2], "w")
exited = sys.argv[3]
atexit.register(lambda: open(exited, "a").write(f"{os.getpid()}\\n"))
start_fork_server(keep_in=Path(sys.argv[1]))
server = multiprocessing.forkserver._forkserver
print(server._forkserver_pid, flush=True)
sys.stdin.readline()  # the test has looked
os.close(server._forkserver_alive_fd)  # as the daemon's end does: the server ends
os.waitpid(server._forkserver_pid, 0)
print(sorted(os.listdir(sys.argv[1])), flush=True)
os._exit(0)  # not our own exit handler, which would remove the folder
"""


def started(daemon: Daemon, argv: list[str], env: dict[str, str], cwd: Path) -> None:
    """``daemon`` started as ``argv`` (its own command line, as typed), in ``env``."""
    with open(daemon.log_path, "ab") as log:
        daemon.process = subprocess.Popen(
            argv, executable=sys.executable, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd
        )


def _signals(pid: int, field: str) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    raise AssertionError(field)


def test_the_fork_holds_none_of_its_parents_descriptors_handlers_or_exit_handlers(
    tmp_path: Path,
) -> None:
    folder, held, exited = tmp_path / "private", tmp_path / "held-open", tmp_path / "exited"
    argv = [str(folder), str(held), str(exited)]
    with subprocess.Popen(
        [sys.executable, "-c", FORKED_FROM_A_PROCESS_WITH_STATE, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as parent:
        assert parent.stdin is not None and parent.stdout is not None
        server = int(parent.stdout.readline())
        # Past its preload, in its loop: it catches SIGCHLD (multiprocessing.forkserver.main).
        _wait_for("no server loop", lambda: signal.SIGCHLD in _signals(server, "SigCgt"))
        assert comm(server) == "stager forkserv"
        targets = [os.readlink(fd) for fd in Path(f"/proc/{server}/fd").iterdir()]
        assert str(held) not in targets, targets
        caught = _signals(server, "SigCgt")
        # Its own handler alone, none of its parent's; SIGHUP stays ignored, as an exec
        # leaves it.
        assert caught == {signal.SIGCHLD}, caught
        assert signal.SIGHUP in _signals(server, "SigIgn")
        parent.stdin.write("\n")
        parent.stdin.flush()
        left = parent.stdout.readline().strip()
        assert parent.wait(30) == 0
    assert left == f"['{TEMP_PREFIX}{parent.pid}']", "the server's end removed its parent's folder"
    assert not exited.exists(), f"the server ran its parent's exit handler: {exited.read_text()}"


def test_the_fork_server_of_a_short_command_line_still_reads_as_one(tmp_path: Path) -> None:
    """`python -m stager serve`, as typed (argv[0] "python"): the title fits in the
    command line's room (23 bytes) only cut short, "stager forkserver (da", which the
    suite's check for leftovers must still know, and ps still shows as the server."""
    daemon = Daemon(cache_dir=tmp_path / "cache")
    # "python" found as a shell finds it: the interpreter finds its venv by it.
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    started(daemon, ["python", "-m", "stager", "serve"], {**daemon.env, "PATH": path}, tmp_path)
    try:
        daemon.wait_ready()
        pid = daemon.process.pid
        server = _wait_for("no fork server", lambda: fork_server_of(pid))
        shown = Path(f"/proc/{server}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert shown.startswith("stager forkserver"), shown
        assert DAEMON_PATTERN.search(shown.strip()), shown
        assert [d.pid for d in daemons.running() if d.pid in (pid, server)] == [pid]
    finally:
        daemon.cleanup()


def test_a_daemon_started_with_no_environment_has_one_daemon_process(tmp_path: Path) -> None:
    """setproctitle finds the command line's room through the environment's first
    string; a daemon started with none (`env -i stager serve ...`) kept its command line
    in its fork server and every process that forked, which `stager stop` then named as
    four daemons ("stop it with `kill` <the fork server>"): the server is a new
    interpreter there, as multiprocessing makes it."""
    daemon = Daemon(cache_dir=tmp_path / "cache")
    argv = ["serve", "--runtime-dir", str(daemon.runtime_dir), "--cache-dir", str(daemon.cache_dir)]
    started(daemon, [sys.executable, "-m", "stager", *argv], {}, tmp_path)
    try:
        daemon.wait_ready()
        pid = daemon.process.pid
        # The fork server, the walker and a spare, at least (whatever their titles).
        below = _wait_for(
            "no processes below it", lambda: len(descendants(pid)) >= 4 and descendants(pid)
        )
        below = {pid, *below}
        assert [d.pid for d in daemons.running() if d.pid in below] == [pid], daemon.log()
    finally:
        daemon.cleanup()
