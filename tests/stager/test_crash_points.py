"""Crash consistency at every durable step (``stager.core.durable.Durable``).

A traced run of one script of requests lists every durable step it passes
through, in order, with repeats (a marker per step). Then, for each of them, a
daemon runs the same script with ``crash_after`` set to that occurrence and dies
right after it, like ``kill -9`` (its staging process too). A fresh daemon on the
same cache must then, after the restart and after each follow-up the API allows
(DELETE, the same POST, another POST under the same name), never show a ready
dataset that differs from its source, never leave one stuck, and end each
request ready and byte-equal, or failed with a sentence.

The script is built to pass through every member of ``Durable``; a new durable
step that the script does not reach fails ``test_the_script_reaches_every_durable_step``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from stager.core.durable import Durable
from stager.image import mount as image_mount
from stager.wire.schemas import (
    END_NAME,
    IMAGE_DELIVERY_NAME,
    MANIFEST_NAME,
    READY_SUFFIX,
    part_name,
)
from tests.counts import tally
from tests.daemon import Daemon, Zygote
from tests.httpserver import Behaviour, serve_files
from tests.trees import digest, make_tar, write_tree

pytestmark = pytest.mark.slow  # four crash tests of about a minute or more each, on 2 cores

TIMEOUT = 30
# Every use of an entry is written, so the script's cache hit reaches Durable.TOUCHED
# (a daemon normally writes one entry's recency at most every 30 s).
EVERY_WRITE = {"STAGER_RECENCY_PERSIST_S": "0"}
# The image request as an index image (docs/image-mode.md): the tar kept whole as its blob.
INDEX_IMAGES = {"STAGER_IMAGE_INDEX": "true", "STAGER_IMAGE_BACKING": "file"}


@dataclass
class World:
    """Sources and requests shared by every run."""

    tmp: Path
    base_url: str
    trees: dict[str, Path]
    delivery: Path  # "ds" as another node would broadcast it, damaged on the way
    adopt: dict
    # Every daemon here is forked from it (tests/daemon_zygote.py): the claims are what
    # a daemon leaves after a kill -9 and does after a restart, at each of ~150 crash
    # points, two daemons each; not how an interpreter starts (~0.9 s of CPU each).
    zygote: Zygote
    image_from_url: bool = False  # "img" extracts the tar from its URL: built as it downloads

    def daemon(self, cache: Path, env: dict[str, str] | None = None) -> Daemon:
        return Daemon(cache_dir=cache, extra_env=env or {}, zygote=self.zygote)

    def body(self, which: str, links: Path | None = None) -> dict:
        if which == "ds":  # copy, fetch, extract what was fetched, rename
            steps = [
                {"op": "copy", "src": str(self.trees["a"]), "dst": "a"},
                {"op": "fetch", "url": f"{self.base_url}/t.tar", "dst": "dl/t.tar"},
                {"op": "extract", "src": "dl/t.tar"},
                {"op": "rename", "src": "t", "dst": "train"},
            ]
            return {
                "name": "ds",
                "steps": steps,
                "link": str((links or self.tmp / "links") / "ds"),
                "lease": {"holder": "job-1"},
            }
        if which == "other":  # the same name, another request
            return {"name": "ds", "steps": [{"op": "copy", "src": str(self.trees["b"])}]}
        if which == "img":  # an archive staged as one image, mounted (docs/image-mode.md)
            src = f"{self.base_url}/t.tar" if self.image_from_url else str(self.tmp / "t.tar")
            steps = [
                {"op": "extract", "src": src},
                {"op": "rename", "src": "t", "dst": "train"},
            ]
            link = str((links or self.tmp / "links") / "img")
            return {"name": "img", "steps": steps, "image": True, "link": link}
        # A staging that fails in its staging process: it adopts a broadcast copy of
        # "ds" that does not match its manifest (and the delivery is removed).
        return {"name": "bad", "steps": self.body("ds")["steps"], "adopt": self.adopt}

    def expected(self, which: str) -> dict[str, str]:
        if which == "other":
            return digest(self.trees["b"])
        if which == "img":
            return {f"train/{k}": v for k, v in digest(self.trees["t"]).items()}
        found = {f"a/{k}": v for k, v in digest(self.trees["a"]).items()}
        found.update({f"train/{k}": v for k, v in digest(self.trees["t"]).items()})
        return found


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, daemon_zygote: Zygote) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("crash")
    trees = {name: write_tree(tmp / name, n_files=8, seed=i) for i, name in enumerate("abt")}
    archive = make_tar(trees["t"], tmp / "t.tar").read_bytes()
    with serve_files(Behaviour(files={"/t.tar": archive})) as url:
        world = World(tmp, url, trees, tmp / "delivery", {}, daemon_zygote)
        world.adopt = damaged_broadcast(world)
        yield world


def damaged_broadcast(world: World) -> dict:
    """The ``adopt`` field of a request for a broadcast of "ds" kept in
    ``world.delivery`` with a byte of file data flipped in its middle part (reserved
    under the label "bad")."""
    return broadcast_of_ds(world, world.tmp / "sender", world.delivery, "bad", damaged=True)


def broadcast_of_ds(
    world: World, sender_cache: Path, delivery: Path, label: str, damaged: bool
) -> dict:
    """Stage "ds" on another daemon (another node), pack it in parts as a fan-out does,
    keep what a receiver gets in ``delivery`` (every part announced whole, the
    manifest, the end file), ``damaged`` or not; the ``adopt`` field of a request for
    that delivery (reserved under ``label``)."""
    sender = world.daemon(sender_cache)
    delivery.mkdir()
    try:
        with sender.start().client() as client:
            post(client, world.body("ds", sender_cache.parent / "sender-links"))
            assert wait(client, "ds")["state"] == "ready"
            ask = {"label": label, "part_bytes": 1 << 16}
            while True:
                exported = client.post("/v1/datasets/ds/export", json=ask).json()
                part = delivery / part_name(exported["part"])
                shutil.copy(exported["path"], part)
                (delivery / (part_name(exported["part"]) + READY_SUFFIX)).touch()
                if exported["manifest"]:
                    break
                ask = {"label": label, "part": exported["part"] + 1}
            shutil.copy(exported["manifest"], delivery / MANIFEST_NAME)
    finally:
        sender.cleanup()
    assert exported["parts"] > 1, exported
    end = {"parts": exported["parts"], "manifest_sha256": exported["manifest_sha256"]}
    (delivery / END_NAME).write_text(json.dumps(end))
    if damaged:
        middle = delivery / part_name(exported["parts"] // 2)
        data = bytearray(middle.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside some file's data
        middle.write_bytes(bytes(data))
    return {
        "incoming": label,
        "origin_node": "node2",
        "origin_key": exported["key"],
        "bundle_bytes": exported["data_bytes"],
    }


def script(client: httpx.Client, world: World, links: Path | None = None) -> None:
    """Requests that pass through every durable step."""
    post(client, world.body("ds", links))
    wait(client, "ds")
    client.delete("/v1/datasets/ds/leases", params={"holder": "job-1"}).raise_for_status()
    client.delete("/v1/datasets/ds").raise_for_status()  # evict
    image_script(client, world, links)
    # sbcast's part: the delivery lands in a reservation
    nbytes = sum(f.stat().st_size for f in world.delivery.iterdir())
    reserved = client.post("/v1/incoming", json={"label": "bad", "bytes": nbytes})
    reserved.raise_for_status()
    for delivered in world.delivery.iterdir():
        shutil.copy(delivered, reserved.json()["path"])
    post(client, world.body("bad"))
    wait(client, "bad")
    client.delete("/v1/datasets/bad").raise_for_status()  # forget the name


def image_script(client: httpx.Client, world: World, links: Path | None = None) -> None:
    """An image: built, published, mounted; a hit; evicted (unmounted, deleted)."""
    post(client, world.body("img", links))
    wait(client, "img")
    post(client, world.body("img", links))
    client.delete("/v1/datasets/img").raise_for_status()


def post(client: httpx.Client, body: dict) -> httpx.Response:
    response = client.post("/v1/datasets", json=body)
    assert response.status_code in (200, 202, 409), response.text
    return response


def wait(client: httpx.Client, name: str) -> dict:
    return client.get(f"/v1/datasets/{name}/wait", params={"timeout": TIMEOUT}).json()


def traced_points(
    world: World, cache: Path, run: Callable = script, env: dict[str, str] | None = None
) -> list[str]:
    """Every durable step ``run`` passes through, in order, with ``#N`` repeats."""
    env = {"STAGER_CRASH_AFTER": "trace", **EVERY_WRITE, **(env or {})}
    daemon = world.daemon(cache, env)
    try:
        with daemon.start().client() as client:
            run(client, world)
        daemon_pid = daemon.process.pid
        daemon.stop()
        log = daemon.log(limit=None)
    finally:
        daemon.cleanup()
    seen: dict[tuple[str, int], int] = {}
    stagings: list[int] = []  # staging processes' pids, in the order they started
    points = []
    for name, pid in re.findall(r"stager durable: (\S+) pid=(\d+)", log):
        pid = int(pid)
        seen[name, pid] = seen.get((name, pid), 0) + 1
        where = ""
        if pid != daemon_pid:
            if pid not in stagings:
                stagings.append(pid)
            where = f"@{stagings.index(pid) + 1}"
        points.append(f"{name}#{seen[name, pid]}{where}")
    return points


@pytest.fixture(scope="module")
def points(world: World) -> list[str]:
    return traced_points(world, world.tmp / "traced-cache")


# Under make test's two workers each crash test is a unit of its own (minutes each),
# the traced script's two together (they share its points).
@pytest.mark.xdist_group("crash-points-traced")
def test_the_script_reaches_every_durable_step(points: list[str]) -> None:
    reached = {p.split("#")[0] for p in points}
    assert len(points) == len(set(points))
    assert reached == {d.value for d in Durable}, f"never reached: {set(Durable) - reached}"


class Checker:
    """Looks at everything a daemon says after a crash, and at what is on disk."""

    def __init__(self, daemon: Daemon, world: World, blobs: bool = False) -> None:
        self.daemon, self.world = daemon, world
        self.blobs = blobs  # every image an index image, its blob beside it

    def settle(self, client: httpx.Client, name: str, which: str) -> dict | None:
        """Wait for ``name`` to end; a ready one must hold exactly ``which``'s content."""
        response = client.get(f"/v1/datasets/{name}/wait", params={"timeout": TIMEOUT})
        if response.status_code == 404:
            return None
        status = response.json()
        assert status["state"] not in ("queued", "staging"), f"{name} stuck: {status}"
        if status["state"] == "ready":
            assert digest(Path(status["path"])) == self.world.expected(which), status
            if status["link"]:
                assert Path(status["link"]).resolve() == Path(status["path"]).resolve()
        elif status["state"] == "failed":
            assert status["error"]["message"], status
        return status

    def mounts_are_sound(self, client: httpx.Client) -> None:
        """Every mount under data/ is of its own published image, the file beside it
        (``<mount point>.erofs``; no orphan mount, no mount over a deleted image), and
        every ready image dataset is mounted at its path (an entry no name shows, staged
        after a crash, may be mounted too)."""
        data = self.daemon.cache_dir / "data"
        found = {m.target: m for m in image_mount.mounts_under(str(data))}
        for target, mount in found.items():
            file = Path(f"{target}.erofs")
            assert file.exists(), f"{target} is mounted, and its image is gone"
            st = file.stat()
            assert image_mount.backing_file(mount) == (st.st_dev, st.st_ino), mount
            if self.blobs:  # what the next boot mounts it with
                assert Path(f"{file}.blob").is_file(), f"{target}: no blob"
        for status in client.get("/v1/datasets").json()["data"]:
            if status["state"] == "ready" and status["image"]:
                assert status["path"] in found, f"ready image {status['name']} is not mounted"

    def no_leftovers(self, client: httpx.Client) -> None:
        """Once nothing is active, no attempt folder is left in partial/ (deletes of
        discarded ones run in the background: give them a moment)."""
        statuses = client.get("/v1/datasets").json()["data"]
        if any(s["state"] in ("queued", "staging") for s in statuses):
            return
        partial = self.daemon.cache_dir / "partial"
        left = wait_for(lambda: [p.name for p in partial.iterdir()] or None, expect_none=True)
        assert left is None, f"left in partial/: {left}"


def wait_for(probe, expect_none: bool, timeout: float = 10):  # noqa: ANN001, ANN201
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if (value is None) == expect_none or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def crashes_at(
    world: World, points: list[str], root: Path, run: Callable = script, env: dict | None = None
) -> list[str]:
    """What went wrong after a crash at each of ``points`` (nothing: an empty list)."""

    def one(point: str) -> str | None:
        cache_root = root / point.replace("#", "-").replace("@", "-")
        try:
            crash_and_follow_up(world, point, cache_root, run, env)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            return f"{point}: {exc}"
        return None

    # Two at a time: each run is its own daemons on its own cache, mostly waiting.
    with ThreadPoolExecutor(2) as pool:
        return [failure for failure in pool.map(one, points) if failure]


@pytest.mark.xdist_group("crash-points-traced")
@pytest.mark.timeout(1200)  # ~2.5 min on 2 cores; each of ~44 runs is two daemon starts
def test_crash_after_every_durable_step(world: World, points: list[str], tmp_path: Path) -> None:
    failures = crashes_at(world, points, tmp_path)
    assert not failures, "\n".join(failures)
    kinds = len({point.split("#")[0] for point in points})
    tally(
        f"crash points: killed after each of {len(points)} durable steps ({kinds} kinds), "
        "checked after restart, DELETE, the same POST and another POST"
    )


@pytest.mark.xdist_group("crash-points-index")
@pytest.mark.timeout(600)
def test_crash_after_every_durable_step_of_an_index_image(world: World, tmp_path: Path) -> None:
    """The image request as an index image (its tar published as a blob beside it, then
    the image: two renames, one commit) killed after each of its durable steps."""
    daemon = world.daemon(tmp_path / "probe", INDEX_IMAGES)
    try:
        with daemon.start().client() as client:
            post(client, world.body("img", tmp_path / "probe-links"))
            blob = Path(wait(client, "img")["image"]["file"] + ".blob")
            assert blob.is_file(), "the image request did not become an index image"
            client.delete("/v1/datasets/img").raise_for_status()
    finally:
        daemon.cleanup()
    points = traced_points(world, tmp_path / "traced", image_script, INDEX_IMAGES)
    assert any(p.startswith("image-published") for p in points), points
    failures = crashes_at(world, points, tmp_path / "runs", image_script, INDEX_IMAGES)
    assert not failures, "\n".join(failures)


@pytest.mark.xdist_group("crash-points-download")
@pytest.mark.timeout(600)
def test_crash_after_every_durable_step_of_an_image_built_as_it_downloads(
    world: World, tmp_path: Path
) -> None:
    """The image request as the extract of a URL, its image built while the tar
    downloads (the image takes its name only once the download is checked), killed
    after each of its durable steps."""
    from_url = dataclasses.replace(world, image_from_url=True)
    points = traced_points(from_url, tmp_path / "traced", image_script)
    assert any(p.startswith("image-built") for p in points), points
    # Built from the download as it arrived: no step ran alone first (no marker of one).
    assert not any(p.startswith("step-done") for p in points), points
    failures = crashes_at(from_url, points, tmp_path / "runs", image_script)
    assert not failures, "\n".join(failures)


def sent_image(world: World, cache: Path, delivery: Path) -> dict:
    """The image request staged on another daemon (another node) and exported as a
    fan-out sends an image dataset, whole, kept at ``delivery``; the ``adopt`` field of
    a request for it (reserved under the label "imgd")."""
    sender = world.daemon(cache)
    try:
        with sender.start().client() as client:
            post(client, world.body("img", cache.parent / "sender-links"))
            assert wait(client, "img")["state"] == "ready"
            exported = client.post("/v1/datasets/img/export", json={"label": "imgd"}).json()
            shutil.copy(exported["path"], delivery)
    finally:
        sender.cleanup()
    assert exported["image"] is not None, exported
    return {"incoming": "imgd", "origin_node": "node2", "origin_key": exported["key"],
            "image": exported["image"]}  # fmt: skip


@pytest.fixture(scope="module")
def sent(world: World) -> tuple[Path, dict]:
    """``sent_image``'s delivery and ``adopt`` field, made once for the tests of an
    adopted image (a sender daemon and a staging each): they only copy it."""
    folder = world.tmp / "image-sender"  # its links apart from the broadcast sender's
    folder.mkdir()
    delivery = folder / "delivered.img"
    return delivery, sent_image(world, folder / "cache", delivery)


def adopting(delivery: Path, adopt: dict) -> Callable:
    """The script of a request that adopts ``delivery`` (reserved, copied in, adopted),
    then asks again (a hit) and deletes it."""

    def adopted_image_script(client: httpx.Client, world: World, links: Path | None = None) -> None:
        size = delivery.stat().st_size
        reserved = client.post("/v1/incoming", json={"label": "imgd", "bytes": size})
        reserved.raise_for_status()
        shutil.copy(delivery, Path(reserved.json()["path"]) / IMAGE_DELIVERY_NAME)
        post(client, {**world.body("img", links), "adopt": adopt})
        assert wait(client, "img")["origin"]["how"] == "broadcast"
        post(client, world.body("img", links))  # a hit
        client.delete("/v1/datasets/img").raise_for_status()

    return adopted_image_script


@pytest.mark.xdist_group("crash-points-adopted")
@pytest.mark.timeout(600)
def test_crash_after_every_durable_step_of_an_adopted_image(
    world: World, sent: tuple[Path, dict], tmp_path: Path
) -> None:
    """The image request adopting another node's image, sent whole (docs/multinode.md):
    the delivery copied, checked by its sha256 and published as any image, killed after
    each of its durable steps; a hit and an eviction after it."""
    script = adopting(*sent)
    points = traced_points(world, tmp_path / "traced", script)
    assert any(p.startswith("image-built") for p in points), points
    assert any(p.startswith("delivery-removed") for p in points), points
    failures = crashes_at(world, points, tmp_path / "runs", script)
    assert not failures, "\n".join(failures)
    tally(f"crash points of an adopted image: killed after each of {len(points)} durable steps")


@pytest.mark.xdist_group("crash-points-adopted")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", ["named#1", "attempt-created#1@1", "image-built#1@1"])
def test_an_adoption_cut_before_its_steps_are_done_ends_at_the_restart(
    world: World, sent: tuple[Path, dict], tmp_path: Path, point: str
) -> None:
    """A restart deletes deliveries, so an adoption it cut before its steps were done
    (an image's adoption writes no step marker: its one step is its build) cannot resume: it is
    ended as the daemon starts, with a sentence, and the same request asked right away
    stages from its source. (Resumed, it failed later on a missing file, and a request
    that joined it meanwhile shared that failure.) One cut after its steps resumes to
    its publish (``test_an_adopted_tree_cut_after_its_steps_resumes_to_its_publish``)."""
    script = adopting(*sent)
    cache, links = tmp_path / "cache", tmp_path / "links"
    crashed_at(world, point, cache, lambda client: script(client, world, links))
    daemon = world.daemon(cache)
    try:
        with daemon.start().client() as client:
            check = Checker(daemon, world)
            status = client.get("/v1/datasets/img").json()
            assert status["state"] == "failed", f"{status}"
            assert status["error"]["type"] == "interrupted", f"{status}"
            assert "delivery" in status["error"]["message"], f"{status}"
            post(client, world.body("img", links))
            status = check.settle(client, "img", "img")
            assert status is not None and status["state"] == "ready", f"{status}"
            assert status["origin"]["how"] == "staged", f"{status}"
    finally:
        daemon.cleanup()


@pytest.mark.xdist_group("crash-points-adopted")
def test_an_adopted_tree_cut_after_its_steps_resumes_to_its_publish(
    world: World, tmp_path: Path
) -> None:
    """An adoption killed once its one step is done (the tree checked against its
    manifest, the step's marker written) needs its delivery no more: the restart
    resumes it to its publish, ready and equal to its source, adopted."""
    delivery = tmp_path / "whole"
    adopt = broadcast_of_ds(world, tmp_path / "sender", delivery, "good", damaged=False)
    body = {"name": "good", "steps": world.body("ds")["steps"], "adopt": adopt}
    cache = tmp_path / "cache"

    def adopt(client: httpx.Client) -> None:
        nbytes = sum(f.stat().st_size for f in delivery.iterdir())
        reserved = client.post("/v1/incoming", json={"label": "good", "bytes": nbytes})
        reserved.raise_for_status()
        for delivered in delivery.iterdir():
            shutil.copy(delivered, reserved.json()["path"])
        post(client, body)
        wait(client, "good")

    crashed_at(world, "step-done#1@1", cache, adopt)
    daemon = world.daemon(cache)
    try:
        with daemon.start().client() as client:
            status = Checker(daemon, world).settle(client, "good", "ds")
            assert status is not None and status["state"] == "ready", f"{status}"
            assert status["origin"]["how"] == "broadcast", f"{status}"
    finally:
        daemon.cleanup()


def crashed_at(world: World, point: str, cache: Path, run: Callable[[httpx.Client], None]) -> None:
    """``run`` against a daemon on ``cache`` that dies (kill -9) right after ``point``;
    what it left mounted stays, for the next daemon to find."""
    crashing = world.daemon(cache, {"STAGER_CRASH_AFTER": point})
    try:
        with crashing.start().client() as client, contextlib.suppress(httpx.TransportError):
            run(client)
        assert crashing.process.wait(timeout=TIMEOUT) == -9, "the daemon did not crash"
    finally:
        crashing.cleanup(unmount=False)


def crash_and_follow_up(
    world: World,
    point: str,
    cache_root: Path,
    run: Callable = script,
    env: dict[str, str] | None = None,
) -> None:
    """``run`` killed right after ``point``; then a fresh daemon on the same cache and
    every follow-up (the image's alone when ``run`` is one of the image's scripts)."""
    cache, links = cache_root / "cache", cache_root / "links"
    env = env or {}
    crashing = world.daemon(cache, {"STAGER_CRASH_AFTER": point, **EVERY_WRITE, **env})
    try:
        with crashing.start().client() as client:
            try:
                run(client, world, links)
            except (httpx.TransportError, httpx.HTTPStatusError, ValueError):
                pass
        assert crashing.process.wait(timeout=TIMEOUT) == -9, "the daemon did not crash"
    finally:
        crashing.cleanup(unmount=False)  # what it left mounted, the next daemon finds

    daemon = world.daemon(cache, env)
    try:
        check = Checker(daemon, world, blobs=env.get("STAGER_IMAGE_INDEX") == "true")
        with daemon.start().client() as client:
            # After the restart alone.
            check.settle(client, "ds", "ds")
            check.settle(client, "bad", "bad")
            check.settle(client, "img", "img")
            check.mounts_are_sound(client)
            check.no_leftovers(client)
            # The image: DELETE, the same POST (ready, mounted), DELETE (unmounted).
            client.delete("/v1/datasets/img")
            post(client, world.body("img", links))
            status = check.settle(client, "img", "img")
            assert status is not None and status["state"] == "ready", f"{status}"
            check.mounts_are_sound(client)
            client.delete("/v1/datasets/img").raise_for_status()
            check.mounts_are_sound(client)
            if run is not script:  # an image's script: the image's follow-ups alone
                return
            # DELETE, then the same POST: ready and equal to its source.
            client.delete("/v1/datasets/ds/leases")
            client.delete("/v1/datasets/ds")
            check.settle(client, "ds", "ds")
            post(client, world.body("ds", links))
            status = check.settle(client, "ds", "ds")
            assert status is not None and status["state"] == "ready", f"{status}"
            # The same POST again: a hit.
            assert post(client, world.body("ds", links)).status_code == 200
            # Another request under the same name, after a DELETE.
            client.delete("/v1/datasets/ds/leases")
            client.delete("/v1/datasets/ds").raise_for_status()
            post(client, world.body("other"))
            status = check.settle(client, "ds", "other")
            assert status is not None and status["state"] == "ready", f"{status}"
            check.no_leftovers(client)
    finally:
        daemon.cleanup()
