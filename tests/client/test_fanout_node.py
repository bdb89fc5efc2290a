"""The per-node agent of a fan-out (``stager-client _node``, client/fanout/agent.py)
against two real daemons over real sockets, standing for two nodes of a job: the
small-size, SLURM-free version of the 4-node cluster tests (tests/deploy/
test_multinode.py, ``-m multinode``). The test plays the driver: it sends each agent
the messages the driver would, and a file copy stands for sbcast.

What it shows: a node that already holds the dataset takes it from its cache and
reads nothing; a receiving node adopts the sender's copy, sent in parts that it
extracts as they come, under the same key without reading the source; a copy that
does not match the manifest, a part that never lands, and a driver that goes away
between parts each make that node stage from the source itself, never ready with
wrong content; and a delivery never outlives the agent.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from client._client import AsyncStagerClient
from client.errors import FanoutError
from client.fanout.agent import Node
from client.fanout.slurm import Broadcast
from tests.daemon import Daemon
from tests.httpserver import Behaviour, serve_files
from tests.stager.test_cache import metric
from tests.trees import digest, write_tree

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

TIMEOUT = 60


class Agent:
    """One node's agent, run in this process, fed messages as the driver would."""

    def __init__(
        self, daemon: Daemon, node: str, body: dict[str, Any], send_file: Any = None
    ) -> None:
        self.daemon, self.node = daemon, node
        self.events: list[dict[str, Any]] = []
        self._messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._client = AsyncStagerClient(daemon.url)
        node_ = Node(self._client, node, body, TIMEOUT, self.events.append, send_file)
        self._task = asyncio.create_task(node_.run(self._read(), "1.0"))

    async def _read(self) -> AsyncIterator[dict[str, Any]]:
        while (message := await self._messages.get()) is not None:
            yield message

    async def tell(self, **message: Any) -> None:
        self._messages.put_nowait(message)

    async def event(self, kind: str, nth: int = 1) -> dict[str, Any]:
        """Its ``nth`` ``kind`` event, once there is one."""
        for _ in range(TIMEOUT * 20):
            found = [e for e in self.events if e["event"] == kind]
            if len(found) >= nth:
                return found[nth - 1]
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.node} never said {kind!r} {nth} times: {self.events}")

    async def finish(self) -> dict[str, Any]:
        """Close its input (the driver is done): its ``done`` event."""
        self._messages.put_nowait(None)
        await asyncio.wait_for(self._task, TIMEOUT)
        await self._client.aclose()
        return await self.event("done")


def body(src: Path) -> dict[str, Any]:
    return {"name": "ds", "steps": [{"op": "copy", "src": str(src)}]}


def copy_file(damage: Callable[[Path], None] | None = None, lost: int | None = None):  # noqa: ANN201
    """sbcast's part, for a sender agent: a file copy to the same path (the receiver's
    folder); ``damage`` applied to the copy of the middle part, part ``lost`` never
    lands (sbcast says it failed)."""
    sent: list[str] = []

    async def send_file(path: str, dest: str, step: str, how: Broadcast) -> None:
        assert step == "1.1" and how == Broadcast(False, 1)
        sent.append(dest)
        if lost is not None and dest.endswith(f"part-{lost:05d}.tar"):
            raise FanoutError(f"sbcast of {path} failed (node2: No space left on device)")
        await asyncio.to_thread(shutil.copyfile, path, dest)
        if damage is not None and dest.endswith("part-00002.tar"):
            damage(Path(dest))

    return send_file


async def send(sender: Agent, receiver: Agent, stop_after: int | None = None) -> int:
    """The driver's part of one broadcast (client/fanout/coordinator.py's _bundle_to): pack part
    0 on the sender, reserve on the receiver, adopt there, have the sender send the
    parts, announce each to the receiver as it lands, then the end. ``stop_after``:
    the driver goes away after announcing that many parts. Returns the part count."""
    await sender.tell(do="export", label="job1-ds", part_bytes=1 << 16)
    exported = await sender.event("exported")
    assert "error" not in exported, exported
    parts = exported["parts"]
    assert parts >= 4, exported  # several parts: order and overlap are exercised
    await receiver.tell(do="reserve", label="job1-ds", bytes=exported["total_bytes"])
    folder = (await receiver.event("reserved"))["path"]
    adopt = {
        "incoming": "job1-ds",
        "origin_node": sender.node,
        "origin_key": exported["key"],
        "job": "1",
        "bundle_bytes": exported["data_bytes"],
    }
    await receiver.tell(do="adopt", adopt=adopt)
    await sender.tell(do="send", label="job1-ds", dest=folder, step="1.1", compress=False,
                      fanout=1)  # fmt: skip
    for index in range(parts + 1):
        sent = await sender.event("sent", index + 1)
        assert sent.get("index") == index and not sent.get("error"), sent
        if index == parts:
            await receiver.tell(do="end", parts=parts, manifest_sha256=sent["manifest_sha256"])
        elif stop_after is not None and index == stop_after:
            break
        else:
            await receiver.tell(do="part", index=index)
    await sender.tell(do="drop-export", label="job1-ds")
    return parts


def flip_a_byte(part: Path) -> None:
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside some file's data
    part.write_bytes(bytes(data))


CASES = {  # how the broadcast goes: the sender's transport, and where the driver stops
    "copy": ({}, None),
    "damaged-part": ({"damage": flip_a_byte}, None),
    "lost-part": ({"lost": 1}, None),
    "driver-gone": ({}, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_node_adopts_the_broadcast_copy_or_stages_from_the_source(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, case: str
) -> None:
    src = write_tree(tmp_path / "src", n_files=40)
    node1 = daemon_factory(cache_dir=tmp_path / "node1")
    node2 = daemon_factory(cache_dir=tmp_path / "node2")
    transport, stop_after = CASES[case]

    async def job() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        sender = Agent(node1, "node1", body(src), copy_file(**transport))
        receiver = Agent(node2, "node2", body(src))
        probes = [await sender.event("probe"), await receiver.event("probe")]
        await sender.tell(do="stage", to=["node1"])
        await sender.event("staged")
        await send(sender, receiver, stop_after)
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
        if case != "copy":
            assert received["how"] == "staged"
            assert "node1" in received["fallback"] and "rejected" in received["fallback"]
            if case == "driver-gone":
                assert "driver ended" in received["fallback"], received
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


async def send_while_staging(sender: Agent, receiver: Agent) -> int:
    """The driver's part when the sender stages from the source (client/fanout/coordinator.py's
    _send_early, then _bundle_to): the sender stages in the background and sends the
    files it finished as it goes; the receiver reserves for its estimate and adopts at
    once; once ready, the parts the early ones did not carry, then the end. Returns how
    many parts went before the staging ended."""
    await sender.tell(do="stage")
    await sender.tell(do="early", label="job3-ds", part_bytes=1 << 16)
    first = await sender.event("early")
    assert "error" not in first, first
    await receiver.tell(do="reserve", label="job3-ds", bytes=first["total_bytes"])
    folder = (await receiver.event("reserved"))["path"]
    adopt = {"incoming": "job3-ds", "origin_node": sender.node, "origin_key": first["key"],
             "job": "3", "bundle_bytes": first["data_bytes"]}  # fmt: skip
    await receiver.tell(do="adopt", adopt=adopt)
    how = {"dest": folder, "step": "1.1", "compress": False, "fanout": 1}
    await sender.tell(do="send-early", label="job3-ds", **how)
    before_ready = 0
    for nth in range(1, 10_000):
        sent = await sender.event("sent", nth)
        if sent.get("early_done"):
            early_parts = sent["parts"]
            break
        await receiver.tell(do="part", index=sent["index"])
        if not [e for e in sender.events if e["event"] == "staged"]:
            before_ready += 1
    staged = await sender.event("staged")
    assert "error" not in staged, staged
    await sender.tell(do="export", label="job3-ds", part=early_parts)
    exported = await sender.event("exported")
    assert exported["part"] == early_parts and "error" not in exported, exported
    await sender.tell(do="send", label="job3-ds", **how)
    for index in range(early_parts, exported["parts"] + 1):
        sent = await sender.event("sent", nth + 1 + index - early_parts)
        assert sent.get("index") == index and not sent.get("error"), sent
        if index < exported["parts"]:
            await receiver.tell(do="part", index=index)
    await receiver.tell(do="end", parts=exported["parts"], manifest_sha256=sent["manifest_sha256"])
    await sender.tell(do="drop-export", label="job3-ds")
    return before_ready


async def early_job(
    node1: Daemon, node2: Daemon, request: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """``request`` on node1 (the source) and node2, parts sent while node1 stages: each
    agent's ``done`` event, and how many parts went before node1's staging was ready."""
    sender = Agent(node1, "node1", request, copy_file())
    receiver = Agent(node2, "node2", request)
    await sender.event("probe"), await receiver.event("probe")
    before_ready = await send_while_staging(sender, receiver)
    return await sender.finish(), await receiver.finish(), before_ready


def test_parts_go_out_while_the_source_node_stages_and_the_receiver_gets_the_ready_tree(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """The source node's staging copies a tree, then downloads a file slowly, then
    renames a folder it copied: the copied files go out while the download runs, the
    renamed ones again at the end, and the receiver ends with the ready tree."""
    src = write_tree(tmp_path / "src", n_files=60, max_size=40_000)
    slow = Behaviour(files={"/late.bin": os.urandom(400_000)}, bytes_per_s=200_000)
    node1 = daemon_factory(cache_dir=tmp_path / "node1")
    node2 = daemon_factory(cache_dir=tmp_path / "node2")

    with serve_files(slow) as url:
        request = {"name": "ds", "steps": [
            {"op": "copy", "src": str(src), "dst": "train"},
            {"op": "fetch", "url": f"{url}/late.bin", "dst": "late.bin"},
            {"op": "rename", "src": "train/class_0", "dst": "train/first"},
        ]}  # fmt: skip
        sent, received, before_ready = asyncio.run(early_job(node1, node2, request))
    assert before_ready >= 2, "the copied files should go out during the download"
    assert sent["how"] == "staged" and received.get("error") is None, received
    why = received.get("fallback")
    assert received["how"] == "broadcast" and received["key"] == sent["key"], why
    adopted, ready = Path(received["path"]), Path(sent["path"])
    assert digest(adopted) == digest(ready)
    assert (adopted / "train" / "first").is_dir() and not (adopted / "train" / "class_0").exists()
    with node2.client() as other:
        assert metric(other, "stager_source_read_bytes_total") == 0
    assert list((node2.cache_dir / "incoming").iterdir()) == []
    assert list((node1.cache_dir / "outgoing").iterdir()) == []


def test_a_single_download_goes_out_in_ranges_while_it_downloads(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A dataset of one large file fetched over HTTP (its ``.part`` renamed when
    complete): its bytes go out in byte ranges while it downloads, the receiver
    assembles them, and only its end goes after the staging."""
    data = os.urandom(1_200_000)
    slow = Behaviour(files={"/train.tar": data}, bytes_per_s=400_000)
    node1 = daemon_factory(cache_dir=tmp_path / "node1")
    node2 = daemon_factory(cache_dir=tmp_path / "node2")

    with serve_files(slow) as url:
        request = {"name": "one", "steps": [{"op": "fetch", "url": f"{url}/train.tar",
                                             "dst": "train.tar"}]}  # fmt: skip
        sent, received, before_ready = asyncio.run(early_job(node1, node2, request))
    assert before_ready >= 3, "the download's bytes should go out while it downloads"
    why = received.get("fallback")
    assert received["how"] == "broadcast" and received["key"] == sent["key"], why
    assert (Path(received["path"]) / "train.tar").read_bytes() == data
    assert not (Path(received["path"]) / "train.tar.part").exists()
    with node2.client() as other:
        assert metric(other, "stager_source_read_bytes_total") == 0


def test_receivers_give_up_a_failed_source_and_take_the_data_from_a_new_one(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """The source node's daemon dies mid-broadcast: told ``resource``, each receiver
    gives up the adoption without reading the source itself, and the fan-out goes on
    from one of them (client/fanout/coordinator.py's _reelect): one more read of the
    source in all, not one per receiver."""
    src = write_tree(tmp_path / "src", n_files=40)
    nodes = [daemon_factory(cache_dir=tmp_path / f"node{i}") for i in (1, 2, 3)]

    async def adopt(agent: Agent, label: str, exported: dict[str, Any]) -> str:
        await agent.tell(do="reserve", label=label, bytes=exported["total_bytes"])
        folder = (await agent.event("reserved", nth=2 if label.endswith("r1") else 1))["path"]
        await agent.tell(do="adopt", adopt={"incoming": label, "origin_node": "x",
                         "origin_key": exported["key"], "job": "1",
                         "bundle_bytes": exported["data_bytes"]})  # fmt: skip
        return folder

    async def job() -> list[dict[str, Any]]:
        first, second, third = (Agent(n, f"node{i}", body(src), copy_file())
                                for i, n in enumerate(nodes, start=1))  # fmt: skip
        await first.tell(do="stage")
        await first.event("staged")
        await first.tell(do="export", label="job1-ds", part_bytes=1 << 16)
        exported = await first.event("exported")
        folders = [await adopt(agent, "job1-ds", exported) for agent in (second, third)]
        shutil.copyfile(exported["path"], Path(folders[0]) / "part-00000.tar")
        await second.tell(do="part", index=0)
        nodes[0].kill()  # the source node's daemon dies between parts
        for agent in (second, third):
            await agent.tell(do="resource", reason="the source node node1 failed")
            await agent.event("resourced")
        # node2 takes over: it stages from the source, node3 adopts its copy.
        await second.tell(do="stage")
        await second.event("staged")
        await second.tell(do="export", label="job1-ds-r1", part_bytes=1 << 16)
        exported = await second.event("exported")
        folder = await adopt(third, "job1-ds-r1", exported)
        await second.tell(do="send", label="job1-ds-r1", dest=folder, step="1.1",
                          compress=False, fanout=1)  # fmt: skip
        for index in range(exported["parts"] + 1):
            sent = await second.event("sent", index + 1)
            if index == exported["parts"]:
                await third.tell(do="end", parts=index, manifest_sha256=sent["manifest_sha256"])
            else:
                await third.tell(do="part", index=index)
        return [await agent.finish() for agent in (first, second, third)]

    _, staged, adopted = asyncio.run(job())
    assert staged.get("error") is None and staged["how"] == "staged", staged
    assert adopted.get("error") is None and adopted["how"] == "broadcast", adopted
    assert adopted["fallback"] is None
    assert digest(Path(adopted["path"])) == digest(src)
    with nodes[2].client() as third:
        assert metric(third, "stager_source_read_bytes_total") == 0  # never read the source
    assert list((nodes[2].cache_dir / "incoming").iterdir()) == []


def image_body(archive: Path) -> dict[str, Any]:
    return {"name": "ds", "steps": [{"op": "extract", "src": str(archive)}], "image": True}


async def send_image(sender: Agent, receiver: Agent) -> dict[str, Any]:
    """The driver's part for an image dataset (client/fanout/coordinator.py's _image_to):
    the sender exports its image as one file, the receiver reserves room for it, the
    sender sends it, and then the receiver adopts it. The export's answer."""
    await sender.tell(do="export", label="job5-ds")
    exported = await sender.event("exported")
    assert "error" not in exported and exported["image"] is not None, exported
    assert exported["parts"] == 1 and exported["manifest"] is None
    await receiver.tell(do="reserve", label="job5-ds", bytes=exported["bytes"])
    folder = (await receiver.event("reserved"))["path"]
    await sender.tell(do="send", label="job5-ds", dest=folder, step="1.1", compress=False,
                      fanout=1)  # fmt: skip
    sent = await sender.event("sent")
    assert sent["index"] == 0 and sent["bytes"] == exported["bytes"] and not sent.get("error")
    adopt = {"incoming": "job5-ds", "origin_node": sender.node, "origin_key": exported["key"],
             "job": "5", "image": exported["image"]}  # fmt: skip
    await receiver.tell(do="adopt", adopt=adopt)
    await sender.tell(do="drop-export", label="job5-ds")
    return exported


@pytest.mark.skipif(os.geteuid() != 0, reason="kernel mounts need root")
@pytest.mark.parametrize("case", ["copy", "damaged"])
def test_an_image_dataset_goes_as_one_file_and_a_damaged_one_is_staged_from_the_source(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, case: str
) -> None:
    from stager.image import mount as image_mount
    from stager.wire.schemas import IMAGE_DELIVERY_NAME
    from tests.daemon import unmount_under
    from tests.trees import make_tar

    src = write_tree(tmp_path / "src", n_files=30)
    archive = make_tar(src, tmp_path / "src.tar.gz")
    node1 = daemon_factory(cache_dir=tmp_path / "node1")
    node2 = daemon_factory(cache_dir=tmp_path / "node2")
    sent_to: list[str] = []

    async def send_file(path: str, dest: str, step: str, how: Broadcast) -> None:
        sent_to.append(dest)
        await copy_file()(path, dest, step, how)
        if case == "damaged":
            flip_a_byte(Path(dest))

    async def job() -> tuple[dict[str, Any], dict[str, Any]]:
        sender = Agent(node1, "node1", image_body(archive), send_file)
        receiver = Agent(node2, "node2", image_body(archive))
        await sender.event("probe"), await receiver.event("probe")
        await sender.tell(do="stage", to=["node1"])
        assert "error" not in await sender.event("staged")
        await send_image(sender, receiver)
        return await sender.finish(), await receiver.finish()

    try:
        sent, received = asyncio.run(job())
        assert [Path(d).name for d in sent_to] == [IMAGE_DELIVERY_NAME]  # one file, one sbcast
        assert received.get("error") is None, received
        assert received["key"] == sent["key"]
        assert image_mount.mounted_at(received["path"]) is not None
        assert digest(Path(received["path"]) / "src") == digest(src)
        with node2.client() as other:
            read = metric(other, "stager_source_read_bytes_total")
        if case == "copy":
            assert received["how"] == "broadcast" and received["fallback"] is None
            assert read == 0
        else:
            assert received["how"] == "staged" and read > 0
            assert "node1" in received["fallback"] and IMAGE_DELIVERY_NAME in received["fallback"]
        assert list((node2.cache_dir / "incoming").iterdir()) == []
        assert list((node1.cache_dir / "outgoing").iterdir()) == []
    finally:
        node1.stop()
        node2.stop()
        unmount_under(tmp_path)
