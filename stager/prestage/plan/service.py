"""``stager plan``: the planner as a service (docs/prestaging.md, "The planner as a
service"): every ``plan_interval_s`` one squeue call and the changes since the last
interval, each an order to its node's prefetch port with a fresh MUNGE credential over
the order's sha256. An order is a wish the node may refuse: sent :data:`SENDS_AT_ONCE`
at a time, each bounded by :data:`SEND_TIMEOUT_S`; one not delivered (no answer, a 5xx,
a 429) is sent again later, backing off (:class:`Backoff`), but one the node's port had
no place for (its 503 too_many_connections: strangers may hold them) at the next
interval; a refusal (any other 4xx) logged and not repeated. A node that has not
answered for longer than a prefetch lives there (``prefetch_expire_s``) holds nothing
of the planner's any more: its cancels are dropped (:meth:`Service._forget_silent`). At most
``plan_orders_per_interval`` orders an interval, shared round-robin between users
(:func:`fair_share`): the rest wait for the next interval.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx

from stager.core import vouch
from stager.core.downloads import tls_context
from stager.core.settings import Settings, host_port
from stager.prestage.plan import state
from stager.prestage.plan.changes import Changes
from stager.prestage.plan.planner import Planner
from stager.prestage.plan.planning import Prefetch
from stager.prestage.plan.squeue import SqueueError
from stager.prestage.prefetch.authority import COPY, COPY_HEADER, WHAT
from stager.staging.blocking import run_io

log = logging.getLogger("stager.prestage.plan")

SEND_TIMEOUT_S = 5.0  # an order is queued on the node, not staged: it answers in ms
SENDS_AT_ONCE = 32


T = TypeVar("T")


@dataclass(frozen=True)
class Order:
    node: str
    body: bytes
    job: str
    prefetch: Prefetch | None  # a start's; None: a cancel
    uid: int = -1  # the job's user: whose share of an interval's orders it takes

    @property
    def key(self) -> tuple[str, str]:
        return self.job, self.node

    @property
    def attempt(self) -> tuple[str, str, str]:
        """What a refusal backs off: (node, job, dataset); a cancel's dataset is ""."""
        return _attempt(self.prefetch) if self.prefetch else (self.node, self.job, "")

    @property
    def copy(self) -> bool:
        """A copy from another planned node: sent once the stages are, with a second
        credential for its source node."""
        return self.prefetch is not None and bool(self.prefetch.source)


def orders(found: Changes, address: Callable[[str], str]) -> list[Order]:
    """One order per start, one cancel per job and node (job ids are numbers: squeue's
    JobID is the raw id, stager.prestage.plan.squeue). A start with a source node is a
    copy from that node's prefetch port, at ``address(source)`` (HOST:PORT)."""
    made: dict[tuple[str, str, str], Order] = {}
    for prefetch, action in [(p, "copy" if p.source else "stage") for p in found.start] + [
        (p, "cancel") for p, _ in found.cancel
    ]:
        body: dict[str, object] = {
            "action": action,
            "job": int(prefetch.job_id),
            "uid": prefetch.uid,
            "gid": prefetch.gid,
            "node": prefetch.node,
        }
        if action == "copy":
            body.update(source=prefetch.source, source_address=address(prefetch.source))
        if action != "cancel":
            body["request"] = prefetch.wanted.request()
            key = (prefetch.job_id, prefetch.node, prefetch.wanted.name)
        else:
            key = (prefetch.job_id, prefetch.node, "")  # a cancel is the job's, on that node
        raw = json.dumps(body, sort_keys=True).encode()
        kept = prefetch if action != "cancel" else None
        made.setdefault(key, Order(prefetch.node, raw, prefetch.job_id, kept, prefetch.uid))
    return list(made.values())


def fair_share(wanted: dict[int, list[T]], limit: int, first: int = 0) -> list[T]:
    """At most ``limit`` of the users' items, one of each user's in turn (in each user's
    own order), beginning with the first user whose uid is ``first`` or above: a user
    with thousands takes no more of an interval than one with a few while both have some."""
    users = sorted(uid for uid, items in wanted.items() if items)
    at = next((i for i, uid in enumerate(users) if uid >= first), 0)
    turn = deque(deque(wanted[uid]) for uid in users[at:] + users[:at])
    chosen: list[T] = []
    while turn and len(chosen) < limit:
        items = turn.popleft()
        chosen.append(items.popleft())
        if items:
            turn.append(items)
    return chosen


class Backoff:
    """Orders a node did not take (a 429 over the user's budget or queue there, no
    answer, a 5xx), per (node, job, dataset): sent again after ``first_s``, then after
    twice as long each time, at most ``most_s`` apart (the horizon: by then the job has
    started or its plan moved). Each try costs a munge, the node's unmunge and its
    fsync'd record; a job never waits for any of it (it stages at its start)."""

    def __init__(self, first_s: float, most_s: float, clock: Callable[[], float]) -> None:
        self.first_s, self.most_s, self.clock = first_s, max(most_s, first_s), clock
        self.until: dict[Hashable, tuple[float, float]] = {}  # key: (not before, last gap)

    def due(self, key: Hashable) -> bool:
        held = self.until.get(key)
        return held is None or self.clock() >= held[0]

    def failed(self, key: Hashable) -> None:
        _, gap = self.until.get(key, (0.0, self.first_s / 2))
        gap = min(gap * 2, self.most_s)
        self.until[key] = (self.clock() + gap, gap)

    def done(self, key: Hashable) -> None:
        self.until.pop(key, None)

    def keep(self, keys: Iterable[Hashable]) -> None:
        """Forget every key but ``keys`` (orders no longer wanted)."""
        wanted = set(keys)
        self.until = {k: v for k, v in self.until.items() if k in wanted}


class Sender:
    """Sends orders to the nodes' prefetch ports: NODE:plan_node_port by the system's
    resolver, or the address ``plan_node_addresses`` gives the node."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port = settings.plan_node_port
        self.addresses = dict(item.split("=", 1) for item in settings.plan_node_addresses)
        self.client = httpx.AsyncClient(
            timeout=SEND_TIMEOUT_S,
            limits=httpx.Limits(max_keepalive_connections=0),  # the node closes each
            verify=tls_context(),  # the process's one: httpx's default, read once
        )
        self.at_once = asyncio.Semaphore(SENDS_AT_ONCE)

    def address(self, node: str) -> str:
        """HOST:PORT of ``node``'s prefetch port."""
        host, port = host_port(self.addresses.get(node) or f"{node}:{self.port}")
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{port}"

    async def _credential(self, what: str, body: bytes) -> str | None:
        payload = json.dumps({"what": what, "sha256": hashlib.sha256(body).hexdigest()})
        settings = self.settings
        return await run_io(
            vouch.encode, payload, settings.munge_socket, settings.prefetch_credential_ttl_s
        )

    async def send(self, order: Order) -> tuple[str, str, bool]:
        """("sent" | "retry" | "busy" | "refused" | "unanswered", why, waiting): "busy",
        the node's port had no place for it (sent again, not backed off); "unanswered",
        no answer of the node's (it, or munged here, is down: as "retry", and the node's
        silence counts); ``waiting``, the node's prefetch
        is staging still, not ready (a copy's source is asked again next interval). A
        copy carries a second credential, over the same body, which its node hands to
        the copy's source node (decoded only there: each credential is used once, on
        one node)."""
        async with self.at_once:
            credential = await self._credential(WHAT, order.body)
            second = await self._credential(COPY, order.body) if order.copy else ""
            if credential is None or second is None:
                return "unanswered", "munged made no credential (is munged running here?)", False
            headers = {"authorization": f"Munge {credential}", "content-type": "application/json"}
            if second:
                headers[COPY_HEADER] = f"Munge {second}"
            try:
                url = f"http://{self.address(order.node)}/v1/prefetches"
                answer = await self.client.post(url, content=order.body, headers=headers)
            except (httpx.HTTPError, OSError, ValueError) as exc:
                return "unanswered", f"{type(exc).__name__}: {exc}".rstrip(": "), False
        if answer.status_code == 200:
            try:
                done = answer.json()["data"]
                waiting = any(p["state"] == "active" and not p["ready"] for p in done)
            except (ValueError, KeyError, TypeError):
                waiting = False  # (a node of an earlier version: its copies wait there)
            return "sent", "", waiting
        try:
            error = answer.json()["error"]
            kind, why = error["type"], error["message"]
        except (ValueError, KeyError, TypeError):
            kind, why = "", answer.text[:200]
        if answer.status_code == 503 and kind == "too_many_connections":
            # The port's places were taken (strangers may hold them, as
            # stager.api.prefetch_port says): nothing of the order, so it is not backed
            # off, only sent at the next interval.
            outcome = "busy"
        elif answer.status_code in (429,) or answer.status_code >= 500:
            outcome = "retry"
        else:
            outcome = "refused"
        return outcome, f"{answer.status_code} {why}", False

    async def close(self) -> None:
        await self.client.aclose()


@dataclass
class Tally:
    jobs: int = 0
    pending: int = 0
    planned: int = 0
    sent: int = 0
    failed: int = 0
    waiting: int = 0  # orders past this interval's share or backing off: sent later
    squeue_ms: float = 0.0


def _attempt(prefetch: Prefetch) -> tuple[str, str, str]:
    """What a start backs off by (``Order.attempt``): (node, job, dataset)."""
    return prefetch.node, prefetch.job_id, prefetch.wanted.name


class Service:
    """``state_path``: where the last plan is kept across restarts (None: nowhere)."""

    def __init__(
        self,
        planner: Planner,
        sender: Sender,
        state_path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.planner = planner
        self.sender = sender
        self.cancels: dict[tuple[str, str], Order] = {}  # not delivered yet: sent again
        self.state_path = state_path
        self._kept: tuple[frozenset[Prefetch], list[state.Cancel]] | None = None
        settings = sender.settings
        self.backoff = Backoff(settings.plan_interval_s, planner.horizon_s, clock)
        self.per_interval = settings.plan_orders_per_interval
        self._first_uid = 0  # whose turn begins the next interval's share
        self._capped: set[str] = set()  # jobs whose left-out prefetches were logged
        # Each node's last answer (any: it is up), or the first order it did not answer
        # since this planner began (an earlier answer is unknown, and older).
        self.heard: dict[str, float] = {}
        self.clock = clock
        self.expire_s = settings.prefetch_expire_s

    async def _load(self) -> None:
        if self.state_path is None:
            return
        previous, cancels = await run_io(state.load, self.state_path)
        self.planner.previous = previous
        for node, body, job in cancels:
            try:
                uid = int(json.loads(body)["uid"])
            except (ValueError, KeyError, TypeError):
                uid = -1
            order = Order(node, body.encode(), job, None, uid)
            self.cancels[order.key] = order
        self._kept = previous, cancels
        if previous or cancels:
            log.info(
                "the last plan: %d prefetches, %d cancels to send", len(previous), len(cancels)
            )

    async def _save(self) -> None:
        cancels = [(o.node, o.body.decode(), o.job) for o in self.cancels.values()]
        kept = self.planner.previous, cancels
        if self.state_path is not None and kept != self._kept:
            await run_io(state.save, self.state_path, *kept)
            self._kept = kept

    def _log_capped(self, capped: dict[str, str]) -> None:
        for job_id in sorted(capped.keys() - self._capped):
            log.warning("job %s: %s", job_id, capped[job_id])
        self._capped = set(capped)  # a job no longer capped is logged again if it is again

    def _choose(self, found: Changes) -> tuple[list[Prefetch], list[Order], set[tuple]]:
        """This interval's share: the starts and cancels sent now, and the (job, node,
        dataset) of the starts that wait. A start backing off, or past its user's share,
        is found new again next interval; a cancel stays in ``cancels``. Each user's
        cancels go first (they free room), then stages, then copies (which need theirs)."""
        wanted: dict[int, list[Prefetch | Order]] = {}
        for order in self.cancels.values():
            if self.backoff.due(order.attempt):
                wanted.setdefault(order.uid, []).append(order)
        for prefetch in sorted(found.start, key=lambda p: bool(p.source)):
            if self.backoff.due(_attempt(prefetch)):
                wanted.setdefault(prefetch.uid, []).append(prefetch)
        chosen = fair_share(wanted, self.per_interval, self._first_uid)
        if len(chosen) == self.per_interval:  # the next interval's turn begins after
            self._first_uid = chosen[-1].uid + 1
        starts = [p for p in chosen if isinstance(p, Prefetch)]
        kept = set(starts)
        unsent = {(p.job_id, p.node, p.wanted) for p in found.start if p not in kept}
        for prefetch in found.start:
            if prefetch not in kept:
                self.planner.forget(prefetch)
        return starts, [o for o in chosen if isinstance(o, Order)], unsent

    async def interval(self) -> Tally:
        """One interval; raises SqueueError when squeue could not be read."""
        started = time.perf_counter()
        found = await run_io(self.planner.interval)
        tally = Tally(squeue_ms=self.planner.source.last_s * 1000)
        plan = found.plan
        tally.jobs, tally.planned = len(plan.jobs), len(plan.planned)
        tally.pending = sum(1 for job in plan.jobs.values() if job.state == "PENDING")
        self._log_capped(plan.capped)
        for order in orders(Changes(cancel=found.changes.cancel), self.sender.address):
            self.cancels[order.key] = order
        starts, cancels, unsent = self._choose(found.changes)
        tally.waiting = len(unsent) + len(self.cancels) - len(cancels)
        made = orders(Changes(start=starts), self.sender.address)
        superseded: dict[tuple[str, str], Order] = {}
        for order in made:
            # Wanted there again (a role changed: copy to stage, or another source):
            # no cancel, which the node could take after the start and drop it with
            # its data. The node re-targets a start itself (it drops what differs). A
            # cancel whose starts all stay unsent is kept (below): the node still holds
            # what it cancels, and nothing else would end it if the job left meanwhile.
            if (cancel := self.cancels.pop(order.key, None)) is not None:
                superseded[order.key] = cancel
                cancels = [c for c in cancels if c.key != order.key]
        first = [o for o in made if not o.copy] + cancels
        outcomes = await asyncio.gather(*(self.sender.send(o) for o in first))
        # Copies once the stages they copy are ready there: their nodes ask the source
        # node at once, and it answers at once (it does not wait: a wait would hold a
        # prefetch slot on the copying node). A copy whose source did not take its stage
        # now, or is staging it still, waits for the next interval (found new again, and
        # that stage sent again: its answer says whether it is ready), rather than fail at
        # a source that holds nothing ready for it.
        missed, waiting = set(), set()
        for order, (outcome, _, staging) in zip(first, outcomes, strict=True):
            if order.prefetch is None:
                continue
            at = (order.job, order.node, order.prefetch.wanted)
            if outcome != "sent":
                missed.add(at)
            elif staging:
                waiting.add(at)
        copies, held = [], set()
        for order in (o for o in made if o.copy):
            assert order.prefetch is not None
            at = (order.job, order.prefetch.source, order.prefetch.wanted)
            if at in missed or at in waiting or at in unsent:
                self.planner.forget(order.prefetch)
                held.add(at)
            else:
                copies.append(order)
        for order in first:  # a stage its copies wait for: asked again next interval
            if order.prefetch is not None and (order.job, order.node, order.prefetch.wanted) in (
                held & waiting
            ):
                self.planner.again(order.prefetch)
        outcomes += await asyncio.gather(*(self.sender.send(o) for o in copies))
        todo = first + copies
        failures: Counter[tuple[str, str]] = Counter()
        for order, (outcome, why, _) in zip(todo, outcomes, strict=True):
            if outcome == "sent":
                tally.sent += 1
            else:
                tally.failed += 1
                failures[order.node, why] += 1
            if outcome in ("retry", "unanswered"):
                self.backoff.failed(order.attempt)
            elif outcome != "busy":
                self.backoff.done(order.attempt)
            if outcome == "unanswered":
                self.heard.setdefault(order.node, self.clock())
            else:
                self.heard[order.node] = self.clock()
            again = outcome in ("retry", "unanswered", "busy")
            if order.prefetch is None and not again:
                self.cancels.pop(order.key, None)
            elif order.prefetch is not None and again:
                self.planner.forget(order.prefetch)  # new again next interval
        delivered = {o.key for o, (outcome, _, _) in zip(todo, outcomes, strict=True)
                     if o.prefetch is not None and outcome == "sent"}  # fmt: skip
        for key, cancel in superseded.items():
            if key not in delivered:
                self.cancels.setdefault(key, cancel)
        self._forget_silent({p.node for p in plan.prefetches})
        self.backoff.keep(
            [_attempt(p) for p in plan.prefetches] + [o.attempt for o in self.cancels.values()]
        )
        for (node, why), count in sorted(failures.items()):
            log.warning("node %s: %d order(s) not carried out: %s", node, count, why)
        await self._save()
        log.info(
            "interval: %d jobs seen (%d pending), %d planned, orders sent %d, failed %d, "
            "waiting %d, squeue %.0f ms, interval %.0f ms",
            tally.jobs, tally.pending, tally.planned, tally.sent, tally.failed,
            tally.waiting, tally.squeue_ms, (time.perf_counter() - started) * 1000,
        )  # fmt: skip
        return tally

    def _forget_silent(self, planned: set[str]) -> None:
        """Drop the cancels (and so their back-offs) of each node silent for longer than
        ``prefetch_expire_s``: a prefetch there ends by itself that long after its order
        (the node's sweep ends it past its start by prefetch_expire_s, and its lease,
        ttl prefetch_expire_s, lapses; a node restarted reloads and ends it), and every
        order it took came before its last answer. So a node gone for good (removed
        from Slurm, never answering) is not asked again each horizon for ever. Make it
        the nodes' STAGER_PREFETCH_EXPIRE_S (a longer one here only keeps them longer)."""
        now = self.clock()
        by_node: dict[str, list[str]] = {}
        for key, cancel in self.cancels.items():
            by_node.setdefault(cancel.node, []).append(key)
        for node, dropped in sorted(by_node.items()):
            silent = now - self.heard.get(node, now)
            if silent <= self.expire_s:
                continue
            for key in dropped:
                del self.cancels[key]
            log.warning(
                "node %s has not answered for %.0f s, longer than a prefetch lives there "
                "(STAGER_PREFETCH_EXPIRE_S %g): its %d cancel(s) are dropped, what they "
                "cancel has expired there",
                node, silent, self.expire_s, len(dropped),
            )  # fmt: skip
        wanted = planned | {o.node for o in self.cancels.values()}
        self.heard = {n: t for n, t in self.heard.items() if n in wanted}

    async def run(self, interval_s: float, once: bool = False) -> int:
        """Intervals every ``interval_s`` until SIGTERM or SIGINT (the interval under way
        is abandoned: the node services keep what they were told); 0 when stopped, or
        with ``once`` when every order of the one interval went through."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await self._load()
            while True:
                began = loop.time()
                work = asyncio.ensure_future(self.interval())
                await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not work.done():
                    self.planner.source.stop()  # its thread ends with the squeue call
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    return 0
                try:
                    tally = work.result()
                except SqueueError as exc:
                    log.warning("no plan this interval: %s", exc)
                    if once:
                        return 1
                else:
                    if once:
                        return 0 if not tally.failed else 1
                left = began + interval_s - loop.time()
                try:
                    await asyncio.wait_for(asyncio.shield(stopping), timeout=max(left, 0))
                    return 0
                except TimeoutError:
                    continue
        finally:
            stopping.cancel()
            await self.sender.close()
