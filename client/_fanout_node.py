"""What runs on each node of a fan-out: ``stager-client _node --request JSON``.

`client._fanout` starts one of these on every node of the job, in one ``srun``
step. Each talks to its own node's daemon over the local socket, reports JSON lines
on stdout (one object per event, each naming its node) and takes instructions as
JSON lines on stdin (srun gives stdin to every task; a line's ``to`` names the
nodes it is for). A task lives for the whole fan-out, so its start-up (a Python
interpreter) is paid once per node, at the beginning, all nodes at once.

    at start   probe: this node's cache key for the request, and whether it holds it
    stage      stage (or take the cache hit) as a plain request
    export     pack the ready dataset into one file and its manifest, for sbcast
    drop-export  delete them once sent
    reserve    room in the cache for a delivery; says the folder sbcast writes into
    hash       (size, sha256) of delivered source files: the manifest others check
    adopt      stage from the delivery; if it does not verify, from the source

When stdin closes, the task reports how the data arrived here (``done``) and exits,
releasing a reservation nothing adopted. A task never told to stage anything says
so: it never leaves data that looks ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from client._client import AsyncStagerClient
from client._slurm import Job
from client.errors import DaemonUnavailable, StagerError, StagingFailed
from stager.fanout.manifest import file_digest
from stager.schemas import Adopt, DatasetPublic, State, TransferPublic, delivered_name

Emit = Callable[[dict[str, Any]], None]
# A node whose daemon does not answer is not waited for long: the job is running.
NODE_RETRY_FOR_S = 10.0


def emit_stdout(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


class Node:
    """One node's part: its daemon, the request, and how the data arrived so far."""

    def __init__(
        self,
        client: AsyncStagerClient,
        node: str,
        body: Mapping[str, Any],
        timeout: float | None,
        emit: Emit,
    ) -> None:
        self.client = client
        self.node = node
        self.body = dict(body)
        self.timeout = timeout
        self.emit = emit
        self.result: dict[str, Any] | None = None  # the ``done`` event, once there is one
        self.incoming: TransferPublic | None = None

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
        finally:
            await self._release()
            self.emit(self.result or self._event("done", error=NOT_TOLD))

    async def _obey(self, message: dict[str, Any]) -> None:
        action = message.get("do")
        if action == "stage":
            self.result = await self.stage(fallback=message.get("reason"))
            self.emit(self._event("staged", **_public(self.result)))
        elif action == "export":
            self.emit(await self.export(str(message["label"])))
        elif action == "drop-export":
            try:
                await self.client.delete_export(str(message["label"]))
            except StagerError:
                pass  # the daemon removes exports past their age itself
        elif action == "reserve":
            self.emit(await self.reserve(str(message["label"]), int(message["bytes"])))
        elif action == "hash":
            self.emit(await asyncio.to_thread(self.hash, list(message["files"])))
        elif action == "adopt":
            self.result = await self.adopt(Adopt.model_validate(message["adopt"]))

    # ---- the actions ---------------------------------------------------------------

    async def probe(self) -> dict[str, Any]:
        try:
            result = await self.client.probe(self.body)
        except StagerError as exc:
            return self._event("probe", error=exc.message)
        return self._event("probe", **result.model_dump(mode="json"))

    async def stage(self, fallback: str | None = None) -> dict[str, Any]:
        """A plain staging (or cache hit) on this node; the ``done`` event."""
        started = time.monotonic()
        try:
            status = await self.client.submit(self.body)
            hit = status.state == State.READY
            if not hit:
                status = await self.client.wait(status.name, self.timeout)
        except StagerError as exc:
            error = f"staging from the source: {exc.message}"
            return self._event("done", error=f"{fallback}; then {error}" if fallback else error)
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

    async def export(self, label: str) -> dict[str, Any]:
        try:
            exported = await self.client.export(str(self.body["name"]), label)
        except StagerError as exc:
            return self._event("exported", error=f"packing {self.body['name']!r}: {exc.message}")
        return self._event("exported", **exported.model_dump(mode="json"))

    async def reserve(self, label: str, nbytes: int) -> dict[str, Any]:
        try:
            self.incoming = await self.client.reserve(label, nbytes)
        except StagerError as exc:
            return self._event("reserved", error=exc.message)
        return self._event("reserved", path=self.incoming.path)

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
            # The copy did not verify, or could not be extracted: the daemon says why.
            # This node stages from the source then; never a false ready.
            return await self.stage(f"the copy from {adopt.origin_node} was rejected ({exc})")
        except StagerError as exc:
            return await self.stage(f"the daemon refused the broadcast copy ({exc.message})")
        return self._done(status, how, started)

    async def _release(self) -> None:
        if self.incoming is None:
            return
        incoming, self.incoming = self.incoming, None
        try:
            await self.client.release_incoming(incoming.id)  # kept if a staging adopts it
        except StagerError:
            pass  # the daemon is gone: it deletes deliveries when it starts again


NOT_TOLD = (
    "the fan-out driver (stager-client stage --peers slurm in the batch script) ended "
    "before saying what to do here; nothing was staged on this node"
)


def _public(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in ("node", "event")}


# ---- the hidden CLI: stager-client _node ---------------------------------------------


async def _stdin_lines() -> AsyncIterator[dict[str, Any]]:
    while line := await asyncio.to_thread(sys.stdin.readline):
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict):
            yield message


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
    async with AsyncStagerClient(args.url, retry_for=NODE_RETRY_FOR_S) as client:
        node = Node(client, job.this_node, body, args.timeout, emit_stdout)
        await node.run(_stdin_lines(), step)
    return 0


def main(argv: list[str]) -> int:
    return asyncio.run(run(build_parser().parse_args(argv)))
