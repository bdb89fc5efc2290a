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
  claimed delivery it read, which the registry then removes (:mod:`stager.engine.lifecycle`);
- ``export``: the next part of a dataset to send.

The API's reservations (``/v1/incoming``, ``/v1/exports``) come here directly. The
blocking file work runs off the event loop in :mod:`stager.fanout.packing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
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
from stager.state.dataset import Entry, State
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


def _now() -> datetime:
    return datetime.now(UTC)


def transfer_key(owner: Caller | None, label: str) -> str:
    """Where a transfer is booked and kept, under its kind's folder: ``label``, and in
    the node service ``<uid>/<label>``: every user names their transfers for
    themselves, and nobody else's label reaches theirs."""
    return label if owner is None else f"{owner.uid}/{label}"


class Transfers:
    """The books of one kind of transfer (exports or deliveries) under one folder, each
    by its key (:func:`transfer_key`)."""

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
        expires_at = _now() + timedelta(seconds=ttl_s)
        transfer = Transfer(label, self.root / key, nbytes, expires_at)
        if owner is not None:
            transfer.owner, transfer.group = owner.uid, owner.gid
        self._live[key] = transfer
        self._changed()
        return transfer

    def renew(self, key: str, ttl_s: float) -> Transfer:
        """``key``, living ``ttl_s`` from now: an export is renewed by every part asked
        for, so a long staging sending early parts does not outlive its export."""
        transfer = self.get(key)
        transfer.expires_at = _now() + timedelta(seconds=ttl_s)
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
        """Back on the books: one taken off (expired) that could not be removed yet."""
        self._live.setdefault(key, transfer)
        self._changed()

    def expired(self) -> dict[str, Transfer]:
        """Unclaimed transfers past their time, taken off the books, by key."""
        now = _now()
        gone = [k for k, t in self._live.items() if t.expires_at <= now and not t.claimed]
        expired = {key: self._live.pop(key) for key in gone}
        self._changed()
        return expired


@dataclass(frozen=True)
class PeerCopy:
    """A prefetch that copies its data from another planned node of its job
    (stager.prestage.prefetch): that node's name and prefetch port (HOST:PORT), the
    planner's copy credential for it, and the order that credential signs."""

    node: str
    address: str
    authorization: str
    order: bytes
    job: int


# Set by the prefetch service while it submits a copy: the order is the proof, so no
# request a user sends can ask for one (a wire field could be sent by anyone).
COPYING: ContextVar[PeerCopy | None] = ContextVar("COPYING", default=None)


@dataclass(frozen=True)
class Arrival:
    """How a request's data arrives: the steps it stages with (an adoption's, or the
    request's own), where it comes from, and (an adoption that misses) its size."""

    steps: list[Any]
    origin: dict[str, Any]
    estimate: int | None = None
    delivery: str | None = None  # the key of the caller's delivery it brought


class FanoutRoom:
    def __init__(self, settings: Settings, ops: Any, admission: Admission, as_user: AsUser):
        self.settings = settings
        self.ops = ops
        # A delivery's folder is its user's to write: whatever looks into it or deletes
        # it runs as that user (stager.rights), never under the admission lock.
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
        """What ``caller``'s ``request`` of a delivery of theirs (expanded to ``steps``,
        cache key ``key``, or ``shared_key`` were it shared by every user) stages, read
        with ``reader``'s rights: the delivery's steps, checked before admission when
        it misses (a hit or a join stages nothing); or a prefetch's copy from another
        planned node (``COPYING``). Only these come here."""
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
        that receives the source node's ready tree and checks it against the manifest
        that node's service vouched for, for ``key``, this node's own key for the
        request (computed as the job's user: what they may not read here, they get no
        copy of), or the request's shared key (``keys``: this node's, and the shared one)
        when this node keeps it as the user's own. Its size is the request's own estimate
        (checked as the user) and the bound of the tar held beside the tree."""
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
        # What it may write: the tree, and the tar it holds beside it while it extracts;
        # admission counts both until the staging ends.
        return Arrival(copying, origin, estimate + limit)

    async def held(self) -> Held:
        """For admission (under its lock): what the room holds. Room promised and not
        written yet is not free; each user's transfers count against their quota with
        what they reserved, or what they wrote if that is more."""
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
        """``entry`` answers a request that arrived with a delivery: claimed when the
        request queued its staging with it (``entry.delivery``), else not needed (the
        request joined or hit) and released."""
        if arrival.delivery is None or (transfer := self.deliveries.find(arrival.delivery)) is None:
            return
        if entry.delivery == arrival.delivery:
            transfer.claimed = True
        elif not transfer.claimed:
            await self._discard(arrival.delivery)

    def staging_starts(self, entry: Entry) -> tuple[Path, ...]:
        """Where the staging of ``entry`` may read: the allowed source roots, and for an
        adoption the incoming folder too (what was delivered there, read with the rights
        of the user whose job delivered it). The request check and the staging process
        both take it from here."""
        return self._roots(adopting=entry.delivery is not None)

    def staging_ends(self, entry: Entry) -> Path | None:
        """The folder of the delivery the staging of ``entry`` read, which has ended:
        read once, it goes (the registry removes it), whatever the outcome."""
        if entry.delivery is None:
            return None
        transfer = self.deliveries.find(entry.delivery)
        if transfer is None:
            return None
        self.deliveries.pop(entry.delivery)
        return transfer.path

    async def source_files(self, steps: list[Any], caller: Caller) -> list[SourceFile]:
        """The request's source files when they can be broadcast as they are (looked at
        as the caller)."""
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
        """Pack part ``request.part`` of ``entry`` for sbcast. With ``early``: of the
        tree it is still staging (``staging_tree``; None: not staging yet). Else of its
        ready tree: the first part (or the first after early parts) asks ``ready`` for
        that tree, plans the parts and is admitted for them; the others come in order,
        each packed while the one before is on its way. A kind that goes as one file
        (an image: ``whole``, stager.kinds) sends it as the first and only part, unless
        ``tree`` asks for parts."""
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
        """One file of ``entry`` sent whole (stager.kinds.base.Sender): room for its
        ``size`` booked as an export, ``copy`` run into the transfer's folder (off the
        event loop; never evicted meanwhile), and in the node service the copy's sha256
        vouched for (stager.core.vouch) whoever's it is, since the receivers' kernels will
        parse it. The copy's path, size, sha256 and the credential."""
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
        """Whether this service vouches for the manifest of ``entry`` (stager.core.vouch): the
        node service does, for an entry every user shares, where munge is installed."""
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
        """Reservations and exports past their time (a job that died), and deliveries
        grown past what was reserved for them: removed. Called by the sweep, outside
        the admission lock. Each owner's deliveries are measured and removed as that
        owner, in a task of its own (``spawn``): one whose process gives no answer waits
        its whole timeout, and is left out of the rounds that start meanwhile, while
        everyone else's deliveries are swept on."""
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
        """One owner's deliveries: ``booked`` measured, and those grown past their room
        removed with ``ended`` (expired). An owner whose process gives no answer
        (stopped, killed) is asked nothing more this round: what is left stays booked,
        tried again in a later one."""
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
        """Whether a delivery holds more than was reserved for it (measured as its owner;
        one that cannot be measured counts as grown), and no staging reads it."""
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
        """At start: deliveries an earlier run left (nobody will adopt them now), each
        deleted by its owner (the passage ``incoming/<uid>/`` names them), every owner's
        at once. An owner whose process gives no answer keeps theirs until the next
        start."""
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
        """Room on the cache disk for a delivery, counted by admission (and against the
        caller's quota) until it goes. The same label again (a re-run step) gets the
        same reservation."""
        owner = self._owner(caller)
        key = transfer_key(owner, request.label)
        async with self._admission:
            transfer = self.deliveries.find(key)
            if transfer is None:
                await self._admit(request.bytes, "", self._quota_owner(owner))
                transfer = self.deliveries.add(
                    key, request.label, request.bytes, request.ttl_s, owner
                )
        await run_io(make_folder, transfer, True)
        return transfer_public(transfer)

    async def release(self, label: str, caller: Caller) -> TransferPublic:
        """Drop a reservation of the caller's and what was delivered into it. A delivery
        that a staging is adopting stays until that staging ends."""
        key = transfer_key(self._owner(caller), label)
        transfer = self.deliveries.get(key)  # NotFound, with its sentence
        if not transfer.claimed:
            await self._discard(key)
        return transfer_public(transfer)

    async def drop_export(self, label: str, caller: Caller) -> TransferPublic:
        return await self._drop_export(transfer_key(self._owner(caller), label))

    # ---- inside ----------------------------------------------------------------------------

    def _owner(self, caller: Caller) -> Caller | None:
        """Whose a transfer is: in the node service the caller's, else the daemon's."""
        return caller if self.settings.multi_user else None

    @staticmethod
    def _quota_owner(owner: Caller | None) -> int | None:
        """Whose quota a transfer's room counts against: a user's, not root's."""
        return owner.uid if owner is not None and not owner.is_root else None

    async def _discard(self, key: str) -> None:
        await self._remove_delivery(self.deliveries.pop(key))

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
        """The next early part of ``entry``, which is staging into ``tree`` (None:
        queued), or none yet; once it is not staging any more, say so: its remaining
        parts are asked for without ``early``."""
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
    """Pre-flight of an adoption, run as the user whose delivery it reads."""
    ops = table.for_settings(settings)
    steps = ops.validate_steps(dumped)
    return int(ops.check(steps, CheckContext(allowed_roots=roots, verify=verify)))


def source_files(settings: Settings, dumped: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's source files that can be broadcast as they are, as JSON (run as
    the user who asks)."""
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
