"""One daemon's share of multi-node fan-out (docs/multinode.md): the room on its
cache disk that broadcasts take, and which delivery each adopting staging reads.

- deliveries: room reserved for what another node sbcasts here (``incoming/``);
- claimed: deliveries a staging is adopting, kept (and counted) until it ends;
- exports: ready datasets packed to be sent (``outgoing/``), part by part (plans);
- exporting: keys being packed, never evicted under the packer.

The engine decides (admission, scheduling); this keeps the books it decides with,
and the registry (:mod:`stager.lifecycle`) makes the one durable change here: a
claimed delivery removed once its staging ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from stager.blocking import run_io
from stager.dataset import Entry
from stager.errors import BadRequest, Conflict, NotFound, from_os_error
from stager.fanout import adoption
from stager.fanout.bundle import PART_BYTES
from stager.fanout.transfers import (
    EXPORT_TTL_S,
    ExportPlan,
    Transfer,
    Transfers,
    make_folder,
    pack_export_part,
    plan_export,
    remove_folder,
    transfer_public,
)
from stager.ops.base import CheckContext
from stager.schemas import (
    Adopt,
    DatasetCreate,
    ExportCreate,
    ExportPublic,
    IncomingCreate,
    TransferPublic,
)
from stager.settings import Settings

Admit = Callable[[int, str], Awaitable[None]]


class FanoutRoom:
    def __init__(self, settings: Settings, ops: Any, admission: asyncio.Lock, admit: Admit):
        self.settings = settings
        self.ops = ops
        self._admission = admission  # the engine's: held while room is promised
        self._admit = admit  # the engine's admission (evicts, or refuses with the sizes)
        self.deliveries = Transfers(settings.incoming_dir, "delivery")
        self.exports = Transfers(settings.outgoing_dir, "export")
        self.claimed: dict[str, Transfer] = {}
        self.plans: dict[str, ExportPlan] = {}  # exports under way, by label
        self._planning: list[str] = []  # keys of exports being listed (part 0)

    @property
    def exporting(self) -> set[str]:
        """Keys with parts still to pack: never evicted under the packer."""
        unpacked = {p.key for p in self.plans.values() if p.packed < len(p.parts)}
        return unpacked | set(self._planning)

    def pending(self) -> list[Transfer]:
        """Every reservation admission counts until its files are written."""
        return [*self.deliveries.live(), *self.exports.live(), *self.claimed.values()]

    # ---- a request that adopts a delivery ---------------------------------------------

    def origin(self, request: DatasetCreate) -> dict[str, Any]:
        """How the entry a request creates arrives: from a broadcast, or staged here."""
        if request.adopt is not None:
            adopt = request.adopt
            nbytes = self.deliveries.get(adopt.incoming).nbytes
            origin = {"how": "broadcast", "node": adopt.origin_node, "job": adopt.job}
            return {**origin, "bytes": nbytes}
        job = request.lease.slurm_job_id if request.lease else None
        return {"how": "staged", "job": job}

    def adoption_steps(self, adopt: Adopt, key: str, steps: list[Any]) -> list[Any]:
        """The steps that stage ``key`` from the delivery instead of the sources."""
        if adopt.origin_key != key:
            raise Conflict(
                f"this node computes cache key {key} for the request, but {adopt.origin_node} "
                f"staged {adopt.origin_key}: the sources look different from here (changed "
                "meanwhile, or another filesystem view); stage from the source instead"
            )
        if missing := adoption.missing_sources(adopt, steps):
            raise BadRequest(
                f"the delivery from {adopt.origin_node} lacks source {missing[0]} of this "
                "request; stage from the source instead"
            )
        folder = self.deliveries.get(adopt.incoming).path
        return adoption.steps_for(adopt, folder, steps, self.ops)

    def source_roots(self, adopting: bool) -> tuple[Path, ...]:
        """Where a staging may read: the allowed source roots, and for an adoption the
        incoming folder too (its files are the daemon's own, delivered there). The
        request check and the staging process both take it from here."""
        roots = tuple(self.settings.allowed_roots)
        if adopting and roots:  # no roots: anywhere the daemon can read already
            roots = (*roots, self.settings.incoming_dir)
        return roots

    def check_adoption(self, steps: list[Any], verify: str) -> int:
        """Pre-flight of an adoption (blocking)."""
        roots = self.source_roots(adopting=True)
        return self.ops.check(steps, CheckContext(allowed_roots=roots, verify=verify))

    def claim(self, adopt: Adopt | None) -> str | None:
        """The delivery a new staging reads: kept (and counted) until it ends."""
        if adopt is None:
            return None
        self.claimed[adopt.incoming] = self.deliveries.pop(adopt.incoming)
        return adopt.incoming

    def unclaim(self, entry: Entry) -> Path | None:
        """The folder of the delivery ``entry``'s staging read, once it has ended: read
        once, it goes (the registry removes it)."""
        if entry.delivery is None:
            return None
        transfer = self.claimed.pop(entry.delivery, None)
        entry.delivery = None
        return transfer.path if transfer is not None else None

    async def release_unused(self, adopt: Adopt | None, entry: Entry) -> None:
        """A request that joined or hit: the copy delivered for it is not needed."""
        label = adopt.incoming if adopt is not None else None
        if label and entry.delivery != label and self.deliveries.find(label):
            await self.release(label)

    # ---- reservations and exports (the API's /v1/incoming and /v1/exports) -------------

    async def reserve(self, request: IncomingCreate) -> TransferPublic:
        """Room on the cache disk for a delivery, counted by admission until it goes.
        The same label again (a re-run step) gets the same reservation."""
        async with self._admission:
            transfer = self.deliveries.find(request.label)
            if transfer is None:
                await self._admit(request.bytes, "")
                transfer = self.deliveries.add(request.label, request.bytes, request.ttl_s)
        await run_io(make_folder, transfer)
        return transfer_public(transfer)

    async def release(self, label: str) -> TransferPublic:
        """Drop a reservation and what was delivered into it. A delivery that a staging
        is adopting stays until that staging ends."""
        if label in self.claimed:
            return transfer_public(self.claimed[label])
        transfer = self.deliveries.pop(label)  # NotFound, with its sentence
        await run_io(remove_folder, transfer.path)
        return transfer_public(transfer)

    async def export(
        self, name: str, request: ExportCreate, ready: tuple[Entry, Path] | None
    ) -> ExportPublic:
        """Pack part ``request.part`` of dataset ``name`` for sbcast. Part 0 (``ready``:
        the ready entry and its tree) plans the parts and is admitted for all of them;
        the others come in order, each packed while the one before is on its way."""
        label, part = request.label, request.part
        if ready is not None:
            await self._plan_export(ready, label, request.part_bytes or PART_BYTES)
        plan = self.plans.get(label)
        if plan is None:
            raise NotFound(f"export {label!r} was not started here; ask for its part 0 first")
        if plan.packing:
            raise Conflict(
                f"export {label!r} is packing part {plan.packed} now; ask for the next part "
                "once that answer came"
            )
        if part != plan.packed or part >= len(plan.parts):
            raise Conflict(
                f"export {label!r} has {plan.packed} of {len(plan.parts)} parts packed; "
                f"ask for part {plan.packed}, not {part}"
            )
        plan.packing = True
        try:
            return await run_io(pack_export_part, plan, self.exports.get(label))
        except OSError as exc:
            raise from_os_error(exc, f"packing {name!r} to send it") from exc
        finally:
            plan.packing = False

    async def _plan_export(self, ready: tuple[Entry, Path], label: str, part_bytes: int) -> None:
        entry, final = ready
        if label in self.plans:
            await self.drop_export(label)  # asked again from the start: a re-run step
        async with self._admission:
            self._planning.append(entry.key)  # from here on, never evicted under the packer
        try:
            plan = await run_io(plan_export, final, entry.key, part_bytes)
            async with self._admission:
                await self._admit(plan.total_bytes, entry.key)
                self.exports.add(label, plan.total_bytes, EXPORT_TTL_S)
                self.plans[label] = plan
        except OSError as exc:
            raise from_os_error(exc, f"listing {final} to send it") from exc
        finally:
            self._planning.remove(entry.key)

    async def drop_export(self, label: str) -> TransferPublic:
        transfer = self.exports.pop(label)
        self.plans.pop(label, None)
        await run_io(remove_folder, transfer.path)
        return transfer_public(transfer)

    async def expire(self) -> list[Path]:
        """Reservations and exports past their time (a job that died): removed."""
        gone = [*self.deliveries.expired(), *self.exports.expired()]
        for transfer in gone:
            self.plans.pop(transfer.label, None)
            await run_io(remove_folder, transfer.path)
        return [t.path for t in gone]
