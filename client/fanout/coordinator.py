"""`Fanout`: the coordinator of ``stage --peers slurm``, run once in the batch script.

It probes every node through the agents, picks the source node and the way the data
travels (`client.fanout.policy`), has the source node send it and the others adopt
it, and records how the data reached each node (`client.fanout.report`). The steps
are described in `client.fanout`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from client._client import AsyncStagerClient
from client.errors import FanoutError, StagerError
from client.fanout.agent import Node
from client.fanout.policy import (
    broadcast_for,
    compressed_name,
    goes_as_image,
    sends_sources,
    source_node,
)
from client.fanout.protocol import Agents
from client.fanout.report import NodeResult, Report
from client.fanout.slurm import (
    STEP_START_TIMEOUT_S,
    Broadcast,
    Job,
    Sink,
    Step,
    agent_argv,
    sbcast,
    sink_argv,
)
from stager.wire.schemas import Adopt, ImageSent, delivered_name

Say = Callable[[str], None]


class SourceLost(FanoutError):
    """The source node's daemon went away while it staged (not the data at fault)."""


class Fanout:
    """One fan-out of one stage request over the job's nodes; `run` gives its `Report`."""

    def __init__(
        self,
        job: Job,
        client: AsyncStagerClient,
        body: Mapping[str, Any],
        timeout: float | None,
        say: Say,
        broadcast: str = "auto",
    ) -> None:
        self.job = job
        self.client = client
        self.body = dict(body)
        self.timeout = timeout
        self.say = say
        self.broadcast = broadcast  # auto | prepared | sources
        self.report = Report(name=str(body["name"]))
        self._started = time.monotonic()
        self._round = 0  # sources chosen anew after one failed
        self._image = False  # the source node stages an image dataset (its probe says)

    def _mark(self, phase: str) -> None:
        self.report.timeline[phase] = round(time.monotonic() - self._started, 3)

    # ---- the run -----------------------------------------------------------------------

    async def run(self) -> Report:
        self._started = time.monotonic()
        try:
            if len(self.job.nodes) == 1:
                await self._alone()
            else:
                await self._everywhere()
            self._mark("ready")
        finally:
            self.report.seconds = time.monotonic() - self._started
        return self.report

    async def _alone(self) -> None:
        """One node: a plain staging, in this process."""
        node = Node(self.client, self.job.this_node, self.body, self.timeout, lambda _: None)
        self._record(await node.stage(), "batch step")

    async def _everywhere(self) -> None:
        argv = ["--request", json.dumps(self.body), "--url", self.client.url]
        if self.timeout is not None:
            argv += ["--timeout", str(self.timeout)]
        step = Step(self.job, self.job.nodes, "node")
        agents = Agents(await step.start(agent_argv(*argv), stdin=True, kill_on_bad_exit=True))
        try:
            await asyncio.wait_for(agents.started(), STEP_START_TIMEOUT_S)
            probes = await agents.collect("probe", self.job.nodes)
            self._mark("probe")
            await self._plan(agents, probes)
            for event in await agents.done():
                self._record(event, agents.step.label())
        except TimeoutError:
            raise FanoutError(
                f"{agents.step.label()} did not start within {STEP_START_TIMEOUT_S:.0f} s "
                f"({agents.step.stderr_tail()}); check the nodes with sinfo"
            ) from None
        finally:
            await agents.close()

    async def _plan(self, agents: Agents, probes: dict[str, dict[str, Any]]) -> None:
        usable = []
        for node in self.job.nodes:
            error = probes.get(node, {}).get("error") or (node not in probes and "no answer")
            if error:
                self._record({"node": node, "error": f"probe: {error}"}, agents.step.label())
            else:
                usable.append(node)
        keys = {probes[n]["key"] for n in usable}
        if len(keys) > 1:
            self.say(
                "the nodes compute different cache keys for this request ("
                + ", ".join(f"{n}: {probes[n]['key']}" for n in usable)
                + "): they see the sources differently, so each stages its own copy"
            )
            await agents.tell({"do": "stage", "to": usable})
            return
        if not keys:
            return
        key = self.report.key = keys.pop()
        holders = [n for n in usable if probes[n].get("state") == "ready"]
        lacking = [n for n in usable if n not in holders]
        source = self.report.source = source_node(key, usable, holders, self.job.this_node)
        # The nodes agree on the key, and so on whether it is an image (the key says).
        self._image = goes_as_image(probes[source], self.body)
        if not lacking:
            await agents.tell({"do": "stage", "to": usable})
        elif sends_sources(self.broadcast, holders, probes[source].get("source_files", [])):
            self.report.mode = "sources"
            await self._send_sources(agents, source, probes[source]["source_files"], lacking)
        else:
            self.report.mode = "bundle"
            await self._send_bundle(agents, source, lacking, holders)

    # ---- helpers -----------------------------------------------------------------------

    def _sends_image(self) -> bool:
        """An image dataset goes as its image file, unless ``--broadcast prepared`` asks
        for its tree in parts (each receiver then builds its own image)."""
        return self._image and self.broadcast != "prepared"

    def _label(self) -> str:
        """Names the delivery folder on every receiver and the export on the sender (a
        new one for each source chosen anew)."""
        again = f"-r{self._round}" if self._round else ""
        return f"job{self.job.job_id}-{self.report.key}{again}"

    def _record(self, event: Mapping[str, Any], step: str) -> NodeResult:
        node = str(event["node"])
        error = event.get("error")
        result = NodeResult(
            node,
            how=event.get("how"),
            path=event.get("path"),
            seconds=event.get("seconds"),
            fallback=event.get("fallback"),
            error=f"{error} ({step})" if error else None,
            image=self.report.mode == "image" and event.get("how") == "broadcast",
        )
        self.report.nodes[node] = result
        return result

    async def _sink(self, nodes: Sequence[str]) -> Sink:
        step = await Step(self.job, nodes, "sink").start(sink_argv())
        return await Sink(step).started()

    async def _reserve(self, agents: Agents, nodes: Sequence[str], nbytes: int) -> str:
        """Room on every receiver: the one folder sbcast writes into (FanoutError if not)."""
        await agents.tell({"do": "reserve", "to": list(nodes), "label": self._label(),
                           "bytes": nbytes})  # fmt: skip
        found = await agents.collect("reserved", nodes)
        errors = [f"{n}: {e['error']}" for n, e in sorted(found.items()) if e.get("error")]
        if errors or len(found) < len(nodes):
            raise FanoutError(
                "not every receiving node could make room for the broadcast copy ("
                + ("; ".join(errors) or agents.step.stderr_tail())
                + "), so the receivers stage from the source"
            )
        paths = {e["path"] for e in found.values()}
        if len(paths) > 1:
            raise FanoutError(
                f"the receiving nodes' cache folders differ ({', '.join(sorted(paths))}); sbcast "
                "writes one path on every node, so run the daemons with the same --cache-dir"
            )
        self._mark("reserve")
        return paths.pop()

    # ---- bundle: stage on one node, pack, broadcast the prepared tree -----------------

    async def _send_bundle(
        self, agents: Agents, source: str, lacking: list[str], holders: list[str]
    ) -> None:
        receivers = [n for n in lacking if n != source]
        # Every holder takes its cache hit (the source too: it then packs its copy), and
        # the sink starts while the source stages: both off the critical path.
        await agents.tell({"do": "stage", "to": sorted({*holders, source})})
        sink_start = asyncio.create_task(self._sink(receivers))
        label = self._label()
        first: dict[str, Any] = {}
        if source not in holders and not self._sends_image():
            # An image dataset goes as its one image file, made at the end of the staging:
            # nothing to send while it stages.
            # It stages from the storage: what it finishes is sent while it goes on.
            await agents.tell({"do": "early", "to": [source], "label": label})
            first = (await agents.collect("early", [source])).get(source) or {}
        sink = await sink_start
        lost: SourceLost | None = None
        try:
            try:
                early = None
                if first and not first.get("error"):
                    early = await self._send_early(agents, sink, source, receivers, first)
                staged = (await agents.collect("staged", [source])).get(source, {})
                self._mark("stage")
                if staged.get("error") or not staged:
                    why = f"the source node {source} failed ({staged.get('error', 'no answer')})"
                    if staged.get("unreachable") and receivers:
                        raise SourceLost(why)
                    raise FanoutError(why)
                await self._bundle_to(agents, sink, source, receivers, early)
            except SourceLost as exc:
                lost = exc
            except FanoutError as exc:
                await agents.tell({"do": "stage", "to": receivers, "reason": exc.message})
            finally:
                await agents.tell({"do": "drop-export", "to": [source], "label": label})
        finally:
            await sink.close()
        if lost is not None:
            await self._reelect(agents, receivers, lost)

    async def _reelect(self, agents: Agents, receivers: list[str], lost: SourceLost) -> None:
        """The source node's daemon went away while it staged: the receivers give up its
        broadcast (none stages from the storage on its own), one of them becomes the
        source, and the fan-out goes on from it. A failed source costs one more read of
        the storage, not one per receiver."""
        await agents.tell({"do": "resource", "to": receivers, "reason": lost.message})
        alive = sorted((await agents.collect("resourced", receivers)).keys())
        if not alive:
            return
        self._round += 1
        source = source_node(str(self.report.key), alive, [], self.job.this_node)
        self.report.reelected.append(str(self.report.source))
        self.report.source = source
        self.say(f"{lost.message}; {source} takes over as the source")
        if len(alive) == 1:
            await agents.tell({"do": "stage", "to": alive})
        else:
            await self._send_bundle(agents, source, alive, [])

    async def _send_early(
        self, agents: Agents, sink: Sink, source: str, receivers: list[str], first: dict[str, Any]
    ) -> Early:
        """The parts the source node packs from the files its staging finished, sent as
        it goes (`stager.fanout.early`): the receivers reserve room for its estimate and
        start adopting at once, extracting each part as it lands."""
        nbytes = int(first["total_bytes"])
        early = Early(await self._reserve(agents, receivers, nbytes),
                      broadcast_for(len(receivers), nbytes, False))  # fmt: skip
        self.report.broadcast = early.how
        await self._adopt_from(agents, source, receivers, first)
        await agents.tell({"do": "send-early", "to": [source], "label": self._label(),
                           "dest": early.dest, "step": sink.step_id,
                           "compress": early.how.compress, "fanout": early.how.fanout})  # fmt: skip
        while True:
            sent = (await agents.collect("sent", [source])).get(source)
            if sent is None:
                raise FanoutError(f"{source}'s task ended while it sent early parts")
            if sent.get("early_done"):
                early.parts = self.report.early_parts = int(sent["parts"])
                self.report.early_bytes = self.report.sent_bytes
                self._mark("early")
                return early
            await self._part_sent(agents, source, receivers, sent)

    async def _adopt_from(
        self, agents: Agents, source: str, receivers: list[str], exported: dict[str, Any]
    ) -> None:
        """The receivers adopt what ``source`` exports (its first export answer): the
        prepared tree, shared by every user of a node service where the source's
        service vouches for its manifest."""
        adopt = Adopt(
            incoming=self._label(),
            origin_node=source,
            origin_key=str(exported["key"]),
            job=self.job.job_id,
            bundle_bytes=int(exported["data_bytes"]),
            vouched=bool(exported.get("vouched")),
        )
        await agents.tell({"do": "adopt", "to": receivers, "adopt": adopt.model_dump()})

    async def _part_sent(
        self, agents: Agents, source: str, receivers: list[str], sent: dict[str, Any]
    ) -> None:
        """A part's sbcast ended: the receivers learn it is there (each checks its own)."""
        if sent.get("failed"):
            # Some nodes may hold that part all the same: each receiver checks its own.
            self.say(f"an sbcast from {source} failed ({sent['failed']}); receivers check")
        self.report.sent_bytes += int(sent["bytes"])
        await agents.tell({"do": "part", "to": receivers, "index": int(sent["index"])})

    async def _bundle_to(
        self, agents: Agents, sink: Sink, source: str, receivers: list[str], early: Early | None
    ) -> None:
        """The prepared tree in parts (after the early ones, what they did not carry),
        pipelined: the source node packs part i+1 while it sbcasts part i, and the
        receivers' daemons extract part i-1 meanwhile."""
        label = self._label()
        first_part = early.parts if early is not None else 0
        await agents.tell({"do": "export", "to": [source], "label": label, "part": first_part,
                           "tree": self.broadcast == "prepared"})  # fmt: skip
        exported = (await agents.collect("exported", [source])).get(source, {})
        self._mark("export")
        if exported.get("error") or not exported:
            raise FanoutError(f"packing on {source} failed ({exported.get('error', 'no answer')})")
        if exported.get("image"):
            await self._image_to(agents, sink, source, receivers, exported)
            return
        if early is None:
            nbytes = int(exported["total_bytes"])
            early = Early(await self._reserve(agents, receivers, nbytes),
                          broadcast_for(len(receivers), nbytes, False))  # fmt: skip
            self.report.broadcast = early.how
            await self._adopt_from(agents, source, receivers, exported)
        end = await self._send_parts(agents, sink, source, label, early, exported)
        await agents.tell({"do": "end", "to": receivers, **end})
        self._mark("sbcast")

    async def _image_to(
        self,
        agents: Agents,
        sink: Sink,
        source: str,
        receivers: list[str],
        exported: dict[str, Any],
    ) -> None:
        """An image dataset, as one file: the source node sbcasts its copy of the image
        (its service hashed it as it copied it), then the receivers adopt it, each
        checking its copy's size and sha256 against that service's (never mounting one
        that differs). Without compression: an image of JPEGs does not compress."""
        self.report.mode = "image"
        nbytes = int(exported["bytes"])
        how = self.report.broadcast = broadcast_for(len(receivers), nbytes, False)
        dest = await self._reserve(agents, receivers, nbytes)
        await agents.tell({"do": "send", "to": [source], "label": self._label(), "dest": dest,
                           "step": sink.step_id, "compress": how.compress,
                           "fanout": how.fanout})  # fmt: skip
        sent = (await agents.collect("sent", [source])).get(source)
        if sent is None or sent.get("error"):
            why = sent.get("error") if sent else f"{source}'s task ended"
            raise FanoutError(f"the broadcast of the image from {source} stopped ({why})")
        if sent.get("failed"):  # some nodes may hold it all the same: each checks its own
            self.say(f"the sbcast of the image from {source} failed ({sent['failed']}); "
                     "receivers check")  # fmt: skip
        self.report.sent_bytes += nbytes
        self._mark("sbcast")
        image = ImageSent.model_validate(exported["image"])
        adopt = Adopt(incoming=self._label(), origin_node=source, origin_key=str(exported["key"]),
                      job=self.job.job_id, image=image,
                      vouched=image.credential is not None)  # fmt: skip
        await agents.tell({"do": "adopt", "to": receivers, "adopt": adopt.model_dump()})

    async def _send_parts(
        self,
        agents: Agents,
        sink: Sink,
        source: str,
        label: str,
        early: Early,
        exported: dict[str, Any],
    ) -> dict[str, Any]:
        """Have the source node sbcast every part from ``exported`` on and then the
        manifest, and tell the receivers each part that landed; what the end must say
        (the count and the manifest's sha256, or why the broadcast stopped)."""
        parts = int(exported["parts"])
        await agents.tell({"do": "send", "to": [source], "label": label, "dest": early.dest,
                           "step": sink.step_id, "compress": early.how.compress,
                           "fanout": early.how.fanout})  # fmt: skip
        receivers = list(sink.step.nodes)
        for index in range(int(exported["part"]), parts + 1):  # the parts, then the manifest
            sent = (await agents.collect("sent", [source])).get(source)
            if sent is None or sent.get("error"):
                why = sent.get("error") if sent else f"{source}'s task ended"
                return {"abort": f"the broadcast from {source} stopped ({why})"}
            if index < parts:
                await self._part_sent(agents, source, receivers, sent)
            elif sent.get("failed"):
                self.say(f"an sbcast from {source} failed ({sent['failed']}); receivers check")
        end = {"parts": parts, "manifest_sha256": sent["manifest_sha256"]}
        if sent.get("manifest_credential"):  # the source's service vouches (stager.core.vouch)
            end["credential"] = sent["manifest_credential"]
        return end

    # ---- sources: broadcast the release files, every node stages from its copy -------

    async def _send_sources(
        self, agents: Agents, source: str, source_files: list[dict[str, Any]], lacking: list[str]
    ) -> None:
        files = {str(f["path"]): int(f["size"]) for f in source_files}
        sink = await self._sink(lacking)
        try:
            dest = await self._reserve(agents, lacking, sum(files.values()))
            for path, size in files.items():
                how = broadcast_for(len(lacking), size, not compressed_name(path))
                self.report.broadcast = how
                target = f"{dest}/{delivered_name(path)}"
                await sbcast(self.job, source, sink.step_id, path, target, how)
                self.report.sent_bytes += size
            self._mark("sbcast")
        except StagerError as exc:
            reason = f"the broadcast of the source files failed ({exc.message})"
            await agents.tell({"do": "stage", "to": lacking, "reason": reason})
            return
        finally:
            await sink.close()
        # The source node's copy is the reference the others are checked against.
        await agents.tell({"do": "hash", "to": [source], "files": list(files)})
        hashed = (await agents.collect("hashed", [source])).get(source, {})
        self._mark("hash")
        if hashed.get("error") or not hashed:
            reason = f"{source}: {hashed.get('error', 'no answer')}"
            await agents.tell({"do": "stage", "to": lacking, "reason": reason})
            return
        adopt = Adopt(
            incoming=self._label(),
            origin_node=source,
            origin_key=str(self.report.key),
            job=self.job.job_id,
            sources={path: tuple(entry) for path, entry in hashed["files"].items()},
        )
        await agents.tell({"do": "adopt", "to": lacking, "adopt": adopt.model_dump()})


@dataclass
class Early:
    """Where the parts go (the receivers' delivery folder, how sbcast sends them), and
    how many early parts went before the ready tree's."""

    dest: str
    how: Broadcast
    parts: int = 0
