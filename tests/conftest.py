from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

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
