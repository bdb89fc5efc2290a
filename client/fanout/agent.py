"""The per-node agent of a fan-out: ``stager-client _node --request JSON``.

The coordinator (`client.fanout.coordinator`) starts one on every node of the job,
in one ``srun`` step. `Node` talks to its own node's daemon over the local socket
(the public client for staging, `FanoutCalls` for probe, export and the incoming
room) and to the coordinator in JSON lines: the instructions and what it answers to
each are listed in `client.fanout.protocol`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from client._client import AsyncStagerClient
from client.errors import DaemonUnavailable, StagerError, StagingFailed
from client.fanout.calls import FanoutCalls
from client.fanout.protocol import Emit, emit_stdout, stdin_messages
from client.fanout.slurm import Broadcast, Job, sbcast
from stager.wire.manifest_format import file_digest
from stager.wire.schemas import (
    END_NAME,
    IMAGE_DELIVERY_NAME,
    MANIFEST_NAME,
    READY_SUFFIX,
    Adopt,
    DatasetPublic,
    ExportPublic,
    State,
    TransferPublic,
    delivered_name,
    part_name,
)

# How a file on this node reaches the same path on the nodes of a step (sbcast).
SendFile = Callable[[str, str, str, Broadcast], Awaitable[None]]
# A node whose daemon does not answer is not waited for long: the job is running.
NODE_RETRY_FOR_S = 10.0


class Node:
    """One node's part: its daemon, the request, and how the data arrived so far."""

    def __init__(
        self,
        client: AsyncStagerClient,
        node: str,
        body: Mapping[str, Any],
        timeout: float | None,
        emit: Emit,
        send_file: SendFile | None = None,
    ) -> None:
        self.client = client
        self.calls = FanoutCalls(client)
        self.node = node
        self.body = dict(body)
        self.timeout = timeout
        self.emit = emit
        self.send_file = send_file
        self.result: dict[str, Any] | None = None  # the ``done`` event, once there is one
        self.incoming: TransferPublic | None = None
        self.exported: ExportPublic | None = None  # the part packed last, on the source
        self._adopting: asyncio.Task[dict[str, Any]] | None = None
        self._staging: asyncio.Task[None] | None = None
        self._sending_early: asyncio.Task[None] | None = None
        self._submitted = asyncio.Event()  # the stage request reached the daemon (or failed)
        # Giving up the current broadcast for one from another source (``resource``):
        # an adoption that fails meanwhile does not stage from the source itself.
        self._resourcing = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"node": self.node, "event": kind, **fields}

    async def run(self, instructions: AsyncIterator[dict[str, Any]], step: str) -> None:
        self.emit(self._event("ready", step=step))
        self.emit(await self.probe())
        try:
            async for message in instructions:
                to = message.get("to")
                if to is None or self.node in to:
                    await self._obey(message)
            if self._adopting is not None:
                # Normally the end came; if the driver went away before, nothing more
                # will arrive: the adoption stops waiting and stages from the source.
                await asyncio.to_thread(self._abort, "the fan-out driver ended before it")
                self.result = await self._adopting
            for task in (self._sending_early, self._staging):
                if task is not None:
                    await task
        finally:
            if self._adopting is not None and not self._adopting.done():
                await asyncio.to_thread(self._abort, "this node's task was stopped")
                self._adopting.cancel()
            for task in (self._sending_early, self._staging):
                if task is not None:
                    task.cancel()
            await self._release()
            self.emit(self.result or self._event("done", error=NOT_TOLD))

    async def _obey(self, message: dict[str, Any]) -> None:
        action = message.get("do")
        if action == "stage" and self._adopting is not None:
            # Told to stage while adopting: the broadcast was given up on; the adoption
            # stops waiting for parts and stages from the source itself.
            await asyncio.to_thread(self._abort, str(message.get("reason") or "given up"))
            self.result = await self._adopting
            self.emit(self._event("staged", **_public(self.result)))
        elif action == "stage" and self._staging is None:
            # In the background: meanwhile the files it finishes may be sent (early).
            self._staging = asyncio.create_task(self._stage_and_say(message.get("reason")))
        elif action == "early":
            self.emit(await self.export_early(str(message["label"]), message.get("part_bytes")))
        elif action == "send-early":
            self._sending_early = asyncio.create_task(self.send_early(message))
        elif action == "export":
            label, part = str(message["label"]), int(message.get("part", 0))
            tree = bool(message.get("tree"))
            self.emit(await self.export(label, message.get("part_bytes"), part, tree))
        elif action == "send":
            await self.send(message)
        elif action == "drop-export":
            try:
                await self.calls.delete_export(str(message["label"]))
            except StagerError:
                pass  # the daemon removes exports past their age itself
        elif action == "reserve":
            self.emit(await self.reserve(str(message["label"]), int(message["bytes"])))
        elif action == "hash":
            self.emit(await asyncio.to_thread(self.hash, list(message["files"])))
        elif action == "adopt":
            # Waited for at the end: meanwhile the parts arrive, and are announced here.
            self._adopting = asyncio.create_task(self.adopt(Adopt.model_validate(message["adopt"])))
        elif action == "resource":
            await self.resource(str(message.get("reason") or "its source node failed"))
        elif action in ("part", "end"):
            try:
                await asyncio.to_thread(self.mark, message)
            except OSError as exc:
                why = f"this node could not record that the broadcast arrived ({exc.strerror})"
                await asyncio.to_thread(self._abort, why)

    # ---- the actions ---------------------------------------------------------------

    async def probe(self) -> dict[str, Any]:
        try:
            result = await self.calls.probe(self.body)
        except StagerError as exc:
            return self._event("probe", error=exc.message)
        return self._event("probe", **result.model_dump(mode="json"))

    async def _stage_and_say(self, fallback: str | None) -> None:
        self.result = await self.stage(fallback)
        self.emit(self._event("staged", **_public(self.result)))

    async def stage(self, fallback: str | None = None) -> dict[str, Any]:
        """A plain staging (or cache hit) on this node; the ``done`` event."""
        started = time.monotonic()
        try:
            try:
                status = await self.client.submit(self.body)
            finally:
                self._submitted.set()
            hit = status.state == State.READY
            if not hit:
                status = await self.client.wait(status.name, self.timeout)
        except StagerError as exc:
            error = f"staging from the source: {exc.message}"
            # ``unreachable``: this node's daemon is gone, not the data at fault; a
            # fan-out goes on from another source (client.fanout.coordinator).
            return self._event("done", error=f"{fallback}; then {error}" if fallback else error,
                               unreachable=isinstance(exc, DaemonUnavailable))  # fmt: skip
        return self._done(status, "hit" if hit else "staged", started, fallback)

    def _done(
        self, status: DatasetPublic, how: str, started: float, fallback: str | None = None
    ) -> dict[str, Any]:
        return self._event(
            "done",
            how=how,
            path=status.path,
            key=status.key,
            size_bytes=status.size_bytes,
            seconds=round(time.monotonic() - started, 3),
            fallback=fallback,
        )

    async def export(
        self, label: str, part_bytes: int | None = None, part: int = 0, tree: bool = False
    ) -> dict[str, Any]:
        """Plan the parts and pack the first (``part``: after the early ones); the others
        are packed as they are sent. A ready image dataset: its image file, one part,
        unless ``tree``."""
        try:
            name = str(self.body["name"])
            self.exported = await self.calls.export(name, label, part, part_bytes, tree=tree)
        except StagerError as exc:
            return self._event("exported", error=f"packing {self.body['name']!r}: {exc.message}")
        return self._event("exported", **self.exported.model_dump(mode="json"))

    async def export_early(self, label: str, part_bytes: int | None = None) -> dict[str, Any]:
        """Start sending the dataset while it stages: its first early part, if it has
        one yet, and the staging's estimate of its size (for the receivers' room)."""
        await self._submitted.wait()
        try:
            name = str(self.body["name"])
            self.exported = await self.calls.export(name, label, 0, part_bytes, early=True)
        except StagerError as exc:
            return self._event("early", error=exc.message)
        return self._event("early", **self.exported.model_dump(mode="json"))

    async def send_early(self, message: dict[str, Any]) -> None:
        """sbcast early parts as the daemon packs them, until the staging is over
        (then ``sent`` with ``early_done`` and the count). A part that cannot be packed
        ends the early parts: the ready tree's parts carry what they did not."""
        label, dest, step = str(message["label"]), str(message["dest"]), str(message["step"])
        how = Broadcast(bool(message["compress"]), int(message["fanout"]))
        exported, name = self.exported, str(self.body["name"])
        while exported is not None and exported.id == label:
            if exported.path is not None:
                failed = await self._send(exported.path, f"{dest}/{part_name(exported.part)}",
                                          step, how)  # fmt: skip
                self.emit(self._event("sent", index=exported.part, bytes=exported.bytes,
                                      failed=failed))  # fmt: skip
            if not exported.more:
                break
            if exported.path is None:
                await asyncio.sleep(exported.retry_after_s)
            # The staging's end is seen by the daemon (the entry is not staging any more)
            # or here (this node's wait for it returned, maybe with an error).
            staging_over = self._staging is not None and self._staging.done()
            try:
                exported = self.exported = await self.calls.export(
                    name, label, exported.parts, early=True
                )
            except StagerError:
                break
            if staging_over and exported.path is None:
                break
        parts = self.exported.parts if self.exported is not None else 0
        self.emit(self._event("sent", early_done=True, parts=parts))

    async def send(self, message: dict[str, Any]) -> None:
        """sbcast the parts to step ``message["step"]``, into folder ``message["dest"]``
        on its nodes, packing part i+1 while part i travels; then the manifest. One
        ``sent`` event per part and one for the manifest (with its sha256). An sbcast
        that fails (``failed``: some node may lack that part) does not stop the others:
        each receiver checks its own copy. A part that cannot be packed does (``error``).
        An image dataset's export is one file, sent alone (one ``sent``, no manifest)."""
        label, dest, step = str(message["label"]), str(message["dest"]), str(message["step"])
        how = Broadcast(bool(message["compress"]), int(message["fanout"]))
        exported = self.exported
        if exported is None or exported.id != label or self.send_file is None:
            self.emit(self._event("sent", error=f"export {label!r} was not packed here"))
            return
        if exported.image is not None:  # an image dataset: its one file, no manifest
            target = f"{dest}/{IMAGE_DELIVERY_NAME}"
            failed = await self._send(str(exported.path), target, step, how)
            self.emit(self._event("sent", index=0, bytes=exported.bytes, failed=failed))
            return
        name = str(self.body["name"])
        while True:
            following = None
            if exported.part + 1 < exported.parts:
                following = asyncio.create_task(self.calls.export(name, label, exported.part + 1))
            target = f"{dest}/{part_name(exported.part)}"
            failed = await self._send(exported.path, target, step, how)
            self.emit(self._event("sent", index=exported.part, bytes=exported.bytes, failed=failed))
            if following is None:
                break
            try:
                exported = self.exported = await following
            except StagerError as exc:
                error = f"packing part {exported.part + 1} of {name!r}: {exc.message}"
                self.emit(self._event("sent", error=error))
                return
        assert exported.manifest is not None
        failed = await self._send(exported.manifest, f"{dest}/{MANIFEST_NAME}", step, how)
        self.emit(self._event("sent", index=exported.parts, failed=failed,
                              manifest_sha256=exported.manifest_sha256,
                              manifest_credential=exported.manifest_credential))  # fmt: skip

    async def _send(self, path: str, dest: str, step: str, how: Broadcast) -> str | None:
        """Why sending ``path`` failed, or None."""
        assert self.send_file is not None
        try:
            await self.send_file(path, dest, step, how)
        except StagerError as exc:
            return exc.message
        return None

    async def reserve(self, label: str, nbytes: int) -> dict[str, Any]:
        try:
            self.incoming = await self.calls.reserve(label, nbytes)
        except StagerError as exc:
            return self._event("reserved", error=exc.message)
        return self._event("reserved", path=self.incoming.path)

    def _abort(self, reason: str) -> None:
        """Tell an adoption still waiting for parts that none will come (the end file,
        unless there is one): it stops and this node stages from the source. Best
        effort: an adoption that cannot read it gives up after ``PART_WAIT_S``."""
        if self.incoming is None:
            return
        folder = Path(self.incoming.path)
        try:
            if not (folder / END_NAME).exists():
                self._write_end(folder, {"abort": reason})
        except OSError:
            pass

    @staticmethod
    def _write_end(folder: Path, end: dict[str, Any]) -> None:
        tmp = folder / (END_NAME + ".tmp")
        tmp.write_text(json.dumps(end))
        os.replace(tmp, folder / END_NAME)  # appears whole

    def mark(self, message: dict[str, Any]) -> None:
        """Tell the adopting staging that part N is whole, or that no more come: files
        in the delivery folder, each appearing whole (a rename)."""
        if self.incoming is None:
            return
        folder = Path(self.incoming.path)
        if message["do"] == "part":
            (folder / (part_name(int(message["index"])) + READY_SUFFIX)).touch()
            return
        said = ("parts", "manifest_sha256", "credential", "abort")
        end = {k: message[k] for k in said if k in message}
        self._write_end(folder, end)

    def hash(self, files: list[str]) -> dict[str, Any]:
        """(size, sha256) of each delivered source file: the manifest the others check."""
        if self.incoming is None:
            return self._event("hashed", error="no delivery folder was reserved here")
        found = {}
        for path in files:
            try:
                found[path] = file_digest(Path(self.incoming.path) / delivered_name(path))
            except OSError as exc:
                error = f"the broadcast copy of {path} is unreadable here ({exc.strerror})"
                return self._event("hashed", error=error)
        return self._event("hashed", files=found)

    async def adopt(self, adopt: Adopt) -> dict[str, Any]:
        started = time.monotonic()
        try:
            status = await self.client.submit({**self.body, "adopt": adopt.model_dump()})
            how = "hit" if status.state == State.READY else "broadcast"
            if status.state != State.READY:
                status = await self.client.wait(status.name, self.timeout)
        except DaemonUnavailable as exc:
            return self._event("done", error=f"adopting the broadcast copy: {exc.message}")
        except StagingFailed as exc:
            if self._resourcing:  # given up for another source's copy: nothing to stage
                return self._event("done", error=f"gave up the copy from {adopt.origin_node}")
            # The copy did not verify, or could not be extracted: the daemon says why.
            # This node stages from the source then; never a false ready.
            return await self.stage(f"the copy from {adopt.origin_node} was rejected ({exc})")
        except StagerError as exc:
            return await self.stage(f"the daemon refused the broadcast copy ({exc.message})")
        return self._done(status, how, started)

    async def resource(self, reason: str) -> None:
        """Give up the broadcast under way (its source node failed): the adoption stops
        (never ready), its reservation goes, and this node waits for what the fan-out
        does next, a broadcast from another source or this node as the source; it does
        not stage from the storage on its own."""
        if self._adopting is not None:
            self._resourcing = True
            await asyncio.to_thread(self._abort, reason)
            await self._adopting
            self._adopting, self._resourcing = None, False
        await self._release()
        self.emit(self._event("resourced"))

    async def _release(self) -> None:
        if self.incoming is None:
            return
        incoming, self.incoming = self.incoming, None
        try:
            await self.calls.release_incoming(incoming.id)  # kept if a staging adopts it
        except StagerError:
            pass  # the daemon is gone: it deletes deliveries when it starts again


NOT_TOLD = (
    "the fan-out driver (stager-client stage --peers slurm in the batch script) ended "
    "before saying what to do here; nothing was staged on this node"
)


def _public(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in ("node", "event")}


# ---- the hidden CLI: stager-client _node ---------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stager-client _node",
        description="One node's part of `stager-client stage --peers slurm` (started by srun).",
    )
    parser.add_argument("--request", required=True, help="the stage request, JSON")
    parser.add_argument("--url", default=None)
    parser.add_argument("--timeout", type=float, default=None)
    return parser


async def run(args: argparse.Namespace) -> int:
    job = Job.here()
    step = f"{job.job_id}.{job.env.get('SLURM_STEP_ID', '?')}"
    body = json.loads(args.request)

    async def send_file(path: str, dest: str, step: str, how: Broadcast) -> None:
        await sbcast(job, job.this_node, step, path, dest, how)  # from this node's file

    async with AsyncStagerClient(args.url, retry_for=NODE_RETRY_FOR_S) as client:
        node = Node(client, job.this_node, body, args.timeout, emit_stdout, send_file)
        await node.run(stdin_messages(), step)
    return 0


def main(argv: list[str]) -> int:
    return asyncio.run(run(build_parser().parse_args(argv)))
