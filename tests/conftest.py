from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.counts import LINES
from tests.daemon import Daemon


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start real ``stager serve`` processes; all are killed at the end of the test."""
    started: list[Daemon] = []

    def start(
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cache_dir: Path | None = None,
        wait: bool = True,
    ) -> Daemon:
        daemon = Daemon(
            cache_dir=cache_dir or tmp_path / "cache", args=args or [], extra_env=env or {}
        )
        started.append(daemon)
        return daemon.start(wait=wait)

    yield start
    for daemon in started:
        daemon.cleanup()


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory()


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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in LINES:
        terminalreporter.write_line(line)
