"""``stager-client stage --peers slurm``: stage on every node of the job, reading the
shared storage once.

Run once, in the batch script. SLURM is the orchestrator and the transport: the
per-node work runs as ``srun`` steps (`client._fanout_node`), the bytes move with
``sbcast``; there is no coordinator of ours and no listener. In order:

1. **Probe** every node: its cache key for the request and whether it holds the
   data (a cache hit).
2. **Pick the source node**: a node that holds it (this one if it does), else one
   chosen from the cache key and the sorted node list, so that different datasets
   start on different nodes.
3. **Move the data** to the nodes that lack it, with one step on exactly those
   nodes (sbcast has no node list; it reaches the nodes of a step):

   - *bundle*: the source node stages (or already holds) the dataset, packs the
     ready tree into one tar with a manifest (every path, size and sha256), and
     sbcasts both. Used whenever a node holds the data: the storage is not read.
   - *sources*: when every source of the request is a plain file (release
     archives), the source node sbcasts them as they are, read from the storage
     once, and every node (itself too) stages from its local copy. The staging
     then runs on all nodes at once instead of one after the other.

4. **Adopt**: each receiving daemon stages from what it received, through the same
   hardened extraction as any archive, checked against the manifest the source
   node computed, and deletes the delivery. A copy that is missing, truncated or
   different is rejected, and that node stages from the source itself.

The outcome is one line per node; the command fails (naming the node and the
step) only when some node has no data and nothing was left to try.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from client import _fanout_node as node_role
from client._client import AsyncStagerClient
from client._slurm import Broadcast, Job, Step, agent_argv, run_each, sbcast
from client.errors import FanoutError, StagerError
from stager.schemas import BUNDLE_NAME, MANIFEST_NAME, Adopt, delivered_name

# sbcast sends one 8 MB block at a time and waits for every node to have it. Up to
# FLAT_FANOUT receivers the sender sends to each directly; beyond, a tree.
BLOCK_BYTES = 8 << 20
FLAT_FANOUT = 8
# lz4 on the wire pays for data it shrinks; packed datasets are mostly JPEG/PNG and
# release archives are compressed already, so it is off unless the data says so.
LZ4_MIN_BYTES = 64 << 20
COMPRESSED_SUFFIXES = (".gz", ".tgz", ".zst", ".tzst", ".xz", ".txz", ".bz2", ".tbz2", ".zip")

Say = Callable[[str], None]


def source_node(key: str, nodes: Sequence[str], holders: Sequence[str], this_node: str) -> str:
    """Who reads the data for the others: a holder (this node first), else a node chosen
    by the key, so that different datasets of one job start on different nodes."""
    if this_node in holders:
        return this_node
    if holders:
        return sorted(holders)[0]
    ordered = sorted(nodes)
    return ordered[int(key[:15], 16) % len(ordered)]


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


@dataclass
class NodeResult:
    node: str
    how: str | None = None  # hit | staged | broadcast
    path: str | None = None
    seconds: float | None = None
    fallback: str | None = None  # why a broadcast copy was not used
    error: str | None = None

    def line(self) -> str:
        if self.error:
            return f"{self.node}: FAILED: {self.error}"
        what = {"hit": "cache hit", "staged": "staged from the source"}.get(
            self.how or "", "broadcast copy adopted"
        )
        took = f" in {self.seconds:.1f} s" if self.seconds is not None else ""
        note = f" (fallback: {self.fallback})" if self.fallback else ""
        return f"{self.node}: {what}{took}{note} -> {self.path}"


@dataclass
class Report:
    name: str
    key: str | None = None
    source: str | None = None
    mode: str = "none"  # bundle | sources | none (nothing to send)
    sent_bytes: int = 0
    broadcast: Broadcast | None = None
    seconds: float = 0.0
    nodes: dict[str, NodeResult] = field(default_factory=dict)

    @property
    def failed(self) -> list[NodeResult]:
        return [r for r in self.nodes.values() if r.error]

    def headline(self) -> str:
        nodes = len(self.nodes)
        text = f"{self.name!r} on {nodes} node{'s' * (nodes != 1)} in {self.seconds:.1f} s"
        if self.mode == "none":
            return text
        sent = f"{self.sent_bytes / 1e6:.1f} MB"
        how = f" ({' '.join(self.broadcast.flags())})" if self.broadcast else ""
        what = "the prepared tree" if self.mode == "bundle" else "the source files"
        return f"{text}: {self.source} sent {what} ({sent}) with sbcast{how}"

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "source": self.source,
            "mode": self.mode,
            "sent_bytes": self.sent_bytes,
            "compress": self.broadcast.compress if self.broadcast else None,
            "fanout": self.broadcast.fanout if self.broadcast else None,
            "seconds": round(self.seconds, 3),
            "nodes": {n: vars(r) for n, r in sorted(self.nodes.items())},
        }


class Fanout:
    def __init__(
        self,
        job: Job,
        client: AsyncStagerClient,
        body: Mapping[str, Any],
        timeout: float | None,
        say: Say,
    ) -> None:
        self.job = job
        self.client = client
        self.body = dict(body)
        self.timeout = timeout
        self.say = say
        self.report = Report(name=str(body["name"]))
        self._request = json.dumps(self.body)
        self._background: set[asyncio.Task[Any]] = set()

    # ---- the run -----------------------------------------------------------------------

    async def run(self) -> Report:
        started = time.monotonic()
        try:
            await self._run()
            if self._background:
                await asyncio.gather(*self._background, return_exceptions=True)
        finally:
            self.report.seconds = time.monotonic() - started
        return self.report

    async def _run(self) -> None:
        nodes = self.job.nodes
        if len(nodes) == 1:
            self._record(await self._stage_here(), "batch")
            return
        probes = await self._on_each(nodes, "probe")
        usable = []
        for node in nodes:
            if probes[node].get("error"):
                self._record({"node": node, "error": f"probe: {probes[node]['error']}"}, "probe")
            else:
                usable.append(node)
        keys = {probes[n]["key"] for n in usable}
        if len(keys) > 1:
            self.say(
                "the nodes compute different cache keys for this request ("
                + ", ".join(f"{n}: {probes[n]['key']}" for n in usable)
                + "): they see the sources differently, so each stages its own copy"
            )
            await self._stage_each(usable)
            return
        if not keys:
            return
        key = self.report.key = keys.pop()
        holders = [n for n in usable if probes[n].get("state") == "ready"]
        lacking = [n for n in usable if n not in holders]
        source = self.report.source = source_node(key, usable, holders, self.job.this_node)
        if not lacking:
            await self._stage_each(usable)
        elif not holders and probes[source].get("source_files"):
            self.report.mode = "sources"
            await self._send_sources(source, probes[source]["source_files"], lacking)
        else:
            self.report.mode = "bundle"
            await self._send_bundle(source, lacking, holders)

    # ---- helpers -----------------------------------------------------------------------

    def _argv(self, role: str, *extra: str) -> list[str]:
        args = ["--request", self._request, "--url", self.client.url]
        if self.timeout is not None:
            args += ["--timeout", str(self.timeout)]
        return agent_argv(role, *args, *extra)

    def _label(self) -> str:
        """Names the delivery folder on every receiver and the export on the sender."""
        return f"job{self.job.job_id}-{self.report.key}"

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
        )
        self.report.nodes[node] = result
        return result

    async def _stage_here(self) -> dict[str, Any]:
        return await node_role.stage(self.client, self.job.this_node, self.body, self.timeout)

    async def _on(self, node: str, role: str, *extra: str) -> dict[str, Any]:
        """``role`` on one node: in-process on this one, else a one-task srun step."""
        if node == self.job.this_node:
            return await node_role.here(role, self.client, self.job, self.body, self.timeout, extra)
        events = await run_each(self.job, [node], role, self._argv(role, *extra))
        return events.get(node) or _silent(node, role)

    async def _on_each(self, nodes: Sequence[str], role: str) -> dict[str, dict[str, Any]]:
        """``role`` on each node: in-process on this one, one srun step for the others."""
        others = [n for n in nodes if n != self.job.this_node]
        tasks = [run_each(self.job, others, role, self._argv(role))] if others else []
        if self.job.this_node in nodes:
            tasks.append(self._on_here(role))
        found: dict[str, dict[str, Any]] = {}
        for events in await asyncio.gather(*tasks):
            found.update(events)
        return {node: found.get(node) or _silent(node, role) for node in nodes}

    async def _on_here(self, role: str) -> dict[str, dict[str, Any]]:
        return {self.job.this_node: await self._on(self.job.this_node, role)}

    async def _stage_each(self, nodes: Sequence[str]) -> None:
        for event in (await self._on_each(nodes, "stage")).values():
            self._record(event, "stage step")

    async def _receivers(self, nodes: Sequence[str]) -> Receivers:
        step = Step(self.job, nodes, "receive")
        await step.start(self._argv("receive", "--label", self._label()), stdin=True)
        return Receivers(step)

    async def _finish(self, recv: Receivers) -> None:
        for event in await recv.done():
            self._record(event, recv.step.label())

    def _later(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- bundle: stage on one node, pack, broadcast the prepared tree -----------------

    async def _send_bundle(self, source: str, lacking: list[str], holders: list[str]) -> None:
        receivers = [n for n in lacking if n != source]
        # Holders other than the source take their cache hit meanwhile, and the
        # receivers' step starts while the source stages: both off the critical path.
        others = [n for n in holders if n != source]
        if others:
            self._later(self._stage_each(others))
        recv_start = asyncio.create_task(self._receivers(receivers))
        staged = self._record(await self._on(source, "stage"), f"staging on {source}")
        recv = await recv_start
        try:
            if staged.error:
                reason = f"the source node failed: {staged.error}"
                await recv.tell({"do": "stage", "reason": reason})
            else:
                await self._bundle_to(recv, source)
            await self._finish(recv)
        finally:
            await recv.close()

    async def _bundle_to(self, recv: Receivers, source: str) -> None:
        label = self._label()
        exported = await self._on(source, "export", "--label", label)
        if exported.get("error"):
            reason = f"packing on {source} failed ({exported['error']})"
            await recv.tell({"do": "stage", "reason": reason})
            return
        self._later(self._on(source, "drop-export", "--label", str(exported["id"])))
        nbytes = int(exported["bundle_bytes"])
        dest = await recv.reserve(nbytes)
        if isinstance(dest, FanoutError):
            await recv.tell({"do": "stage", "reason": dest.message})
            return
        how = self.report.broadcast = broadcast_for(len(recv.step.nodes), nbytes, False)
        try:
            for path, name in (
                (exported["manifest"], MANIFEST_NAME),
                (exported["bundle"], BUNDLE_NAME),
            ):
                await sbcast(self.job, source, recv.step_id, path, f"{dest}/{name}", how)
        except StagerError as exc:
            # Some nodes may hold a whole copy all the same: each receiver checks its own.
            self.say(
                f"the broadcast from {source} failed ({exc.message}); receivers check their copy"
            )
        self.report.sent_bytes = nbytes
        adopt = Adopt(
            incoming=label,
            origin_node=source,
            origin_key=str(exported["key"]),
            job=self.job.job_id,
            manifest_sha256=exported["manifest_sha256"],
        )
        await recv.tell({"do": "adopt", "adopt": adopt.model_dump()})

    # ---- sources: broadcast the release files, every node stages from its copy -------

    async def _send_sources(
        self, source: str, source_files: list[dict[str, Any]], lacking: list[str]
    ) -> None:
        files = {str(f["path"]): int(f["size"]) for f in source_files}
        recv = await self._receivers(lacking)
        try:
            dest = await recv.reserve(sum(files.values()))
            if isinstance(dest, FanoutError):
                await recv.tell({"do": "stage", "reason": dest.message})
            else:
                await self._sources_to(recv, source, files, dest)
            await self._finish(recv)
        finally:
            await recv.close()

    async def _sources_to(
        self, recv: Receivers, source: str, files: dict[str, int], dest: str
    ) -> None:
        try:
            for path, size in files.items():
                how = broadcast_for(len(recv.step.nodes), size, not compressed_name(path))
                self.report.broadcast = how
                target = f"{dest}/{delivered_name(path)}"
                await sbcast(self.job, source, recv.step_id, path, target, how)
                self.report.sent_bytes += size
        except StagerError as exc:
            await recv.tell({"do": "stage", "reason": f"the broadcast failed ({exc.message})"})
            return
        # The source node's copy is the reference the others are checked against.
        hashed = await recv.ask(source, {"do": "hash", "to": [source], "files": list(files)})
        if hashed.get("error"):
            await recv.tell({"do": "stage", "reason": f"{source}: {hashed['error']}"})
            return
        adopt = Adopt(
            incoming=self._label(),
            origin_node=source,
            origin_key=str(self.report.key),
            job=self.job.job_id,
            sources={path: tuple(entry) for path, entry in hashed["files"].items()},
        )
        await recv.tell({"do": "adopt", "adopt": adopt.model_dump()})


def _silent(node: str, role: str) -> dict[str, Any]:
    return {
        "node": node,
        "event": role,
        "error": f"its {role} task ended without reporting (srun failed, or stager-client "
        "could not run there); see the job's log",
    }


class Receivers:
    """The step on the nodes that lack the data, and the conversation with its tasks."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self._events = step.events()
        self._early: list[dict[str, Any]] = []  # events read while looking for others
        self.step_id = ""

    async def _collect(self, kind: str, nodes: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The next ``kind`` event from each of ``nodes`` (fewer if the step ends)."""
        found = {}
        for event in [e for e in self._early if e.get("event") == kind and e["node"] in nodes]:
            self._early.remove(event)
            found[event["node"]] = event
        while len(found) < len(nodes):
            try:
                event = await anext(self._events)
            except StopAsyncIteration:
                break
            if event.get("event") == kind and event["node"] in nodes:
                found[event["node"]] = event
            else:
                self._early.append(event)
        return found

    async def _started(self) -> None:
        if self.step_id:
            return
        found = await self._collect("ready", self.step.nodes)
        missing = [n for n in self.step.nodes if n not in found]
        if missing or self.step.step_id is None:
            raise FanoutError(
                f"{self.step.label()} did not start on {', '.join(missing) or 'every node'} "
                f"({self.step.stderr_tail()}); check those nodes with sinfo"
            )
        self.step_id = self.step.step_id

    async def tell(self, message: dict[str, Any]) -> None:
        await self._started()
        await self.step.write(message)

    async def reserve(self, nbytes: int) -> str | FanoutError:
        """Room on every receiver: the one folder sbcast writes into, or why not."""
        await self.tell({"do": "reserve", "bytes": nbytes})
        found = await self._collect("reserved", self.step.nodes)
        errors = [f"{n}: {e['error']}" for n, e in sorted(found.items()) if e.get("error")]
        if errors or len(found) < len(self.step.nodes):
            return FanoutError(
                "not every receiving node could make room for the broadcast copy ("
                + ("; ".join(errors) or self.step.stderr_tail())
                + "), so the receivers stage from the source"
            )
        paths = {e["path"] for e in found.values()}
        if len(paths) > 1:
            return FanoutError(
                f"the receiving nodes' cache folders differ ({', '.join(sorted(paths))}); sbcast "
                "writes one path on every node, so run the daemons with the same --cache-dir"
            )
        return paths.pop()

    async def ask(self, node: str, message: dict[str, Any]) -> dict[str, Any]:
        await self.tell(message)
        found = await self._collect("hashed", [node])
        return found.get(node) or {"error": f"no answer ({self.step.stderr_tail()})"}

    async def done(self) -> list[dict[str, Any]]:
        """Every receiver's outcome; stdin closes, so a task not yet told gives up."""
        self.step.close_stdin()
        found = await self._collect("done", self.step.nodes)
        await self.step.wait()
        for node in self.step.nodes:
            found.setdefault(
                node,
                {
                    "node": node,
                    "event": "done",
                    "error": f"its task ended without a report ({self.step.stderr_tail()})",
                },
            )
        return list(found.values())

    async def close(self) -> None:
        await self.step.kill()


async def fan_out(
    body: Mapping[str, Any], *, url: str | None, timeout: float | None, say: Say
) -> Report:
    job = await Job.detect()
    async with AsyncStagerClient(url) as client:
        return await Fanout(job, client, body, timeout, say).run()
