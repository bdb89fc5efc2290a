"""A private munged for tests: its own key and socket, stopped at the end.

The node services of a multi-node job vouch for fan-out manifests through munged
(stager/core/vouch.py). On a cluster that is SLURM's munged; here each test session gets
one of its own, so nothing depends on (or disturbs) a system munged. munge is
installed from Debian's packages when it is missing, as the SLURM cluster scripts do.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.locks import held, lock_path


def _install() -> None:
    if shutil.which("munged") and shutil.which("munge"):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("needs munge (root installs it with apt-get)")
    # The other pytest-xdist worker may be installing too (the SLURM cluster's up.sh):
    # apt-get fails at once on a lock that another apt-get holds.
    with held(lock_path("apt")):
        if shutil.which("munged") and shutil.which("munge"):
            return
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "munge"]):
            subprocess.run(argv, check=True, env=env, capture_output=True, timeout=600)


@contextmanager
def private_munged() -> Iterator[Path]:
    """A munged of its own; yields its socket (reachable by every user)."""
    _install()
    folder = Path(tempfile.mkdtemp(prefix="munge-"))
    folder.chmod(0o755)  # users' munge and unmunge reach the socket
    key, pid_file = folder / "munge.key", folder / "munged.pid"
    subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, timeout=60)
    socket = folder / "munge.socket"
    argv = ["munged", "--force", f"--socket={socket}", f"--key-file={key}",
            f"--log-file={folder / 'munged.log'}", f"--pid-file={pid_file}",
            f"--seed-file={folder / 'munged.seed'}"]  # fmt: skip
    subprocess.run(argv, check=True, timeout=60)
    try:
        deadline = time.monotonic() + 10
        while not socket.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        yield socket
    finally:
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
        deadline = time.monotonic() + 10
        while pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(folder, ignore_errors=True)
