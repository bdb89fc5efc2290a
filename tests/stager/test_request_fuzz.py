"""Generated requests, driven all the way through staging on a real daemon.

Every field of every endpoint gets values a user could send by mistake (NUL
bytes, names longer than the filesystem allows, malformed URLs, huge or negative
numbers, special files, links out of the cache, junk types) mixed with good
ones, so that many requests get through to the engine and stage for real. The
promises: no response is a 5xx, every 4xx is a sentence naming what is wrong,
every accepted staging ends (ready, failed or cancelled) instead of hanging, and
nothing is left behind once nothing is active: no attempt folder in partial/, no
tree in data/ that is not a ready entry's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.counts import tally
from tests.daemon import Daemon
from tests.httpserver import Behaviour, serve_files
from tests.trees import make_tar, write_tree

EXAMPLES = int(os.environ.get("STAGER_FUZZ_EXAMPLES", "120"))
LONG = "n" * 300


@dataclass
class Sandbox:
    daemon: Daemon
    root: Path
    url: str
    sent: list[int]
    other_answers: int = 0


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    root = tmp_path_factory.mktemp("fuzz")
    tree = write_tree(root / "tree", n_files=5, max_size=3000)
    make_tar(tree, root / "tree.tar")
    make_tar(tree, root / "tree.tar.gz")
    (root / "file.bin").write_bytes(b"x" * 1000)
    os.mkfifo(root / "fifo")
    (root / "links").mkdir()
    archive = (root / "tree.tar.gz").read_bytes()
    daemon = Daemon(
        cache_dir=root / "cache",
        extra_env={"STAGER_STALL_TIMEOUT": "5", "STAGER_CANCEL_GRACE": "1"},
    )
    with serve_files(Behaviour(files={"/t.tar.gz": archive})) as url:
        daemon.start()
        try:
            yield Sandbox(daemon, root, url, [])
        finally:
            daemon.cleanup()


def paths(box_root: str) -> st.SearchStrategy[str]:
    """Sources: good ones, missing ones, special files, and strings no path can be."""
    good = [f"{box_root}/tree", f"{box_root}/tree.tar", f"{box_root}/tree.tar.gz"]
    odd = [f"{box_root}/file.bin", f"{box_root}/nope", f"{box_root}/fifo", "/dev/null"]
    broken = ["relative/x", "", "/", f"/{LONG}", f"{box_root}/a\0b", "/proc/self/../..", "/..//"]
    return st.one_of(st.sampled_from(good + odd + broken), st.text(max_size=20))


def relatives() -> st.SearchStrategy[str]:
    fixed = [".", "a", "a/b/", "../up", "/abs", LONG, "x\0y", "", "t.tar.gz", "tree"]
    return st.one_of(st.sampled_from(fixed), st.text(max_size=12))


def junk() -> st.SearchStrategy[object]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=10),
        st.lists(st.integers(), max_size=2),
    )


def good_steps(box: str, url: str) -> st.SearchStrategy[list[dict]]:
    """Steps that stage: the engine's paths, not only validation, get exercised."""
    choices = [
        [{"op": "copy", "src": f"{box}/tree", "dst": "a"}],
        [{"op": "copy", "src": f"{box}/file.bin"}, {"op": "rename", "src": "file.bin", "dst": "f"}],
        [{"op": "extract", "src": f"{box}/tree.tar"}],
        [{"op": "extract", "src": f"{box}/tree.tar.gz", "strip_components": 1}],
        [{"op": "symlink", "src": f"{box}/tree", "mode": "tree", "dst": "s"}],
        [{"op": "unpack", "src": f"{box}/tree.tar.gz", "mode": "copy"}],
        [
            {"op": "fetch", "url": f"{url}/t.tar.gz", "dst": "dl/t.tar.gz"},
            {"op": "extract", "src": "dl/t.tar.gz"},
        ],
    ]
    return st.lists(st.sampled_from(choices), min_size=1, max_size=2).map(
        lambda parts: [step for part in parts for step in part]
    )


def bad_values(box: str) -> st.SearchStrategy[object]:
    """What a field may get by mistake: paths no filesystem has, special files, numbers
    out of any range, malformed URLs, wrong types."""
    strings = [
        f"{box}/nope", f"{box}/fifo", "/dev/null", "relative/x", "", "/", f"/{LONG}",
        f"{box}/a\0b", "../up", "x\0y", LONG, "http://[::1", "ftp://x/y", "http://",
        f"{box}/cache/x", f"{box}/file.bin", "Bad Name!", "0" * 64, "rar", "bogus",
    ]  # fmt: skip
    return st.one_of(st.sampled_from(strings), junk(), st.text(max_size=12))


def bodies(box: str, url: str) -> st.SearchStrategy[dict]:
    good = st.fixed_dictionaries(
        {"name": st.integers(0, 40).map("ds{}".format), "steps": good_steps(box, url)},
        optional={
            "link": st.sampled_from([f"{box}/links/l", f"{box}/links/sub/l2"]),
            "verify": st.sampled_from(["size", "sha256", "none"]),
            "fingerprint": st.sampled_from(["cheap", "deep"]),
            "lease": st.fixed_dictionaries(
                {"holder": st.sampled_from(["job-1", "job-2"])},
                optional={"ttl_s": st.sampled_from([60.0, 3600.0]), "slurm_job_id": st.just("42")},
            ),
        },
    )
    recipe = st.fixed_dictionaries(
        {
            "name": st.sampled_from(["r1", "r2"]),
            "recipe": st.sampled_from(["imagefolder", "imagefolder", "cifar10", "nope"]),
            "source": st.sampled_from([f"{box}/tree", f"{box}/nope"]),
        },
        optional={"params": st.dictionaries(st.sampled_from(["mode", "x"]), junk(), max_size=1)},
    )
    return st.one_of(good, recipe)


def mutated(body: dict, data: st.DataObject, box: str) -> dict:
    """``body`` with one field (or an added one) replaced by a bad value, or as it is."""
    places: list[tuple[dict, str]] = []

    def collect(node: object) -> None:
        if isinstance(node, dict):
            places.extend((node, key) for key in node)
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(body)
    how = data.draw(st.sampled_from(["as is", "as is", "replace", "add"]), label="mutation")
    if how == "replace":
        node, key = data.draw(st.sampled_from(places), label="field")
        node[key] = data.draw(bad_values(box), label="bad value")
    elif how == "add":
        node, _ = data.draw(st.sampled_from(places), label="where")
        key = data.draw(
            st.sampled_from(["lease", "link", "ttl_s", "keep", "nested", "mode", "zzz"]),
            label="added field",
        )
        node[key] = data.draw(bad_values(box), label="bad value")
    return body


def leases() -> st.SearchStrategy[object]:
    """Lease bodies for ``POST .../leases``: good ones and every kind of bad one."""
    return st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {"holder": st.one_of(st.sampled_from(["job-1", "", "h\0", LONG]), st.text())},
            optional={
                "ttl_s": st.one_of(st.floats(), st.sampled_from([1e308, -1, 0, 60, 10**400])),
                "slurm_job_id": st.one_of(st.sampled_from(["42", "4_2", "x", "9" * 80]), junk()),
            },
        ),
        junk(),
    )


def send(client: httpx.Client, method: str, url: str, body: object) -> httpx.Response:
    """JSON as Python writes it: NaN and Infinity too, which strict JSON has not."""
    content = json.dumps(body).encode("utf-8", "surrogatepass")
    headers = {"content-type": "application/json"}
    return client.request(method, url, content=content, headers=headers)


def check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["type"] and len(error["message"]) > 10, error


def settle(client: httpx.Client, name: str) -> None:
    """An accepted staging ends: ready, failed or cancelled, never stuck."""
    status = client.get(f"/v1/datasets/{name}/wait", params={"timeout": 30})
    check_answer(status)
    if status.status_code == 200:
        assert status.json()["state"] not in ("queued", "staging"), status.text


def clean_up(client: httpx.Client) -> None:
    for status in client.get("/v1/datasets").json()["data"]:
        check_answer(client.delete(f"/v1/datasets/{status['name']}/leases"))
        check_answer(client.delete(f"/v1/datasets/{status['name']}"))
        check_answer(client.delete(f"/v1/datasets/{status['name']}"))  # then forget it


def nothing_left_behind(box: Sandbox, client: httpx.Client) -> None:
    statuses = client.get("/v1/datasets").json()["data"]
    ready = {s["key"] for s in statuses if s["state"] == "ready"}
    assert not any(s["state"] in ("queued", "staging") for s in statuses)
    partial, data = box.daemon.cache_dir / "partial", box.daemon.cache_dir / "data"
    deadline = time.monotonic() + 10
    while list(partial.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)  # discarded attempts are deleted in the background
    assert list(partial.iterdir()) == []
    assert {p.name for p in data.iterdir()} <= ready


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_generated_stage_requests_never_500_and_always_settle(sandbox: Sandbox, data) -> None:
    box = str(sandbox.root)
    body = mutated(data.draw(bodies(box, sandbox.url)), data, box)
    with sandbox.daemon.client(timeout=60) as client:
        response = send(client, "POST", "/v1/datasets", body)
        check_answer(response)
        sandbox.sent.append(response.status_code)
        if response.status_code in (200, 202):
            settle(client, str(body["name"]))
            # The same request again, then a DELETE: joins, hits and evictions too.
            check_answer(send(client, "POST", "/v1/datasets", body))
        if data.draw(st.booleans(), label="clean up"):
            clean_up(client)
            nothing_left_behind(sandbox, client)


@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(
    name=st.one_of(st.sampled_from(["ds", "r1", "none"]), st.text(max_size=20)),
    lease=leases(),
    timeout=st.one_of(st.floats(), st.sampled_from(["x", "-1", "1e400", "nan", "0.1"])),
    holder=st.one_of(st.text(max_size=10), st.just("h\0")),
    gc=st.one_of(st.none(), junk(), st.fixed_dictionaries({"all": junk()})),
)
def test_every_other_endpoint_answers_4xx_not_5xx(
    sandbox: Sandbox, name: str, lease: object, timeout: object, holder: str, gc: object
) -> None:
    quoted = f"/v1/datasets/{quote(name, safe='')}"
    with sandbox.daemon.client(timeout=60) as client:
        answers = [
            client.get(quoted),
            client.get(f"{quoted}/wait", params={"timeout": str(timeout)}),
            send(client, "POST", f"{quoted}/leases", lease),
            client.get(f"{quoted}/leases"),
            client.delete(f"{quoted}/leases", params={"holder": holder}),
            client.delete(f"{quoted}/leases/{quote(holder, safe='')}x"),
            client.delete("/v1/leases", params={"holder": holder}),
            send(client, "POST", "/v1/gc", gc),
        ]
    for response in answers:
        check_answer(response)
    sandbox.other_answers += len(answers)


def test_the_fuzz_reached_the_engine(sandbox: Sandbox) -> None:
    """Runs after the generated requests: enough of them were accepted and staged."""
    if not sandbox.sent:
        pytest.skip("run with the tests above")
    accepted = sum(code in (200, 202) for code in sandbox.sent)
    tally(
        f"fuzz: {len(sandbox.sent)} generated stage requests ({accepted} staged) and "
        f"{sandbox.other_answers} requests to the other endpoints, 0 answers >= 500"
    )
    assert accepted >= max(10, len(sandbox.sent) // 6), sandbox.sent
    with sandbox.daemon.client() as client:
        clean_up(client)
        nothing_left_behind(sandbox, client)
