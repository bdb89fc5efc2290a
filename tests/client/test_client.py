"""The Python API: error translation, waiting and retries over httpx.MockTransport,
then the promised contract against a real daemon."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from client import (
    AsyncStagerClient,
    Backoff,
    Conflict,
    ConnectionLost,
    DaemonError,
    DaemonUnavailable,
    DatasetEvicted,
    DatasetNotFound,
    NeverRequested,
    RequestRejected,
    StagerClient,
    StagerError,
    StagingCancelled,
    StagingFailed,
    WaitTimeout,
    stage_body,
)
from stager.wire.schemas import LeaseCreate
from tests.daemon import Daemon
from tests.imports import among, loaded_modules

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

Handler = Callable[[httpx.Request], httpx.Response]


def status(name: str = "d", state: str = "staging", **extra: object) -> dict:
    return {
        "name": name,
        "key": "k",
        "state": state,
        "created_at": "2024-01-01T00:00:00Z",
        "updated_at": "2024-01-01T00:00:00Z",
        **extra,
    }


class FakeTime:
    """A clock that only moves when the code under test sleeps or a request takes time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def client(handler: Handler, fake: FakeTime | None = None, **kwargs: object) -> StagerClient:
    fake = fake or FakeTime()
    return StagerClient(
        "unix:///nowhere.sock",
        transport=httpx.MockTransport(handler),
        clock=fake.clock,
        sleep=fake.sleep,
        **kwargs,
    )


def error(code: int, type_: str, message: str) -> httpx.Response:
    return httpx.Response(code, json={"error": {"type": type_, "message": message}})


# ---- translation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "cls"),
    [(400, RequestRejected), (401, RequestRejected), (404, DatasetNotFound), (409, Conflict)],
)
def test_4xx_become_rejections_carrying_the_sentence(code: int, cls: type) -> None:
    c = client(lambda r: error(code, "some_type", "source /x does not exist; check --source"))
    with pytest.raises(cls) as info:
        c.status("d")
    assert str(info.value) == "source /x does not exist; check --source"
    assert (info.value.type, info.value.status_code) == ("some_type", code)


def test_5xx_and_foreign_answers_are_daemon_errors() -> None:
    with pytest.raises(DaemonError, match="internal error: boom"):
        client(lambda r: error(500, "internal_error", "internal error: boom")).status("d")
    with pytest.raises(DaemonError, match="HTTP 404 and no stager error; check --url"):
        client(lambda r: httpx.Response(404, text="<html>not here")).status("d")
    with pytest.raises(DaemonError, match="not the stager API's reply"):
        client(lambda r: httpx.Response(200, json={"hello": 1})).status("d")


def test_transport_errors_become_daemon_unavailable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    def drop(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected", request=request)

    with pytest.raises(DaemonUnavailable) as info:
        client(refuse).status("d")
    assert str(info.value).startswith(
        "no stager daemon answers at unix:///nowhere.sock ([Errno 111] Connection refused); "
        "start it with `stager serve --detach`"
    )
    with pytest.raises(ConnectionLost, match="went away during status"):
        client(drop).status("d")


# ---- waiting -------------------------------------------------------------------------


def test_wait_long_polls_and_returns_the_ready_status() -> None:
    answers = iter([status(), status(), status(state="ready", path="/cache/d")])
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=next(answers))

    ready = client(handler).wait("d")
    assert ready.state == "ready" and ready.path == "/cache/d"
    assert [r.url.path for r in seen] == ["/v1/datasets/d/wait"] * 3
    assert all(float(r.url.params["timeout"]) == 60.0 for r in seen)  # chunks, not a spin


@pytest.mark.parametrize(
    ("state", "cls", "sentence"),
    [
        ("failed", StagingFailed, "archive /a.tgz is truncated or corrupt; re-create it"),
        ("cancelled", StagingCancelled, "staging was cancelled by a request"),
        ("evicted", DatasetEvicted, "dataset 'd' was evicted from the node cache; stage it again"),
    ],
)
def test_wait_raises_with_the_daemons_sentence(state: str, cls: type, sentence: str) -> None:
    err = None if state == "evicted" else {"type": "x", "message": sentence}
    c = client(lambda r: httpx.Response(200, json=status(state=state, error=err)))
    with pytest.raises(cls) as info:
        c.wait("d", timeout=5)
    assert isinstance(info.value, StagingFailed) and str(info.value) == sentence
    assert info.value.status.state == state


def test_wait_timeout_uses_chunks_no_longer_than_what_is_left() -> None:
    fake = FakeTime()
    polls: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        polls.append(float(request.url.params["timeout"]))
        fake.now += polls[-1]  # the daemon holds the long-poll that long
        progress = {"step": "copy", "step_index": 1, "steps_total": 2, "bytes_done": 5,
                    "bytes_total": 10}  # fmt: skip
        return httpx.Response(200, json=status(progress=progress))

    with pytest.raises(WaitTimeout) as info:
        client(handler, fake).wait("d", timeout=100)
    assert polls == [60.0, 40.0]
    assert str(info.value) == (
        "dataset 'd' is still staging after 100 s (step 1/2 copy, 50% of 10 bytes); "
        "wait longer (--timeout) or see `stager-client status d`"
    )
    assert isinstance(info.value, StagerError) and info.value.status.progress.bytes_done == 5


def test_wait_reports_progress_at_the_interval() -> None:
    """The first status at once (a display shows it without waiting a poll), then one
    at least every interval."""
    seen, polls = [], []
    answers = iter([status(), status(), status(state="ready", path="/p")])

    def handler(request: httpx.Request) -> httpx.Response:
        polls.append(request.url.params["timeout"])
        return httpx.Response(200, json=next(answers))

    client(handler).wait("d", on_status=seen.append, interval=0.5)
    assert [s.state for s in seen] == ["staging", "staging", "ready"]
    assert polls == ["0.0", "0.5", "0.5"]


def test_wait_retries_a_daemon_that_is_not_up_yet_then_a_restart() -> None:
    script = ["refuse", "refuse", "refuse", "ok", "drop", "refuse", "ready"]
    fake = FakeTime()

    def handler(request: httpx.Request) -> httpx.Response:
        step = script.pop(0)
        if step == "refuse":
            raise httpx.ConnectError("[Errno 2] No such file or directory", request=request)
        if step == "drop":
            raise httpx.ReadError("connection reset", request=request)
        return httpx.Response(200, json=status(state="ready" if step == "ready" else "staging"))

    assert client(handler, fake).wait("d").state == "ready"
    # Exponential backoff, reset once the daemon answered.
    assert fake.sleeps == [0.05, 0.1, 0.2, 0.05, 0.1]


def test_wait_retries_a_request_broken_off_by_a_stopping_daemon() -> None:
    # uvicorn answers a bare 500 to requests still open when graceful shutdown times out.
    answers = [httpx.Response(500, text="Internal Server Error"),
               httpx.Response(503, text="stopping"),
               httpx.Response(200, json=status(state="ready", path="/p"))]  # fmt: skip
    fake = FakeTime()
    assert client(lambda r: answers.pop(0), fake).wait("d").path == "/p"
    assert fake.sleeps == [0.05, 0.1]
    with pytest.raises(ConnectionLost, match=r"broke off GET /v1/datasets/d \(HTTP 500\)"):
        client(lambda r: httpx.Response(500, text="Internal Server Error")).status("d")


def test_a_connection_refused_by_the_daemons_caps_is_retried_and_told_in_its_words() -> None:
    sentence = (
        "uid 1001 holds 64 connections to the stager service, the most one user may "
        "(--max-connections-per-user 64); close some, then retry"
    )
    refusal = {"error": {"type": "too_many_connections", "message": sentence}}
    busy = httpx.Response(503, json=refusal)
    answers = [busy, busy, httpx.Response(200, json=status(state="ready", path="/p"))]
    fake = FakeTime()
    assert client(lambda r: answers.pop(0), fake).wait("d").path == "/p"
    assert fake.sleeps == [0.05, 0.1]
    with pytest.raises(DaemonUnavailable) as info:
        client(lambda r: busy).status("d")
    assert type(info.value) is DaemonUnavailable  # not ConnectionLost: it never reached it
    assert str(info.value) == sentence


def test_wait_gives_up_on_a_gone_daemon_after_retry_for() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    fake = FakeTime()
    with pytest.raises(DaemonUnavailable) as info:
        client(refuse, fake, retry_for=3).wait("d")
    assert "did not come back after 3.0 s of retries" in str(info.value)
    assert sum(fake.sleeps) == pytest.approx(3.0) and max(fake.sleeps) == 0.5


def test_a_wait_gives_an_unknown_name_its_grace_from_the_daemons_first_answer() -> None:
    """10 s with no daemon, then 'no such name' until the grace (60 s by default) ends:
    DatasetNotFound with the daemon's sentence, 60 s after its first answer, not 50. The
    caller is told once of each: the silent daemon, the name not requested yet."""
    fake, said = FakeTime(), []
    not_found = {"error": {"type": "not_found", "message": "no dataset named 'x'"}}

    def handler(request: httpx.Request) -> httpx.Response:
        if fake.now < 10:
            raise httpx.ConnectError("[Errno 2] No such file or directory", request=request)
        return httpx.Response(404, json=not_found)

    c = client(handler, fake, on_retry=said.append)
    with pytest.raises(DatasetNotFound) as info:
        c.wait("x", on_not_requested=said.append)
    assert str(info.value) == "no dataset named 'x'; no stage request for it came in 60 s"
    assert info.value.waited == 60
    assert 70 <= fake.now < 71
    assert said == [
        "no stager daemon answers at unix:///nowhere.sock ([Errno 2] No such file or "
        "directory); retrying for up to 30 s",
        "dataset 'x' has not been requested yet; waiting up to 60 s for its stage request",
    ]


def test_a_wait_whose_request_lands_in_the_grace_returns_ready() -> None:
    fake = FakeTime()
    not_found = {"error": {"type": "not_found", "message": "no dataset named 'x'"}}

    def handler(request: httpx.Request) -> httpx.Response:
        if fake.now < 20:
            return httpx.Response(404, json=not_found)
        return httpx.Response(200, json=status("x", "ready", path="/p"))

    assert client(handler, fake).wait("x").path == "/p"


def test_wait_with_retry_for_zero_fails_at_once() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    fake = FakeTime()
    with pytest.raises(DaemonUnavailable, match=r"^no stager daemon answers"):
        client(refuse, fake, retry_for=0).wait("d")
    assert fake.sleeps == []


def test_backoff_never_sleeps_past_the_callers_deadline() -> None:
    fake = FakeTime()
    backoff = Backoff(budget=30, clock=fake.clock)
    exc = DaemonUnavailable("gone", url="u")
    fake.now = 10.0
    assert backoff.delay(exc, deadline=10.03) == pytest.approx(0.03)
    fake.now = 10.03
    with pytest.raises(DaemonUnavailable, match="after 0.0 s of retries"):
        backoff.delay(exc, deadline=10.03)


# ---- bodies --------------------------------------------------------------------------


def test_stage_body_sends_only_what_was_given() -> None:
    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(202, json=status())

    c = client(handler)
    c.stage("d", steps=[{"op": "copy", "src": "/x"}], link="/tmp/l",
            lease=LeaseCreate(holder="job-1"))  # fmt: skip
    c.stage("r", recipe="inat2021", source="/net/inat", params={"version": "2021"})
    assert sent == [
        {"name": "d", "link": "/tmp/l", "lease": {"holder": "job-1"},
         "steps": [{"op": "copy", "src": "/x"}]},
        {"name": "r", "recipe": "inat2021", "source": "/net/inat", "params": {"version": "2021"}},
    ]  # fmt: skip
    assert stage_body("n", steps=[{"op": "copy", "src": "/y"}]) == {
        "name": "n",
        "steps": [{"op": "copy", "src": "/y"}],
    }


def test_async_client_waits_and_translates_the_same_way() -> None:
    answers = iter([status(), status(state="failed", error={"type": "t", "message": "why"})])

    async def go() -> None:
        transport = httpx.MockTransport(lambda r: httpx.Response(200, json=next(answers)))
        async with AsyncStagerClient("unix:///x.sock", transport=transport) as c:
            with pytest.raises(StagingFailed, match="^why$"):
                await c.wait("d", timeout=5)

    asyncio.run(go())


# ---- against a real daemon ---------------------------------------------------------------


def test_contract_promised_to_the_trainer(daemon: Daemon, tree: Path, monkeypatch) -> None:
    monkeypatch.setenv("STAGER_URL", daemon.url)
    with StagerClient() as c:
        c.stage("imgs", steps=[{"op": "copy", "src": str(tree)}])
    ready = StagerClient().wait("imgs", timeout=20)  # the trainer's exact call
    assert ready.state == "ready" and Path(ready.path).is_dir()
    with StagerClient() as c:
        assert [d.name for d in c.list()] == ["imgs"]
        assert c.status("imgs").path == ready.path
        assert c.health()["status"] == "ok"
        lease = c.lease("imgs", "job-1", ttl_s=60)
        assert lease.holder == "job-1" and lease.expires_at is not None
        with pytest.raises(Conflict, match="leased by job-1"):
            c.cancel("imgs")
        assert [x.id for x in c.release("imgs", lease_id=lease.id)] == [lease.id]
        assert c.cancel("imgs").state == "evicted"
        with pytest.raises(DatasetNotFound, match="no dataset named 'nope'"):
            c.status("nope")
        said: list[str] = []
        with pytest.raises(NeverRequested, match=r"'nope' was never requested in 1 s \(the "
                           r"daemon knows: imgs\)") as never:  # fmt: skip
            c.wait("nope", timeout=1, on_not_requested=said.append, await_request=None)
        assert isinstance(never.value, WaitTimeout) and never.value.name == "nope"
        assert said == ["dataset 'nope' has not been requested yet; waiting for its stage request"]


def test_async_client_against_a_real_daemon(daemon: Daemon, tree: Path) -> None:
    async def go() -> list[str]:
        async with AsyncStagerClient(daemon.url) as c:
            for name in ("a", "b"):
                await c.stage(name, steps=[{"op": "copy", "src": str(tree), "dst": name}])
            done = await asyncio.gather(c.wait("a", timeout=20), c.wait("b", timeout=20))
            return [d.state for d in done]

    assert asyncio.run(go()) == ["ready", "ready"]


def test_importing_client_pulls_in_neither_fastapi_nor_torch() -> None:
    """Nor httpx's own command line (httpx._main: click, pygments; ~35 ms of each
    stager-client process), which httpx imports with itself unless marked absent, nor
    rich's console and progress, which only a bar on a terminal draws with (~30 ms)."""
    loaded = loaded_modules("client", "client.cli")
    assert "client.cli" in loaded  # full dotted names, so 'stager.engine.scheduler' below can match
    heavy = (
        "fastapi",
        "starlette",
        "uvicorn",
        "torch",
        "pydantic_settings",
        "stager.engine.scheduler",
        "click",
        "pygments",
        "rich.console",
        "rich.progress",
    )
    assert among(loaded, heavy) == []
