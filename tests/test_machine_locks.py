"""What lets the tests that change the machine run on both of `make test`'s workers
(tests/users.py, tests/locks.py): a folder made searchable for the test users stays so
until the last session that asked for it ends, whatever order they end in, and gets
its mode back after a session was killed; the test users of a killed session are
removed by the next session of their prefix, and a live session's are left to it.
Each case runs a second session as a real process of its own (the locks and shares
belong to processes)."""

from __future__ import annotations

import grp
import os
import pwd
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.slurm_cluster import REPO
from tests.users import PREFIX, made_users, searchable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making users needs root")

# A second session: enters ``searchable`` or ``made_users``, says "in", and stays in
# until its standard input closes (or it is killed).
SEARCHABLE = """
import sys
from pathlib import Path
from tests.users import searchable
with searchable([Path(sys.argv[1])], Path(sys.argv[2])):
    print("in", flush=True)
    sys.stdin.read()
"""
USERS = """
import sys
from tests.users import made_users
with made_users(sys.argv[1]):
    print("in", flush=True)
    sys.stdin.read()
"""


@contextmanager
def session(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """The second session, in; ended (its input closed) at the end unless the block
    ended it already."""
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "in\n", (
            process.communicate(timeout=30)
        )
        yield process
    finally:
        end(process)


def end(process: subprocess.Popen[str]) -> None:
    """The session ended (its input closed, which communicate does), once."""
    assert process.stdin is not None
    if process.stdin.closed:
        return
    _, err = process.communicate(timeout=60)
    assert process.returncode in (0, -signal.SIGKILL), err


def searchable_by_others(folder: Path) -> bool:
    return bool(folder.stat().st_mode & stat.S_IXOTH)


@pytest.fixture
def hidden(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A file under a 0700 folder (as root's home is), and the shares' state file."""
    folder = tmp_path / "home"
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").write_text("")
    folder.chmod(0o700)
    return folder, folder / "bin" / "python", tmp_path / "search.json"


@pytest.mark.parametrize("first_to_end", ["the first", "the second"])
def test_a_folder_stays_searchable_until_the_last_session_ends(hidden, first_to_end):
    folder, target, state = hidden
    with session(SEARCHABLE, str(target), str(state)) as first:
        assert searchable_by_others(folder)
        with searchable([target], state):
            if first_to_end == "the first":
                end(first)
            assert searchable_by_others(folder), f"{first_to_end} to end closed it"
        if first_to_end == "the second":
            assert searchable_by_others(folder), "closed under the first session"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not state.exists()


def test_a_killed_sessions_share_is_dropped_by_the_next(hidden):
    folder, target, state = hidden
    with session(SEARCHABLE, str(target), str(state)) as killed:
        killed.kill()
        killed.wait(timeout=30)
    assert searchable_by_others(folder)  # nobody gave the mode back
    with searchable([target], state):
        assert searchable_by_others(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def exists(name: str) -> bool:
    """A user or a group of that name."""
    for database in (pwd.getpwnam, grp.getgrnam):
        try:
            database(name)
        except KeyError:
            continue
        return True
    return False


@pytest.fixture
def prefix() -> Iterator[str]:
    """A prefix of this test's own, its users gone at the end whatever happened."""
    mine = f"{PREFIX}-t"
    yield mine
    for name in (f"{mine}-alice", f"{mine}-bob"):
        subprocess.run(["userdel", name], capture_output=True)
    subprocess.run(["groupdel", f"{mine}-group"], capture_output=True)


def test_the_users_of_a_killed_session_are_removed_by_the_next(prefix):
    names = (f"{prefix}-alice", f"{prefix}-bob")
    with session(USERS, prefix) as killed:
        killed.kill()
        killed.wait(timeout=30)
    assert all(exists(name) for name in names)  # left by the killed session
    with made_users(prefix) as (alice, bob):
        assert (alice.name, bob.name) == names
    assert not any(exists(name) for name in [*names, f"{prefix}-group"])


def test_a_live_sessions_users_are_left_to_it(prefix):
    names = (f"{prefix}-alice", f"{prefix}-bob")
    with session(USERS, prefix):
        with made_users(prefix) as (alice, _):
            assert alice.name == names[0]
        assert all(exists(name) for name in names), "removed under the session that made them"
    assert not any(exists(name) for name in names)


def test_two_workers_have_users_of_their_own():
    """The users' prefix names the pytest-xdist worker, where there is one."""

    def prefix_of(worker: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
        env["PYTHONPATH"] = str(REPO)
        if worker is not None:
            env["PYTEST_XDIST_WORKER"] = worker
        argv = [sys.executable, "-c", "from tests.users import PREFIX; print(PREFIX)"]
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout

    alone, first, second = prefix_of(None).strip(), prefix_of("gw0"), prefix_of("gw1")
    assert first.strip() == f"{alone}-gw0" and second.strip() == f"{alone}-gw1"
