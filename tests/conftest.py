from __future__ import annotations

import os
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import mounts
from tests.counts import session_lines
from tests.daemon import Daemon, Zygote
from tests.mounts import fuse_for_users  # noqa: F401 (fixture)
from tests.processes import temp_folders, temp_folders_left
from tests.slurm_cluster import in_ci, leftovers, local_cluster, mark_session  # noqa: F401
from tests.users import User, interpreter_for_users, users  # noqa: F401 (fixtures)

_MOUNTS_BEFORE: set[str] = set()
_TEMP_BEFORE: set[Path] = set()


def pytest_configure(config: pytest.Config) -> None:
    # Every process the tests start inherits the mark: `pytest_sessionfinish` finds
    # the daemons of this run, and only those.
    mark_session()
    _MOUNTS_BEFORE.update(mounts.snapshot())
    _TEMP_BEFORE.update(temp_folders())


# What the machine has only one of, for every test at once: the local SLURM cluster
# (and its munged), the installed package and the first hour's demo
# (test_first_hour.py, test_install.py), a nested test run (test_suite_guards.py).
# Under pytest-xdist (`make test` runs two workers, --dist loadgroup) the modules
# that use these all go to one worker, one test at a time, in the group "machine";
# every other module goes whole to one worker (its module fixtures are made once,
# and a test may read what an earlier one of its module recorded), unless its tests
# name groups of their own (minutes-long tests, run side by side). The tests that
# change the machine for themselves run on both workers: their users are the
# worker's own (tests/users.py), each module's munged is private (tests/munge.py),
# and what two workers change at once (the mode of root's home, Debian's packages)
# is changed under a machine-wide lock (tests/locks.py).
_MACHINE_FIXTURES = frozenset(("local_cluster",))
_MACHINE_FILES = frozenset(("test_first_hour.py", "test_install.py", "test_suite_guards.py"))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    machine = {
        item.path
        for item in items
        if set(getattr(item, "fixturenames", ())) & _MACHINE_FIXTURES
        or item.path.name in _MACHINE_FILES
    }
    group_of = {}
    for item in items:
        if item.path in machine:
            assert item.get_closest_marker("xdist_group") is None, (
                f"{item.nodeid} names an xdist group of its own, but its module changes the "
                "machine: its tests must all run in the group 'machine'"
            )
            item.add_marker(pytest.mark.xdist_group("machine"))
        elif item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
        group_of[item] = item.get_closest_marker("xdist_group").args[0]
    # The groups that hold slow tests go first, the most first, and `make test` keeps
    # that order (--no-loadscope-reorder: xdist would put the groups of few tests, the
    # minutes-long ones, last), so that the many short ones even out the end.
    slow = Counter(group_of[item] for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[group_of[item]])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a daemon it started is still running (slurmctld, slurmd,
    munged, stager serve), or an image it mounted (or its loop device) is still
    there: tests stop what they start. Under pytest-xdist the controller checks, once
    every worker has ended (a worker would see the other's daemons still at work).
    A /tmp/pymp-* or /tmp/torchelastic_* folder made during the run and left (its
    process never ran its exit handler, or nothing removes it: tests.processes.TEMP_GLOBS)
    fails it under ``CI=true``; elsewhere it is told, not failed:
    a run beside this one on the same machine leaves its own, which no mark tells apart."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["summary_lines"] = _summary_lines()  # for the controller
        # What the worker's own process holds ends with it, before the controller looks.
        left_here = _ZYGOTE_LEFT + leftovers(grace_s=2.0, under=os.getpid())
        session.config.workeroutput["left_running"] = left_here
        return
    left = _WORKERS_LEFT + _ZYGOTE_LEFT + leftovers() + sorted(_mounts_left())
    temp_left = temp_folders_left(_TEMP_BEFORE)
    if in_ci():
        left, temp_left = left + temp_left, []
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if temp_left:
        lines = ["left in /tmp (by this run, or by a run beside it):", *temp_left]
        _report(reporter, "left behind", lines)
    if left:
        lines = ["the test run left these running (a test or fixture did not stop them):", *left]
        _report(reporter, "left running", lines, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _report(reporter: object, title: str, lines: list[str], red: bool = False) -> None:
    if reporter is None:
        print("\n".join(lines))
        return
    reporter.write_sep("=", title, red=red, yellow=not red)  # type: ignore[attr-defined]
    for line in lines:
        reporter.write_line(line)  # type: ignore[attr-defined]


def _mounts_left(grace_s: float = 2.0) -> set[str]:
    """Image mounts and loop devices this run made and left (a lazily unmounted image's
    loop device goes when its last reader closes: a moment's grace)."""
    import time

    deadline = time.monotonic() + grace_s
    while True:
        left = mounts.snapshot() - _MOUNTS_BEFORE
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


# The daemons a test started, for its failure's report.
_DAEMONS = pytest.StashKey[list[Daemon]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """A failed test's report ends with what each daemon it started said, and whether
    that daemon still runs: a failure seen once in a full run can be read afterwards."""
    report: pytest.TestReport = yield
    marker = item.get_closest_marker("xdist_group")
    _GROUP_S[marker.args[0] if marker else item.path.stem] += report.duration
    if report.failed and report.when == "call":
        for number, daemon in enumerate(item.stash.get(_DAEMONS, []), 1):
            code = daemon.process.poll() if daemon.process else "never started"
            title = f"daemon {number} ({daemon.url}, exit code {code})"
            report.sections.append((title, daemon.log(limit=20_000)))
    return report


@pytest.fixture(scope="session")
def daemon_zygote() -> Iterator[Zygote]:
    """This worker's tests/daemon_zygote.py (started at its first use, ~1 s of CPU once):
    the daemons of a module marked ``forked_daemons`` are forked from it."""
    zygote = Zygote()
    try:
        yield zygote
    finally:
        # Closing it kills what it forked and still runs: told first, as a daemon left
        # running (pytest_sessionfinish, which runs after this).
        _ZYGOTE_LEFT.extend(zygote.running())
        zygote.close()


@pytest.fixture
def daemon_factory(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Daemon]]:
    """Start real ``stager serve`` processes; all are killed at the end of the test.
    In a module marked ``forked_daemons`` each is forked from ``daemon_zygote`` (its
    claims are what a daemon does, not how its interpreter starts); elsewhere each is a
    new ``python -m stager``."""
    started: list[Daemon] = []
    request.node.stash[_DAEMONS] = started
    forked = request.node.get_closest_marker("forked_daemons") is not None
    zygote = request.getfixturevalue("daemon_zygote") if forked else None

    def start(
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cache_dir: Path | None = None,
        wait: bool = True,
    ) -> Daemon:
        daemon = Daemon(
            cache_dir=cache_dir or tmp_path / "cache",
            args=args or [],
            extra_env=env or {},
            zygote=zygote,
        )
        started.append(daemon)
        return daemon.start(wait=wait)

    yield start
    for daemon in started:
        daemon.cleanup()


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory()


@pytest.fixture(scope="module")
def refusing_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for a module's tests of requests that must be refused: a refusal
    leaves nothing behind (each such test checks that it did), so they share no state
    and need not each pay a start (~1-2 s of a CI worker)."""
    daemon = Daemon(cache_dir=tmp_path_factory.mktemp("refusing") / "cache")
    try:
        yield daemon.start()
    finally:
        daemon.cleanup()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount small tmpfs filesystems (e.g. ``tmpfs("6m")``): a real disk that fills up.
    Needs root; the test is skipped with the reason elsewhere."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        point = tmp_path / f"tmpfs{len(mounts)}"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], check=False)


class DiskWatch:
    """The free space on the filesystem of the tests' temporary folders, after each
    test: the summary names the test after which it was lowest, so a run that ends
    in "disk full" on a small CI machine says where its space went."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.lowest: tuple[int, str] | None = None

    def note(self, config: pytest.Config, nodeid: str) -> None:
        stats = os.statvfs(config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]
        free = stats.f_bavail * stats.f_frsize
        if self.start is None:
            self.start = free
        if self.lowest is None or free < self.lowest[0]:
            self.lowest = (free, nodeid)

    def line(self) -> str | None:
        if self.start is None or self.lowest is None:
            return None
        free, nodeid = self.lowest
        gib = 2**30
        return (
            f"disk: {self.start / gib:.1f} GiB free after the first test, "
            f"lowest {free / gib:.1f} GiB after {nodeid}"
        )


DISK = DiskWatch()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    DISK.note(item.config, item.nodeid)


# The summary lines of each pytest-xdist worker, sent to the controller as it ends.
_WORKER_LINES: list[str] = []
_WORKERS_LEFT: list[str] = []  # what each pytest-xdist worker left running under itself
_ZYGOTE_LEFT: list[str] = []  # daemons forked from this process's zygote, left running


# Seconds spent in each xdist group (setup, call and teardown): the groups that make
# `make test` long, printed by each worker at the end (a group runs on one worker, so
# the longest, "machine", bounds the run from below).
_GROUP_S: Counter[str] = Counter()


def _group_line(top: int = 10) -> str:
    if not _GROUP_S:
        return ""
    slowest = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in _GROUP_S.most_common(top))
    return f"time by group on this worker ({sum(_GROUP_S.values()):.0f} s in all): {slowest}"


def _summary_lines() -> list[str]:
    return [line for line in [*session_lines(), DISK.line(), _group_line()] if line]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's, called in its controller
def pytest_testnodedown(node, error) -> None:  # noqa: ANN001 (xdist's own types)
    _WORKER_LINES.extend(getattr(node, "workeroutput", {}).get("summary_lines", []))
    _WORKERS_LEFT.extend(getattr(node, "workeroutput", {}).get("left_running", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in [*_WORKER_LINES, *_summary_lines()]:
        terminalreporter.write_line(line)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder every user of the machine can reach (pytest's own ``tmp_path`` sits
    under a 0700 folder): for tests that read or stage as other users."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="stager-shared-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        # rm, not shutil.rmtree: a cache's trash may hold a hostile archive's 100,000
        # folders 500 deep (test_hostile_accounting.py), which rmtree takes 89 s to
        # delete and rm 11 s. Not into another filesystem (a mount a test left).
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(folder)], check=False)


@pytest.fixture
def alice_home(users: tuple[User, User], shared_tmp: Path) -> Path:  # noqa: F811 (the fixture)
    """alice's folder in ``shared_tmp``, hers and 0755."""
    alice, _ = users
    folder = shared_tmp / "alice-home"
    folder.mkdir(mode=0o755)
    os.chown(folder, alice.uid, alice.gid)
    return folder
