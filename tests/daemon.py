"""A real ``stager serve`` process for tests, reached over its Unix socket or TCP."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from stager.wire.schemas import DatasetPublic

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_privileged_port() -> int:
    """A free port below 1024 (the tests run as root): what a prefetch port must be."""
    import random
    import socket

    for port in random.sample(range(700, 1024), 324):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 1024 on 127.0.0.1")


_RUNTIME_DIRS: list[Path] = []


def _runtime_dir() -> Path:
    """A short-lived folder for a daemon's socket and log (Unix socket paths are limited
    to ~107 bytes, so it lives at a short path under the temp dir), removed when this
    process exits, whether or not its user called ``cleanup``."""
    if not _RUNTIME_DIRS:
        atexit.register(_remove_runtime_dirs)
    folder = Path(tempfile.mkdtemp(prefix="stg-"))
    _RUNTIME_DIRS.append(folder)
    return folder


def _remove_runtime_dirs() -> None:
    for folder in _RUNTIME_DIRS:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Daemon:
    cache_dir: Path
    runtime_dir: Path = field(default_factory=_runtime_dir)
    extra_env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    process: subprocess.Popen | ZygoteChild | None = None
    # Run as this user (a tests.users.User: uid and gid) instead of the test's own.
    user: Any = None
    # Run under this command (e.g. ``prlimit --nofile=256:256 --``).
    wrapper: list[str] = field(default_factory=list)
    # Forked from this process that has imported the daemon's modules, instead of started
    # as a new interpreter (tests/daemon_zygote.py: for tests of many daemons).
    zygote: Zygote | None = None

    @property
    def socket(self) -> Path:
        return self.runtime_dir / "stager.sock"

    @property
    def log_path(self) -> Path:
        return self.runtime_dir / "test-daemon.log"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            STAGER_RUNTIME_DIR=str(self.runtime_dir),
            STAGER_CACHE_DIR=str(self.cache_dir),
            STAGER_MIN_FREE_BYTES="0",
            STAGER_URL=self.url,
        )
        env.update(self.extra_env)
        return env

    @property
    def host(self) -> str | None:
        return self.args[self.args.index("--host") + 1] if "--host" in self.args else None

    @property
    def url(self) -> str:
        if self.host:
            return f"http://{self.host}:{self.args[self.args.index('--port') + 1]}"
        return f"unix://{self.socket}"

    def start(self, wait: bool = True) -> Daemon:
        if self.forkable:
            assert self.zygote is not None
            self.process = self.zygote.start(["serve", *self.args], self.env, self.log_path)
        else:
            self.process = self._popen()
        if wait:
            self.wait_ready()
        return self

    @property
    def forkable(self) -> bool:
        """Whether it starts as a fork of ``zygote``: one is given, and the daemon runs
        as the test's own user, bare, with no variable an interpreter reads only as it
        starts (a fork would not see it); else a new interpreter."""
        return (
            self.zygote is not None
            and self.user is None
            and not self.wrapper
            and not any(key.startswith(("PYTHON", "LC_", "LANG")) for key in self.extra_env)
        )

    def _popen(self) -> subprocess.Popen:
        argv = [sys.executable, "-m", "stager", "serve", *self.args]
        if self.user is not None:
            os.chown(self.runtime_dir, self.user.uid, self.user.gid)
            user = [f"--reuid={self.user.uid}", f"--regid={self.user.gid}", "--init-groups"]
            argv = ["setpriv", *user, "--", *argv]
        with open(self.log_path, "ab") as log:  # the child holds its own copy
            return subprocess.Popen(
                [*self.wrapper, *argv], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout: float = 30.0) -> None:
        # One client for every poll: a client is cheap to reuse and not to make
        # (see ``client``), and a start polls 20-40 times.
        deadline = time.monotonic() + timeout
        with self.client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.process and self.process.poll() is not None:
                    raise RuntimeError(f"daemon exited early:\n{self.log()}")
                try:
                    if client.get("/readyz").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
        raise TimeoutError(f"daemon not ready after {timeout}s:\n{self.log()}")

    def client(self, timeout: float = 30.0, token: str | None = None) -> httpx.Client:
        # Plain HTTP (a Unix socket, or http:// on this machine): no TLS, so no CA bundle
        # to load, which httpx does for every client it makes unless told (~15-30 ms of
        # CPU each; as the client library does, client._discovery).
        headers = {"authorization": f"Bearer {token}"} if token else {}
        if self.host:
            return httpx.Client(base_url=self.url, timeout=timeout, headers=headers, verify=False)
        transport = httpx.HTTPTransport(uds=str(self.socket), verify=False)
        return httpx.Client(
            transport=transport, base_url="http://stager", timeout=timeout, headers=headers
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the daemon and wait; returns its exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> Daemon:
        if self.process and self.process.poll() is None:
            self.stop()
        return self.start()

    def log(self, limit: int | None = 4000) -> str:
        """The daemon's output so far: its end (``limit`` characters), or all of it."""
        try:
            text = self.log_path.read_text(errors="replace")
            return text[-limit:] if limit else text
        except OSError:
            return ""

    def cleanup(self, unmount: bool = True) -> None:
        """Kill it if running; take down the image mounts it left (unless ``unmount`` is
        False: a crash test's next daemon must find them)."""
        if self.process and self.process.poll() is None:
            self.kill()
        if unmount:
            unmount_under(self.cache_dir)  # image datasets a killed daemon left mounted
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


class Zygote:
    """tests/daemon_zygote.py, running: it forks a ``stager serve`` on each ``start``,
    whose end it reports. Stop it with ``close`` (it kills what it forked and still runs)."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.daemon_zygote", "stager", "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
        )
        self._lock = threading.Condition()
        self._started: dict[int, int | str] = {}  # request id: pid, or why it failed
        self._ended: dict[int, int] = {}  # pid: returncode
        self._forked: list[int] = []  # every daemon it forked, in order
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message = json.loads(line)
            with self._lock:
                if "id" in message:
                    self._started[message["id"]] = message.get("pid", message.get("error"))
                else:
                    self._ended[message["pid"]] = message["returncode"]
                self._lock.notify_all()
        with self._lock:
            self._lock.notify_all()

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> ZygoteChild:
        assert self._process.stdin is not None
        with self._lock:
            self._next_id += 1
            ask = self._next_id
            request = {"id": ask, "argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log)}
            self._process.stdin.write(json.dumps(request).encode() + b"\n")
            self._process.stdin.flush()
            self._lock.wait_for(lambda: ask in self._started or self._process.poll() is not None)
            pid = self._started.pop(ask, "the zygote ended")
            if isinstance(pid, int):
                self._forked.append(pid)
        if isinstance(pid, str):
            raise OSError(f"no daemon forked: {pid}")
        return ZygoteChild(self, pid)

    def running(self, grace_s: float = 2.0) -> list[str]:
        """The daemons it forked that still run after ``grace_s`` (a stop just sent may
        still be under way), as the suite's check for leftovers names them: ``close``
        kills them, before that check could see them."""
        deadline = time.monotonic() + grace_s
        with self._lock:
            self._lock.wait_for(
                lambda: (
                    all(pid in self._ended for pid in self._forked)
                    or self._process.poll() is not None
                ),
                max(0.0, deadline - time.monotonic()),
            )
            left = [pid for pid in self._forked if pid not in self._ended]
        return [f"pid {pid}: a daemon forked from tests/daemon_zygote.py" for pid in left]

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        with self._lock:
            self._lock.wait_for(
                lambda: pid in self._ended or self._process.poll() is not None, timeout
            )
            return self._ended.get(pid)

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=30)
        self._reader.join(timeout=30)


@dataclass
class ZygoteChild:
    """A daemon a Zygote forked, as much of ``subprocess.Popen`` as Daemon uses."""

    zygote: Zygote
    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid, timeout)
            if self.returncode is None and timeout:
                raise subprocess.TimeoutExpired(f"daemon {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


@contextmanager
def node_service(cache_dir: Path, *args: str, **env: str) -> Iterator[Daemon]:
    """A node service (``stager serve --multi-user``, as root) for the block: its
    socket's folder reachable by every user, stopped and removed after."""
    daemon = Daemon(cache_dir=cache_dir, args=["--multi-user", *args], extra_env=env)
    daemon.runtime_dir.chmod(0o755)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        daemon.cleanup()


def unmount_under(folder: Path) -> None:
    """Take down every mount below ``folder`` (deepest first; lazily: a test's reader may
    still be closing), so that a test that killed a daemon leaves no mount behind."""
    from stager.image.mount import mounts_under

    for found in reversed(mounts_under(str(folder))):
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", found.target], capture_output=True)
        else:
            subprocess.run(["fusermount3", "-u", "-z", found.target], capture_output=True)


def stage(client: httpx.Client, body: dict) -> httpx.Response:
    return client.post("/v1/datasets", json=body)


def stage_ready(client: httpx.Client, body: dict, timeout: float = 30) -> DatasetPublic:
    response = stage(client, body)
    assert response.status_code in (200, 202), response.text
    waited = client.get(f"/v1/datasets/{body['name']}/wait", params={"timeout": timeout})
    status = DatasetPublic.model_validate_json(waited.text)
    assert status.state == "ready", status.error
    return status
