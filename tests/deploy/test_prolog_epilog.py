"""deploy/slurm's prolog, task prolog and epilog, run directly with the variables
slurmd gives them, against a real daemon: no SLURM needed, so this runs everywhere
(test_slurm_e2e.py covers them under a real slurmd).
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "deploy" / "slurm"
BIN_DIR = Path(sys.executable).parent


def checkout_bin(folder: Path) -> Path:
    """``stager`` that runs this checkout's code: the prolog starts the daemon with a
    clean environment, so a virtualenv installed from another checkout would win."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "stager"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {BIN_DIR / "stager"} "$@"\n')
    wrapper.chmod(0o755)
    return folder


pytestmark = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("bash", "curl", "flock")),
    reason="the SLURM scripts need bash, curl and flock",
)


@dataclass
class Node:
    """One fake node: a config file and the folders it names."""

    root: Path
    config: Path
    log: Path

    @property
    def runtime_dir(self) -> Path:
        return self.root / f"rt-{os.getuid()}"

    @property
    def socket(self) -> Path:
        return self.runtime_dir / "stager.sock"

    def tmpdir(self, job: int) -> Path:
        return self.root / f"job-{job}"

    def run(self, script: str, job: int) -> subprocess.CompletedProcess[str]:
        user = pwd.getpwuid(os.getuid()).pw_name
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "STAGER_SLURM_CONFIG": str(self.config),
            "SLURM_JOB_ID": str(job),
            "SLURM_JOB_USER": user,
            "SLURM_JOB_UID": str(os.getuid()),
            "SLURM_JOB_GID": str(os.getgid()),
        }
        return subprocess.run(
            ["bash", str(SLURM_DIR / script)], env=env, capture_output=True, text=True, timeout=120
        )

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def api(self) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=str(self.socket), verify=False)  # no TLS: no CA load
        return httpx.Client(transport=transport, base_url="http://stager", timeout=30)

    def answers(self) -> bool:
        try:
            with self.api() as api:
                return api.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    # Unix socket paths are limited to ~107 bytes: keep the node's folders short.
    root = Path(tempfile.mkdtemp(prefix="stgslurm-"))
    config = tmp_path / "slurm.env"
    config.write_text(
        "\n".join(
            [
                f"STAGER_BIN_DIR={checkout_bin(root / 'bin')}",
                "STAGER_SLURM_START=1",
                f"STAGER_SLURM_RUNTIME_DIR={root}/rt-%U",
                f"STAGER_SLURM_CACHE_DIR={root}/cache-%u",
                "STAGER_SLURM_SERVE_ARGS='--min-free-bytes 0'",  # sourced by bash: quote spaces
                f"STAGER_SLURM_TMPDIR={root}/job-%j",
                "STAGER_EPILOG_STOP=1",
                f"STAGER_SLURM_LOG={root}/stager-slurm.log",
                f"STAGER_SLURM_STATE_DIR={root}/state",
            ]
        )
        + "\n"
    )
    node = Node(root=root, config=config, log=root / "stager-slurm.log")
    yield node
    subprocess.run(
        [str(BIN_DIR / "stager"), "stop", "--runtime-dir", str(node.runtime_dir)],
        capture_output=True,
        check=False,
    )
    shutil.rmtree(root, ignore_errors=True)


def test_two_jobs_share_one_daemon_and_the_last_epilog_stops_it(node: Node, tmp_path: Path) -> None:
    first = node.run("prolog.sh", 101)
    assert first.returncode == 0, first.stderr
    assert "job=101" in node.log_text() and "started daemon" in node.log_text()
    assert node.answers()
    assert node.tmpdir(101).is_dir() and node.tmpdir(101).stat().st_mode & 0o777 == 0o700

    second = node.run("prolog.sh", 102)
    assert second.returncode == 0, second.stderr
    assert "job=102 user=" in node.log_text() and "daemon already running" in node.log_text()

    exports = node.run("task-prolog.sh", 101)
    assert exports.stdout.splitlines() == [
        f"export SLURM_TMPDIR={node.tmpdir(101)}",
        f"export STAGER_URL=unix://{node.socket}",
    ]

    # Job 101 stages something under its lease, as job.sh's `stage --lease` does.
    source = tmp_path / "data.bin"
    source.write_bytes(os.urandom(4096))
    with node.api() as api:
        created = api.post(
            "/v1/datasets",
            json={
                "name": "tiny",
                "steps": [{"op": "copy", "src": str(source), "dst": "."}],
                "lease": {"holder": "slurm-job-101", "slurm_job_id": "101"},
            },
        )
        assert created.status_code in (200, 201, 202), created.text
        assert api.get("/v1/datasets/tiny/wait", params={"timeout": 30}).json()["state"] == "ready"
        assert [lease["holder"] for lease in api.get("/v1/datasets/tiny/leases").json()] == [
            "slurm-job-101"
        ]

    ended = node.run("epilog.sh", 101)
    assert ended.returncode == 0, ended.stderr
    log = node.log_text()
    assert "released 1 lease(s) of slurm-job-101" in log
    assert "keeping the daemon: 1 other job(s)" in log
    assert not node.tmpdir(101).exists()
    with node.api() as api:
        assert api.get("/v1/datasets/tiny/leases").json() == []
        assert api.get("/v1/datasets/tiny").json()["state"] == "ready"  # still cached

    last = node.run("epilog.sh", 102)
    assert last.returncode == 0, last.stderr
    assert "released 0 lease(s) of slurm-job-102" in node.log_text()
    assert "stopped daemon" in node.log_text()
    assert not node.answers()


def test_the_epilog_drops_what_a_broadcast_of_the_job_left(node: Node) -> None:
    """A job killed mid-broadcast (docs/multinode.md) leaves a delivery reserved on a
    receiver; the epilog releases it (its room too), and only that job's."""
    assert node.run("prolog.sh", 301).returncode == 0
    assert node.run("prolog.sh", 3010).returncode == 0  # keeps the daemon past 301's end
    with node.api() as api:
        for label in ("job301-abc", "job3010-abc"):
            reserved = api.post("/v1/incoming", json={"label": label, "bytes": 1000})
            assert reserved.status_code == 200, reserved.text
            (Path(reserved.json()["path"]) / "bundle.tar").write_bytes(b"x" * 1000)
    incoming = node.root / f"cache-{pwd.getpwuid(os.getuid()).pw_name}" / "incoming"
    # A folder the daemon does not know (it restarted since): removed all the same.
    (incoming / "job301-old").mkdir()
    assert node.run("epilog.sh", 301).returncode == 0, node.log_text()
    assert sorted(p.name for p in incoming.iterdir()) == ["job3010-abc"]
    assert "dropped broadcast leftover" in node.log_text()
    with node.api() as api:
        assert api.delete("/v1/incoming/job301-abc").status_code == 404
        assert api.delete("/v1/incoming/job3010-abc").status_code == 200


def test_prolog_never_fails_the_job(node: Node) -> None:
    """A broken install is logged; the prolog still exits 0 (non-zero drains the node)."""
    node.config.write_text(
        node.config.read_text().replace(
            f"STAGER_BIN_DIR={node.root / 'bin'}", "STAGER_BIN_DIR=/nonexistent"
        )
    )
    result = node.run("prolog.sh", 201)
    assert result.returncode == 0, result.stderr
    assert "no stager executable (STAGER_BIN_DIR=/nonexistent)" in node.log_text()
    assert not node.answers()
    assert node.run("epilog.sh", 201).returncode == 0
    assert "no daemon socket" in node.log_text()


def test_prolog_refuses_a_runtime_dir_another_user_owns(node: Node) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a folder that belongs to another user")
    nobody = pwd.getpwnam("nobody").pw_uid
    node.runtime_dir.mkdir(mode=0o755)
    os.chown(node.runtime_dir, nobody, grp.getgrnam("nogroup").gr_gid)
    result = node.run("prolog.sh", 301)
    assert result.returncode == 0, result.stderr
    assert f"belongs to uid {nobody}" in node.log_text()
    assert not node.answers()
