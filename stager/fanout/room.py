"""The one owner of a daemon's share of multi-node fan-out (docs/multinode.md): its
books and the room on its cache disk that broadcasts take.

- deliveries: room reserved for what another node sbcasts here (``incoming/``); a
  delivery a staging adopts is *claimed*: kept, and counted, until that staging ends;
- exports: ready (or still staging) datasets packed to be sent (``outgoing/``), part
  by part, each with its plan.

Both count as promised room in admission until they are gone, so a broadcast never
fills the disk behind the cache's back. Both expire (a job that died leaves nothing
for long), and a daemon that restarts deletes whatever an earlier run left there.

The engine decides (admission, scheduling) and calls in through its hooks, one per
phase of a request or a staging:

- ``arrival``: what a request that may adopt a delivery stages, and from where;
- ``held``: for admission, what the room holds (promised bytes, keys being packed);
- ``admitted``: the request is decided; its delivery is claimed, or released unused;
- ``staging_starts`` / ``staging_ends``: where an adopting staging may read, and the
  claimed delivery it read, which the registry then removes (:mod:`stager.lifecycle`);
- ``export``: the next part of a dataset to send.

The API's reservations (``/v1/incoming``, ``/v1/exports``) come here directly. The
blocking file work runs off the event loop in :mod:`stager.fanout.packing`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from stager import vouch
from stager.blocking import run_io
from stager.dataset import Entry, State
from stager.errors import BadRequest, Conflict, NotFound, StagerError, from_os_error
from stager.fanout import adoption
from stager.fanout.bundle import PART_BYTES
from stager.fanout.early import RETRY_MIN_S, part_bytes_for
from stager.fanout.packing import (
    ExportPlan,
    Transfer,
    bundle_estimate,
    make_folder,
    pack_early_part,
    pack_export_part,
    plan_export,
    plan_rest,
    remove_folder,
    unwritten_bytes,
)
from stager.fs.credentials import Reader
from stager.manifest_format import Manifest
from stager.ops.base import CheckContext
from stager.schemas import (
    Adopt,
    DatasetCreate,
    ExportCreate,
    ExportPublic,
    IncomingCreate,
    SourceFile,
    TransferPublic,
)
from stager.settings import Settings

EXPORT_TTL_S = 3600.0

Admit = Callable[[int, str], Awaitable[None]]
ReadyTree = Callable[[Entry], Awaitable[Path]]


def _now() -> datetime:
    return datetime.now(UTC)


class Transfers:
    """The books of one kind of transfer (exports or deliveries) under one folder."""

    def __init__(self, root: Path, kind: str) -> None:
        self.root = root
        self.kind = kind  # "export" or "delivery", for messages
        self._live: dict[str, Transfer] = {}

    def live(self) -> list[Transfer]:
        return list(self._live.values())

    def find(self, label: str) -> Transfer | None:
        return self._live.get(label)

    def add(self, label: str, nbytes: int, ttl_s: float) -> Transfer:
        """Book ``label`` (again: the same label renews it, as a re-run step would)."""
        transfer = Transfer(label, self.root / label, nbytes, _now() + timedelta(seconds=ttl_s))
        self._live[label] = transfer
        return transfer

    def renew(self, label: str, ttl_s: float) -> Transfer:
        """``label``, living ``ttl_s`` from now: an export is renewed by every part asked
        for, so a long staging sending early parts does not outlive its export."""
        transfer = self.get(label)
        transfer.expires_at = _now() + timedelta(seconds=ttl_s)
        return transfer

    def get(self, label: str) -> Transfer:
        transfer = self._live.get(label)
        if transfer is None:
            raise NotFound(
                f"no {self.kind} {label!r} on this node (released, expired, or this daemon "
                "restarted since); start the multi-node staging again"
            )
        return transfer

    def pop(self, label: str) -> Transfer:
        transfer = self.get(label)
        del self._live[label]
        return transfer

    def expired(self) -> list[Transfer]:
        """Unclaimed transfers past their time, taken off the books."""
        now = _now()
        gone = [t for t in self._live.values() if t.expires_at <= now and not t.claimed]
        for transfer in gone:
            del self._live[transfer.label]
        return gone


@dataclass(frozen=True)
class Arrival:
    """How a request's data arrives: the steps it stages with (an adoption's, or the
    request's own), where it comes from, and (an adoption that misses) its size."""

    steps: list[Any]
    origin: dict[str, Any]
    estimate: int | None = None


@dataclass(frozen=True)
class Held:
    """What admission must not count as free or evict: room promised to transfers and
    not written yet, and the keys of datasets being packed to be sent."""

    unwritten_bytes: int
    exporting: set[str]


class FanoutRoom:
    def __init__(self, settings: Settings, ops: Any, admission: asyncio.Lock, admit: Admit):
        self.settings = settings
        self.ops = ops
        self._admission = admission  # the engine's: held while room is promised
        self._admit = admit  # the engine's admission (evicts, or refuses with the sizes)
        self.deliveries = Transfers(settings.incoming_dir, "delivery")
        self.exports = Transfers(settings.outgoing_dir, "export")
        self.plans: dict[str, ExportPlan] = {}  # exports under way, by label
        self._planning: list[str] = []  # keys of exports being listed (part 0)

    # ---- the engine's hooks ------------------------------------------------------------

    async def arrival(
        self,
        request: DatasetCreate,
        steps: list[Any],
        key: str,
        shared_key: str,
        reader: Reader | None,
        miss: bool,
    ) -> Arrival:
        """What ``request`` (expanded to ``steps``, cache key ``key``, or ``shared_key``
        were it shared by every user) stages, read with ``reader``'s rights: without a
        delivery, its own steps, staged here; with one, the delivery's steps, checked
        before admission when it misses (a hit or a join stages nothing)."""
        adopt = request.adopt
        if adopt is None:
            job = request.lease.slurm_job_id if request.lease else None
            return Arrival(steps, {"how": "staged", "job": job})
        delivery = self.deliveries.get(adopt.incoming)
        origin = {"how": "broadcast", "node": adopt.origin_node, "job": adopt.job}
        origin["bytes"] = delivery.nbytes
        if not miss:
            return Arrival(steps, origin)
        if adopt.origin_key not in (key, shared_key):
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
        vouch = None
        if reader is not None and reader.vouched:  # shared: the origin's service vouches
            vouch = adoption.Vouch(os.geteuid(), key, self.settings.munge_socket)
        adopting = adoption.steps_for(adopt, delivery.path, steps, self.ops, vouch)
        estimate = await run_io(self._check_adoption, adopting, request.verify)
        return Arrival(adopting, origin, estimate)

    async def held(self) -> Held:
        """For admission (under its lock): what the room holds."""
        promised = [*self.deliveries.live(), *self.exports.live()]
        return Held(await run_io(unwritten_bytes, promised), self.exporting)

    @property
    def exporting(self) -> set[str]:
        """Keys with parts still to pack: never evicted under the packer."""
        unpacked = {p.key for p in self.plans.values() if p.early or p.packed < p.count}
        return unpacked | set(self._planning)

    async def admitted(self, adopt: Adopt | None, entry: Entry) -> None:
        """``entry`` answers a request that brought delivery ``adopt``: claimed when the
        request queued its staging with it (``entry.delivery``), else not needed (the
        request joined or hit) and released."""
        transfer = self.deliveries.find(adopt.incoming) if adopt is not None else None
        if transfer is None:
            return
        if entry.delivery == transfer.label:
            transfer.claimed = True
        elif not transfer.claimed:
            await self._discard(transfer)

    def staging_starts(self, entry: Entry) -> tuple[Path, ...]:
        """Where the staging of ``entry`` may read: the allowed source roots, and for an
        adoption the incoming folder too (its files are the daemon's own, delivered
        there). The request check and the staging process both take it from here."""
        return self._roots(adopting=entry.delivery is not None)

    def staging_ends(self, entry: Entry) -> Path | None:
        """The folder of the delivery the staging of ``entry`` read, which has ended:
        read once, it goes (the registry removes it), whatever the outcome."""
        if entry.delivery is None:
            return None
        transfer = self.deliveries.find(entry.delivery)
        if transfer is None:
            return None
        self.deliveries.pop(transfer.label)
        return transfer.path

    async def source_files(self, steps: list[Any]) -> list[SourceFile]:
        """The request's source files when they can be broadcast as they are."""
        return await run_io(adoption.broadcastable_sources, steps, self.ops)

    async def export(
        self, entry: Entry, request: ExportCreate, staging_tree: Path | None, ready: ReadyTree
    ) -> ExportPublic:
        """Pack part ``request.part`` of ``entry`` for sbcast. With ``early``: of the
        tree it is still staging (``staging_tree``; None: not staging yet). Else of its
        ready tree: the first part (or the first after early parts) asks ``ready`` for
        that tree, plans the parts and is admitted for them; the others come in order,
        each packed while the one before is on its way."""
        if request.early:
            answer = await self._export_early(entry, request, staging_tree)
        else:
            answer = await self._export_ready(entry, request, ready)
        answer.vouched = self._vouches_for(entry)
        if answer.vouched and answer.manifest_sha256 is not None:
            answer.manifest_credential = await run_io(
                vouch.vouch, entry.key, answer.manifest_sha256, self.settings.munge_socket
            )
        return answer

    def _vouches_for(self, entry: Entry) -> bool:
        """Whether this service vouches for the manifest of ``entry`` (stager.vouch): the
        node service does, for an entry every user shares, where munge is installed."""
        shared = entry.reader is not None and entry.reader.public
        return self.settings.multi_user and shared and vouch.available()

    async def _export_ready(
        self, entry: Entry, request: ExportCreate, ready: ReadyTree
    ) -> ExportPublic:
        label, part = request.label, request.part
        plan = self.plans.get(label)
        resuming = plan is not None and plan.early and part == plan.packed
        if part == 0 or resuming:
            tree = await ready(entry)
            if plan is not None and resuming:
                await self._locked(plan, label, plan_rest, plan, tree)
            else:
                await self._plan_export(entry, tree, label, request.part_bytes or PART_BYTES)
        plan = self._plan(label, part)
        if part >= plan.count or plan.early:
            raise Conflict(
                f"export {label!r} has {plan.packed} of {plan.count} parts packed; "
                f"ask for part {plan.packed}, not {part}"
            )
        transfer = self.exports.renew(label, EXPORT_TTL_S)
        return await self._locked(plan, label, pack_export_part, plan, transfer)

    async def expire(self) -> list[Path]:
        """Reservations and exports past their time (a job that died): removed."""
        gone = [*self.deliveries.expired(), *self.exports.expired()]
        for transfer in gone:
            self.plans.pop(transfer.label, None)
            await run_io(remove_folder, transfer.path)
        return [t.path for t in gone]

    # ---- the API's reservations and exports ---------------------------------------------

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
        transfer = self.deliveries.get(label)  # NotFound, with its sentence
        if not transfer.claimed:
            await self._discard(transfer)
        return transfer_public(transfer)

    async def _discard(self, delivery: Transfer) -> None:
        self.deliveries.pop(delivery.label)
        await run_io(remove_folder, delivery.path)

    async def drop_export(self, label: str) -> TransferPublic:
        transfer = self.exports.pop(label)
        self.plans.pop(label, None)
        await run_io(remove_folder, transfer.path)
        return transfer_public(transfer)

    # ---- inside ----------------------------------------------------------------------------

    def _check_adoption(self, steps: list[Any], verify: str) -> int:
        """Pre-flight of an adoption (blocking)."""
        roots = self._roots(adopting=True)
        return self.ops.check(steps, CheckContext(allowed_roots=roots, verify=verify))

    def _roots(self, adopting: bool) -> tuple[Path, ...]:
        roots = tuple(self.settings.allowed_roots)
        if adopting and roots:  # no roots: anywhere the daemon can read already
            roots = (*roots, self.settings.incoming_dir)
        return roots

    async def _export_early(
        self, entry: Entry, request: ExportCreate, tree: Path | None
    ) -> ExportPublic:
        """The next early part of ``entry``, which is staging into ``tree`` (None:
        queued), or none yet; once it is not staging any more, say so: its remaining
        parts are asked for without ``early``."""
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
            packed, retry = await self._locked(plan, label, pack_early_part, plan, transfer, tree)
        except StagerError:
            # The staging moved its tree (published) or removed a file while it was read:
            # nothing was sent; the next look sees where it stands.
            packed, retry = None, RETRY_MIN_S
        return packed or early_public(plan, transfer, more=True, retry_after_s=retry)

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

    async def _plan_export(self, entry: Entry, tree: Path, label: str, part_bytes: int) -> None:
        if label in self.plans:
            await self.drop_export(label)  # asked again from the start: a re-run step
        async with self._admission:
            self._planning.append(entry.key)  # from here on, never evicted under the packer
        try:
            plan = await run_io(plan_export, tree, entry.key, part_bytes)
            async with self._admission:
                await self._admit(plan.total_bytes, entry.key)
                self.exports.add(label, plan.total_bytes, EXPORT_TTL_S)
                self.plans[label] = plan
        except OSError as exc:
            raise from_os_error(exc, f"listing {tree} to send it") from exc
        finally:
            self._planning.remove(entry.key)


def early_public(plan: ExportPlan, transfer: Transfer, **fields: Any) -> ExportPublic:
    """An early export's answer without a part: none yet, or (``more`` False) no more."""
    return ExportPublic(id=transfer.label, key=plan.key, part=plan.packed, parts=plan.packed,
                        total_bytes=transfer.nbytes, data_bytes=plan.data_bytes,
                        **fields)  # fmt: skip


def transfer_public(transfer: Transfer) -> TransferPublic:
    return TransferPublic(
        id=transfer.label,
        path=str(transfer.path),
        bytes=transfer.nbytes,
        expires_at=transfer.expires_at,
    )
