"""The per-node agent of a fan-out (``stager-client _node``, client/_fanout_node.py)
against two real daemons over real sockets, standing for two nodes of a job: the
small-size, SLURM-free version of the 4-node cluster tests (tests/deploy/
test_multinode.py, ``-m multinode``). The test plays the driver: it sends each agent
the messages the driver would, and a file copy stands for sbcast.

What it shows: a node that already holds the dataset takes it from its cache and
reads nothing; a receiving node adopts the sender's copy under the same key without
reading the source; a copy that does not match the manifest makes that node stage
from the source itself, never ready with wrong content; and a delivery never
outlives the agent.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from client._client import AsyncStagerClient
from client._fanout_node import Node
from stager.schemas import BUNDLE_NAME, MANIFEST_NAME
from tests.daemon import Daemon
from tests.stager.test_cache import metric
from tests.trees import digest, write_tree

TIMEOUT = 60


class Agent:
    """One node's agent, run in this process, fed messages as the driver would."""

    def __init__(self, daemon: Daemon, node: str, body: dict[str, Any]) -> None:
        self.daemon, self.node = daemon, node
        self.events: list[dict[str, Any]] = []
        self._messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._client = AsyncStagerClient(daemon.url)
        self._task = asyncio.create_task(
            Node(self._client, node, body, TIMEOUT, self.events.append).run(self._read(), "1.0")
        )

    async def _read(self) -> AsyncIterator[dict[str, Any]]:
        while (message := await self._messages.get()) is not None:
            yield message

    async def tell(self, **message: Any) -> None:
        self._messages.put_nowait(message)

    async def event(self, kind: str) -> dict[str, Any]:
        for _ in range(TIMEOUT * 20):
            found = [e for e in self.events if e["event"] == kind]
            if found:
                return found[-1]
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.node} never said {kind!r}: {self.events}")

    async def finish(self) -> dict[str, Any]:
        """Close its input (the driver is done): its ``done`` event."""
        self._messages.put_nowait(None)
        await asyncio.wait_for(self._task, TIMEOUT)
        await self._client.aclose()
        return await self.event("done")


def body(src: Path) -> dict[str, Any]:
    return {"name": "ds", "steps": [{"op": "copy", "src": str(src)}]}


async def send(sender: Agent, receiver: Agent, damage: Callable[[Path], None] | None) -> None:
    """The driver's part of one broadcast: pack on the sender, reserve on the receiver,
    copy (sbcast's part), drop the export, adopt."""
    await sender.tell(do="export", label="job1-ds")
    exported = await sender.event("exported")
    assert "error" not in exported, exported
    await receiver.tell(do="reserve", label="job1-ds", bytes=exported["bundle_bytes"] + 10_000)
    folder = Path((await receiver.event("reserved"))["path"])
    shutil.copyfile(exported["bundle"], folder / BUNDLE_NAME)
    shutil.copyfile(exported["manifest"], folder / MANIFEST_NAME)
    if damage is not None:
        damage(folder / BUNDLE_NAME)
    await sender.tell(do="drop-export", label="job1-ds")
    adopt = {
        "incoming": "job1-ds",
        "origin_node": sender.node,
        "origin_key": exported["key"],
        "job": "1",
        "manifest_sha256": exported["manifest_sha256"],
    }
    await receiver.tell(do="adopt", adopt=adopt)


def flip_a_byte(bundle: Path) -> None:
    data = bytearray(bundle.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside some file's data
    bundle.write_bytes(bytes(data))


@pytest.mark.parametrize("damaged", [False, True], ids=["copy", "damaged-copy"])
def test_a_node_adopts_the_broadcast_copy_or_stages_from_the_source(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, damaged: bool
) -> None:
    src = write_tree(tmp_path / "src", n_files=40)
    node1 = daemon_factory(cache_dir=tmp_path / "node1")
    node2 = daemon_factory(cache_dir=tmp_path / "node2")

    async def job() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        sender, receiver = Agent(node1, "node1", body(src)), Agent(node2, "node2", body(src))
        probes = [await sender.event("probe"), await receiver.event("probe")]
        await sender.tell(do="stage", to=["node1"])
        await sender.event("staged")
        await send(sender, receiver, flip_a_byte if damaged else None)
        return await sender.finish(), await receiver.finish(), probes

    sent, received, probes = asyncio.run(job())
    assert [p["state"] for p in probes] == [None, None]
    assert probes[0]["key"] == probes[1]["key"]  # both nodes compute one key
    assert sent.get("error") is None and sent["how"] == "staged", sent
    assert received.get("error") is None, received
    assert received["key"] == sent["key"]
    assert digest(Path(received["path"])) == digest(src)  # never ready with wrong content
    with node2.client() as other:
        read = metric(other, "stager_source_read_bytes_total")
        if damaged:
            assert received["how"] == "staged"
            assert "node1" in received["fallback"] and "rejected" in received["fallback"]
            assert read > 0  # it read the source itself
        else:
            assert received["how"] == "broadcast" and received["fallback"] is None
            assert read == 0
            assert metric(other, "stager_arrivals_total", how="broadcast") == 1
    # Whatever was delivered is gone once adopted or rejected; the export too.
    assert list((node2.cache_dir / "incoming").iterdir()) == []
    assert list((node1.cache_dir / "outgoing").iterdir()) == []


def test_a_node_that_holds_the_dataset_reads_nothing_and_an_unused_delivery_goes(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=20)
    node = daemon_factory(cache_dir=tmp_path / "node1")
    with node.client() as client:
        assert client.post("/v1/datasets", json=body(src)).status_code == 202
        client.get("/v1/datasets/ds/wait", params={"timeout": TIMEOUT})
        read_before = metric(client, "stager_source_read_bytes_total")

    async def job() -> tuple[dict[str, Any], dict[str, Any]]:
        holder = Agent(node, "node1", body(src))
        probe = await holder.event("probe")
        await holder.tell(do="reserve", label="job2-ds", bytes=1_000_000)  # not needed
        await holder.event("reserved")
        await holder.tell(do="stage")
        return probe, await holder.finish()

    probe, done = asyncio.run(job())
    assert probe["state"] == "ready"
    assert done["how"] == "hit" and digest(Path(done["path"])) == digest(src)
    with node.client() as client:
        assert metric(client, "stager_source_read_bytes_total") == read_before
        assert metric(client, "stager_arrivals_total", how="hit") == 1
    assert list((node.cache_dir / "incoming").iterdir()) == []
