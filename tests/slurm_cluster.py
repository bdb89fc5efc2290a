"""The single-node SLURM cluster for the ``slurm`` tests, and the check that nothing is left.

`local_cluster` (a session fixture) brings deploy/slurm/local-cluster up once,
for the tests that ask for it, and down at the end of the session, prolog-started
stager daemons included, unless the cluster was already up before the session:
then it is someone else's, and stays up.

`leftovers` lists what the session started and did not stop: every slurmctld,
slurmd, munged and ``stager serve`` that carries this session's mark in its
environment (every process the tests start inherits it), and, when the session
brought the cluster up, that cluster's daemons (found by their pid files) and
the daemons its prologs started. Processes of other sessions, and clusters
started outside the suite (deploy/slurm/multinode's own, a developer's), carry
no mark and are never reported, nor are the daemons of such a cluster that up.sh
restarted during the session (a changed config). The conftest fails the run if anything is left.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.locks import held, lock_path
from tests.processes import descendants

REPO = Path(__file__).resolve().parents[1]
LOCAL_CLUSTER = REPO / "deploy" / "slurm" / "local-cluster"
CONFIG = Path("/etc/stager/slurm.env")
BIN_DIR = Path(sys.executable).parent  # the environment running the tests has stager
PID_FILES = {
    "slurmctld": Path("/run/slurmctld.pid"),
    "slurmd": Path("/run/slurmd.pid"),
    "munged": Path("/run/munge/munged.pid"),
}
# Set once per session, inherited by every process the tests start (not STAGER_*: the
# cluster fixture strips those from the environment it passes on).
MARK_VAR = "PYTEST_STAGER_SESSION"
# A daemon's fork server (and what it forked: stagings, the walking process) must die
# with the daemon too, however the daemon ended: a fork of the daemon, titled
# (stager.core.processes.FORK_SERVER_TITLE: cut to the daemon's command line's room,
# "stager forkserver" at the least), or a new interpreter where it had threads.
DAEMON_PATTERN = re.compile(
    r"(^|/)(slurmctld|slurmd|munged)( |$)|stager(\.__main__)? serve\b"
    r"|^stager forkserver|multiprocessing\.forkserver import main"
)


@dataclass
class Cluster:
    runtime_dir: Path
    cache_dir: Path
    tmpdir_pattern: str
    log: Path
    state_dir: Path
    started_here: bool

    @property
    def socket(self) -> Path:
        return self.runtime_dir / "stager.sock"

    def api(self) -> httpx.Client:
        """The node's stager daemon over its Unix socket."""
        transport = httpx.HTTPTransport(uds=str(self.socket), verify=False)  # no TLS: no CA load
        return httpx.Client(transport=transport, base_url="http://stager", timeout=10)


_started: list[Cluster] = []  # clusters this session brought up
_kept: set[int] = set()  # daemons of a cluster that was up before the session
LEFTOVER_GRACE_S = 10.0  # how long the end-of-session check waits for stragglers


def unavailable(reason: str) -> None:
    """Skip a SLURM test that cannot run here, except in CI (``CI=true``): there
    the cluster is part of the promise, and a skip would hide that it was never tested."""
    if in_ci():
        pytest.fail(f"CI=true and the SLURM tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def in_ci() -> bool:
    """Whether the suite runs as CI does (``CI=true``): alone on its machine, and every
    promise tested."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def mark_session() -> str:
    return os.environ.setdefault(MARK_VAR, uuid.uuid4().hex)


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        if re.match(r"^[A-Z_]+=", line):
            key, _, value = line.partition("=")
            values[key] = value
    return values


def expand(pattern: str, job_id: str = "") -> str:
    return pattern.replace("%U", str(os.getuid())).replace("%u", "root").replace("%j", job_id)


def pid_alive(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


def cluster_is_up() -> bool:
    return all(pid_alive(p) for p in PID_FILES.values())


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        unavailable("needs root: up.sh installs slurm-wlm and munge and runs slurmd as root")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        unavailable("needs Debian's apt-get to install slurm-wlm (or SLURM installed)")
    was_up = cluster_is_up()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGER_")}
    # The settings the tests rely on, whatever an earlier up.sh run chose.
    env.update(STAGER_BIN_DIR=str(BIN_DIR), STAGER_SLURM_START="1", STAGER_EPILOG_STOP="0")
    try:
        # up.sh installs slurm-wlm and munge on a bare machine, with apt-get, which
        # fails at once on the lock of another apt-get (tests/munge.py's, beside it).
        with held(lock_path("apt")):
            result = subprocess.run(
                ["bash", str(LOCAL_CLUSTER / "up.sh")],
                env=env, capture_output=True, text=True, timeout=480,
            )  # fmt: skip
    except subprocess.TimeoutExpired:
        if not was_up:  # whatever it did start goes down again
            subprocess.run(["bash", str(LOCAL_CLUSTER / "down.sh")],
                           capture_output=True, timeout=180, check=False)  # fmt: skip
        unavailable("up.sh did not bring SLURM up within 480 s")
    config = read_env_file(CONFIG) if CONFIG.exists() else {}
    cluster = Cluster(
        runtime_dir=Path(expand(config.get("STAGER_SLURM_RUNTIME_DIR", "/tmp/stager-%U"))),
        cache_dir=Path(expand(config.get("STAGER_SLURM_CACHE_DIR", "/tmp/stager-%U/cache"))),
        tmpdir_pattern=config.get("STAGER_SLURM_TMPDIR", "/tmp/slurm-%j"),
        log=Path(config.get("STAGER_SLURM_LOG", "/var/log/stager-slurm.log")),
        state_dir=Path(config.get("STAGER_SLURM_STATE_DIR", "/run/stager-slurm")),
        started_here=not was_up,
    )
    if cluster.started_here:
        _started.append(cluster)
    else:
        # Someone else's cluster stays up, even where up.sh restarted its daemons
        # under this session (a changed slurm.conf): those carry the mark, and are
        # not this session's to stop.
        _kept.update(pid for p in PID_FILES.values() if (pid := pid_alive(p)) is not None)
    try:
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
            unavailable(f"SLURM cannot be started here (up.sh exited {result.returncode}):\n{tail}")
        yield cluster
    finally:
        if cluster.started_here:
            subprocess.run(
                ["bash", str(LOCAL_CLUSTER / "down.sh")],
                capture_output=True, text=True, timeout=180, check=False,
            )  # fmt: skip


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True
    ).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def _processes() -> Iterator[tuple[int, str, bytes]]:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        yield int(entry.name), cmdline, environ


def leftovers(grace_s: float | None = None, under: int | None = None) -> list[str]:
    """Daemons this session started and did not stop (waits ``grace_s`` for stragglers);
    with ``under``, only that process's descendants: what a pytest-xdist worker itself
    left, which would end with it unseen (an in-process fork server)."""
    grace_s = LEFTOVER_GRACE_S if grace_s is None else grace_s
    mark = os.environ.get(MARK_VAR, "").encode()
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        below = None if under is None else set(descendants(under))
        for pid, cmdline, environ in _processes():
            if pid == os.getpid() or pid in _kept or not DAEMON_PATTERN.search(cmdline):
                continue
            if below is not None and pid not in below:
                continue
            if mark and f"{MARK_VAR}=".encode() + mark in environ.split(b"\0"):
                found.append(f"pid {pid}: {cmdline}")
        for cluster in _started:
            for name, pidfile in PID_FILES.items():
                pid = pid_alive(pidfile)
                if pid is not None:
                    found.append(f"{name} of the local cluster (pid {pid}, {pidfile})")
            for marker in cluster.state_dir.glob("users/*/started-by-prolog"):
                found.append(f"a stager daemon a prolog started ({marker})")
        found = sorted(set(found))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
