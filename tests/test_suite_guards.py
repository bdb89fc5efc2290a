"""The suite's own guards, run in a pytest of their own: a daemon left running fails
the run (a multiprocessing temp folder left in /tmp too, under ``CI=true``; told
otherwise), under ``CI=true`` a SLURM test that cannot get its cluster fails instead
of skipping (a skip there would report an untested promise as green), and a passed
test's temporary folder does not outlive it (the suite's disk use is its largest
test's, not the sum: a CI machine with little free disk filled up), and under `make
test`'s two pytest-xdist workers the tests that use what the machine has one of (its
SLURM cluster) all run on one (pytest 9.2 made pytest-xdist 3.8 ignore its groups,
silently)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm_cluster import MARK_VAR, REPO

CONFTEST = """
import tests.slurm_cluster as slurm_cluster
from tests.conftest import daemon_zygote, local_cluster, pytest_configure, pytest_sessionfinish
from tests.conftest import pytest_collection_modifyitems

slurm_cluster.LEFTOVER_GRACE_S = 1.0
slurm_cluster.LOCAL_CLUSTER = __import__("pathlib").Path(__file__).parent / "cluster"
"""
LEAVES_A_DAEMON = """
import os, subprocess, time

def test_starts_a_slurmd_and_forgets_it():
    # argv[0] "slurmd": the guard's pattern, a harmless sleep behind it.
    proc = subprocess.Popen(["bash", "-c", "exec -a slurmd sleep 60"])
    with open(os.environ["LEAK_PIDFILE"], "w") as f:
        f.write(str(proc.pid))
    # Running as slurmd before the test ends, as a daemon a test started would be (a
    # loaded machine may not have run bash's exec yet when the session ends).
    for _ in range(500):
        with open(f"/proc/{proc.pid}/cmdline", "rb") as cmdline:
            if cmdline.read().startswith(b"slurmd"):
                break
        time.sleep(0.01)
"""
LEAVES_A_FORKED_DAEMON = """
import os
from tests.daemon import Daemon

def test_forks_a_daemon_and_forgets_it(daemon_zygote, tmp_path):
    daemon = Daemon(cache_dir=tmp_path / "cache", zygote=daemon_zygote).start()
    with open(os.environ["LEAK_RUNTIME"], "w") as f:
        print(daemon.process.pid, daemon.runtime_dir, file=f)
"""
WRITES_TWO_TMP_PATHS = """
FIRST = []

def test_first(tmp_path):
    (tmp_path / "data").write_bytes(b"x" * 4096)
    FIRST.append(tmp_path)

def test_second(tmp_path):
    assert not FIRST[0].exists(), "a passed test's tmp_path outlived it"
"""
LEAVES_A_MOUNT = """
import os
from stager.image.build import build_image
from stager.image.mount import mount_kernel

def test_mounts_an_image_and_forgets_it(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_text("a")
    build_image(str(tmp_path / "src"), str(tmp_path / "x.erofs"))
    (tmp_path / "m").mkdir()
    mount_kernel(str(tmp_path / "x.erofs"), str(tmp_path / "m"))
    with open(os.environ["LEAK_MOUNT"], "w") as f:
        f.write(str(tmp_path / "m"))
"""
LEAVES_A_TEMP_FOLDER = """
import os, subprocess, sys

def test_kills_a_process_before_its_exit_handlers():
    # multiprocessing's temp folder, as a fork server's listener makes it; the process
    # killed -9 never removes it.
    made = "import multiprocessing.util as u; print(u.get_temp_dir(), flush=True); input()"
    child = subprocess.Popen([sys.executable, "-c", made], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    folder = child.stdout.readline().strip()
    child.kill()
    child.wait()
    # torchrun's logs without --log-dir: a folder nothing removes.
    logs = subprocess.run([sys.executable, "-c", "import tempfile; "
                           "print(tempfile.mkdtemp(prefix='torchelastic_'))"],
                          capture_output=True, text=True).stdout.strip()
    with open(os.environ["LEAK_TEMP"], "w") as f:
        print(folder, logs, sep=chr(10), file=f)
"""
NEEDS_THE_CLUSTER = """
def test_on_the_cluster(local_cluster):
    pass
"""

NEEDS_THE_ONE_CLUSTER = """
import os, time, pytest

@pytest.fixture
def local_cluster():  # stands for the real fixture: its name is what groups the test
    return None

@pytest.mark.parametrize("n", range(4))
def test_needs_the_one_cluster(local_cluster, n):
    time.sleep(0.2)
    with open(os.environ["WORKERS_SEEN"], "a") as seen:
        seen.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""
PLAIN = """
import time

def test_plain():
    time.sleep(0.2)
"""


def _inner_pytest(tmp_path: Path, test: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_inner.py").write_text(test)
    cluster = tmp_path / "cluster"  # an up.sh that cannot bring SLURM up
    cluster.mkdir()
    (cluster / "up.sh").write_text("echo 'slurmctld: cannot start' >&2; exit 3\n")
    (cluster / "down.sh").write_text("exit 0\n")
    environ = {k: v for k, v in os.environ.items() if k not in (MARK_VAR, "CI")}
    environ.update(PYTHONPATH=str(REPO), STAGER_TESTS_WATCHED=f"{tmp_path}/", **env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "base"), *args, str(tmp_path)],
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_daemon_left_running_fails_the_run(tmp_path):
    pidfile = tmp_path / "leaked.pid"
    done = _inner_pytest(tmp_path / "run", LEAVES_A_DAEMON, LEAK_PIDFILE=str(pidfile))
    try:
        assert "1 passed" in done.stdout, done.stdout[-2000:]
        assert done.returncode == 1, done.stdout[-2000:]  # the test passed, the run did not
        assert "left running" in done.stdout and "slurmd" in done.stdout
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_a_daemon_forked_from_the_zygote_and_left_running_fails_the_run(tmp_path):
    """The zygote kills what it forked and still runs as the session ends, before the
    check for what the run left: that check must still hear of a daemon a test forgot."""
    record = tmp_path / "leaked-runtime"
    done = _inner_pytest(tmp_path / "run", LEAVES_A_FORKED_DAEMON, LEAK_RUNTIME=str(record))
    try:
        assert "1 passed" in done.stdout, done.stdout[-2000:]
        pid = record.read_text().split()[0]
        assert done.returncode == 1, done.stdout[-2000:]  # the test passed, the run did not
        assert "left running" in done.stdout and f"pid {pid}" in done.stdout, done.stdout
    finally:
        if record.exists():
            shutil.rmtree(record.read_text().split(maxsplit=1)[1].strip(), ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a kernel mount needs root")
def test_an_image_mount_left_behind_fails_the_run(tmp_path):
    record = tmp_path / "leaked-mount"
    done = _inner_pytest(tmp_path / "run", LEAVES_A_MOUNT, LEAK_MOUNT=str(record))
    try:
        assert "1 passed" in done.stdout, done.stdout[-2000:]
        assert done.returncode == 1, done.stdout[-2000:]  # the test passed, the run did not
        assert "erofs mount at" in done.stdout and "loop device" in done.stdout
    finally:
        if record.exists():
            subprocess.run(["umount", record.read_text()], check=False)


def test_a_temp_folder_left_in_tmp_fails_the_run(tmp_path):
    record = tmp_path / "leaked-temp"

    def left() -> list[str]:
        return record.read_text().splitlines() if record.exists() else []

    def remove() -> None:
        for folder in left():
            shutil.rmtree(folder, ignore_errors=True)

    local = _inner_pytest(tmp_path / "local", LEAVES_A_TEMP_FOLDER, LEAK_TEMP=str(record))
    try:
        # Told, not failed, off CI: another run on the machine may have left it.
        assert local.returncode == 0 and "1 passed" in local.stdout, local.stdout[-2000:]
        assert len(left()) == 2
        for folder in left():
            assert f"{folder} (a temp folder its process did not remove" in local.stdout
    finally:
        remove()
    ci = _inner_pytest(tmp_path / "ci", LEAVES_A_TEMP_FOLDER, LEAK_TEMP=str(record), CI="true")
    try:
        assert "1 passed" in ci.stdout, ci.stdout[-2000:]
        assert ci.returncode == 1, ci.stdout[-2000:]  # the test passed, the run did not
        assert "left running" in ci.stdout
        for folder in left():
            assert f"{folder} (a temp folder its process did not remove" in ci.stdout
    finally:
        remove()


def test_missing_cluster_skips_locally_and_fails_under_ci(tmp_path):
    local = _inner_pytest(tmp_path / "local", NEEDS_THE_CLUSTER)
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout[-2000:]
    ci = _inner_pytest(tmp_path / "ci", NEEDS_THE_CLUSTER, CI="true")
    assert ci.returncode == 1 and "1 error" in ci.stdout, ci.stdout[-2000:]
    assert "CI=true and the SLURM tests cannot run" in ci.stdout
    assert "skipped" not in ci.stdout


def test_a_passed_tests_tmp_path_is_deleted_under_the_projects_settings(tmp_path):
    done = _inner_pytest(tmp_path, WRITES_TWO_TMP_PATHS, "-c", str(REPO / "pyproject.toml"))
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-2000:]


def test_under_two_workers_the_tests_of_the_one_cluster_run_on_one(tmp_path):
    """`make test`'s grouping (pytest-xdist's loadgroup) holds: tests of two modules
    that use the local cluster all run on one worker, whatever else is spread."""
    run, seen = tmp_path / "run", tmp_path / "workers-seen"
    run.mkdir()
    (run / "test_needs_it_too.py").write_text(NEEDS_THE_ONE_CLUSTER)
    for number in range(3):
        (run / f"test_plain_{number}.py").write_text(PLAIN)
    done = _inner_pytest(
        run, NEEDS_THE_ONE_CLUSTER, "-n", "2", "--dist", "loadgroup", WORKERS_SEEN=str(seen)
    )
    assert done.returncode == 0 and "11 passed" in done.stdout, done.stdout[-2000:]
    workers = seen.read_text().split()
    assert len(workers) == 8 and len(set(workers)) == 1, workers
