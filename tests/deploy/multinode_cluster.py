"""The 4-node test cluster for a test module: up once (skipped where it cannot run
here), down at the module's end, and then nothing of it left (no process in its
namespaces, no namespace, link, mount or folder)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from bench.multinode import Cluster, ClusterError, leftovers

NODES = 4


def module_cluster(users_jobs: bool = False, **options: Any) -> Iterator[Cluster]:
    """For a module-scoped fixture: ``yield from module_cluster(...)``; ``options`` go to
    ``Cluster`` (e.g. ``node_service=True``); ``users_jobs``: jobs of other users than
    root write their outputs in the jobs folder too."""
    if os.geteuid() != 0:
        pytest.skip("needs root: namespaces, mounts, slurmd")
    if shutil.which("apt-get") is None and shutil.which("slurmd") is None:
        pytest.skip("needs Debian's apt-get to install slurm-wlm, sshfs (or them installed)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse for the shared storage (sshfs)")
    made = Cluster(nodes=NODES, rate="200mbit", local_size="1g", **options)
    try:
        made.up()
    except ClusterError as exc:
        pytest.skip(f"the multi-node cluster cannot start here: {exc}")
    try:
        if users_jobs:
            made.jobs_dir.chmod(0o1777)
        yield made
    finally:
        namespaces = made.namespaces
        made.down()
        left = leftovers(namespaces)
        assert not left, f"down.sh left: {left}"
