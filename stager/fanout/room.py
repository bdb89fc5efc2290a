"""A daemon's share of multi-node fan-out (docs/multinode.md): its books and the room on
its cache disk that broadcasts take: deliveries (room reserved for what another node
sbcasts here, ``incoming/``; one a staging adopts is *claimed*, kept and counted until
that staging ends) and exports (datasets packed to be sent, ``outgoing/``). Both count
as promised room in admission until they are gone, both expire, and a restart deletes
them. The engine calls in through one hook per phase (``arrival``, ``held``,
``admitted``, ``staging_starts``/``staging_ends``, ``export``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from stager.core import vouch
from stager.core.errors import (
    BadRequest,
    Conflict,
    NotFound,
    StagerError,
    UserProcessUnanswered,
    from_os_error,
)
from stager.core.identity import Caller
from stager.core.settings import Settings
from stager.engine.admission import Admission, Held
from stager.fanout import adoption
from stager.fanout.bundle import PART_BYTES
from stager.fanout.early import RETRY_MIN_S, part_bytes_for
from stager.fanout.packing import (
    ExportPlan,
    Transfer,
    bundle_estimate,
    folder_bytes,
    make_folder,
    pack_early_part,
    pack_export_part,
    plan_export,
    plan_rest,
    remove_folder,
)
from stager.fs.credentials import Reader
from stager.ops import table
from stager.ops.base import CheckContext
from stager.ops.copy_from_node import CopyFromNodeStep
from stager.staging.blocking import run_io
from stager.staging.publish import remove_delivery
from stager.state.dataset import Entry, State, now
from stager.wire.manifest_format import Manifest
from stager.wire.schemas import (
    DatasetCreate,
    ExportCreate,
    ExportPublic,
    IncomingCreate,
    SourceFile,
    TransferPublic,
)

log = logging.getLogger("stager.fanout")

EXPORT_TTL_S = 3600.0

AsUser = Callable[..., Awaitable[Any]]  # (uid or caller, fn, *args) -> fn's JSON result
ReadyTree = Callable[[Entry], Awaitable[Path]]
# A dataset kind's export as one file (stager.kinds.base.Kind.export), None: in parts.
WholeExport = Callable[..., Awaitable["ExportPublic | None"]]


def transfer_key(owner: Caller | None, label: str) -> str:
    """``label``, or in the node service ``<uid>/<label>``: each user's own namespace."""
    return label if owner is None else f"{owner.uid}/{label}"


class Transfers:
    """The books of exports or deliveries under one folder, by :func:`transfer_key`."""

    def __init__(self, root: Path, kind: str, changed: Callable[[], None] = lambda: None) -> None:
        self.root = root
        self.kind = kind  # "export" or "delivery", for messages
        self._live: dict[str, Transfer] = {}
        self._changed = changed  # told of every booking and every transfer gone

    def live(self) -> list[Transfer]:
        return list(self._live.values())

    def items(self) -> list[tuple[str, Transfer]]:
        return list(self._live.items())

    def find(self, key: str) -> Transfer | None:
        return self._live.get(key)

    def add(
        self, key: str, label: str, nbytes: int, ttl_s: float, owner: Caller | None = None
    ) -> Transfer:
        """Book ``key`` (again: the same key renews it, as a re-run step would)."""
        expires_at = now() + timedelta(seconds=ttl_s)
        transfer = Transfer(label, self.root / key, nbytes, expires_at)
        if owner is not None:
            transfer.owner, transfer.group = owner.uid, owner.gid
        self._live[key] = transfer
        self._changed()
        return transfer

    def renew(self, key: str, ttl_s: float) -> Transfer:
        """Every part asked for renews an export, so a long staging sending early parts
        does not outlive it."""
        transfer = self.get(key)
        transfer.expires_at = now() + timedelta(seconds=ttl_s)
        return transfer

    def get(self, key: str) -> Transfer:
        transfer = self._live.get(key)
        if transfer is None:
            label = key.rpartition("/")[2]
            raise NotFound(
                f"no {self.kind} {label!r} of yours on this node (released, expired, or this "
                "daemon restarted since); start the multi-node staging again"
            )
        return transfer

    def pop(self, key: str) -> Transfer:
        transfer = self.get(key)
        del self._live[key]
        self._changed()
        return transfer

    def keep(self, key: str, transfer: Transfer) -> None:
        """Back on the books: an expired one that could not be removed yet."""
        self._live.setdefault(key, transfer)
        self._changed()

    def expired(self) -> dict[str, Transfer]:
        """Unclaimed transfers past their time, taken off the books, by key."""
        at = now()
        gone = [k for k, t in self._live.items() if t.expires_at <= at and not t.claimed]
        expired = {key: self._live.pop(key) for key in gone}
        self._changed()
        return expired


@dataclass(frozen=True)
class PeerCopy:
    """A prefetch that copies its data from another planned node of its job: the
    planner's copy credential for it, and the order that credential signs."""

    node: str
    address: str  # its prefetch port, HOST:PORT
    authorization: str
    order: bytes
    job: int


# Set by the prefetch service while it submits a copy: the order is the proof, so no
# request a user sends can ask for one (a wire field could be sent by anyone).
COPYING: ContextVar[PeerCopy | None] = ContextVar("COPYING", default=None)


@dataclass(frozen=True)
class Arrival:
    """How a request's data arrives: its steps, origin and (a miss) size."""

    steps: list[Any]
    origin: dict[str, Any]
    estimate: int | None = None
    delivery: str | None = None  # the key of the caller's delivery it brought


class FanoutRoom:
    def __init__(self, settings: Settings, ops: Any, admission: Admission, as_user: AsUser):
        self.settings = settings
        self.ops = ops
        # A delivery's folder is its user's: whatever looks into it or deletes it runs
        # as that user, never under the admission lock.
        self._as_user = as_user
        self._admission = admission.lock  # held while room is promised
        self._admit = admission.make_room  # evicts, or refuses with the sizes
        # Whether any transfer is booked or export listed: admission asks ``held`` and
        # ``exporting`` only then, so a request with no fan-out never comes here.
        self.holding = False
        self.deliveries = Transfers(settings.incoming_dir, "delivery", self._note)
        self.exports = Transfers(settings.outgoing_dir, "export", self._note)
        self.plans: dict[str, ExportPlan] = {}  # exports under way, by label
        self._sweeping: set[int | None] = set()  # owners whose deliveries a sweep holds
        self._planning: list[str] = []  # keys of exports being listed (part 0)

    def _note(self) -> None:
        self.holding = bool(self.deliveries.live() or self.exports.live() or self._planning)

    # ---- the engine's hooks ------------------------------------------------------------

    async def arrival(
        self,
        request: DatasetCreate,
        caller: Caller,
        steps: list[Any],
        key: str,
        shared_key: str,
        reader: Reader | None,
        miss: bool,
    ) -> Arrival:
        """What an adoption of ``caller``'s delivery, or a prefetch's copy from another
        node (``COPYING``), stages; a miss is checked here, before admission."""
        adopt = request.adopt
        peer = COPYING.get()
        if peer is not None and adopt is None:
            return await self._copied(peer, request, caller, steps, (key, shared_key), miss)
        assert adopt is not None, "only an adoption or a peer's copy arrives by the room"
        delivery_key = transfer_key(self._owner(caller), adopt.incoming)
        delivery = self.deliveries.get(delivery_key)
        origin = {"how": "broadcast", "node": adopt.origin_node, "job": adopt.job}
        origin["bytes"] = delivery.nbytes
        if not miss:
            return Arrival(steps, origin, delivery=delivery_key)
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
        # Shared, or an image (parsed by the kernel, whoever's it is): the origin node's
        # service vouches, not the job.
        if reader is not None and (reader.vouched or adopt.image is not None):
            vouch = adoption.Vouch(os.geteuid(), key, self.settings.munge_socket)
        own = not self.settings.multi_user
        adopting = adoption.steps_for(adopt, delivery.path, steps, self.ops, vouch, own)
        roots = self._roots(adopting=True)
        dumped = self.ops.dump_steps(adopting)
        estimate = int(
            await self._as_user(
                caller, check_adoption, self.settings, dumped, request.verify, roots
            )
        )
        return Arrival(adopting, origin, estimate, delivery_key)

    async def _copied(
        self,
        peer: PeerCopy,
        request: DatasetCreate,
        caller: Caller,
        steps: list[Any],
        keys: tuple[str, str],
        miss: bool,
    ) -> Arrival:
        """A prefetch copied from ``peer`` (docs/prestaging.md, "4-node job"): one step
        that receives its ready tree and checks it against the manifest the peer's
        service vouched for, for this node's key (computed as the job's user) or the
        shared one (``keys``)."""
        key, shared_key = keys
        origin = {"how": "broadcast", "node": peer.node, "job": str(peer.job)}
        if not miss:
            return Arrival(steps, origin)
        estimate = int(
            await self._as_user(
                caller, check_adoption, self.settings, self.ops.dump_steps(steps),
                request.verify, self._roots(adopting=False),
            )
        )  # fmt: skip
        # The tar of the tree and its manifest: twice the tree bounds both.
        limit = 2 * estimate + (64 << 20)
        step = CopyFromNodeStep(
            address=peer.address,
            origin_node=peer.node,
            authorization=peer.authorization,
            order=peer.order.decode(),
            vouch_uid=os.geteuid(),
            vouch_key=key,
            shared_key=shared_key,
            munge_socket=str(self.settings.munge_socket) if self.settings.munge_socket else None,
            limit_bytes=limit,
            wait_s=self.settings.prefetch_copy_wait_s,
        )
        copying = self.ops.validate_steps([{"op": "copy_from_node", **step.model_dump()}])
        # Admission counts the tree and the tar beside it until the staging ends.
        return Arrival(copying, origin, estimate + limit)

    async def held(self) -> Held:
        """For admission: room promised and not written; each user's transfers count
        against their quota with the larger of what they reserved and wrote."""
        exports = self.exports.live()
        exported = await run_io(lambda: [folder_bytes(t.path) for t in exports])
        transfers = [*self.deliveries.live(), *exports]
        written = [t.written for t in self.deliveries.live()] + exported
        unwritten, reserved_by = 0, {}
        for transfer, nbytes in zip(transfers, written, strict=True):
            unwritten += max(0, transfer.nbytes - nbytes)
            if transfer.owner is not None:
                held = max(transfer.nbytes, nbytes)
                reserved_by[transfer.owner] = reserved_by.get(transfer.owner, 0) + held
        return Held(unwritten, self.exporting, reserved_by)

    @property
    def exporting(self) -> set[str]:
        """Keys with parts still to pack: never evicted under the packer."""
        unpacked = {p.key for p in self.plans.values() if p.early or p.packed < p.count}
        return unpacked | set(self._planning)

    async def admitted(self, arrival: Arrival, entry: Entry) -> None:
        """A delivery is claimed when its request queued a staging with it, else
        released (the request joined or hit)."""
        if arrival.delivery is None or (transfer := self.deliveries.find(arrival.delivery)) is None:
            return
        if entry.delivery == arrival.delivery:
            transfer.claimed = True
        elif not transfer.claimed:
            await self._remove_delivery(self.deliveries.pop(arrival.delivery))

    def staging_starts(self, entry: Entry) -> tuple[Path, ...]:
        """Where the staging of ``entry`` may read: the allowed roots, and for an
        adoption the incoming folder too."""
        return self._roots(adopting=entry.delivery is not None)

    def staging_ends(self, entry: Entry) -> Path | None:
        """The folder of the delivery an ended staging read: the registry removes it."""
        if entry.delivery is None:
            return None
        transfer = self.deliveries.find(entry.delivery)
        if transfer is None:
            return None
        self.deliveries.pop(entry.delivery)
        return transfer.path

    async def source_files(self, steps: list[Any], caller: Caller) -> list[SourceFile]:
        """The request's source files that can be broadcast as they are."""
        dumped = self.ops.dump_steps(steps)
        found = await self._as_user(caller, source_files, self.settings, dumped)
        return [SourceFile(**item) for item in found]

    async def export(
        self,
        entry: Entry,
        request: ExportCreate,
        caller: Caller,
        staging_tree: Path | None,
        ready: ReadyTree,
        whole: WholeExport,
    ) -> ExportPublic:
        """Pack part ``request.part`` of ``entry`` for sbcast: with ``early``, of the
        tree it is still staging (``staging_tree``; None: not yet); else of the tree
        ``ready`` gives, planned and admitted at the first part. A kind that goes as one
        file (``whole``) sends it as the only part, unless ``tree`` asks for parts."""
        owner = self._owner(caller)
        first = request.part == 0 and not request.early and not request.tree
        if first and (sent := await whole(entry, request, owner, ready, self)):
            return sent
        if request.early:
            answer = await self._export_early(entry, request, owner, staging_tree)
        else:
            answer = await self._export_ready(entry, request, owner, ready)
        answer.vouched = self._vouches_for(entry)
        if answer.vouched and answer.manifest_sha256 is not None:
            answer.manifest_credential = await run_io(
                vouch.vouch, entry.key, answer.manifest_sha256, self.settings.munge_socket
            )
        return answer

    async def send_file(
        self,
        entry: Entry,
        request: ExportCreate,
        owner: Caller | None,
        size: int,
        copy: Callable[[Transfer], tuple[Path, int, str]],
    ) -> tuple[Path, int, str, str | None]:
        """One file of ``entry`` sent whole: ``size`` booked as an export, ``copy`` run
        into its folder, and in the node service its sha256 vouched for whoever's it
        is (the receivers' kernels parse it). The copy's path, size, sha256, credential."""
        key, label = transfer_key(owner, request.label), request.label
        if self.exports.find(key) is not None:
            await self._drop_export(key)  # asked again from the start: a re-run step
        async with self._admission:
            await self._admit(size, entry.key, self._quota_owner(owner))
            self._planning.append(entry.key)  # never evicted while it is copied
            self._note()
            transfer = self.exports.add(key, label, size, EXPORT_TTL_S, owner)
        try:
            await run_io(make_folder, transfer)
            path, size, sha256 = await run_io(copy, transfer)
        except OSError as exc:
            raise from_os_error(exc, f"copying {entry.key} to send it") from exc
        finally:
            self._planning.remove(entry.key)
            self._note()
        credential = None
        if self.settings.multi_user and vouch.available():
            socket = self.settings.munge_socket
            credential = await run_io(vouch.vouch, entry.key, sha256, socket, vouch.IMAGE)
        return path, size, sha256, credential

    def _vouches_for(self, entry: Entry) -> bool:
        """The node service vouches for a shared entry's manifest where munge is."""
        shared = entry.reader is not None and entry.reader.public
        return self.settings.multi_user and shared and vouch.available()

    async def _export_ready(
        self, entry: Entry, request: ExportCreate, owner: Caller | None, ready: ReadyTree
    ) -> ExportPublic:
        part, key = request.part, transfer_key(owner, request.label)
        plan = self.plans.get(key)
        resuming = plan is not None and plan.early and part == plan.packed
        if part == 0 or resuming:
            tree = await ready(entry)
            if plan is not None and resuming:
                await self._locked(plan, key, plan_rest, plan, tree)
            else:
                part_bytes = request.part_bytes or PART_BYTES
                await self._plan_export(entry, tree, key, owner, part_bytes)
        plan = self._plan(key, part)
        if part >= plan.count or plan.early:
            raise Conflict(
                f"export {request.label!r} has {plan.packed} of {plan.count} parts packed; "
                f"ask for part {plan.packed}, not {part}"
            )
        transfer = self.exports.renew(key, EXPORT_TTL_S)
        return await self._locked(plan, key, pack_export_part, plan, transfer)

    async def expire(self, spawn: Callable[[Awaitable[None], str], None]) -> None:
        """Remove transfers past their time and deliveries grown past their room. Each
        owner's deliveries are swept as that owner in a task of their own (``spawn``):
        one whose process does not answer is left out of later rounds meanwhile."""
        exports = self.exports.expired()
        for key in exports:
            self.plans.pop(key, None)
        for transfer in exports.values():
            await run_io(remove_folder, transfer.path)
            log.info("removed expired %s", transfer.path)
        owners: dict[int | None, tuple[list[tuple[str, Transfer]], dict[str, Transfer]]] = {}
        for key, transfer in self.deliveries.expired().items():  # off the books first
            owners.setdefault(transfer.owner, ([], {}))[1][key] = transfer
        for key, transfer in list(self.deliveries.items()):
            owners.setdefault(transfer.owner, ([], {}))[0].append((key, transfer))
        for owner, (booked, ended) in owners.items():
            if owner in self._sweeping:  # its last round still waits on its process
                for key, transfer in ended.items():
                    self.deliveries.keep(key, transfer)
                continue
            self._sweeping.add(owner)
            spawn(self._sweep_owner(owner, booked, ended), f"delivery sweep of uid {owner}")

    async def _sweep_owner(
        self, owner: int | None, booked: list[tuple[str, Transfer]], ended: dict[str, Transfer]
    ) -> None:
        """One owner's ``booked`` deliveries measured, those grown past their room removed
        with ``ended``; an owner that does not answer keeps the rest for a later round."""
        removed: set[str] = set()
        try:
            answered = True
            try:
                for key, transfer in booked:
                    # Released by its job meanwhile (then gone, and measured as grown):
                    # no longer the sweep's.
                    if await self._overgrown(transfer) and self.deliveries.find(key) is transfer:
                        ended[key] = self.deliveries.pop(key)
            except UserProcessUnanswered as exc:
                answered = False
                log.warning("could not measure a delivery of uid %s: %s", owner, exc)
            for key, transfer in ended.items():
                if answered:
                    try:
                        await self._remove_delivery(transfer)
                        removed.add(key)
                        log.info("removed expired %s", transfer.path)
                        continue
                    except UserProcessUnanswered as exc:
                        answered = False
                        log.warning("could not remove delivery %s: %s", transfer.path, exc)
        except Exception:  # a task of its own: said here, and the next round tries again
            log.exception("the sweep of uid %s's deliveries failed", owner)
        finally:
            for key, transfer in ended.items():
                if key not in removed:  # still booked: tried again in a later round
                    self.deliveries.keep(key, transfer)
            self._sweeping.discard(owner)

    async def _overgrown(self, transfer: Transfer) -> bool:
        """Whether an unclaimed delivery holds more than its room (unmeasurable: yes)."""
        try:
            transfer.written = int(await self._as_user(transfer.owner, folder_bytes, transfer.path))
        except UserProcessUnanswered:
            raise
        except (OSError, StagerError) as exc:
            transfer.written = transfer.nbytes + 1
            log.warning("could not measure delivery %s: %s", transfer.path, exc)
        if transfer.written <= transfer.nbytes or transfer.claimed:
            return False
        log.warning(
            "ending delivery %s: it holds %d bytes, past the %d reserved",
            transfer.path,
            transfer.written,
            transfer.nbytes,
        )
        return True

    async def clear_deliveries(self) -> None:
        """At start: an earlier run's deliveries, deleted by their owners at once (one
        that does not answer keeps theirs until the next start)."""
        folders = await run_io(lambda: sorted(self.settings.incoming_dir.iterdir()))
        cleared = [self._clear_owner(folder) for folder in folders]
        for outcome in await asyncio.gather(*cleared, return_exceptions=True):
            if isinstance(outcome, BaseException):  # raised once every owner's is done
                raise outcome

    async def _clear_owner(self, folder: Path) -> None:
        if not self.settings.multi_user:
            await run_io(remove_folder, folder)
            return
        uid = int(folder.name) if folder.name.isdigit() else None
        try:
            for label in await run_io(lambda: sorted(folder.iterdir())):
                await remove_delivery(self._as_user, uid, label)
        except UserProcessUnanswered as exc:
            log.warning("deliveries of uid %s left for the next start: %s", uid, exc)
            return
        with contextlib.suppress(OSError):  # not empty: left for the next start
            await run_io(folder.rmdir)

    async def _remove_delivery(self, transfer: Transfer) -> None:
        if self.settings.multi_user:
            await remove_delivery(self._as_user, transfer.owner, transfer.path)
        else:
            await run_io(remove_folder, transfer.path)

    # ---- the API's reservations and exports: each caller's own ---------------------------

    async def reserve(self, request: IncomingCreate, caller: Caller) -> TransferPublic:
        """Room for a delivery, counted by admission until it goes; the same label
        again (a re-run step) gets the same reservation."""
        owner = self._owner(caller)
        key = transfer_key(owner, request.label)
        async with self._admission:
            transfer = self.deliveries.find(key)
            if transfer is None:
                # A user's own (a running job's fan-out): it may evict data only
                # prefetches hold, as its request would (admission.speculative).
                await self._admit(request.bytes, "", self._quota_owner(owner), request=True)
                transfer = self.deliveries.add(
                    key, request.label, request.bytes, request.ttl_s, owner
                )
        await run_io(make_folder, transfer, True)
        return transfer_public(transfer)

    async def release(self, label: str, caller: Caller) -> TransferPublic:
        """Drop a reservation and its delivery, unless a staging adopts it."""
        key = transfer_key(self._owner(caller), label)
        transfer = self.deliveries.get(key)  # NotFound, with its sentence
        if not transfer.claimed:
            await self._remove_delivery(self.deliveries.pop(key))
        return transfer_public(transfer)

    async def drop_export(self, label: str, caller: Caller) -> TransferPublic:
        return await self._drop_export(transfer_key(self._owner(caller), label))

    # ---- inside ----------------------------------------------------------------------------

    def _owner(self, caller: Caller) -> Caller | None:
        return caller if self.settings.multi_user else None

    @staticmethod
    def _quota_owner(owner: Caller | None) -> int | None:
        return owner.uid if owner is not None and not owner.is_root else None

    async def _drop_export(self, key: str) -> TransferPublic:
        transfer = self.exports.pop(key)
        self.plans.pop(key, None)
        await run_io(remove_folder, transfer.path)
        return transfer_public(transfer)

    def _roots(self, adopting: bool) -> tuple[Path, ...]:
        roots = tuple(self.settings.allowed_roots)
        if adopting and roots:  # no roots: anywhere the daemon can read already
            roots = (*roots, self.settings.incoming_dir)
        return roots

    async def _export_early(
        self, entry: Entry, request: ExportCreate, owner: Caller | None, tree: Path | None
    ) -> ExportPublic:
        """The next early part of ``entry`` staging into ``tree`` (None: queued), or none
        yet; once it stopped staging, the rest are asked for without ``early``."""
        part, key = request.part, transfer_key(owner, request.label)
        if part == 0 and key not in self.plans:
            nbytes = bundle_estimate(entry.estimate_bytes, 0)
            async with self._admission:
                await self._admit(nbytes, entry.key, self._quota_owner(owner))
                self.exports.add(key, request.label, nbytes, EXPORT_TTL_S, owner)
                part_bytes = request.part_bytes or part_bytes_for(entry.estimate_bytes,
                                                                  PART_BYTES)  # fmt: skip
                self.plans[key] = ExportPlan(Path(), entry.key, [], Manifest(),
                                             entry.estimate_bytes, part_bytes, early=True,
                                             scratch=self.ops.scratch(entry.steps),
                                             sized_by_staging=not request.part_bytes)  # fmt: skip
        plan = self._plan(key, part)
        if not plan.early:
            raise Conflict(f"export {request.label!r} is past its early parts; ask without 'early'")
        if plan.sized_by_staging:  # a download's size is known once it started
            size = max(entry.estimate_bytes, entry.progress.bytes_total)
            plan.part_bytes = max(plan.part_bytes, part_bytes_for(size, PART_BYTES))
        transfer = self.exports.renew(key, EXPORT_TTL_S)
        await run_io(make_folder, transfer)
        staging = entry.state in (State.QUEUED, State.STAGING)
        if tree is None or not staging:
            return early_public(plan, transfer, more=staging, retry_after_s=RETRY_MIN_S)
        try:
            packed, retry = await self._locked(plan, key, pack_early_part, plan, transfer, tree)
        except StagerError:
            # The staging moved its tree (published) or removed a file while it was read:
            # nothing was sent; the next look sees where it stands.
            packed, retry = None, RETRY_MIN_S
        return packed or early_public(plan, transfer, more=True, retry_after_s=retry)

    def _plan(self, key: str, part: int) -> ExportPlan:
        plan, label = self.plans.get(key), key.rpartition("/")[2]
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

    async def _locked(self, plan: ExportPlan, key: str, work: Any, *args: Any) -> Any:
        """``work(*args)`` off the event loop, as the one piece of work on ``plan``."""
        plan.packing = True
        try:
            return await run_io(work, *args)
        except OSError as exc:
            label = key.rpartition("/")[2]
            raise from_os_error(exc, f"packing export {label!r} to send it") from exc
        finally:
            plan.packing = False

    async def _plan_export(
        self, entry: Entry, tree: Path, key: str, owner: Caller | None, part_bytes: int
    ) -> None:
        if key in self.plans:
            await self._drop_export(key)  # asked again from the start: a re-run step
        async with self._admission:
            self._planning.append(entry.key)  # from here on, never evicted under the packer
            self._note()
        try:
            plan = await run_io(plan_export, tree, entry.key, part_bytes)
            async with self._admission:
                await self._admit(plan.total_bytes, entry.key, self._quota_owner(owner))
                label = key.rpartition("/")[2]
                transfer = self.exports.add(key, label, plan.total_bytes, EXPORT_TTL_S, owner)
                self.plans[key] = plan
            await run_io(make_folder, transfer)
        except OSError as exc:
            raise from_os_error(exc, f"listing {tree} to send it") from exc
        finally:
            self._planning.remove(entry.key)
            self._note()


def check_adoption(
    settings: Settings, dumped: list[dict[str, Any]], verify: str, roots: tuple[Path, ...]
) -> int:
    """Run as the user whose delivery it reads."""
    ops = table.for_settings(settings)
    steps = ops.validate_steps(dumped)
    return int(ops.check(steps, CheckContext(allowed_roots=roots, verify=verify)))


def source_files(settings: Settings, dumped: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run as the user who asks."""
    ops = table.for_settings(settings)
    steps = ops.validate_steps(dumped)
    return [f.model_dump() for f in adoption.broadcastable_sources(steps, ops)]


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
