"""Every operation of the live OpenAPI document, fuzzed from its own schemas.

The operations are read from the daemon's OpenAPI document, not listed here, so an
endpoint added tomorrow is fuzzed tomorrow. For each one, strategies built from its
schemas (tests/schema_strategies.py) draw bodies and parameters that satisfy them
(the edges of every bound, the whole op table's steps) and, half of the time,
values that break them (junk types,
huge and non-finite numbers); they go to a real daemon over its socket. The promise:
no answer of 500 or more, and every 4xx is a sentence. Sources are confined to an
empty sandbox (``--allowed-root``), so a generated path never stages the machine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.api.app import create_app
from stager.core.settings import Settings
from tests.counts import tally
from tests.daemon import Daemon
from tests.schema_strategies import from_schema

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

EXAMPLES = int(os.environ.get("STAGER_OPENAPI_FUZZ_EXAMPLES", "25"))
DOCUMENT = create_app(Settings()).openapi()
OPERATIONS = sorted(
    (method.upper(), path)
    for path, methods in DOCUMENT["paths"].items()
    for method in methods
    if method in ("get", "post", "put", "patch", "delete")
)
# Long polls and event streams would wait for their timeout: asked with a short one.
SHORT = {"timeout": 0.2}
STREAMS = {"/v1/datasets/{name}/events"}
fuzzed: dict[tuple[str, str], int] = {}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("openapi-fuzz")
    (root / "sandbox").mkdir()
    daemon = Daemon(
        cache_dir=root / "cache",
        args=["--allowed-root", str(root / "sandbox")],
        extra_env={"STAGER_STALL_TIMEOUT": "3", "STAGER_CANCEL_GRACE": "1"},
    )
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


def junk() -> st.SearchStrategy[Any]:
    numbers = st.sampled_from([1e308, -1e308, 10**30, -(10**30), float("nan"), float("inf")])
    leaves = st.one_of(st.none(), st.booleans(), numbers, st.integers(), st.text(max_size=8))
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=6,
    )


def values(node: dict[str, Any] | None) -> st.SearchStrategy[Any]:
    if node is None:
        return junk()
    return st.one_of(from_schema(node, DOCUMENT), junk())


def path_value() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(["ds", "none", "job-1", "a" * 300]), st.text(max_size=12))


def send(client: httpx.Client, method: str, url: str, params: dict, body: Any) -> httpx.Response:
    """JSON as Python writes it: NaN and Infinity too, which strict JSON has not."""
    if body is None:
        return client.request(method, url, params=params)
    content = json.dumps(body).encode("utf-8", "surrogatepass")
    headers = {"content-type": "application/json"}
    return client.request(method, url, params=params, content=content, headers=headers)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)
@given(data=st.data())
def test_every_operation_answers_below_500(daemon: Daemon, method: str, path: str, data) -> None:
    operation = DOCUMENT["paths"][path][method.lower()]
    url, params = path, {}
    for parameter in operation.get("parameters", []):
        name, where = parameter["name"], parameter["in"]
        if where == "path":
            url = url.replace(f"{{{name}}}", quote(data.draw(path_value(), label=name), safe=""))
        elif where == "query" and (parameter.get("required") or data.draw(st.booleans())):
            value = SHORT.get(name) if name in SHORT else data.draw(values(parameter["schema"]))
            params[name] = value if isinstance(value, str) else json.dumps(value)
    body = None
    content = operation.get("requestBody", {}).get("content", {})
    if "application/json" in content:
        body = data.draw(values(content["application/json"].get("schema")), label="body")
    if path in STREAMS:
        return  # fuzzed through its status route; a stream would hold the test
    with daemon.client(timeout=30) as client:
        response = send(client, method, url, params, body)
    assert response.status_code < 500, f"{method} {url} {params} {body!r}: {response.text}"
    if response.status_code >= 400 and response.headers.get("content-type", "").startswith(
        "application/json"
    ):
        error = response.json()["error"]
        assert error["type"] and len(error["message"]) > 10, error
    fuzzed[(method, path)] = fuzzed.get((method, path), 0) + 1


def test_the_fuzz_reached_every_operation_of_the_document(daemon: Daemon) -> None:
    if not fuzzed:
        pytest.skip("run with the test above")
    with daemon.client() as client:
        live = client.get("/openapi.json").json()
    served = {(m.upper(), p) for p, methods in live["paths"].items() for m in methods}
    assert served == set(OPERATIONS), "the served document differs from the app's"
    missing = sorted(set(OPERATIONS) - set(fuzzed) - {("GET", p) for p in STREAMS})
    assert not missing, f"never fuzzed: {missing}"
    tally(
        f"openapi fuzz: {sum(fuzzed.values())} requests over all {len(OPERATIONS)} operations, "
        "0 answers >= 500"
    )


def test_nothing_of_the_machine_was_staged(daemon: Daemon) -> None:
    """Generated sources were confined to the empty sandbox: nothing big got in."""
    data = daemon.cache_dir / "data"
    total = sum(p.stat().st_size for p in data.rglob("*") if p.is_file()) if data.exists() else 0
    assert total < 1 << 20, f"the fuzz staged {total} bytes: a source escaped the sandbox"
    assert isinstance(Path(daemon.cache_dir), Path)
