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

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.multinode import Cluster, fresh_copy
from client.fanout.policy import source_node
from tests.deploy.multinode_cluster import NODES, module_cluster
from tests.trees import make_tar, write_tree

pytestmark = [pytest.mark.multinode, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from module_cluster()


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


# ---- fan-out -----------------------------------------------------------------------------

TREE_DIGEST = (
    "cd {path} && find . \\( -type f -o -type l \\) -print0 | sort -z "
    "| xargs -0 -r sha256sum | sha256sum | cut -c1-64"
)


def local_digest(path: Path) -> str:
    return subprocess.run(
        ["bash", "-c", TREE_DIGEST.format(path=path)], capture_output=True, text=True, check=True
    ).stdout.strip()


def node_digests(cluster: Cluster, path: str) -> dict[str, str]:
    return {
        node: cluster.on_node(i, TREE_DIGEST.format(path=path)).strip()
        for i, node in enumerate(cluster.nodes, start=1)
    }


def stage_script(name: str, source: str, *extra: str) -> str:
    return (
        f"stager-client stage {name} --recipe imagefolder --source {source} --peers slurm "
        f"--timeout 300 --json {' '.join(extra)} > $PWD/{name}.json\n"
    )


def run_stage(
    cluster: Cluster, name: str, source: str, nodes: int = NODES, extra: tuple = (), **kw
) -> tuple:
    before = cluster.storage()
    job = cluster.sbatch(stage_script(name, source, *extra), nodes=nodes, name=name, **kw)
    moved = cluster.storage() - before
    report_file = cluster.jobs_dir / f"{name}.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    return job, report, moved


@pytest.fixture(scope="module")
def data(cluster: Cluster) -> dict[str, Path]:
    """Datasets on the shared storage; and every node's daemon up (a first job's prolog
    starts them), so tests can ask a daemon before their own job runs."""
    warm = cluster.sbatch(f"srun --nodes={NODES} --ntasks-per-node=1 true\n", NODES, "warm")
    assert warm.ok, warm.output
    tree = write_tree(cluster.storage_dir / "imgs", n_files=120, max_size=80_000)
    archive = make_tar(tree, cluster.storage_dir / "imgs.tar.gz", arcname=".")
    return {"tree": tree, "archive": archive}


@pytest.mark.parametrize("kind", ["tree", "archive", "archive-sources"])
def test_a_4_node_job_reads_the_storage_once_and_every_node_gets_the_same_data(
    cluster: Cluster, data: dict[str, Path], kind: str
) -> None:
    """The prepared tree in parts (auto, a tree or an archive), and an archive sent
    as it is (``--broadcast sources``)."""
    sources = kind == "archive-sources"
    source = fresh_copy(data["archive" if sources else kind], f"once-{kind}")
    extra = ("--broadcast", "sources") if sources else ()
    job, report, moved = run_stage(cluster, f"once-{kind}", cluster.shared(source), extra=extra)
    assert job.ok, job.output
    size = (
        source.stat().st_size
        if source.is_file()
        else sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    )
    assert moved.content <= 1.05 * size, (moved, size, report)
    assert report["mode"] == ("sources" if sources else "bundle")
    hows = sorted(r["how"] for r in report["nodes"].values())
    assert hows == (["broadcast"] * 4 if sources else ["broadcast"] * 3 + ["staged"])
    paths = {r["path"] for r in report["nodes"].values()}
    assert len(paths) == 1
    expected = local_digest(data["tree"])
    assert node_digests(cluster, paths.pop()) == dict.fromkeys(cluster.nodes, expected)


def test_an_image_dataset_goes_to_every_node_as_one_file(
    cluster: Cluster, data: dict[str, Path]
) -> None:
    """``--as-image``: the source node builds the image, sends that one file with one
    sbcast, and every other node checks it by its sha256 and mounts it."""
    source = fresh_copy(data["tree"], "image")
    job, report, moved = run_stage(cluster, "image", cluster.shared(source), extra=("--as-image",))
    assert job.ok, job.output
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    assert moved.content <= 1.05 * size, (moved, size, report)
    assert report["mode"] == "image" and report["early_parts"] == 0, report
    assert report["compress"] is False
    hows = sorted(r["how"] for r in report["nodes"].values())
    assert hows == ["broadcast"] * 3 + ["staged"], report
    assert sum(r["image"] for r in report["nodes"].values()) == 3, report
    paths = {r["path"] for r in report["nodes"].values()}
    assert len(paths) == 1
    path = paths.pop()
    assert node_digests(cluster, path) == dict.fromkeys(cluster.nodes, local_digest(data["tree"]))
    for index in range(1, NODES + 1):  # a read-only EROFS mount on every node
        mount = cluster.on_node(index, f"findmnt -n -o FSTYPE,OPTIONS {path}").split()
        assert mount[0] == "erofs" and "ro" in mount[1].split(","), mount


def test_on_a_slow_link_parts_go_out_while_the_source_node_stages(
    cluster: Cluster, data: dict[str, Path]
) -> None:
    """Files the source node finished go out while it stages the rest (early parts):
    the receivers still end with the same data, and the storage is read once."""
    source = fresh_copy(data["tree"], "early")
    cluster.set_rate("20mbit")  # the staging takes seconds: early parts have time to go
    try:
        job, report, moved = run_stage(cluster, "early", cluster.shared(source))
    finally:
        cluster.set_rate("200mbit")
    assert job.ok, job.output
    assert report["early_parts"] >= 2, report
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    assert moved.content <= 1.05 * size, (moved, size, report)
    hows = sorted(r["how"] for r in report["nodes"].values())
    assert hows == ["broadcast"] * 3 + ["staged"], report
    paths = {r["path"] for r in report["nodes"].values()}
    expected = local_digest(data["tree"])
    assert node_digests(cluster, paths.pop()) == dict.fromkeys(cluster.nodes, expected)


def test_when_one_node_holds_the_dataset_no_byte_leaves_the_storage(
    cluster: Cluster, data: dict[str, Path]
) -> None:
    source = cluster.shared(fresh_copy(data["tree"], "held"))
    holder = cluster.nodes[2]  # not the batch node (the first)
    first = cluster.sbatch(stage_script("held-1", source), nodes=1, name="held-1",
                           extra=[f"--nodelist={holder}"])  # fmt: skip
    assert first.ok, first.output
    job, report, moved = run_stage(cluster, "held-4", source)
    assert job.ok, job.output
    assert moved.content == 0, (moved, report)
    assert report["source"] == holder and report["mode"] == "bundle"
    assert report["nodes"][holder]["how"] == "hit"
    assert {r["how"] for n, r in report["nodes"].items() if n != holder} == {"broadcast"}
    # Each node now says how its copy arrived.
    status = json.loads(cluster.on_node(2, f"{cluster.bin_dir}/stager-client status held-4 --json"))
    assert status["origin"]["how"] == "broadcast" and status["origin"]["node"] == holder


def source_of(cluster: Cluster, source: str) -> str:
    """The node a fan-out of ``source`` will stage on, as the driver picks it: from the
    cache key, which node 1's daemon computes for the request."""
    body = json.dumps({"name": "x", "recipe": "imagefolder", "source": source})
    probe = cluster.on_node(
        1,
        "curl -s --unix-socket /tmp/stager-0/stager.sock -H 'content-type: application/json' "
        f"-X POST http://stager/v1/datasets/probe -d '{body}'",
    )
    return source_node(json.loads(probe)["key"], cluster.nodes, [], cluster.nodes[0])


def test_a_node_whose_broadcast_fails_stages_from_the_source_and_no_copy_is_wrong(
    cluster: Cluster, data: dict[str, Path]
) -> None:
    source = fresh_copy(data["tree"], "fail")
    sender = source_of(cluster, cluster.shared(source))
    index, broken = next((i, n) for i, n in enumerate(cluster.nodes, 1) if n != sender)
    # That node's delivery folder is a disk with no room: sbcast cannot write its copy.
    incoming = "/tmp/stager-0/cache/incoming"
    cluster.on_node(index, f"mount -t tmpfs -o size=16k full {incoming}")
    try:
        job, report, moved = run_stage(cluster, "fail", cluster.shared(source))
    finally:
        cluster.on_node(index, f"umount {incoming}")
    assert job.ok, job.output
    assert report["source"] == sender
    assert report["nodes"][broken]["how"] == "staged", report
    assert "rejected" in report["nodes"][broken]["fallback"], report
    assert not any(r["error"] for r in report["nodes"].values()), report
    paths = {r["path"] for r in report["nodes"].values()}
    expected = local_digest(data["tree"])
    assert node_digests(cluster, paths.pop()) == dict.fromkeys(cluster.nodes, expected)


def test_kill_9_of_the_staging_nodes_daemon_costs_one_more_read_and_a_rerun_reads_nothing(
    cluster: Cluster, data: dict[str, Path]
) -> None:
    """The source node's daemon dies while it stages and sends early parts: the others
    choose a new source among themselves and go on from it (one more read of the
    storage, not one per node), and the job fails naming the dead node. Run again
    (its prolog starts that daemon again, which does not resume the staging on its
    own), the job reads nothing from the storage: the dead node adopts a holder's copy."""
    source = fresh_copy(data["tree"], "kill")
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    sender = source_of(cluster, cluster.shared(source))
    index = cluster.nodes.index(sender) + 1
    before = cluster.storage()
    cluster.set_rate("10mbit")  # the sender's staging now takes seconds: time to kill it
    try:
        job_id = cluster.submit(stage_script("kill", cluster.shared(source)), NODES, "kill")
        deadline = time.monotonic() + 60
        # Killed once it is staging and sending what it finished (an early part).
        parts = "ls /tmp/stager-0/cache/outgoing/*/ 2>/dev/null | grep part"
        while not cluster.on_node(index, parts, check=False).strip():
            assert time.monotonic() < deadline, "the sender never sent an early part"
            time.sleep(0.1)
        cluster.on_node(index, "kill -9 $(cat /tmp/stager-0/stager.pid)")
        job = cluster.wait(job_id, "kill", timeout=240)
    finally:
        cluster.set_rate("200mbit")
    moved = cluster.storage() - before
    assert job.exit_code != "0:0", job.output
    # The job says which node is left without data, and why.
    assert f"not ready on every node ({sender}:" in job.output
    assert "no stager daemon answers" in job.output
    report = json.loads((cluster.jobs_dir / "kill.json").read_text())
    assert report["reelected"] == [sender] and report["source"] != sender, report
    others = {n: r for n, r in report["nodes"].items() if n != sender}
    assert not any(r["error"] for r in others.values()), report
    assert sorted(r["how"] for r in others.values()) == ["broadcast"] * 2 + ["staged"], report
    assert moved.content <= 2.05 * size, (moved, size, report)
    expected = local_digest(data["tree"])
    for i, node in enumerate(cluster.nodes, start=1):
        if node != sender:
            path = others[node]["path"]
            assert cluster.on_node(i, TREE_DIGEST.format(path=path)).strip() == expected

    job, report, moved = run_stage(cluster, "kill-again", cluster.shared(source))
    assert job.ok, job.output
    assert moved.content == 0, (moved, report)
    assert report["nodes"][sender]["how"] == "broadcast", report
    assert {r["how"] for n, r in report["nodes"].items() if n != sender} == {"hit"}, report
    path = report["nodes"][sender]["path"]
    assert cluster.on_node(index, TREE_DIGEST.format(path=path)).strip() == expected
