from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import Daemon


@pytest.fixture(scope="module")
def recipe_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One real daemon for a module's stagings: each staging is a new name and spec,
    so sharing it costs nothing in isolation and saves a start-up per test."""
    cache: Path = tmp_path_factory.mktemp("recipe-cache")
    daemon = Daemon(cache_dir=cache, extra_env={"STAGER_OP_WORKERS": "4"})
    daemon.start()
    yield daemon
    daemon.cleanup()
