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
from stager.dataset import Entry, State
from stager.errors import BadRequest, Conflict, NotFound, StagerError, from_os_error
from stager.fanout import adoption
from stager.fanout.bundle import PART_BYTES
from stager.fanout.early import RETRY_MIN_S, part_bytes_for
from stager.fanout.transfers import (
    EXPORT_TTL_S,
    ExportPlan,
    Transfer,
    Transfers,
    bundle_estimate,
    early_public,
    make_folder,
    pack_early_part,
    pack_export_part,
    plan_export,
    plan_rest,
    remove_folder,
    transfer_public,
)
from stager.manifest_format import Manifest
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
        unpacked = {p.key for p in self.plans.values() if p.early or p.packed < p.count}
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
        if missing := adoption.missing_sources(adopt, steps, self.ops):
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

    def unclaim(self, label: str) -> Path | None:
        """The folder of delivery ``label``, which a staging read and has ended: read
        once, it goes (the registry removes it)."""
        transfer = self.claimed.pop(label, None)
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

    def plans_from(self, label: str, part: int) -> bool:
        """Whether asking for part ``part`` of ``label`` plans parts of a ready tree:
        the first part of an export, or the first after its early parts."""
        plan = self.plans.get(label)
        return part == 0 or (plan is not None and plan.early and part == plan.packed)

    async def export(
        self, name: str, request: ExportCreate, ready: tuple[Entry, Path] | None
    ) -> ExportPublic:
        """Pack part ``request.part`` of dataset ``name`` for sbcast. The first part
        (``ready``: the ready entry and its tree) plans the parts and is admitted for all
        of them (after early parts: for what they did not carry); the others come in
        order, each packed while the one before is on its way."""
        label, part = request.label, request.part
        if ready is not None:
            plan = self.plans.get(label)
            if plan is not None and plan.early and part == plan.packed:
                await self._locked(plan, label, plan_rest, plan, ready[1])
            else:
                await self._plan_export(ready, label, request.part_bytes or PART_BYTES)
        plan = self._plan(label, part)
        if part >= plan.count or plan.early:
            raise Conflict(
                f"export {label!r} has {plan.packed} of {plan.count} parts packed; "
                f"ask for part {plan.packed}, not {part}"
            )
        transfer = self.exports.renew(label, EXPORT_TTL_S)
        return await self._locked(plan, name, pack_export_part, plan, transfer)

    async def export_early(
        self, entry: Entry, request: ExportCreate, tree: Path | None
    ) -> ExportPublic:
        """Pack the next early part of ``entry``, which is staging into ``tree`` (None:
        queued), or say there is none yet; once it is not staging any more, say so: its
        remaining parts are asked for without ``early``."""
        label, part = request.label, request.part
        if part == 0 and label not in self.plans:
            nbytes = bundle_estimate(entry.estimate_bytes, 0)
            async with self._admission:
                await self._admit(nbytes, entry.key)
                self.exports.add(label, nbytes, EXPORT_TTL_S)
                part_bytes = request.part_bytes or part_bytes_for(entry.estimate_bytes,
                                                                  PART_BYTES)  # fmt: skip
                self.plans[label] = ExportPlan(Path(), entry.key, [], Manifest(),
                                               entry.estimate_bytes, part_bytes,
                                               early=True)  # fmt: skip
        plan = self._plan(label, part)
        if not plan.early:
            raise Conflict(f"export {label!r} is past its early parts; ask without 'early'")
        transfer = self.exports.renew(label, EXPORT_TTL_S)
        staging = entry.state in (State.QUEUED, State.STAGING)
        if tree is None or not staging:
            return early_public(plan, transfer, more=staging, retry_after_s=RETRY_MIN_S)
        try:
            return await self._locked(plan, entry.key, pack_early_part, plan, transfer, tree)
        except StagerError:
            # The staging moved its tree (published) or removed a file while it was read:
            # nothing was sent; the next look sees where it stands.
            return early_public(plan, transfer, more=True, retry_after_s=RETRY_MIN_S)

    def _plan(self, label: str, part: int) -> ExportPlan:
        plan = self.plans.get(label)
        if plan is None:
            raise NotFound(f"export {label!r} was not started here; ask for its part 0 first")
        if plan.packing:
            raise Conflict(
                f"export {label!r} is packing part {plan.packed} now; ask for the next part "
                "once that answer came"
            )
        if part != plan.packed:
            raise Conflict(
                f"export {label!r} has {plan.packed} parts packed; ask for part "
                f"{plan.packed}, not {part}"
            )
        return plan

    async def _locked(self, plan: ExportPlan, what: str, work: Any, *args: Any) -> Any:
        """``work(*args)`` off the event loop, as the one piece of work on ``plan``."""
        plan.packing = True
        try:
            return await run_io(work, *args)
        except OSError as exc:
            raise from_os_error(exc, f"packing {what!r} to send it") from exc
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
