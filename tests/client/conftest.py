"""Helpers for client tests: run ``stager-client`` as a real process, slow sources."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import Daemon
from tests.httpserver import Behaviour, serve_files
from tests.trees import make_tar, write_tree

REPO = Path(__file__).resolve().parents[2]
SLOW_SIZE = 300_000
SLOWER_SIZE = 800_000


def run_cli(
    daemon: Daemon | None, *args: str, timeout: float = 30, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``stager-client ARGS`` in a child process whose stdio are pipes (not a terminal)."""
    return subprocess.run(
        cli_command(*args),
        env={**(daemon.env if daemon else {}), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def start_cli(daemon: Daemon, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cli_command(*args),
        env=daemon.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "client.cli", *args]


def copy_step(src: Path, dst: str = ".") -> str:
    return f'{{"op": "copy", "src": "{src}", "dst": "{dst}"}}'


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return write_tree(tmp_path / "tree", n_files=12, max_size=4000)


@pytest.fixture
def truncated_archive(tmp_path: Path, tree: Path) -> Path:
    """A gzip that starts right (passes the daemon's format sniffing) and ends mid-stream."""
    whole = make_tar(tree, tmp_path / "whole.tar.gz")
    data = whole.read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(data[: len(data) // 2])
    return cut


@pytest.fixture
def slow_url() -> Iterator[str]:
    """A 300 kB file served at 100 kB/s: a staging that takes ~3 s, long enough to act on."""
    behaviour = Behaviour(files={"/big.bin": b"x" * SLOW_SIZE}, bytes_per_s=100_000)
    with serve_files(behaviour) as base:
        yield f"{base}/big.bin"


@pytest.fixture
def slower_served() -> Iterator[tuple[str, Behaviour]]:
    """A staging that takes ~8 s: outlasts a daemon's stop and start. The URL, and its
    server's behaviour (a test may lift the throttle once the slowness has served)."""
    behaviour = Behaviour(files={"/bigger.bin": b"x" * SLOWER_SIZE}, bytes_per_s=100_000)
    with serve_files(behaviour) as base:
        yield f"{base}/bigger.bin", behaviour


@pytest.fixture
def slower_url(slower_served: tuple[str, Behaviour]) -> str:
    return slower_served[0]


def fetch_step(url: str, dst: str = "big.bin") -> str:
    return f'{{"op": "fetch", "url": "{url}", "dst": "{dst}"}}'
