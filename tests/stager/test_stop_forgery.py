"""`stager stop` against a user who forges what it reads: lines of /proc/net/unix (the
kernel prints a socket's path raw, so a path holding a newline adds a line of the
binder's choosing) and a runtime folder with a pid file of theirs. Root runs `stop`:
it must neither die of a forged line, nor point root at the forger's folder, nor
signal a process that folder's pid file names and that is not its daemon."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.api.server import pid_alive
from tests.users import User

BIN = Path(sys.executable).parent
DEBIAN_PYTHON = "/usr/bin/python3.11"  # every user can run it

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs a second, real user")

# Binds a listening Unix socket at each path given (a forged line's own path is folders
# under the lair, made first), says so, and holds them until its input closes.
BINDER = """
import os, socket, sys
held = []
for path in sys.argv[1:]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen()
    held.append(s)
print("bound", flush=True)
sys.stdin.read()
"""


def forged(inode: str, flags: str, path: str) -> str:
    """A line of /proc/net/unix, short (a socket's path is at most 107 bytes): Num
    RefCount Protocol Flags Type St Inode Path."""
    return f"\n0: 2 0 {flags} 1 1 {inode} {path}"


@pytest.fixture
def root_daemon() -> Iterator[tuple[Path, int]]:
    """Root's own daemon, started with --runtime-dir; its folder and pid."""
    run = Path(tempfile.mkdtemp(prefix="stg-"))
    env = {"PATH": os.environ["PATH"], "STAGER_CACHE_DIR": str(run / "cache"),
           "STAGER_MIN_FREE_BYTES": "0"}  # fmt: skip
    started = subprocess.run([str(BIN / "stager"), "serve", "--detach", "--runtime-dir",
                              str(run)], env=env, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        yield run, int((run / "stager.pid").read_text())
    finally:
        subprocess.run([str(BIN / "stager"), "stop", "--runtime-dir", str(run)],
                       capture_output=True, timeout=60)  # fmt: skip
        shutil.rmtree(run, ignore_errors=True)


def unnamed_socket_of(pid: int) -> str:
    """An inode of a socket ``pid`` holds that the table shows with no path (one the
    forger may claim a path for; any user sees every inode in the table)."""
    table = Path("/proc/net/unix").read_text().splitlines()[1:]
    pathless = {f.split()[6] for f in table if len(f.split()) == 7}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:[") and target[8:-1] in pathless:
            return target[8:-1]
    pytest.skip("the daemon holds no socket without a path")


def stop(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`stager stop` as root, as root's shell runs it: no folder named unless ``argv``."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_RUNTIME_DIR": str(home)}
    return subprocess.run([str(BIN / "stager"), "stop", *argv], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_forged_socket_lines_and_pid_files_make_root_stop_nothing_of_others(
    users: tuple[User, User], tmp_path: Path, root_daemon: tuple[Path, int]
) -> None:
    alice, _ = users
    run, daemon_pid = root_daemon
    lair = Path(tempfile.mkdtemp(prefix="l", dir="/tmp"))  # short, as a socket's path
    os.chown(lair, alice.uid, alice.gid)
    lair.chmod(0o755)
    inode = unnamed_socket_of(daemon_pid)
    victim = subprocess.Popen(["sleep", "300"])  # any process of root's
    paths = [
        f"{lair}/a" + forged("1", "zz", "/x"),  # a flags field that is not hex
        f"{lair}/b" + forged(inode, "00010000", f"{lair}/stager.sock"),  # a path for root's
    ]
    binder = alice.popen([DEBIAN_PYTHON, "-c", BINDER, *paths], stdin=subprocess.PIPE)
    try:
        bound = binder.stdout.readline() if binder.stdout is not None else ""
        assert bound == "bound\n", binder.stderr.read() if binder.stderr else binder
        alice.run([DEBIAN_PYTHON, "-c", BINDER.replace("sys.stdin.read()", ""),
                   f"{lair}/stager.sock"])  # fmt: skip
        plain = stop(tmp_path)
        assert "Traceback" not in plain.stderr, plain.stderr
        assert str(lair) not in plain.stdout + plain.stderr, plain.stderr
        assert f"yours runs on {run}/stager.sock (pid {daemon_pid})" in plain.stderr

        # Root told (by anyone) to stop the daemon of alice's folder: its pid file names
        # root's own daemon, or any process of root's.
        for pid in (daemon_pid, victim.pid):
            alice.run(["sh", "-c", f"echo {pid} > {lair}/stager.pid"])
            told = stop(tmp_path, "--runtime-dir", str(lair))
            assert told.returncode == 1, told
            assert f"stager: not signalling pid {pid}, named by {lair}/stager.pid:" in told.stderr
            assert pid_alive(daemon_pid) and victim.poll() is None
        # Root's own folder, whose pid file is root's, names another process of root's.
        (run / "stager.pid").write_text(f"{victim.pid}\n")
        told = stop(tmp_path, "--runtime-dir", str(run))
        assert f"not signalling pid {victim.pid}" in told.stderr and victim.poll() is None
        assert "is not a stager daemon of uid 0" in told.stderr
        (run / "stager.pid").write_text(f"{daemon_pid}\n")
        assert "stager stopped" in stop(tmp_path, "--runtime-dir", str(run)).stdout
    finally:
        victim.kill()
        victim.wait()
        if binder.stdin is not None:
            binder.stdin.close()
        binder.wait(10)
        shutil.rmtree(lair, ignore_errors=True)
