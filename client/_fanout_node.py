"""What runs on each node of a fan-out: ``stager-client _node ROLE ...``.

`client._fanout` starts these with ``srun`` (one task per node) or, for the node
it runs on, calls them in-process. Each talks to its own node's daemon over the
local socket and reports JSON lines on stdout, one object per event, each naming
its node; the driver reads them from srun's output. Roles:

    probe        this node's cache key for the request, and whether it holds the data
    stage        stage (or hit) as a plain request: the source node, and holders
    export       pack the ready dataset into one file and its manifest, for sbcast
    drop-export  delete that file once sent
    receive      wait for instructions on stdin: reserve room, hash what arrived,
                 adopt it (falling back to the source when it does not verify), or
                 stage from the source; then report how the data arrived

A task that is not told what to do (the driver died: stdin closes) releases what
it reserved and reports an error: it never leaves data that looks ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
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


def _error(node: str, what: str, exc: StagerError) -> dict[str, Any]:
    return {"node": node, "event": "done", "error": f"{what}: {exc.message}"}


# ---- roles -----------------------------------------------------------------------------


async def probe(client: AsyncStagerClient, node: str, body: Mapping[str, Any]) -> dict[str, Any]:
    try:
        result = await client.probe(body)
    except StagerError as exc:
        return {"node": node, "event": "probe", "error": exc.message}
    return {"node": node, "event": "probe", **result.model_dump(mode="json")}


async def stage(
    client: AsyncStagerClient,
    node: str,
    body: Mapping[str, Any],
    timeout: float | None,
    *,
    fallback: str | None = None,
) -> dict[str, Any]:
    """A plain staging (or cache hit) on this node; the ``done`` event."""
    started = time.monotonic()
    try:
        status = await client.submit(body)
        hit = status.state == State.READY
        if not hit:
            status = await client.wait(status.name, timeout)
    except StagerError as exc:
        event = _error(node, "staging from the source", exc)
        if fallback:
            event["error"] = f"{fallback}; then {event['error']}"
        return event
    return _done(node, status, "hit" if hit else "staged", started, fallback)


def _done(
    node: str, status: DatasetPublic, how: str, started: float, fallback: str | None = None
) -> dict[str, Any]:
    return {
        "node": node,
        "event": "done",
        "how": how,
        "path": status.path,
        "key": status.key,
        "size_bytes": status.size_bytes,
        "seconds": round(time.monotonic() - started, 3),
        "fallback": fallback,
    }


async def export(client: AsyncStagerClient, node: str, name: str, label: str) -> dict[str, Any]:
    """Pack ready ``name`` into one file and its manifest, for sbcast."""
    try:
        exported = await client.export(name, label)
    except StagerError as exc:
        return {"node": node, "event": "export", "error": f"packing {name!r}: {exc.message}"}
    return {"node": node, "event": "export", **exported.model_dump(mode="json")}


async def drop_export(client: AsyncStagerClient, node: str, export_id: str) -> dict[str, Any]:
    try:
        await client.delete_export(export_id)
    except StagerError as exc:  # the daemon deletes old exports itself
        return {"node": node, "event": "drop-export", "error": exc.message}
    return {"node": node, "event": "drop-export"}


async def here(
    role: str,
    client: AsyncStagerClient,
    job: Job,
    body: Mapping[str, Any],
    timeout: float | None,
    extra: Sequence[str],
) -> dict[str, Any]:
    """A one-shot role on this node, in-process (the driver's own node) or from the CLI."""
    node = job.this_node
    options = _options(extra)
    if role == "probe":
        return await probe(client, node, body)
    if role == "stage":
        return await stage(client, node, body, timeout)
    if role == "export":
        return await export(client, node, str(body["name"]), options["label"])
    if role == "drop-export":
        return await drop_export(client, node, options["label"])
    raise ValueError(f"unknown role {role!r}")


def _options(extra: Sequence[str]) -> dict[str, str]:
    """``--label X`` style pairs, as the driver passes them."""
    return {extra[i].removeprefix("--"): extra[i + 1] for i in range(0, len(extra) - 1, 2)}


class Receiver:
    """One receiving node: reserve, maybe hash, then adopt or stage, as instructed."""

    def __init__(
        self,
        client: AsyncStagerClient,
        node: str,
        body: Mapping[str, Any],
        label: str,
        timeout: float | None,
        emit: Emit,
    ) -> None:
        self.client = client
        self.node = node
        self.body = dict(body)
        self.label = label
        self.timeout = timeout
        self.emit = emit
        self.incoming: TransferPublic | None = None

    async def run(self, instructions: AsyncIterator[dict[str, Any]], step: str) -> None:
        self.emit({"node": self.node, "event": "ready", "step": step})
        try:
            async for message in instructions:
                to = message.get("to")
                if to is not None and self.node not in to:
                    continue
                done = await self._obey(message)
                if done is not None:
                    self.emit(done)
                    return
            self.emit(
                {
                    "node": self.node,
                    "event": "done",
                    "error": "the fan-out driver (stager-client stage --peers slurm in the batch "
                    "script) went away before saying what to do; nothing was staged here",
                }
            )
        finally:
            await self._release()

    async def _obey(self, message: dict[str, Any]) -> dict[str, Any] | None:
        action = message.get("do")
        if action == "reserve":
            self.emit(await self._reserve(int(message["bytes"])))
            return None
        if action == "hash":
            self.emit(await asyncio.to_thread(self._hash, list(message["files"])))
            return None
        if action == "adopt":
            return await self._adopt(Adopt.model_validate(message["adopt"]))
        if action == "stage":
            await self._release()
            return await stage(
                self.client, self.node, self.body, self.timeout, fallback=message.get("reason")
            )
        return None

    async def _reserve(self, nbytes: int) -> dict[str, Any]:
        try:
            self.incoming = await self.client.reserve(self.label, nbytes)
        except StagerError as exc:
            return {"node": self.node, "event": "reserved", "error": exc.message}
        return {"node": self.node, "event": "reserved", "path": self.incoming.path}

    def _hash(self, files: list[str]) -> dict[str, Any]:
        """(size, sha256) of each delivered source file: the manifest the others check."""
        assert self.incoming is not None
        found = {}
        for path in files:
            try:
                found[path] = file_digest(Path(self.incoming.path) / delivered_name(path))
            except OSError as exc:
                return {
                    "node": self.node,
                    "event": "hashed",
                    "error": f"the broadcast copy of {path} is unreadable here ({exc.strerror})",
                }
        return {"node": self.node, "event": "hashed", "files": found}

    async def _adopt(self, adopt: Adopt) -> dict[str, Any]:
        started = time.monotonic()
        try:
            status = await self.client.submit({**self.body, "adopt": adopt.model_dump()})
            if status.state != State.READY:
                status = await self.client.wait(status.name, self.timeout)
        except StagingFailed as exc:
            # The copy did not verify (or could not be extracted): the daemon says why.
            # That node stages from the source; never a false ready.
            reason = f"the copy from {adopt.origin_node} was rejected ({exc.message})"
            return await stage(self.client, self.node, self.body, self.timeout, fallback=reason)
        except DaemonUnavailable as exc:
            return _error(self.node, "adopting the broadcast copy", exc)
        except StagerError as exc:
            reason = f"the daemon refused the broadcast copy ({exc.message})"
            return await stage(self.client, self.node, self.body, self.timeout, fallback=reason)
        return _done(self.node, status, "broadcast", started)

    async def _release(self) -> None:
        if self.incoming is None:
            return
        incoming, self.incoming = self.incoming, None
        try:
            await self.client.release_incoming(incoming.id)
        except StagerError:
            pass  # adopted (the daemon removed it) or the daemon is gone: nothing to free


# ---- the hidden CLI: stager-client _node ROLE ----------------------------------------


async def _stdin_lines() -> AsyncIterator[dict[str, Any]]:
    while line := await asyncio.to_thread(sys.stdin.readline):
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict):
            yield message


ONE_SHOT = ("probe", "stage", "export", "drop-export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stager-client _node",
        description="One node's part of `stager-client stage --peers slurm` (started by srun).",
    )
    parser.add_argument("role", choices=[*ONE_SHOT, "receive"])
    parser.add_argument("--request", required=True, help="the stage request, JSON")
    parser.add_argument("--url", default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--label", default="")
    return parser


async def run(args: argparse.Namespace) -> int:
    job = await Job.detect()
    body = json.loads(args.request)
    async with AsyncStagerClient(args.url, retry_for=NODE_RETRY_FOR_S) as client:
        if args.role in ONE_SHOT:
            extra = ["--label", args.label]
            emit_stdout(await here(args.role, client, job, body, args.timeout, extra))
            return 0
        step = f"{job.job_id}.{job.env.get('SLURM_STEP_ID', '?')}"
        receiver = Receiver(client, job.this_node, body, args.label, args.timeout, emit_stdout)
        await receiver.run(_stdin_lines(), step)
    return 0


def main(argv: list[str]) -> int:
    return asyncio.run(run(build_parser().parse_args(argv)))
