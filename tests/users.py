"""Real second users for security tests: made with ``useradd`` for the test session,
removed at its end, and commands run as them with ``setpriv`` (their uid, their gid,
their groups), so the kernel treats them as it would any user of a shared node.

Needs root; the fixtures skip with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.locks import alive, held, lock_path, process_key, try_hold

# Per checkout and per pytest-xdist worker: test sessions of two checkouts on one
# machine (a developer's worktrees), and the two workers of one `make test`, must not
# make, use and delete each other's users mid-run.
_CHECKOUT = hashlib.sha256(str(Path(__file__).resolve()).encode()).hexdigest()[:6]
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1"; none without xdist
PREFIX = f"stg-{_CHECKOUT}" + (f"-{_WORKER}" if _WORKER else "")
GROUP = f"{PREFIX}-group"  # alice is in it, bob is not


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def run(
        self, argv: Sequence[str], timeout: float = 60, **kwargs: object
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` as this user: uid, gid and supplementary groups, a clean HOME."""
        env = self._env(kwargs.pop("env", {}))  # type: ignore[arg-type]
        return subprocess.run(
            self._as_me(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            **kwargs,  # type: ignore[arg-type]
        )

    def popen(self, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
        """``argv`` started as this user (as ``run``), its output piped."""
        env = self._env(kwargs.pop("env", {}))  # type: ignore[arg-type]
        return subprocess.Popen(
            self._as_me(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            **kwargs,  # type: ignore[call-overload]
        )

    def _as_me(self, argv: Sequence[str]) -> list[str]:
        command = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups"]
        return [*command, "--", *argv]

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": f"/tmp/{self.name}"}
        env.update(extra)
        return env

    def curl(
        self, socket: Path, method: str, path: str, body: object = None, headers: Sequence[str] = ()
    ) -> tuple[int, dict]:
        """One request over a Unix socket as this user; (status, JSON body, or the text
        under "text" for a body that is not JSON)."""
        argv = ["curl", "-s", "-o", "-", "-w", "\n%{http_code}", "--unix-socket", str(socket)]
        argv += ["-X", method, f"http://stager{path}"]
        for header in headers:
            argv += ["-H", header]
        if body is not None:
            argv += ["-H", "content-type: application/json", "--data", json.dumps(body)]
        done = self.run(argv)
        text, _, code = done.stdout.rpartition("\n")
        try:
            answer = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            answer = {"text": text}  # /metrics and the like
        return int(code or 0), answer


def _ensure_user(name: str, groups: Sequence[str] = ()) -> User:
    try:
        pwd.getpwnam(name)
    except KeyError:
        argv = ["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin"]
        if groups:
            argv += ["--groups", ",".join(groups)]
        subprocess.run([*argv, name], check=True, capture_output=True)
    entry = pwd.getpwnam(name)
    Path(f"/tmp/{name}").mkdir(mode=0o700, exist_ok=True)
    os.chown(f"/tmp/{name}", entry.pw_uid, entry.pw_gid)
    return User(name, entry.pw_uid, entry.pw_gid)


@pytest.fixture(scope="session")
def users() -> Iterator[tuple[User, User]]:
    """Two real users of this worker's: alice (in the group ``GROUP``) and bob (not)."""
    if os.geteuid() != 0:
        pytest.skip("creating users needs root")
    if shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("needs useradd and setpriv (Debian: passwd, util-linux)")
    with made_users() as made:
        yield made


@contextmanager
def made_users(prefix: str = PREFIX) -> Iterator[tuple[User, User]]:
    """alice (in the group ``{prefix}-group``) and bob (not), made now if they do not
    exist, and removed at the end (root, useradd and setpriv). The session holds the
    lock of its prefix while it uses them: users of the prefix found while no live
    session holds it are a killed run's, taken over and removed at the end too; a
    session that finds the lock held (another run of this checkout and worker) shares
    the users and leaves them to their owner."""
    group = f"{prefix}-group"
    owner = try_hold(lock_path(f"users-{prefix}"))
    try:
        made_group = False
        try:
            grp.getgrnam(group)
        except KeyError:
            subprocess.run(["groupadd", group], check=True, capture_output=True)
            made_group = True
        names = (f"{prefix}-alice", f"{prefix}-bob")
        shared = {n for n in names if _exists(n)} if owner is None else set()
        alice = _ensure_user(names[0], groups=[group])
        bob = _ensure_user(names[1])
        try:
            yield alice, bob
        finally:
            for user in (alice, bob):
                shutil.rmtree(f"/tmp/{user.name}", ignore_errors=True)
                if user.name not in shared:
                    _remove_user(user.name)
            if made_group or owner is not None:
                subprocess.run(["groupdel", group], capture_output=True)
    finally:
        if owner is not None:
            os.close(owner)


def _remove_user(name: str, timeout: float = 10.0) -> None:
    """``userdel``, once the user's last processes (a daemon's fork server on its way
    out) have ended: userdel refuses a user who still runs something."""
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run(["userdel", name], capture_output=True, text=True)
        if done.returncode == 0 or not _exists(name):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not remove test user {name}: {done.stderr.strip()}")
        time.sleep(0.2)


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="session")
def interpreter_for_users() -> Iterator[str]:
    """This test run's Python, usable by every user (``usable_by_everyone``)."""
    with usable_by_everyone():
        yield sys.executable


# The folders usable_by_everyone opened, with their modes before, and the sessions
# that need them open (``locks.process_key``s): the last to end gives the modes back.
# Two sessions at once (`make test`'s two workers) would otherwise race: the second
# finds the folder open and records nothing, the first closes it under the second.
SEARCH_STATE = lock_path("search").with_suffix(".json")


@contextmanager
def usable_by_everyone() -> Iterator[None]:
    """This Python and the working folder, usable by every user (``searchable``)."""
    with searchable([Path(sys.executable), Path(os.path.realpath(sys.executable)), Path.cwd()]):
        yield


@contextmanager
def searchable(paths: Sequence[Path], state_file: Path = SEARCH_STATE) -> Iterator[None]:
    """The folders above ``paths`` (here under root's 0700 home) get search permission
    for others while any session that asked for it runs, and get their modes back when
    the last one ends (a killed session's share is dropped by the next to look); the
    sessions keep their shares in ``state_file``."""
    me = process_key(os.getpid())
    assert me is not None
    lock = state_file.with_suffix(".lock")
    with held(lock):
        state = _search_state(state_file)
        for path in paths:
            for folder in [*reversed(path.parents)]:
                mode = stat.S_IMODE(folder.stat().st_mode)
                if not mode & stat.S_IXOTH:
                    state["modes"].append([str(folder), mode])
                    folder.chmod(mode | stat.S_IXOTH)
        state["holders"].append(me)
        _save_search_state(state_file, state)
    try:
        yield
    finally:
        with held(lock):
            state = _search_state(state_file)
            if me in state["holders"]:  # once: a session may ask twice
                state["holders"].remove(me)
            if not state["holders"]:
                for folder, mode in reversed(state["modes"]):
                    with contextlib.suppress(FileNotFoundError):  # a test's, gone
                        Path(folder).chmod(mode)
                state["modes"] = []
            _save_search_state(state_file, state)


def _search_state(state_file: Path) -> dict[str, list]:
    """What ``state_file`` holds, without the sessions that no longer run (its lock
    held)."""
    try:
        state = json.loads(state_file.read_text())
    except FileNotFoundError:
        state = {"modes": [], "holders": []}
    state["holders"] = [key for key in state["holders"] if alive(key)]
    return state


def _save_search_state(state_file: Path, state: dict[str, list]) -> None:
    if state["holders"] or state["modes"]:
        state_file.write_text(json.dumps(state))
    else:
        state_file.unlink(missing_ok=True)
