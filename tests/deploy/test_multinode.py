"""Multi-node jobs on a real SLURM cluster of 4 nodes on this machine
(deploy/slurm/multinode): each node a slurmd in its own network and mount namespace
with its own /tmp, the shared storage served over a rate-limited link and counted on
the storage side.

The module brings the cluster up once (under its lock, so no other run takes it
down meanwhile) and down at the end, and then checks that nothing is left: no
process in its namespaces, no namespace, link, mount or folder. Sizes here are
CI-sized; the 200 MB figures for N = 1, 2, 4 are bench/bench_fanout.py's.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from bench.multinode import Cluster, ClusterError, leftovers

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

NODES = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("needs root: namespaces, mounts, slurmd")
    if shutil.which("apt-get") is None and shutil.which("slurmd") is None:
        pytest.skip("needs Debian's apt-get to install slurm-wlm, sshfs (or them installed)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse for the shared storage (sshfs)")
    made = Cluster(nodes=NODES, rate="200mbit", local_size="1g")
    try:
        made.up()
    except ClusterError as exc:
        pytest.skip(f"the multi-node cluster cannot start here: {exc}")
    try:
        yield made
    finally:
        namespaces = made.namespaces
        made.down()
        left = leftovers(namespaces)
        assert not left, f"down.sh left: {left}"


def test_every_node_has_its_own_disk_and_reads_the_storage_over_the_counted_link(
    cluster: Cluster,
) -> None:
    data = cluster.storage_dir / "probe.bin"
    data.write_bytes(os.urandom(3_000_000))
    before = cluster.storage()
    job = cluster.sbatch(
        f"""
srun --nodes={NODES} --ntasks-per-node=1 bash -c '
    echo "$SLURMD_NODENAME" > /tmp/whoami
    sleep 1
    echo "$SLURMD_NODENAME sees $(cat /tmp/whoami) $(ls /tmp/stager-*/stager.sock | wc -l)"'
srun --nodes=1 --ntasks=1 -w {cluster.nodes[1]} md5sum {cluster.shared(data)}
""",
        nodes=NODES,
        name="disks",
    )
    assert job.ok, job.output
    for node in cluster.nodes:
        # Own /tmp per node (it read back its own name), and a daemon from the prolog.
        assert f"{node} sees {node} 1" in job.output
    assert job.output.count(" sees ") == NODES
    moved = cluster.storage() - before
    assert 3_000_000 <= moved.content <= 3_000_000 * 1.01
    assert moved.wire >= moved.content
    # This machine's own view does not see the nodes' disks.
    assert not os.path.exists("/tmp/whoami") or "mn" not in open("/tmp/whoami").read()
