"""The fan-out's decisions, as pure functions: which node reads the data, how sbcast
sends it, and how a node's copy is described."""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from datetime import UTC, datetime

from client._progress import describe_origin
from client.fanout.policy import (
    BLOCK_BYTES,
    broadcast_for,
    fanout_for,
    goes_as_image,
    source_node,
)
from stager.wire.schemas import DatasetPublic, Origin, ProbeResult, State

NODES = ["mn1", "mn2", "mn3", "mn4"]


def key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()[:24]


def test_a_holder_is_the_source_and_this_node_first() -> None:
    assert source_node(key(1), NODES, ["mn4", "mn3"], "mn1") == "mn3"
    assert source_node(key(1), NODES, ["mn4", "mn1"], "mn1") == "mn1"


def test_without_holders_the_key_picks_and_spreads_datasets_over_the_nodes() -> None:
    shuffled = random.Random(0).sample(NODES, len(NODES))
    picks = [source_node(key(i), NODES, [], "mn1") for i in range(400)]
    # The same key gives the same node, whatever order the nodes are listed in.
    assert picks == [source_node(key(i), shuffled, [], "mn2") for i in range(400)]
    counts = Counter(picks)
    assert set(counts) == set(NODES) and min(counts.values()) > 60


def test_the_source_nodes_probe_says_whether_the_dataset_goes_as_its_image() -> None:
    """The probe's word wins over the request (an image refused there is a tree); a
    probe from a daemon that predates the word falls back to the request."""
    asked = {"name": "d", "steps": [{"op": "extract", "src": "/s.tar"}], "image": True}
    prebuilt = {"name": "d", "steps": [{"op": "image", "src": "/i.erofs"}]}
    tree = {"name": "d", "steps": [{"op": "extract", "src": "/s.tar"}]}

    def probe(**fields: object) -> dict:
        return ProbeResult(key=key(1), **fields).model_dump(mode="json")

    assert goes_as_image(probe(image=False), asked) is False  # image_fallback's tree
    assert goes_as_image(probe(image=True), tree) is True
    old_daemon = {"key": key(1), "state": None}  # no "image" in its answer
    for body, expected in ((asked, True), (prebuilt, True), (tree, False)):
        assert goes_as_image(probe(), body) is expected
        assert goes_as_image(old_daemon, body) is expected


def test_sbcast_fans_out_flat_to_few_nodes_and_as_a_tree_to_many() -> None:
    assert fanout_for(3, 200 << 20) == 3
    assert fanout_for(8, 200 << 20) == 8
    assert fanout_for(60, BLOCK_BYTES) == 8  # one block: latency, not bandwidth
    for receivers in (9, 31, 63, 255):
        width = fanout_for(receivers, 1 << 30)
        assert 2 <= width < 8
        costs = {w: w * tree_depth(w, receivers) for w in range(2, 9)}
        assert costs[width] == min(costs.values())


def tree_depth(width: int, receivers: int) -> int:
    """Levels of a tree where each node forwards to ``width`` others."""
    depth, reached = 0, 1
    while reached < receivers + 1:
        reached, depth = reached * (width + 1), depth + 1
    return depth


def test_lz4_only_for_large_compressible_data() -> None:
    assert broadcast_for(3, 1 << 30, compressible=True).compress
    assert not broadcast_for(3, 1 << 30, compressible=False).compress
    assert not broadcast_for(3, 1 << 20, compressible=True).compress
    assert broadcast_for(3, 1 << 30, False).flags() == ["--compress=none", "--fanout=3"]


def status(origin: Origin | None, state: State = State.READY) -> DatasetPublic:
    now = datetime.now(UTC)
    return DatasetPublic(name="d", key="k", state=state, origin=origin, created_at=now,
                         updated_at=now)  # fmt: skip


def test_status_says_how_the_copy_arrived() -> None:
    assert describe_origin(status(None)) == ""
    assert describe_origin(status(Origin(how="staged", job="12"))) == (
        "; staged here from the source, job 12"
    )
    broadcast = Origin(how="broadcast", node="mn2", job="42", hit=True)
    assert describe_origin(status(broadcast)) == (
        "; broadcast from mn2, job 42; this request was a cache hit"
    )
    assert describe_origin(status(broadcast, State.STAGING)) == ""


def test_an_image_sent_whole_is_said_so_in_the_headline_the_lines_and_the_json() -> None:
    from client.fanout.report import NodeResult, Report
    from client.fanout.slurm import Broadcast

    report = Report(name="inat", source="mn2", mode="image", sent_bytes=1_000_000_000)
    report.broadcast = Broadcast(False, 3)
    report.nodes["mn1"] = NodeResult("mn1", how="broadcast", path="/c/d", seconds=2.0, image=True)
    report.seconds = 4.0
    headline = report.headline()
    assert "mn2 sent the image (1.0 GB) with sbcast" in headline, headline
    assert "--compress=none" in headline
    assert report.nodes["mn1"].line() == "mn1: broadcast image adopted in 2.0 s -> /c/d"
    as_json = report.as_json()
    assert as_json["mode"] == "image" and as_json["nodes"]["mn1"]["image"] is True
