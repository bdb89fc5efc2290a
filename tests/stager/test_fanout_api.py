"""The daemon's side of a multi-node fan-out, with two real daemons standing for two
nodes (their own cache folders) and a plain file copy standing for sbcast: probe,
export, reserve, adopt (bundle and source files), and what happens to a copy that
does not match: the staging fails with a sentence, nothing is published, and the
same request then stages from the source."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from stager.wire.manifest_format import file_digest
from stager.wire.schemas import END_NAME, MANIFEST_NAME, READY_SUFFIX, delivered_name, part_name
from tests.daemon import Daemon
from tests.httpserver import Behaviour, serve_files
from tests.stager.test_cache import metric, ready
from tests.trees import digest, make_tar, write_tree

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py


def request(name: str, src: Path) -> dict:
    return {"name": name, "steps": [{"op": "copy", "src": str(src)}]}


def archive_request(name: str, archive: Path) -> dict:
    return {"name": name, "steps": [{"op": "extract", "src": str(archive)}]}


@pytest.fixture
def two(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> tuple[Daemon, Daemon]:
    return (
        daemon_factory(cache_dir=tmp_path / "node1"),
        daemon_factory(cache_dir=tmp_path / "node2"),
    )


def send_bundle(
    sender: httpx.Client,
    receiver: httpx.Client,
    body: dict,
    label: str,
    corrupt: bool = False,
    tree: bool = False,
) -> dict:
    """What the job's tasks do, with a file copy for sbcast: export part 0, reserve on
    the receiver, ask it to adopt, then send every part (announcing each one whole)
    and the manifest, and write the end file. Returns the receiver's final status."""
    name = body["name"]
    ask = {"label": label, "part_bytes": 1 << 16, **({"tree": True} if tree else {})}
    first = sender.post(f"/v1/datasets/{name}/export", json=ask)
    assert first.status_code == 200, first.text
    exported = first.json()
    assert exported["parts"] > 2  # small parts: the order and the waiting are exercised
    skipped = sender.post(f"/v1/datasets/{name}/export", json={"label": label, "part": 2})
    assert skipped.status_code == 409 and "ask for part 1" in skipped.text
    reserved = receiver.post(
        "/v1/incoming", json={"label": label, "bytes": exported["total_bytes"]}
    )
    assert reserved.status_code == 200, reserved.text
    folder = Path(reserved.json()["path"])
    adopt = {
        "incoming": label,
        "origin_node": "node1",
        "origin_key": exported["key"],
        "job": "42",
        "bundle_bytes": exported["data_bytes"],
    }
    response = receiver.post("/v1/datasets", json={**body, "adopt": adopt})
    assert response.status_code == 202, response.text
    for part in range(exported["parts"]):
        if part:
            answer = sender.post(f"/v1/datasets/{name}/export", json={"label": label, "part": part})
            exported = answer.json()
        target = folder / part_name(part)
        shutil.copyfile(exported["path"], target)
        if corrupt and part == exported["parts"] // 2:
            data = bytearray(target.read_bytes())
            data[len(data) // 2] ^= 0xFF  # inside some file's data
            target.write_bytes(bytes(data))
        (folder / (part_name(part) + READY_SUFFIX)).touch()
    shutil.copyfile(exported["manifest"], folder / MANIFEST_NAME)
    end = {"parts": exported["parts"], "manifest_sha256": exported["manifest_sha256"]}
    (folder / END_NAME).write_text(json.dumps(end))
    assert sender.delete(f"/v1/exports/{label}").status_code == 200
    assert not Path(exported["path"]).exists()
    return receiver.get(f"/v1/datasets/{name}/wait", params={"timeout": 60}).json()


def test_probe_reports_the_key_and_the_copy_and_changes_nothing(
    two: tuple[Daemon, Daemon], tmp_path: Path
) -> None:
    archive = make_tar(write_tree(tmp_path / "imgs", n_files=10), tmp_path / "imgs.tar.gz")
    body = archive_request("imgs", archive)
    node1, node2 = two
    with node1.client() as one, node2.client() as other:
        probed = one.post("/v1/datasets/probe", json=body).json()
        assert probed["state"] is None and probed["image"] is False
        # What the node stages it as: an image where asked for and mountable (root here).
        as_image = one.post("/v1/datasets/probe", json={**body, "image": True}).json()
        assert as_image["image"] is True and as_image["key"] != probed["key"]
        assert probed["source_files"] == [{"path": str(archive), "size": archive.stat().st_size}]
        assert one.get("/v1/datasets").json()["count"] == 0  # no name, no entry
        staged = ready(one, body)
        assert one.post("/v1/datasets/probe", json=body).json()["state"] == "ready"
        # Another node computes the same key for the same sources.
        assert other.post("/v1/datasets/probe", json=body).json()["key"] == staged["key"]
        tree = request("tree", tmp_path / "imgs")
        assert one.post("/v1/datasets/probe", json=tree).json()["source_files"] == []


def test_a_bundle_is_adopted_under_the_same_key_and_the_delivery_is_deleted(
    two: tuple[Daemon, Daemon], tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=40)
    (src / "class_0" / "alias.jpg").symlink_to("img_0000.jpg")
    body = request("ds", src)
    node1, node2 = two
    with node1.client() as one, node2.client() as other:
        staged = ready(one, {**body, "lease": {"holder": "j", "slurm_job_id": "42"}})
        assert staged["origin"] == {
            "how": "staged", "node": None, "job": "42", "bytes": 0, "hit": False
        }  # fmt: skip
        adopted = send_bundle(one, other, body, "job42-ds")
        assert adopted["state"] == "ready", adopted["error"]
        assert adopted["key"] == staged["key"]
        assert adopted["origin"]["how"] == "broadcast" and adopted["origin"]["node"] == "node1"
        assert digest(Path(adopted["path"])) == digest(src)
        assert (Path(adopted["path"]) / "class_0" / "alias.jpg").is_symlink()
        assert list((node2.cache_dir / "incoming").iterdir()) == []
        # Where each copy came from, in the metrics of each node.
        assert metric(one, "stager_arrivals_total", how="staged") == 1
        data = sum(p.stat().st_size for p in src.rglob("*") if p.is_file() and not p.is_symlink())
        assert metric(one, "stager_source_read_bytes_total") == data
        assert metric(other, "stager_arrivals_total", how="broadcast") == 1
        assert metric(other, "stager_source_read_bytes_total") == 0
        assert metric(other, "stager_broadcast_received_bytes_total") > staged["size_bytes"]
        # The next request on the receiving node is a cache hit.
        again = other.post("/v1/datasets", json=body)
        assert again.status_code == 200 and again.json()["origin"]["hit"] is True
        assert metric(other, "stager_arrivals_total", how="hit") == 1


def test_a_copy_that_does_not_match_is_never_ready_and_the_source_is_staged_instead(
    two: tuple[Daemon, Daemon], tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=30)
    body = request("ds", src)
    node1, node2 = two
    with node1.client() as one, node2.client() as other:
        ready(one, body)
        failed = send_bundle(one, other, body, "job7-ds", corrupt=True)
        assert failed["state"] == "failed"
        assert "node1" in failed["error"]["message"]
        assert not (node2.cache_dir / "data" / failed["key"]).exists()
        assert list((node2.cache_dir / "incoming").iterdir()) == []
        staged = ready(other, body)  # the same request, from the source this time
        assert staged["origin"]["how"] == "staged"
        assert digest(Path(staged["path"])) == digest(src)


def test_broadcast_source_files_are_checked_then_staged_from_on_every_node(
    two: tuple[Daemon, Daemon], tmp_path: Path
) -> None:
    archive = make_tar(write_tree(tmp_path / "imgs", n_files=20), tmp_path / "imgs.tar.gz")
    body = archive_request("imgs", archive)
    node1, node2 = two
    with node1.client() as one, node2.client() as other:
        reference = ready(one, body)
        adopted, folder = send_archive(other, body, archive, reference["key"], "j1")
        assert adopted["state"] == "ready", adopted["error"]
        assert adopted["key"] == reference["key"]
        assert digest(Path(adopted["path"])) == digest(Path(reference["path"]))
        assert not folder.exists()
        assert metric(other, "stager_source_read_bytes_total") == 0


def send_archive(
    receiver: httpx.Client, body: dict, archive: Path, key: str, label: str
) -> tuple[dict, Path]:
    """The archive broadcast as it is (a file copy for sbcast) and adopted by the
    receiver; returns its final status and the delivery folder."""
    reserved = receiver.post("/v1/incoming", json={"label": label, "bytes": 10_000_000}).json()
    copy = Path(reserved["path"]) / delivered_name(str(archive))
    shutil.copyfile(archive, copy)
    adopt = {
        "incoming": label,
        "origin_node": "node1",
        "origin_key": key,
        "sources": {str(archive): list(file_digest(copy))},
    }
    receiver.post("/v1/datasets", json={**body, "adopt": adopt})
    status = receiver.get(f"/v1/datasets/{body['name']}/wait", params={"timeout": 60}).json()
    return status, Path(reserved["path"])


def test_a_delivery_for_other_sources_is_refused(
    two: tuple[Daemon, Daemon], tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=5)
    node1, node2 = two
    with node2.client() as other:
        other.post("/v1/incoming", json={"label": "j2", "bytes": 1000})
        adopt = {"incoming": "j2", "origin_node": "node1", "origin_key": "0" * 24,
                 "bundle_bytes": 10}  # fmt: skip
        response = other.post("/v1/datasets", json={**request("ds", src), "adopt": adopt})
        assert response.status_code == 409
        assert "node1 staged" in response.json()["error"]["message"]
        assert other.get("/v1/datasets").json()["count"] == 0


def test_reservations_count_against_the_disk(
    daemon_factory: Callable[..., Daemon], tmpfs: Callable[[str], Path]
) -> None:
    disk = tmpfs("8m")
    daemon = daemon_factory(cache_dir=disk / "cache", env={"STAGER_MIN_FREE_BYTES": "0"})
    with daemon.client() as client:
        first = client.post("/v1/incoming", json={"label": "a", "bytes": 5_000_000})
        assert first.status_code == 200
        second = client.post("/v1/incoming", json={"label": "b", "bytes": 5_000_000})
        assert second.status_code == 422, second.text  # the first one's room is taken
        assert client.post("/v1/incoming", json={"label": "a", "bytes": 5_000_000}).is_success
        assert client.delete("/v1/incoming/a").status_code == 200
        assert not Path(first.json()["path"]).exists()
        assert client.post("/v1/incoming", json={"label": "b", "bytes": 5_000_000}).is_success
        assert client.delete("/v1/incoming/nope").status_code == 404


def test_adoption_works_where_sources_are_confined_to_allowed_roots(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A site that sets --allowed-root still fans out: the delivered files sit in the
    daemon's own incoming folder, outside those roots, and both the request check and
    the staging process accept them there (only there: a source must still be inside)."""
    data = tmp_path / "datasets"
    src = write_tree(data / "src", n_files=20)
    archive = make_tar(src, data / "src.tar.gz")
    node1, node2 = (
        daemon_factory(cache_dir=tmp_path / node, args=["--allowed-root", str(data)])
        for node in ("node1", "node2")
    )
    with node1.client() as one, node2.client() as other:
        body = request("tree", src)
        ready(one, body)
        adopted = send_bundle(one, other, body, "job9-tree")
        assert adopted["state"] == "ready", adopted["error"]
        assert adopted["origin"]["how"] == "broadcast"
        assert digest(Path(adopted["path"])) == digest(src)

        body = archive_request("imgs", archive)
        reference = ready(one, body)
        adopted, _ = send_archive(other, body, archive, reference["key"], "j9")
        assert adopted["state"] == "ready", adopted["error"]
        assert digest(Path(adopted["path"])) == digest(Path(reference["path"]))

        # The incoming folder is no source root for anything but an adoption.
        outside = other.post("/v1/datasets", json=request("sneak", node2.cache_dir / "incoming"))
        assert outside.status_code == 400 and "outside the allowed source roots" in outside.text


def test_an_early_export_follows_the_staging_and_then_hands_over_to_the_ready_tree(
    two: tuple[Daemon, Daemon], tmp_path: Path
) -> None:
    """While a dataset stages, an early export answers a part or "ask again"; once it
    is not staging any more, "no more" (``more`` false); the ready tree's parts then
    continue the numbering, and early parts are not asked for again."""
    src = write_tree(tmp_path / "src", n_files=30)
    slow = Behaviour(files={"/late.bin": os.urandom(300_000)}, bytes_per_s=150_000)
    node1, _ = two
    export = "/v1/datasets/ds/export"
    with serve_files(slow) as url, node1.client() as one:
        steps = [{"op": "copy", "src": str(src)},
                 {"op": "fetch", "url": f"{url}/late.bin", "dst": "late.bin"}]  # fmt: skip
        assert one.post("/v1/datasets", json={"name": "ds", "steps": steps}).status_code == 202
        answer = one.post(export, json={"label": "job7-ds", "early": True, "part_bytes": 1 << 16})
        assert answer.status_code == 200, answer.text
        early = answer.json()
        assert early["more"] is True and early["data_bytes"] > 0
        not_ready = one.post(export, json={"label": "job8-ds"})
        assert not_ready.status_code == 409 and "not ready" in not_ready.json()["error"]["message"]
        skipped = one.post(export, json={"label": "job7-ds", "part": 5, "early": True})
        assert skipped.status_code == 409 and "ask for part" in skipped.json()["error"]["message"]
        while early["more"]:
            if early["path"] is None:
                time.sleep(early["retry_after_s"])
            part = early["parts"]
            early = one.post(export, json={"label": "job7-ds", "part": part, "early": True}).json()
        assert one.get("/v1/datasets/ds").json()["state"] == "ready"
        sent_early = early["parts"]
        assert sent_early >= 1  # the copied files went while the download ran
        rest = one.post(export, json={"label": "job7-ds", "part": sent_early})
        assert rest.status_code == 200 and rest.json()["part"] == sent_early, rest.text
        again = one.post(export, json={"label": "job7-ds", "part": sent_early + 1, "early": True})
        assert (
            again.status_code == 409 and "past its early parts" in again.json()["error"]["message"]
        )
        unknown = one.post("/v1/datasets/nope/export", json={"label": "x", "early": True})
        assert unknown.status_code == 404
        assert one.delete("/v1/exports/job7-ds").status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"ttl_s": 9.07e307, "label": "P", "bytes": 22407.0},  # as the fuzzer sent it
        {"ttl_s": 60, "label": "P", "bytes": 2**80},
        {"ttl_s": -1, "label": "P", "bytes": 1},
    ],
)
def test_an_unbounded_reservation_is_a_422_naming_the_field(
    refusing_daemon: Daemon, body: dict
) -> None:
    with refusing_daemon.client() as client:
        response = client.post("/v1/incoming", json=body)
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    assert ("ttl_s" in message) or ("bytes" in message), message


def test_a_delivery_is_kept_while_adopted_and_released_when_a_request_hits_instead(
    two: tuple[Daemon, Daemon], tmp_path: Path
) -> None:
    """The three fates of a delivery: claimed by the staging that adopts it (a DELETE
    meanwhile leaves it there), removed when that staging ends, and released at once
    when its request hits a copy the node already holds."""
    src = write_tree(tmp_path / "src", n_files=10)
    body = request("ds", src)
    node1, node2 = two
    with node1.client() as one, node2.client() as other:
        staged = ready(one, body)
        exported = one.post("/v1/datasets/ds/export", json={"label": "a"}).json()
        adopt = {
            "incoming": "a",
            "origin_node": "node1",
            "origin_key": staged["key"],
            "job": "42",
            "bundle_bytes": exported["data_bytes"],
        }
        folder = Path(
            other.post("/v1/incoming", json={"label": "a", "bytes": 1 << 20}).json()["path"]
        )
        assert other.post("/v1/datasets", json={**body, "adopt": adopt}).status_code == 202
        # Adopting: the parts have not come yet, and a release does not pull them away.
        assert other.delete("/v1/incoming/a").status_code == 200
        assert folder.is_dir()
        shutil.copyfile(exported["path"], folder / part_name(0))
        (folder / (part_name(0) + READY_SUFFIX)).touch()
        shutil.copyfile(exported["manifest"], folder / MANIFEST_NAME)
        end = {"parts": exported["parts"], "manifest_sha256": exported["manifest_sha256"]}
        (folder / END_NAME).write_text(json.dumps(end))
        assert other.get("/v1/datasets/ds/wait", params={"timeout": 60}).json()["state"] == "ready"
        assert not folder.exists()  # read once: gone with its staging
        assert other.delete("/v1/incoming/a").status_code == 404
        # A second delivery for what the node now holds: the request hits, and the room
        # it reserved is given back at once.
        folder = Path(
            other.post("/v1/incoming", json={"label": "b", "bytes": 1 << 20}).json()["path"]
        )
        hit = other.post("/v1/datasets", json={**body, "adopt": {**adopt, "incoming": "b"}})
        assert hit.status_code == 200 and hit.json()["origin"]["hit"] is True
        assert not folder.exists()
        assert other.delete("/v1/incoming/b").status_code == 404


@pytest.mark.parametrize("stop", ["kill -9", "SIGTERM"])
def test_a_staging_that_fed_a_fan_out_is_not_resumed_from_the_source_on_its_own(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, stop: str
) -> None:
    """Its peers may hold the data by now: a restarted daemon leaves it to the next
    request (which a fan-out sources from a holder) instead of reading the source
    again by itself. A staging nobody fed from resumes as before."""
    blob = os.urandom(1 << 20)
    behaviour = Behaviour(files={"/fed": blob, "/alone": blob}, bytes_per_s=500_000)
    daemon = daemon_factory(cache_dir=tmp_path / "node")
    with serve_files(behaviour) as url:
        with daemon.client() as client:
            for name in ("fed", "alone"):
                body = {
                    "name": name,
                    "steps": [{"op": "fetch", "url": f"{url}/{name}", "dst": "b"}],
                }
                assert client.post("/v1/datasets", json=body).status_code == 202
            early = client.post("/v1/datasets/fed/export", json={"label": "j1-fed", "early": True})
            assert early.status_code == 200, early.text
            deadline = time.monotonic() + 20
            while client.get("/v1/datasets/fed").json()["progress"]["bytes_done"] == 0:
                assert time.monotonic() < deadline, "the fed staging never started"
                time.sleep(0.05)
        if stop == "kill -9":
            daemon.kill()
        else:
            daemon.stop()
        daemon.start()
        with daemon.client() as client:
            fed = client.get("/v1/datasets/fed").json()
            assert fed["state"] == "failed" and fed["error"]["type"] == "interrupted", fed
            assert "--peers slurm" in fed["error"]["message"]
            alone = client.get("/v1/datasets/alone/wait", params={"timeout": 60}).json()
            assert alone["state"] == "ready", alone  # resumed on its own
            again = client.post("/v1/datasets", json={"name": "fed", "steps": [
                {"op": "fetch", "url": f"{url}/fed", "dst": "b"}]})  # fmt: skip
            assert again.status_code == 202, again.text
            status = client.get("/v1/datasets/fed/wait", params={"timeout": 60}).json()
            assert status["state"] == "ready", status


def test_expired_reservations_and_exports_go_and_the_sweep_goes_on(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A job that died leaves a reservation and an export: each goes once past its time,
    and the sweep that removed them keeps sweeping (a second reservation goes too)."""
    src = write_tree(tmp_path / "src", n_files=5)
    daemon = daemon_factory(cache_dir=tmp_path / "node", env={"STAGER_SWEEP_INTERVAL_S": "0.2"})
    with daemon.client() as client:
        ready(client, request("ds", src))
        exported = client.post("/v1/datasets/ds/export", json={"label": "e"}).json()
        first = client.post("/v1/incoming", json={"label": "a", "bytes": 1, "ttl_s": 0.3}).json()
        deadline = time.monotonic() + 10
        while Path(first["path"]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(first["path"]).exists()
        assert Path(exported["path"]).exists()  # an hour to live: not yet
        second = client.post("/v1/incoming", json={"label": "b", "bytes": 1, "ttl_s": 0.3}).json()
        while Path(second["path"]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(second["path"]).exists(), daemon.log()
        assert client.delete("/v1/incoming/a").status_code == 404
