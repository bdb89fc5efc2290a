"""The fan-out's decisions, as pure functions of what the probes found: which node
reads the data for the others, whether it sends the source files or the prepared
tree, and how sbcast sends each file."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from client.fanout.slurm import Broadcast

# sbcast sends one 8 MB block at a time and waits for every node to have it. Up to
# FLAT_FANOUT receivers the sender sends to each directly; beyond, a tree.
BLOCK_BYTES = 8 << 20
FLAT_FANOUT = 8
# lz4 on the wire pays for data it shrinks; packed datasets are mostly JPEG/PNG and
# release archives are compressed already, so it is off unless the data says so.
LZ4_MIN_BYTES = 64 << 20
COMPRESSED_SUFFIXES = (".gz", ".tgz", ".zst", ".tzst", ".xz", ".txz", ".bz2", ".tbz2", ".zip")


def source_node(key: str, nodes: Sequence[str], holders: Sequence[str], this_node: str) -> str:
    """Who reads the data for the others: a holder (this node first), else a node chosen
    by the key, so that different datasets of one job start on different nodes."""
    if this_node in holders:
        return this_node
    if holders:
        return sorted(holders)[0]
    ordered = sorted(nodes)
    return ordered[int(key[:15], 16) % len(ordered)]


def goes_as_image(probe: Mapping[str, Any], body: Mapping[str, Any]) -> bool:
    """Whether the source node stages the request as one image, which then travels as
    one file: that node's probe says (an image refused there may be a tree, through
    ``image_fallback``). A daemon from before the probe said it (``image`` absent):
    the request says, as that daemon's export would."""
    said = probe.get("image")
    if said is not None:
        return bool(said)
    steps = body.get("steps") or []
    return bool(body.get("image")) or any(
        isinstance(step, Mapping) and step.get("op") == "image" for step in steps
    )


def sends_sources(broadcast: str, holders: Sequence[str], files: Sequence[Any]) -> bool:
    """Broadcast the source files, rather than the prepared tree, only when asked
    (``--broadcast sources``), there are such files and no node holds the data.
    Measured (docs/benchmarks.md, a 201 MB .tar.gz on 4 nodes): the prepared tree
    sent in parts beats the archive, since the source node extracts while it reads
    the storage and the receivers get plain tars while the parts travel, where the
    archive is sent first and then decompressed on every node."""
    return not holders and bool(files) and broadcast == "sources"


def fanout_for(receivers: int, nbytes: int) -> int:
    """sbcast's ``--fanout``: flat (the sender sends every copy) for few receivers or
    one block; for many, the tree width that minimises width x depth per block."""
    if receivers <= FLAT_FANOUT or nbytes <= BLOCK_BYTES:
        return max(1, min(receivers, FLAT_FANOUT))

    def cost(width: int) -> tuple[int, int]:
        depth, reached = 0, 1
        while reached < receivers + 1:
            reached *= width + 1
            depth += 1
        return width * depth, -width

    return min(range(2, FLAT_FANOUT + 1), key=cost)


def broadcast_for(receivers: int, nbytes: int, compressible: bool) -> Broadcast:
    return Broadcast(compressible and nbytes >= LZ4_MIN_BYTES, fanout_for(receivers, nbytes))


def compressed_name(path: str) -> bool:
    return path.lower().endswith(COMPRESSED_SUFFIXES)
