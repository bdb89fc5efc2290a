"""What a fan-out did: how the data reached each node, what was sent and where the time
went; one line per node, a headline, or one JSON document (``--json``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from client.fanout.slurm import Broadcast


@dataclass
class NodeResult:
    node: str
    how: str | None = None  # hit | staged | broadcast
    path: str | None = None
    seconds: float | None = None
    fallback: str | None = None  # why a broadcast copy was not used
    error: str | None = None
    image: bool = False  # the broadcast copy was an image file, sent whole

    def line(self) -> str:
        if self.error:
            return f"{self.node}: FAILED: {self.error}"
        adopted = "broadcast image adopted" if self.image else "broadcast copy adopted"
        what = {"hit": "cache hit", "staged": "staged from the source"}.get(self.how or "", adopted)
        took = f" in {self.seconds:.1f} s" if self.seconds is not None else ""
        note = f" (fallback: {self.fallback})" if self.fallback else ""
        return f"{self.node}: {what}{took}{note} -> {self.path}"


@dataclass
class Report:
    name: str
    key: str | None = None
    source: str | None = None
    mode: str = "none"  # bundle | sources | image (one file) | none (nothing to send)
    sent_bytes: int = 0
    early_parts: int = 0  # parts sent while the source node was still staging
    early_bytes: int = 0  # and their bytes (the rest went once it was ready)
    reelected: list[str] = field(default_factory=list)  # sources that failed, in order
    broadcast: Broadcast | None = None
    seconds: float = 0.0
    nodes: dict[str, NodeResult] = field(default_factory=dict)
    # When each phase ended, in seconds from the start: where the time went.
    timeline: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> list[NodeResult]:
        return [r for r in self.nodes.values() if r.error]

    def headline(self) -> str:
        nodes = len(self.nodes)
        text = f"{self.name!r} on {nodes} node{'s' * (nodes != 1)} in {self.seconds:.1f} s"
        if self.mode == "none":
            return text
        sent = _size(self.sent_bytes)
        how = f" ({' '.join(self.broadcast.flags())})" if self.broadcast else ""
        what = {"bundle": "the prepared tree", "image": "the image"}.get(
            self.mode, "the source files"
        )
        early = (
            f", {self.early_bytes / 1e6:.1f} MB in {self.early_parts} parts while it staged"
            if self.early_parts
            else ""
        )
        return f"{text}: {self.source} sent {what} ({sent}{early}) with sbcast{how}"

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "source": self.source,
            "mode": self.mode,
            "sent_bytes": self.sent_bytes,
            "early_parts": self.early_parts,
            "early_bytes": self.early_bytes,
            "reelected": self.reelected,
            "compress": self.broadcast.compress if self.broadcast else None,
            "fanout": self.broadcast.fanout if self.broadcast else None,
            "seconds": round(self.seconds, 3),
            "timeline": self.timeline,
            "nodes": {n: vars(r) for n, r in sorted(self.nodes.items())},
        }


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
