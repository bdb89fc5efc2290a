"""DESIGN: the daemon never imports torch; the ImageNet ops import torch/scipy lazily,
in the staging process that runs them."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import time
from pathlib import Path

import stager.ops
from tests.daemon import Daemon, stage_ready
from tests.imports import among, loaded_modules
from tests.processes import comm, descendants

DAEMON = [
    "stager.api.app",
    "stager.engine.scheduler",
    "stager.ops",
    "stager.request.recipes",
    "stager.cli",
]
# Ops are imported on first use, so importing `stager.ops` alone would not catch a
# top-level `import torch` in one of them: import every op module too.
OPS = [f"stager.ops.{m.name}" for m in pkgutil.iter_modules(stager.ops.__path__)]
HEAVY = ("torch", "torchvision", "scipy")
# What a process that imported torch has mapped: its package's shared objects.
TORCH_MAPPED = "/torch/"


def test_importing_the_daemon_and_its_ops_loads_neither_torch_nor_scipy() -> None:
    loaded = loaded_modules(*DAEMON, *OPS)
    assert "stager.ops.imagenet_devkit" in loaded  # the ops that use torch were imported
    assert among(loaded, HEAVY) == []


def mapped(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_a_serving_daemon_and_every_process_it_keeps_map_no_torch(
    daemon: Daemon, tmp_path: Path
) -> None:
    """The running daemon, its fork server (whose preload imports every op), its walker
    and the spare a finished staging leaves, after a staging: none has loaded torch."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "f").write_text("x")
    with daemon.client() as client:
        stage_ready(client, {"name": "a", "steps": [{"op": "copy", "src": str(tree)}]})
    assert daemon.process is not None
    deadline = time.monotonic() + 10  # the spare is forked once the staging has ended
    while True:
        pids = [daemon.process.pid, *descendants(daemon.process.pid)]
        names = {comm(pid) for pid in pids}
        if {"stager-walker", "stager-spare"} <= names or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {"stager-walker", "stager-spare"} <= names, names  # the processes it keeps
    assert [comm(pid) for pid in pids if TORCH_MAPPED in mapped(pid)] == []


def test_a_process_that_imported_torch_maps_it() -> None:
    """The mark the test above looks for is there when torch is loaded."""
    code = f"import torch; print({TORCH_MAPPED!r} in open('/proc/self/maps').read())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr
