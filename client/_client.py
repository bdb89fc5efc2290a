"""`StagerClient` (sync) and `AsyncStagerClient`: the daemon's HTTP API as Python calls.

Both share everything but the I/O: request bodies, decoding, error translation, the
retry policy and the long-poll arithmetic are module functions; each class only
sends requests and sleeps its own way (as httpx does for its two clients).

Retries: a job script starts ``wait`` right after launching the daemon, and a
daemon may restart under a long wait, so ``wait`` and ``stage`` (idempotent by
name + spec on the daemon) retry an unreachable daemon with bounded backoff for
``retry_for`` seconds. Status, list, cancel and lease calls fail fast: a human
typing them wants the answer now.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from client._discovery import Endpoint, discover
from client._progress import describe_step
from client.errors import (
    Conflict,
    ConnectionLost,
    DaemonError,
    DaemonUnavailable,
    DatasetEvicted,
    DatasetNotFound,
    NeverRequested,
    RequestRejected,
    StagingCancelled,
    StagingFailed,
    Unauthorized,
    WaitTimeout,
)
from stager.wire.schemas import DatasetPublic, DatasetsPublic, LeasePublic, State, WhoAmI

Model = TypeVar("Model")
StatusCallback = Callable[[DatasetPublic], None]

DEFAULT_TIMEOUT_S = 10.0  # plain requests; the daemon answers status in milliseconds
DEFAULT_RETRY_FOR_S = 30.0  # how long wait/stage keep trying an unreachable daemon
# How long a wait gives a name the daemon does not know to be requested, from the
# daemon's first answer: in a job the wait may start before the stage request lands.
DEFAULT_AWAIT_REQUEST_S = 60.0
LONG_POLL_MAX_S = 60.0  # one long-poll; short enough to notice a hung daemon
READ_MARGIN_S = 10.0  # a long-poll's read timeout is its length plus this

_LEASES = TypeAdapter(list[LeasePublic])
_REJECTED = {401: Unauthorized, 404: DatasetNotFound, 409: Conflict}


# ---- errors: the one place httpx's exceptions become ours -----------------------------


@contextmanager
def _translate(endpoint: Endpoint, what: str) -> Iterator[None]:
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise DaemonUnavailable(
            f"no stager daemon answers at {endpoint.url} ({exc})", url=endpoint.url
        ) from exc
    except httpx.TimeoutException as exc:
        raise ConnectionLost(
            f"the stager daemon at {endpoint.url} did not answer {what} in time",
            url=endpoint.url,
            fix="check that it is not stuck (its log is <runtime_dir>/stager.log)",
        ) from exc
    except httpx.TransportError as exc:
        raise ConnectionLost(
            f"the stager daemon at {endpoint.url} went away during {what} ({exc or type(exc)})",
            url=endpoint.url,
            fix="check its log (<runtime_dir>/stager.log) and restart it with "
            "`stager serve --detach`",
        ) from exc


def _error_sentence(response: httpx.Response) -> tuple[str, str] | None:
    """The daemon's (type, message), or None when the body is not its error shape."""
    try:
        error = response.json()["error"]
        return str(error["type"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        return None


def _decode(response: httpx.Response, adapter: Callable[[bytes], Model], url: str) -> Model:
    if response.is_success:
        try:
            return adapter(response.content)
        except ValidationError as exc:
            raise DaemonError(
                f"{url} answered {response.request.url.path} with something that is not the "
                "stager API's reply; check --url / STAGER_URL and the daemon's version",
                status_code=response.status_code,
            ) from exc
    error = _error_sentence(response)
    if response.status_code == 503 and error is not None:
        # Refused as it connected, before a request was read (the daemon's connection
        # caps): nothing reached it, so any call may be retried. Its sentence is
        # "problem; fix".
        problem, _, fix = error[1].rpartition("; ")
        raise DaemonUnavailable(problem or fix, url=url, fix=fix if problem else "retry")
    if response.status_code == 503 or (error is None and response.status_code >= 500):
        # Not the API's own error: the server broke the request off, as uvicorn does with
        # requests still open when a stopping daemon's graceful-shutdown time runs out.
        raise ConnectionLost(
            f"the stager daemon at {url} broke off {response.request.method} "
            f"{response.request.url.path} (HTTP {response.status_code}), as it does while "
            "shutting down",
            url=url,
            fix="check its log (<runtime_dir>/stager.log) and restart it with "
            "`stager serve --detach`",
        )
    if error is None:
        raise DaemonError(
            f"{url} answered {response.request.method} {response.request.url.path} with "
            f"HTTP {response.status_code} and no stager error; check --url / STAGER_URL",
            status_code=response.status_code,
        )
    type_, message = error
    if 400 <= response.status_code < 500:
        cls = _REJECTED.get(response.status_code, RequestRejected)
        raise cls(message, type=type_, status_code=response.status_code)
    raise DaemonError(message, status_code=response.status_code)


def _model(model: type[BaseModel]) -> Callable[[bytes], Any]:
    return model.model_validate_json


# ---- waiting ------------------------------------------------------------------------


def outcome(status: DatasetPublic) -> DatasetPublic | None:
    """The status if ready, None while still going; raises if it ended otherwise."""
    if status.state == State.READY:
        return status
    if not status.state.terminal:
        return None
    sentence = status.error.message if status.error else None
    if status.state == State.CANCELLED:
        raise StagingCancelled(sentence or f"dataset {status.name!r} was cancelled", status=status)
    if status.state == State.EVICTED:
        raise DatasetEvicted(
            sentence or f"dataset {status.name!r} was evicted from the node cache; stage it again",
            status=status,
        )
    raise StagingFailed(
        sentence or f"dataset {status.name!r} failed to stage (no reason given)", status=status
    )


def _timed_out(status: DatasetPublic, timeout: float) -> WaitTimeout:
    p = status.progress
    where = describe_step(p) or "not started"
    if p.bytes_total:
        where += f", {p.bytes_done / p.bytes_total:.0%} of {p.bytes_total} bytes"
    return WaitTimeout(
        f"dataset {status.name!r} is still {status.state} after {timeout:g} s ({where}); "
        f"wait longer (--timeout) or see `stager-client status {status.name}`",
        status=status,
    )


class _NotRequestedYet:
    """A wait that began before its stage request (a rank waits while another rank asks;
    the prolog stages while the batch script already waits): keep asking for ``grace``
    seconds from the daemon's first "no such name" (so a daemon still starting does not
    eat into it; None: as long as the caller's timeout), say so once, then fail as an
    unknown name does, with the daemon's sentence: a typo still ends."""

    pause_s = 0.5

    def __init__(
        self,
        name: str,
        deadline: float | None,
        clock: Callable[[], float],
        grace: float | None = DEFAULT_AWAIT_REQUEST_S,
    ) -> None:
        self.name, self.deadline, self.clock, self.grace = name, deadline, clock, grace
        self.since: float | None = None  # the daemon's first "no such name"
        self.said = False

    def pause(self, say: Callable[[str], None] | None) -> float | None:
        """Seconds to sleep before asking again, or None once the grace or the caller's
        timeout has passed (`grace_ended` says which)."""
        now = self.clock()
        if self.since is None:
            self.since = now
        if self.grace == 0:
            return None
        if not self.said and say is not None:
            up_to = "" if self.grace is None else f"up to {self.grace:g} s "
            say(
                f"dataset {self.name!r} has not been requested yet; "
                f"waiting {up_to}for its stage request"
            )
        self.said = True
        end = self._end()
        if end is None:
            return self.pause_s
        left = end - now
        return min(self.pause_s, left) if left > 0 else None

    def _end(self) -> float | None:
        ends = [x for x in (self.deadline, self._grace_end()) if x is not None]
        return min(ends, default=None)

    def _grace_end(self) -> float | None:
        return None if self.grace is None or self.since is None else self.since + self.grace

    @property
    def grace_ended(self) -> bool:
        """The grace ran out before the caller's timeout: the name is unknown, not late."""
        grace_end = self._grace_end()
        return grace_end is not None and (self.deadline is None or grace_end < self.deadline)

    def unknown(self, exc: DatasetNotFound) -> DatasetNotFound:
        """The daemon's own "no dataset named" sentence, saying how long it waited."""
        if not self.grace:
            return exc
        error = DatasetNotFound(
            f"{exc.message}; no stage request for it came in {self.grace:g} s",
            type=exc.type,
            status_code=exc.status_code,
        )
        error.waited = self.grace
        return error

    def timed_out(self, timeout: float | None, known: list[DatasetPublic]) -> NeverRequested:
        names = ", ".join(sorted(s.name for s in known)) or "none"
        return NeverRequested(
            f"dataset {self.name!r} was never requested in {timeout or 0.0:g} s (the daemon "
            f"knows: {names}); check the name, and that the job's stage request ran",
            name=self.name,
        )


def _poll_length(deadline: float | None, now: float, interval: float | None) -> float:
    length = LONG_POLL_MAX_S if interval is None else min(interval, LONG_POLL_MAX_S)
    if deadline is not None:
        length = min(length, max(0.0, deadline - now))
    return length


class Backoff:
    """Bounded exponential backoff over one streak of failures.

    ``delay(exc)`` gives the next pause, or raises ``exc`` (saying how long it
    tried) once ``budget`` seconds have passed since the streak began, or the
    caller's own deadline has.
    """

    first_s = 0.05
    cap_s = 0.5  # a daemon coming up is noticed within half a second

    def __init__(
        self,
        budget: float,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.budget = budget
        self.clock = clock
        self.say = say  # told at each streak's start: a wait never sits silent
        self.reset()

    def reset(self) -> None:
        self._since: float | None = None
        self._next = self.first_s

    def delay(self, exc: DaemonUnavailable, deadline: float | None = None) -> float:
        now = self.clock()
        starts = self._since is None
        if starts:
            self._since = now
        limit = self._since + self.budget
        if deadline is not None:
            limit = min(limit, deadline)
        if now >= limit:
            spent = now - self._since
            raise (exc.after_retries(spent) if spent > 0 else exc) from exc
        if starts and self.say is not None:
            self.say(f"{exc.problem}; retrying for up to {limit - now:.3g} s")
        pause = min(self._next, limit - now)
        self._next = min(self._next * 2, self.cap_s)
        return pause


# ---- request bodies -----------------------------------------------------------------


def stage_body(
    name: str,
    *,
    recipe: str | None = None,
    source: str | None = None,
    params: Mapping[str, Any] | None = None,
    steps: Sequence[Mapping[str, Any] | BaseModel] | None = None,
    link: str | None = None,
    verify: str | None = None,
    fingerprint: str | None = None,
    lease: Mapping[str, Any] | BaseModel | None = None,
    image: bool | None = None,
    image_fallback: bool | None = None,
) -> dict[str, Any]:
    """A ``POST /v1/datasets`` body with only what was given, so the daemon's defaults
    apply; validation is left to the daemon, whose sentences name the field at fault.
    ``image``: stage it as one read-only image (``image_fallback``: or a tree where the
    daemon cannot mount one)."""
    body: dict[str, Any] = {"name": name}
    given = {"recipe": recipe, "source": source, "link": link, "verify": verify}
    given["fingerprint"] = fingerprint
    given["image"], given["image_fallback"] = image, image_fallback
    body.update({k: v for k, v in given.items() if v is not None})
    if params:
        body["params"] = dict(params)
    if steps:
        body["steps"] = [_plain(step) for step in steps]
    if lease is not None:
        body["lease"] = _plain(lease)
    return body


def _plain(value: Mapping[str, Any] | BaseModel) -> dict[str, Any]:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True, by_alias=True)
    return dict(value)


def _lease_body(holder: str, slurm_job_id: str | None, ttl_s: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {"holder": holder}
    if slurm_job_id is not None:
        body["slurm_job_id"] = slurm_job_id
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    return body


def _q(name: str) -> str:
    # A mistyped name with a '/' must reach the daemon as one name, to get its 404 sentence.
    return quote(name, safe="")


def _release_path(name: str, lease_id: str | None) -> str:
    return f"/v1/datasets/{_q(name)}/leases" + (f"/{_q(lease_id)}" if lease_id else "")


# ---- the clients ----------------------------------------------------------------------


class _Base:
    def __init__(
        self,
        url: str | None,
        token: str | None,
        timeout: float,
        retry_for: float,
        env: Mapping[str, str] | None,
        on_retry: Callable[[str], None] | None,
    ) -> None:
        self.endpoint = discover(url, token, env)
        self.timeout = timeout
        self.retry_for = retry_for
        self.on_retry = on_retry

    @property
    def url(self) -> str:
        return self.endpoint.url

    def _http_args(self) -> dict[str, Any]:
        return {
            "base_url": self.endpoint.base_url,
            "timeout": self.timeout,
            "headers": {"user-agent": "stager-client", **self.endpoint.headers()},
        }


class StagerClient(_Base):
    """Talks to the node's stager daemon.

    ``StagerClient()`` finds the daemon from ``STAGER_URL`` or the default socket.
    ``transport`` replaces the network (``httpx.MockTransport`` in tests).
    ``on_retry`` is told, once a streak, that the daemon does not answer and for how
    long ``wait`` and ``submit`` keep trying.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        transport: httpx.BaseTransport | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_for: float = DEFAULT_RETRY_FOR_S,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_retry: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(url, token, timeout, retry_for, env, on_retry)
        self._clock = clock
        self._sleep = sleep
        self._http = httpx.Client(
            transport=transport or self.endpoint.transport(), **self._http_args()
        )

    def __enter__(self) -> StagerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(
        self,
        method: str,
        path: str,
        adapter: Callable[[bytes], Model],
        *,
        what: str,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Model:
        with _translate(self.endpoint, what):
            response = self._http.request(method, path, timeout=timeout or self.timeout, **kwargs)
        return _decode(response, adapter, self.url)

    def health(self) -> dict[str, Any]:
        """The daemon's liveness answer, e.g. ``{"status": "ok", "version": "0.1.0"}``."""
        return self._call("GET", "/healthz", json.loads, what="the health check")

    def whoami(self) -> WhoAmI:
        """Who the daemon takes this process's user to be (the kernel's word, in the node
        service) and which mode it runs in."""
        return self._call("GET", "/v1/whoami", _model(WhoAmI), what="whoami")

    def status(self, name: str) -> DatasetPublic:
        return self._call("GET", f"/v1/datasets/{_q(name)}", _model(DatasetPublic), what="status")

    def recipes(self) -> dict[str, Any]:
        """``GET /v1/recipes``: ``data`` (each recipe, its params and splits) and ``ops``."""
        return self._call("GET", "/v1/recipes", json.loads, what="recipes")

    def list(self) -> list[DatasetPublic]:
        return self._call("GET", "/v1/datasets", _model(DatasetsPublic), what="list").data

    def submit(self, body: Mapping[str, Any] | BaseModel) -> DatasetPublic:
        """POST a full request body (a ``DatasetCreate`` or its JSON form); retried while
        the daemon is unreachable, which is safe because staging is idempotent by name+spec."""
        payload = _plain(body)
        backoff = Backoff(self.retry_for, self._clock, self.on_retry)
        while True:
            try:
                return self._call(
                    "POST", "/v1/datasets", _model(DatasetPublic), what="stage", json=payload
                )
            except DaemonUnavailable as exc:
                self._sleep(backoff.delay(exc))

    def stage(self, name: str, **fields: Any) -> DatasetPublic:
        """Stage (or join) a dataset; keyword arguments as in `stage_body`. Returns at once."""
        return self.submit(stage_body(name, **fields))

    def wait(
        self,
        name: str,
        timeout: float | None = None,
        *,
        on_status: StatusCallback | None = None,
        interval: float | None = None,
        on_not_requested: Callable[[str], None] | None = None,
        await_request: float | None = DEFAULT_AWAIT_REQUEST_S,
    ) -> DatasetPublic:
        """Block until ``name`` is ready and return its status (``.path``).

        Long-polls the daemon, so it returns within milliseconds of the dataset
        becoming ready. ``timeout=None`` waits forever. ``on_status`` gets every
        status seen, at least every ``interval`` seconds (for progress displays).
        A name the daemon does not know may be requested within ``await_request``
        seconds of the daemon's first answer (its stage request may still be on its way;
        None: as long as ``timeout``, 0: fail at once); ``on_not_requested`` gets one
        sentence saying the wait is waiting for it. After that it raises
        `DatasetNotFound` with the daemon's sentence.
        Raises `StagingFailed`, `WaitTimeout` (`NeverRequested`), `DatasetNotFound` or
        `DaemonUnavailable`.
        """
        start = self._clock()
        deadline = None if timeout is None else start + timeout
        backoff = Backoff(self.retry_for, self._clock, self.on_retry)
        unknown = _NotRequestedYet(name, deadline, self._clock, await_request)
        seen = on_status is None  # a display shows the first status at once, not a poll later
        while True:
            poll = _poll_length(deadline, self._clock(), interval) if seen else 0.0
            try:
                status = self._call(
                    "GET",
                    f"/v1/datasets/{_q(name)}/wait",
                    _model(DatasetPublic),
                    what=f"the wait for {name!r}",
                    params={"timeout": poll},
                    timeout=poll + READ_MARGIN_S,
                )
            except DaemonUnavailable as exc:
                self._sleep(backoff.delay(exc, deadline))
                continue
            except DatasetNotFound as exc:
                if (pause := unknown.pause(on_not_requested)) is None:
                    if unknown.grace_ended:
                        raise unknown.unknown(exc) from None
                    raise unknown.timed_out(timeout, self.list()) from None
                self._sleep(pause)
                continue
            backoff.reset()
            seen = True
            if on_status is not None:
                on_status(status)
            if outcome(status) is not None:
                return status
            if deadline is not None and self._clock() >= deadline:
                raise _timed_out(status, timeout or 0.0)

    def cancel(self, name: str) -> DatasetPublic:
        """Cancel a staging, evict a ready dataset, or forget a finished one."""
        return self._call(
            "DELETE", f"/v1/datasets/{_q(name)}", _model(DatasetPublic), what="cancel"
        )

    # Leases pin a dataset against eviction while a job uses it.
    def lease(
        self,
        name: str,
        holder: str,
        *,
        slurm_job_id: str | None = None,
        ttl_s: float | None = None,
    ) -> LeasePublic:
        body = _lease_body(holder, slurm_job_id, ttl_s)
        path = f"/v1/datasets/{_q(name)}/leases"
        return self._call("POST", path, _model(LeasePublic), what="lease", json=body)

    def release(
        self, name: str, *, holder: str | None = None, lease_id: str | None = None
    ) -> list[LeasePublic]:
        """Release one lease by id, every lease of ``holder``, or all leases on ``name``."""
        params = {"holder": holder} if holder and not lease_id else None
        path = _release_path(name, lease_id)
        return self._call("DELETE", path, _LEASES.validate_json, what="release", params=params)


class AsyncStagerClient(_Base):
    """`StagerClient` for asyncio code; the same methods, awaited."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_for: float = DEFAULT_RETRY_FOR_S,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_retry: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(url, token, timeout, retry_for, env, on_retry)
        self._clock = clock
        self._http = httpx.AsyncClient(
            transport=transport or self.endpoint.async_transport(), **self._http_args()
        )

    async def __aenter__(self) -> AsyncStagerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        adapter: Callable[[bytes], Model],
        *,
        what: str,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Model:
        with _translate(self.endpoint, what):
            response = await self._http.request(
                method, path, timeout=timeout or self.timeout, **kwargs
            )
        return _decode(response, adapter, self.url)

    async def whoami(self) -> WhoAmI:
        return await self._call("GET", "/v1/whoami", _model(WhoAmI), what="whoami")

    async def status(self, name: str) -> DatasetPublic:
        return await self._call("GET", f"/v1/datasets/{_q(name)}", _model(DatasetPublic),
                                what="status")  # fmt: skip

    async def recipes(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/recipes", json.loads, what="recipes")

    async def list(self) -> list[DatasetPublic]:
        return (await self._call("GET", "/v1/datasets", _model(DatasetsPublic), what="list")).data

    async def submit(self, body: Mapping[str, Any] | BaseModel) -> DatasetPublic:
        payload = _plain(body)
        backoff = Backoff(self.retry_for, self._clock, self.on_retry)
        while True:
            try:
                return await self._call(
                    "POST", "/v1/datasets", _model(DatasetPublic), what="stage", json=payload
                )
            except DaemonUnavailable as exc:
                await asyncio.sleep(backoff.delay(exc))

    async def stage(self, name: str, **fields: Any) -> DatasetPublic:
        return await self.submit(stage_body(name, **fields))

    async def wait(
        self,
        name: str,
        timeout: float | None = None,
        *,
        on_status: StatusCallback | None = None,
        interval: float | None = None,
        on_not_requested: Callable[[str], None] | None = None,
        await_request: float | None = DEFAULT_AWAIT_REQUEST_S,
    ) -> DatasetPublic:
        """See `StagerClient.wait`."""
        deadline = None if timeout is None else self._clock() + timeout
        backoff = Backoff(self.retry_for, self._clock, self.on_retry)
        unknown = _NotRequestedYet(name, deadline, self._clock, await_request)
        seen = on_status is None  # a display shows the first status at once, not a poll later
        while True:
            poll = _poll_length(deadline, self._clock(), interval) if seen else 0.0
            try:
                status = await self._call(
                    "GET",
                    f"/v1/datasets/{_q(name)}/wait",
                    _model(DatasetPublic),
                    what=f"the wait for {name!r}",
                    params={"timeout": poll},
                    timeout=poll + READ_MARGIN_S,
                )
            except DaemonUnavailable as exc:
                await asyncio.sleep(backoff.delay(exc, deadline))
                continue
            except DatasetNotFound as exc:
                if (pause := unknown.pause(on_not_requested)) is None:
                    if unknown.grace_ended:
                        raise unknown.unknown(exc) from None
                    raise unknown.timed_out(timeout, await self.list()) from None
                await asyncio.sleep(pause)
                continue
            backoff.reset()
            seen = True
            if on_status is not None:
                on_status(status)
            if outcome(status) is not None:
                return status
            if deadline is not None and self._clock() >= deadline:
                raise _timed_out(status, timeout or 0.0)

    async def cancel(self, name: str) -> DatasetPublic:
        return await self._call("DELETE", f"/v1/datasets/{_q(name)}", _model(DatasetPublic),
                                what="cancel")  # fmt: skip

    async def lease(
        self,
        name: str,
        holder: str,
        *,
        slurm_job_id: str | None = None,
        ttl_s: float | None = None,
    ) -> LeasePublic:
        body = _lease_body(holder, slurm_job_id, ttl_s)
        path = f"/v1/datasets/{_q(name)}/leases"
        return await self._call("POST", path, _model(LeasePublic), what="lease", json=body)

    async def release(
        self, name: str, *, holder: str | None = None, lease_id: str | None = None
    ) -> list[LeasePublic]:
        params = {"holder": holder} if holder and not lease_id else None
        path = _release_path(name, lease_id)
        return await self._call(
            "DELETE", path, _LEASES.validate_json, what="release", params=params
        )
