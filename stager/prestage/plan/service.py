"""``stager plan``: the planner as a service (docs/prestaging.md, "The planner as a
service"): every ``plan_interval_s`` one squeue call and the changes since the last
interval, each an order to its node's prefetch port with a fresh MUNGE credential over
the order's sha256. An order is a wish the node may refuse: sent :data:`SENDS_AT_ONCE`
at a time, each bounded by :data:`SEND_TIMEOUT_S`; one not delivered (no answer, a 5xx,
a 429) is sent again next interval, a refusal (any other 4xx) logged and not repeated.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class Order:
    node: str
    body: bytes
    job: str
    prefetch: Prefetch | None  # a start's; None: a cancel

    @property
    def key(self) -> tuple[str, str]:
        return self.job, self.node

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
        made.setdefault(key, Order(prefetch.node, raw, prefetch.job_id, kept))
    return list(made.values())


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
        """("sent" | "retry" | "refused", why, waiting): ``waiting``, the node's prefetch
        is staging still, not ready (a copy's source is asked again next interval). A
        copy carries a second credential, over the same body, which its node hands to
        the copy's source node (decoded only there: each credential is used once, on
        one node)."""
        async with self.at_once:
            credential = await self._credential(WHAT, order.body)
            second = await self._credential(COPY, order.body) if order.copy else ""
            if credential is None or second is None:
                return "retry", "munged made no credential (is munged running here?)", False
            headers = {"authorization": f"Munge {credential}", "content-type": "application/json"}
            if second:
                headers[COPY_HEADER] = f"Munge {second}"
            try:
                url = f"http://{self.address(order.node)}/v1/prefetches"
                answer = await self.client.post(url, content=order.body, headers=headers)
            except (httpx.HTTPError, OSError, ValueError) as exc:
                return "retry", f"{type(exc).__name__}: {exc}".rstrip(": "), False
        if answer.status_code == 200:
            try:
                done = answer.json()["data"]
                waiting = any(p["state"] == "active" and not p["ready"] for p in done)
            except (ValueError, KeyError, TypeError):
                waiting = False  # (a node of an earlier version: its copies wait there)
            return "sent", "", waiting
        try:
            why = answer.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = answer.text[:200]
        outcome = (
            "retry" if answer.status_code in (429,) or answer.status_code >= 500 else "refused"
        )
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
    squeue_ms: float = 0.0


class Service:
    """``state_path``: where the last plan is kept across restarts (None: nowhere)."""

    def __init__(self, planner: Planner, sender: Sender, state_path: Path | None = None) -> None:
        self.planner = planner
        self.sender = sender
        self.cancels: dict[tuple[str, str], Order] = {}  # not delivered yet: sent again
        self.state_path = state_path
        self._kept: tuple[frozenset[Prefetch], list[state.Cancel]] | None = None

    async def _load(self) -> None:
        if self.state_path is None:
            return
        previous, cancels = await run_io(state.load, self.state_path)
        self.planner.previous = previous
        for node, body, job in cancels:
            order = Order(node, body.encode(), job, None)
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

    async def interval(self) -> Tally:
        """One interval; raises SqueueError when squeue could not be read."""
        started = time.perf_counter()
        found = await run_io(self.planner.interval)
        tally = Tally(squeue_ms=self.planner.source.last_s * 1000)
        plan = found.plan
        tally.jobs, tally.planned = len(plan.jobs), len(plan.planned)
        tally.pending = sum(1 for job in plan.jobs.values() if job.state == "PENDING")
        made = orders(found.changes, self.sender.address)
        starting = {o.key for o in made if o.prefetch is not None}
        for order in made:
            if order.key in starting:
                # Wanted there again (a role changed: copy to stage, or another source):
                # no cancel, which the node could take after the start and drop it with
                # its data. The node re-targets a start itself (it drops what differs).
                self.cancels.pop(order.key, None)
            else:
                self.cancels[order.key] = order
        first = [o for o in made if o.prefetch is not None and not o.copy]
        first += list(self.cancels.values())
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
            if at in missed or at in waiting:
                self.planner.forget(order.prefetch)
                held.add(at)
            else:
                copies.append(order)
        for order in first:  # a stage its copies wait for: asked again next interval
            if order.prefetch is not None and (order.job, order.node, order.prefetch.wanted) in (
                held & waiting
            ):
                self.planner.forget(order.prefetch)
        outcomes += await asyncio.gather(*(self.sender.send(o) for o in copies))
        todo = first + copies
        failures: Counter[tuple[str, str]] = Counter()
        for order, (outcome, why, _) in zip(todo, outcomes, strict=True):
            if outcome == "sent":
                tally.sent += 1
            else:
                tally.failed += 1
                failures[order.node, why] += 1
            if order.prefetch is None and outcome != "retry":
                self.cancels.pop(order.key, None)
            elif order.prefetch is not None and outcome == "retry":
                self.planner.forget(order.prefetch)  # new again next interval
        for (node, why), count in sorted(failures.items()):
            log.warning("node %s: %d order(s) not carried out: %s", node, count, why)
        await self._save()
        log.info(
            "interval: %d jobs seen (%d pending), %d planned, orders sent %d, failed %d, "
            "squeue %.0f ms, interval %.0f ms",
            tally.jobs, tally.pending, tally.planned, tally.sent, tally.failed,
            tally.squeue_ms, (time.perf_counter() - started) * 1000,
        )  # fmt: skip
        return tally

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
