"""The daemon's user processes: a request's work that touches a user's paths, done by
a process that became that user.

``await pool.call(identity, fn, *args)`` runs ``fn(*args)`` in a process of
``identity``'s (forked by the fork server, ready in milliseconds) and returns its JSON
result. A user's processes are theirs alone and kept for their next request, at most
``per_user`` at once, so one user's slow checks never take another user's.

A call past ``timeout_s`` ends its process and fails with a sentence. Nothing is
awaited from one while the daemon holds a lock others wait on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from stager.core.errors import StagerError, UserProcessFailed, UserProcessTimeout
from stager.core.processes import USER_NAME, name_process, reap, start_child
from stager.rights import agent, channel
from stager.rights.become import Identity, become, close_fds_except

log = logging.getLogger("stager.rights")

# The modules whose functions the daemon runs as a user. The fork server imports them
# (stager.engine.preload): a process that became a user must not import anything, since the
# interpreter's own files may be unreadable to that user (a Python under root's home).
USER_SIDE_MODULES = (
    "stager.request.preflight",
    "stager.staging.publish",
    "stager.fanout.packing",
    "stager.fanout.room",
)


@dataclass
class _Agent:
    identity: Identity
    process: Any
    sock: socket.socket
    idle_since: float = 0.0
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)


def _agent_main(identity: Identity, sock: socket.socket) -> None:
    """A user process's life, in the process the fork server forked: drop everything of
    root's, become the user, serve until the daemon closes the channel."""
    code = 1
    try:
        close_fds_except({sock.fileno()})
        name_process(USER_NAME)
        become(identity)
        agent.serve(sock)
        code = 0
    finally:
        os._exit(code)


class UserProcesses:
    def __init__(
        self,
        per_user: int,
        idle_s: float,
        timeout_s: float,
        off_loop: Callable[..., Awaitable[Any]],
    ) -> None:
        # The daemon's doorway to threads (stager.staging.blocking.run_io).
        self._off_loop = off_loop
        self._reaping: set[asyncio.Future[Any]] = set()
        self.per_user = per_user
        self.idle_s = idle_s
        self.timeout_s = timeout_s
        self._idle: dict[Identity, list[_Agent]] = {}
        self._busy: dict[int, int] = {}  # by uid
        self._live: set[int] = set()  # every user process's pid, idle or busy, until ended
        self._freed = asyncio.Condition()
        self._closed = False

    async def call(
        self, identity: Identity, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """``fn(*args, **kwargs)`` as ``identity``; its JSON result, or its error raised."""
        if fn.__module__ not in USER_SIDE_MODULES:
            raise ValueError(f"{fn.__module__}.{fn.__qualname__} is not in USER_SIDE_MODULES")
        worker = await self._take(identity)
        healthy = False
        try:
            payload = await asyncio.wait_for(
                self._exchange(worker, ("call", fn, args, kwargs)), self.timeout_s
            )
            answer = channel.decode_answer(payload)
            healthy = True
        except TimeoutError:
            raise UserProcessTimeout(
                f"checking this request as uid {identity.uid} took longer than "
                f"{self.timeout_s:g} s (a source on a hung filesystem?); check the source "
                "and ask again"
            ) from None
        except (channel.Closed, OSError, ValueError) as exc:  # ended, or sent no JSON
            log.warning("user process of uid %d failed: %r", identity.uid, exc)
            raise UserProcessFailed(
                f"the process doing this request's work as uid {identity.uid} ended before "
                "it answered; ask again"
            ) from None
        finally:
            await self._give_back(worker, healthy)
        try:
            return channel.result(answer)
        except channel.AgentFailed as exc:
            log.error("user process of uid %d: %s", identity.uid, exc)
            raise UserProcessFailed(
                f"the process doing this request's work as uid {identity.uid} failed; the "
                "daemon log says why"
            ) from None

    async def _exchange(self, worker: _Agent, request: tuple[Any, ...]) -> bytes:
        # Sent without blocking the loop, within the call's deadline: a process its user
        # stopped (SIGSTOP) reads nothing, and a request past the socket's buffer would
        # otherwise hold the whole daemon in sendall until they let it go on.
        loop = asyncio.get_running_loop()
        for packet, _ in channel.packets(channel.encode_request(request)):
            await loop.sock_sendall(worker.sock, packet)
        parts: list[bytes] = []
        while True:
            ready = loop.create_future()
            loop.add_reader(worker.sock.fileno(), ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_reader(worker.sock.fileno())
            data, fds, last = channel.recv_packet(worker.sock)
            for fd in fds:  # calls answer with data only
                os.close(fd)
            parts.append(data)
            if last:
                return b"".join(parts)

    async def _take(self, identity: Identity) -> _Agent:
        async with self._freed:
            while True:
                if self._closed:
                    raise StagerError("the daemon is stopping")
                # Counted per uid: the same user under another group (sg, newgrp) is
                # another identity, and must not get another share of processes.
                if self._busy.get(identity.uid, 0) < self.per_user:
                    self._busy[identity.uid] = self._busy.get(identity.uid, 0) + 1
                    idle = self._idle.get(identity, [])
                    while idle:
                        worker = idle.pop()
                        if worker.expiry is not None:
                            worker.expiry.cancel()
                        if worker.process.is_alive():
                            return worker
                        self._discard(worker)
                    break
                await self._freed.wait()
        try:
            return await self._off_loop(self._start, identity)
        except BaseException:
            async with self._freed:
                self._busy[identity.uid] -= 1
                self._freed.notify_all()
            raise

    def _start(self, identity: Identity) -> _Agent:
        mine, theirs = channel.pair()
        try:
            process = start_child(_agent_main, (identity, theirs), f"stager-user-{identity.uid}")
        finally:
            theirs.close()
        mine.setblocking(False)  # the loop waits for it (_exchange)
        self._live.add(process.pid)
        return _Agent(identity, process, mine)

    async def _give_back(self, worker: _Agent, healthy: bool) -> None:
        async with self._freed:
            self._busy[worker.identity.uid] -= 1
            if healthy and not self._closed:
                self._keep_idle(worker)
            else:
                self._discard(worker)
            self._freed.notify_all()

    def _keep_idle(self, worker: _Agent) -> None:
        """Keep ``worker`` for its identity's next call, for ``idle_s``. A user keeps as
        many idle processes as they may run, under whatever groups (sg, newgrp make other
        identities); the longest idle of theirs goes first."""
        uid = worker.identity.uid
        theirs = [w for identity, idle in self._idle.items() if identity.uid == uid for w in idle]
        theirs.sort(key=lambda w: w.idle_since)
        for oldest in theirs[: max(0, len(theirs) - self.per_user + 1)]:
            self._drop_idle(oldest)
        loop = asyncio.get_running_loop()
        worker.idle_since = loop.time()
        worker.expiry = loop.call_later(self.idle_s, self._expire, worker)
        self._idle.setdefault(worker.identity, []).append(worker)

    def _expire(self, worker: _Agent) -> None:
        if worker in self._idle.get(worker.identity, []):
            self._drop_idle(worker)

    def _drop_idle(self, worker: _Agent) -> None:
        idle = self._idle[worker.identity]
        idle.remove(worker)
        if not idle:
            del self._idle[worker.identity]
        if worker.expiry is not None:
            worker.expiry.cancel()
        self._discard(worker)

    def _discard(self, worker: _Agent) -> None:
        """Close the channel (the process exits at its next read) and end the process:
        one that timed out may be stuck; it is killed, reaped off the loop."""
        with contextlib.suppress(OSError):
            worker.sock.close()
        with contextlib.suppress(OSError):
            worker.process.kill()
        self._live.discard(worker.process.pid)
        reaping = asyncio.ensure_future(self._off_loop(worker.process.join, 5.0))
        self._reaping.add(reaping)
        reaping.add_done_callback(self._reaping.discard)

    def pids(self) -> list[int]:
        """The user processes alive now (for tests and ps)."""
        return [w.process.pid for idle in self._idle.values() for w in idle]

    async def close(self) -> None:
        async with self._freed:
            self._closed = True
            workers = [w for idle in self._idle.values() for w in idle]
            self._idle.clear()
            self._freed.notify_all()
        for worker in workers:
            if worker.expiry is not None:
                worker.expiry.cancel()
            with contextlib.suppress(OSError):
                worker.sock.close()
        for worker in workers:
            self._live.discard(worker.process.pid)
            await self._off_loop(reap, worker.process, 2.0)
        for pid in self._live:  # busy ones (their user may have stopped them): ended now
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self._live.clear()
