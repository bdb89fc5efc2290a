"""The talk between the coordinator and the per-node agents: JSON lines, both ways.

The coordinator starts one agent on every node of the job, in one ``srun`` step.
Each agent reports on stdout, one object per line, each naming its node
(``{"node": ..., "event": ..., ...}``); it takes instructions as JSON lines on
stdin (srun gives stdin to every task; a line's ``to`` names the nodes it is for,
``do`` what to do). An agent lives for the whole fan-out, so its start-up (a Python
interpreter) is paid once per node, at the beginning, all nodes at once.

    instruction  what the agent does                                 it answers
    (at start)   probe: this node's cache key for the request, and   ready, probe
                 whether it holds it
    stage        stage (or take the cache hit) as a plain request,   staged
                 in the background
    early        start an export of the dataset while it stages      early
                 (its estimate)
    send-early   sbcast the files the staging finished, in parts,    sent (one a part,
                 as it goes                                          then early_done)
    export       pack the first part of the ready dataset that       exported
                 early parts did not carry (and plan the others);
                 a ready image dataset: a copy of its image file,
                 with its size and sha256 (``image``)
    send         sbcast every part, each packed while the one        sent (one a part,
                 before travels, then the manifest; an image         then the manifest's;
                 dataset's export: its one image file                an image: one)
    drop-export  delete the packed parts once sent                   -
    reserve      room in the cache for a delivery; the folder        reserved
                 sbcast writes into
    hash         (size, sha256) of delivered source files: the       hashed
                 manifest the others check
    adopt        stage from the delivery (the daemon extracts the    staged, if given up
                 parts as they come); if it does not verify, from
                 the source
    part, end    a part is whole here; no more parts come (with      -
                 the manifest's sha256)
    resource     give up the broadcast under way (its source node    resourced
                 failed) without staging from the source: another
                 source follows

When stdin closes, the agent reports how the data arrived on its node (``done``)
and exits, releasing a reservation nothing adopted. An agent never told to stage
anything says so: it never leaves data that looks ready.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from client.errors import FanoutError
from client.fanout.slurm import Step

Emit = Callable[[dict[str, Any]], None]


# ---- the agent's end ------------------------------------------------------------------


def emit_stdout(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


async def stdin_messages() -> AsyncIterator[dict[str, Any]]:
    """Each instruction on stdin until it closes; lines that are not one are skipped."""
    while line := await asyncio.to_thread(sys.stdin.readline):
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict):
            yield message


# ---- the coordinator's end --------------------------------------------------------------


class Agents:
    """The step with one agent task per node, and the talk with it."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self._events = step.events()
        self._early: list[dict[str, Any]] = []  # read while looking for other events

    async def collect(self, kind: str, nodes: Sequence[str]) -> dict[str, dict[str, Any]]:
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

    async def started(self) -> None:
        found = await self.collect("ready", self.step.nodes)
        if self.step.step_id is None:
            missing = [n for n in self.step.nodes if n not in found]
            raise FanoutError(
                f"{self.step.label()} did not start on {', '.join(missing) or 'any node'} "
                f"({self.step.stderr_tail()}); check those nodes with sinfo"
            )

    async def tell(self, message: dict[str, Any]) -> None:
        await self.step.write(message)

    async def done(self) -> list[dict[str, Any]]:
        """Every node's outcome: stdin closes, each task reports and exits."""
        self.step.close_stdin()
        found = await self.collect("done", self.step.nodes)
        await self.step.wait()
        return [
            found.get(node)
            or {
                "node": node,
                "event": "done",
                "error": f"its task ended without a report ({self.step.stderr_tail()})",
            }
            for node in self.step.nodes
        ]

    async def close(self) -> None:
        await self.step.kill()
