"""The owner of processes and threads, its own contract (stager/core/processes.py): a
command's end or the sentence why it has none, a bare fork's exit code, a thread's
error kept for the thread that joins it, a forked pool started whole, and a daemon's
fork server socket in a folder of the daemon's own that nothing killed leaves behind."""

from __future__ import annotations

import grp
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from stager.cli import EXIT_FAILED
from stager.core.processes import (
    FORK,
    TEMP_PREFIX,
    NotRun,
    Threaded,
    fork_child,
    fork_pool,
    pid_alive,
    run,
    temp_folder_in,
)
from tests.daemon import Daemon
from tests.processes import fork_server_of, socket_paths_of
from tests.users import GROUP, User


def test_a_command_runs_to_its_end_and_its_status_is_the_callers() -> None:
    done = run(
        [sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'a\\xff'); sys.exit(3)"], 30
    )
    assert done.returncode == 3 and done.stdout == "a\udcff"  # a byte not UTF-8 kept
    echoed = run([sys.executable, "-c", "print(input())"], 30, input="fed\n")
    assert echoed.stdout == "fed\n"


def test_a_command_that_cannot_run_or_never_ends_is_one_sentence_naming_it() -> None:
    with pytest.raises(NotRun, match="no-such-tool could not be started") as missing:
        run(["/nonexistent/no-such-tool"], 5)
    assert not missing.value.timed_out and isinstance(missing.value, OSError)
    with pytest.raises(NotRun, match="sleep did not answer within 0.2 s") as slow:
        run(["sleep", "30"], 0.2)
    assert slow.value.timed_out


def test_a_bare_fork_exits_with_its_mains_code_or_1_when_it_raises() -> None:
    def fails() -> int:
        raise RuntimeError("in the child")

    codes = []
    for main in (lambda: 7, fails):
        _, status = os.waitpid(fork_child(main), 0)
        codes.append(os.waitstatus_to_exitcode(status))
    assert codes == [7, 1]


class _Failing(Threaded):
    thread_name = "test-failing"

    def run(self) -> None:
        raise ValueError("on its thread")


def test_a_threads_error_is_kept_for_the_thread_that_joins_it() -> None:
    failing = _Failing()
    failing.join()  # not started: nothing to wait for
    failing.start()
    failing.join()
    assert isinstance(failing.error, ValueError)


def test_a_forked_pool_has_every_worker_started_before_it_is_handed_out() -> None:
    pool = fork_pool(2, context=FORK)
    try:
        assert len(pool._processes) == 2  # forked now, before any thread of ours exists
        assert pool.submit(os.getpid).result() != os.getpid()
    finally:
        pool.shutdown()


def _listener_of(daemon: Daemon, timeout_s: float = 10.0) -> Path:
    """The path of the socket the daemon's fork server listens on."""
    assert daemon.process is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server = fork_server_of(daemon.process.pid)
        paths = socket_paths_of(server) if server is not None else []
        if paths:
            return Path(paths[0])
        time.sleep(0.05)
    raise AssertionError(f"the daemon's fork server listens on no socket:\n{daemon.log()}")


@pytest.mark.parametrize("node_service", [False, True], ids=["per-user", "node-service"])
def test_a_daemon_killed_9_leaves_no_fork_server_folder_behind(
    tmp_path: Path, node_service: bool
) -> None:
    """The fork server's socket lives in the daemon's private folder (the runtime folder
    of a user's daemon, its private/ in the node service), in a folder of its pid; a
    daemon killed -9 ran no exit handler, and the next start removes that folder; a
    stopped one removes its own. (multiprocessing's own, /tmp/pymp-*, stayed forever.)"""
    if node_service and os.geteuid() != 0:
        pytest.skip("the node service runs as root")
    daemon = Daemon(cache_dir=tmp_path / "cache", args=["--multi-user"] if node_service else [])
    private = daemon.runtime_dir / "private" if node_service else daemon.runtime_dir
    if node_service:
        daemon.runtime_dir.chmod(0o755)  # everyone reaches the node service's socket
    try:
        daemon.start()
        assert daemon.process is not None
        killed = _listener_of(daemon).parent
        assert killed == private / f"{TEMP_PREFIX}{daemon.process.pid}"
        daemon.kill()
        assert killed.is_dir()  # no exit handler ran
        daemon.start()
        assert not killed.exists(), "a killed daemon's fork server folder outlived it"
        stopped = _listener_of(daemon).parent
        assert daemon.stop() == 0
        assert not stopped.exists(), "a stopped daemon's fork server folder outlived it"
    finally:
        daemon.cleanup()


@pytest.fixture
def chosen_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's multiprocessing temp folder not chosen yet, as at a daemon's start
    (and as it was, after the test)."""
    monkeypatch.setitem(multiprocessing.current_process()._config, "tempdir", None)


def _ended() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.usefixtures("chosen_afresh")
def test_only_this_users_folders_of_ended_processes_are_removed(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    ended = folder / f"{TEMP_PREFIX}{_ended()}"
    (ended / "x").mkdir(parents=True)
    running = subprocess.Popen(["sleep", "60"])
    try:
        alive = folder / f"{TEMP_PREFIX}{running.pid}"
        alive.mkdir()
        victim = tmp_path / "victim"
        (victim / "kept").mkdir(parents=True)
        link = folder / f"{TEMP_PREFIX}{_ended()}"
        link.symlink_to(victim)  # a link is never followed, nor removed
        others = folder / f"{TEMP_PREFIX}{_ended()}"
        others.mkdir()
        if os.geteuid() == 0:
            os.chown(others, 54321, 54321)  # another user's: not ours to remove
        unrelated = [folder / "pymp-abc", folder / f"{TEMP_PREFIX}x1", folder / "stager.sock"]
        for path in unrelated:
            path.mkdir()
        made = temp_folder_in(folder)
        assert made == str(folder / f"{TEMP_PREFIX}{os.getpid()}")
        assert multiprocessing.current_process()._config["tempdir"] == made
        assert (Path(made).stat().st_mode & 0o777) == 0o700
        assert not ended.exists()
        assert alive.is_dir() and link.is_symlink() and (victim / "kept").is_dir()
        assert others.is_dir() == (os.geteuid() == 0)
        assert all(path.is_dir() for path in unrelated)
    finally:
        running.kill()
        running.wait()


@pytest.mark.usefixtures("chosen_afresh")
def test_a_folder_others_may_write_or_too_long_a_path_keeps_multiprocessings_own(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # sticky, as /tmp: others still make names in it
    stale = shared / f"{TEMP_PREFIX}{_ended()}"
    stale.mkdir()
    assert temp_folder_in(shared) is None
    assert stale.is_dir()  # nothing removed where others write
    deep = tmp_path / ("d" * (107 - len(str(tmp_path)) - 20))
    assert temp_folder_in(deep) is None  # its listener-XXXXXXXX would not fit a socket
    assert not deep.exists()
    above = tmp_path / "open"
    above.mkdir()
    above.chmod(0o777)  # no sticky bit: others may move a folder in it, and put theirs
    assert temp_folder_in(above / "run") is None
    assert not (above / "run").exists()  # nothing made before the daemon's check passed
    assert multiprocessing.current_process()._config["tempdir"] is None


def test_nothing_is_removed_below_a_folder_another_user_may_write(
    users: tuple[User, User], tmp_path: Path
) -> None:
    """A runtime folder in a folder that alice's group may write: she may rename it away
    and put one of hers in its place, so the daemon refuses it, saying why. Its fork
    server's folder was chosen before that check, by a check of its own that looked at
    the runtime folder alone, and removed the ended daemons' ``mp-<pid>`` folders in it
    first; now the one check (stager.core.prestart.unheld) comes before anything."""
    alice, _ = users
    above = Path(tempfile.mkdtemp(prefix="stg-", dir="/tmp"))  # short: a socket's path
    try:
        os.chown(above, 0, grp.getgrnam(GROUP).gr_gid)
        above.chmod(0o770)
        assert alice.run(["mkdir", str(above / "hers")]).returncode == 0  # she may write it
        runtime = above / "run"
        runtime.mkdir(mode=0o700)
        stale = runtime / f"{TEMP_PREFIX}{_ended()}"
        stale.mkdir()
        clean = {k: v for k, v in os.environ.items() if not k.startswith("STAGER_")}
        env = {**clean, "STAGER_RUNTIME_DIR": str(runtime), "STAGER_CACHE_DIR": str(tmp_path)}
        done = subprocess.run(
            [sys.executable, "-m", "stager", "serve"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == EXIT_FAILED, done.stderr
        assert f"--runtime-dir {runtime} cannot be used: others may write {above}" in done.stderr
        assert stale.is_dir(), "an ended daemon's folder was removed before the check"
    finally:
        subprocess.run(["rm", "-rf", str(above)], check=False)


@pytest.mark.usefixtures("chosen_afresh")
def test_names_no_process_can_have_do_not_stop_a_start(tmp_path: Path) -> None:
    """``mp-`` and digits that are no pid (past a C long, a digit of another script)
    must not end the daemon's start in a traceback: no process has them, so they are
    not in use."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    huge, other_digit = folder / f"{TEMP_PREFIX}{10**20}", folder / f"{TEMP_PREFIX}\u00b2"
    huge.mkdir()
    other_digit.mkdir()
    assert temp_folder_in(folder) == str(folder / f"{TEMP_PREFIX}{os.getpid()}")
    assert not huge.exists()
    assert other_digit.is_dir()  # not digits as a pid is written: not ours to judge


@pytest.mark.parametrize("pid", [0, -1, 10**20])
def test_no_process_has_a_pid_that_is_none(pid: int) -> None:
    """kill(0) and kill(-1) name a group of processes, not one: a pid file that holds
    either (or too large a number) reads as no daemon (``stager stop`` refused to
    signal it, or ended in a traceback), not as one that runs."""
    assert not pid_alive(pid)
