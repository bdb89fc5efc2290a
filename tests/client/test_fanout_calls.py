"""`FanoutCalls` (client/fanout/calls.py): the fan-out's endpoints travel over the
public client's own connection (its injected transport, its timeouts, its one
translation of errors), while the public client offers only the user's API. The
same calls against real daemons: tests/client/test_fanout_node.py."""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

import httpx
import pytest

from client import AsyncStagerClient, Conflict, StagerClient
from client._client import DEFAULT_TIMEOUT_S
from client.fanout.calls import EXPORT_TIMEOUT_S, FanoutCalls

TRANSFER = {"id": "job1-k", "path": "/cache/incoming/job1-k", "bytes": 5,
            "expires_at": "2024-01-01T00:00:00Z"}  # fmt: skip
EXPORT = {"id": "job1-k", "key": "k", "part": 0, "parts": 2, "path": "/cache/outgoing/p0",
          "bytes": 5, "total_bytes": 9, "data_bytes": 8}  # fmt: skip


def test_fanout_calls_use_the_clients_transport_timeouts_and_error_translation() -> None:
    seen: list[tuple[str, str, Any, float]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.method, request.url.path, body, request.extensions["timeout"]["read"]))
        if request.url.path == "/v1/incoming":
            message = "the cache has 3 bytes free, not 5; free room or stage from the source"
            return httpx.Response(409, json={"error": {"type": "no_room", "message": message}})
        if request.url.path.endswith("/probe"):
            return httpx.Response(200, json={"key": "k", "state": "ready"})
        return httpx.Response(
            200, json=EXPORT if request.url.path.endswith("/export") else TRANSFER
        )

    async def go() -> None:
        transport = httpx.MockTransport(handler)
        async with AsyncStagerClient("unix:///nowhere.sock", transport=transport) as client:
            calls = FanoutCalls(client)
            assert (await calls.probe({"name": "ds", "recipe": "r"})).state == "ready"
            assert (await calls.export("ds", "job1-k", 1, early=True)).parts == 2
            await calls.export("ds", "job1-k", 0, part_bytes=1 << 20)
            assert (await calls.delete_export("job1-k")).id == "job1-k"
            with pytest.raises(Conflict, match="^the cache has 3 bytes free, not 5; free"):
                await calls.reserve("job1-k", 5)
            await calls.release_incoming("job1-k")

    asyncio.run(go())
    assert seen == [
        ("POST", "/v1/datasets/probe", {"name": "ds", "recipe": "r"}, DEFAULT_TIMEOUT_S),
        ("POST", "/v1/datasets/ds/export", {"label": "job1-k", "part": 1, "early": True},
         EXPORT_TIMEOUT_S),
        ("POST", "/v1/datasets/ds/export", {"label": "job1-k", "part": 0, "part_bytes": 1 << 20},
         EXPORT_TIMEOUT_S),
        ("DELETE", "/v1/exports/job1-k", None, DEFAULT_TIMEOUT_S),
        ("POST", "/v1/incoming", {"label": "job1-k", "bytes": 5}, DEFAULT_TIMEOUT_S),
        ("DELETE", "/v1/incoming/job1-k", None, DEFAULT_TIMEOUT_S),
    ]  # fmt: skip


# What a user calls, the same on both clients (awaited on the async one); anything else
# public on them is plumbing that belongs beside the code that needs it (as FanoutCalls).
USER_API = {
    "status",
    "list",
    "submit",
    "stage",
    "wait",
    "cancel",
    "lease",
    "release",
    "whoami",
    "recipes",
}


def public_methods(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if name[0] != "_"}


def test_the_public_clients_offer_the_users_api_and_nothing_else() -> None:
    assert public_methods(AsyncStagerClient) == USER_API | {"aclose"}
    assert public_methods(StagerClient) == USER_API | {"close", "health"}
    assert not public_methods(FanoutCalls) & public_methods(AsyncStagerClient)
