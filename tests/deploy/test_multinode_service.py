"""Multi-node fan-out through node services on the real 4-node SLURM cluster
(deploy/slurm/multinode with ``MN_NODE_SERVICE=1``): every node runs ``stager serve
--multi-user`` as root from its start, as the admin's systemd would, and real users'
jobs use it (docs/multiuser.md).

alice's 4-node job reads the shared storage once, and the three broadcast copies are
shared (their manifests vouched for by the source node's service through the
cluster's munged), so bob's 4-node job of the same data then hits on every node and
reads nothing from the storage. The CI-sized promise is
tests/stager/test_multiuser_fanout.py (two services on one machine).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.multinode import Cluster
from tests.deploy.multinode_cluster import NODES, module_cluster
from tests.deploy.test_multinode import local_digest, node_digests, stage_script
from tests.trees import write_tree
from tests.users import User

pytestmark = [pytest.mark.multinode, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from module_cluster(users_jobs=True, node_service=True)


def as_user(user: User) -> list[str]:
    return [f"--uid={user.uid}", f"--gid={user.gid}"]


def public_tree(cluster: Cluster, name: str) -> Path:
    """A tree on the shared storage that every user may read."""
    tree = write_tree(cluster.storage_dir / name, n_files=120, max_size=80_000)
    for path in [tree, *tree.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return tree


def alice_then_bob(
    cluster: Cluster, users: tuple[User, User], source: str, prefix: str, *flags: str
) -> dict[str, tuple[dict, Any, list[str]]]:
    """Alice's job, then bob's, each staging ``source`` on every node as that user: each
    job's report, the bytes that left the storage while it ran, and how each node got
    the data."""
    runs = {}
    for user, name in zip(users, (f"{prefix}-alice", f"{prefix}-bob"), strict=True):
        before = cluster.storage()
        job = cluster.sbatch(stage_script(name, source, *flags), nodes=NODES, name=name,
                             extra=as_user(user))  # fmt: skip
        moved = cluster.storage() - before
        assert job.ok, job.output
        report = json.loads((cluster.jobs_dir / f"{name}.json").read_text())
        runs[name] = (report, moved, sorted(r["how"] for r in report["nodes"].values()))
    return runs


def one_shared_copy(cluster: Cluster, reports: dict, tree: Path) -> str:
    """The one path every job's report names on every node (one shared copy, the same key
    everywhere), holding ``tree``'s bytes on every node."""
    paths = {r["path"] for rep in reports.values() for r in rep["nodes"].values()}
    assert len(paths) == 1, reports
    path = paths.pop()
    assert node_digests(cluster, path) == dict.fromkeys(cluster.nodes, local_digest(tree))
    return path


def test_alices_fan_out_is_shared_and_bobs_job_then_reads_nothing(
    cluster: Cluster, users: tuple[User, User], interpreter_for_users: str
) -> None:
    tree = public_tree(cluster, "public-imgs")
    size = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())
    source = cluster.shared(tree)
    runs = alice_then_bob(cluster, users, source, "mu")
    (report, moved, hows), (bob_report, bob_moved, bob_hows) = runs.values()
    assert moved.content <= 1.05 * size, (moved, size, report)
    assert hows == ["broadcast"] * 3 + ["staged"], report
    assert bob_moved.content == 0, (bob_moved, bob_report)
    assert bob_hows == ["hit"] * NODES, bob_report
    reports = {name: run[0] for name, run in runs.items()}
    path = one_shared_copy(cluster, reports, tree)
    # The node service, not a per-user daemon, served both users: no user's own cache.
    for index in range(1, NODES + 1):
        assert cluster.on_node(index, "ls -d /tmp/stager-[0-9]* 2>/dev/null || true").strip() == ""
    assert Path(path).parts[:3] == ("/", "tmp", "stager-node")


def test_alices_image_dataset_goes_as_one_vouched_file_and_bob_hits_it(
    cluster: Cluster, users: tuple[User, User], interpreter_for_users: str
) -> None:
    """An image dataset through node services: one file sbcast as alice, its sha256
    vouched for by the source node's service (the cluster's munged), mounted shared on
    every node, so bob's job of the same data hits everywhere."""
    tree = public_tree(cluster, "public-image")
    source = cluster.shared(tree)
    runs = alice_then_bob(cluster, users, source, "img", "--as-image")
    (report, _, hows), (bob_report, bob_moved, bob_hows) = runs.values()
    assert report["mode"] == "image", report
    assert hows == ["broadcast"] * 3 + ["staged"], report
    assert bob_moved.content == 0, (bob_moved, bob_report)
    assert bob_hows == ["hit"] * NODES, bob_report
    reports = {name: run[0] for name, run in runs.items()}
    path = one_shared_copy(cluster, reports, tree)
    for index in range(1, NODES + 1):
        assert cluster.on_node(index, f"findmnt -n -o FSTYPE {path}").strip() == "erofs"
