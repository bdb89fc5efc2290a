"""An image dataset fanned out as one file, with two real daemons standing for two nodes
(their own cache folders) and a file copy standing for sbcast: the source node's image
is exported whole with its size and sha256, the receiver adopts it under the same key
and mounts it; a delivery that is not those bytes (a flipped byte, cut short, swapped
for another image after the hash was taken) is never mounted, and that node then
stages from the source."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from stager.image import mount as image_mount
from stager.image.build import build_image
from stager.wire.schemas import IMAGE_DELIVERY_NAME
from tests.daemon import Daemon, unmount_under
from tests.stager.test_cache import metric
from tests.trees import digest, make_tar, write_tree

TIMEOUT = 60

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="kernel mounts need root"),
    pytest.mark.forked_daemons,  # tests/daemon_zygote.py
]


def image_body(archive: Path, name: str = "ds") -> dict:
    steps = [{"op": "extract", "src": str(archive)}, {"op": "rename", "src": "t", "dst": "train"}]
    return {"name": name, "steps": steps, "image": True}


def wait(client: httpx.Client, name: str) -> dict:
    return client.get(f"/v1/datasets/{name}/wait", params={"timeout": TIMEOUT}).json()


def ready(client: httpx.Client, body: dict) -> dict:
    response = client.post("/v1/datasets", json=body)
    assert response.status_code in (200, 202), response.text
    status = wait(client, body["name"])
    assert status["state"] == "ready", status
    return status


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, Path]:
    tree = write_tree(tmp_path / "t", n_files=30, seed=5)
    return tree, make_tar(tree, tmp_path / "t.tar.gz")


@pytest.fixture
def two(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    yield (
        daemon_factory(cache_dir=tmp_path / "node1"),
        daemon_factory(cache_dir=tmp_path / "node2"),
    )
    unmount_under(tmp_path)  # whatever a failed test left mounted


Damage = Callable[[Path], None]


def send_image(
    sender: httpx.Client, receiver: httpx.Client, body: dict, label: str,
    damage: Damage | None = None, delivered: list[os.stat_result] | None = None,
) -> tuple[dict, dict]:  # fmt: skip
    """What the job's tasks do, with a file copy for sbcast: export (one file, hashed by
    the source's service), reserve on the receiver, send the file, ask the receiver to
    adopt it. The export's answer and the receiver's final status (``delivered`` gets
    the delivered file's stat)."""
    answer = sender.post(f"/v1/datasets/{body['name']}/export", json={"label": label})
    assert answer.status_code == 200, answer.text
    exported = answer.json()
    reserved = receiver.post("/v1/incoming", json={"label": label, "bytes": exported["bytes"]})
    assert reserved.status_code == 200, reserved.text
    folder = Path(reserved.json()["path"])
    shutil.copyfile(exported["path"], folder / IMAGE_DELIVERY_NAME)
    if damage is not None:
        damage(folder / IMAGE_DELIVERY_NAME)
    if delivered is not None:
        delivered.append((folder / IMAGE_DELIVERY_NAME).stat())
    adopt = {"incoming": label, "origin_node": "node1", "origin_key": exported["key"],
             "job": "42", "image": exported["image"]}  # fmt: skip
    response = receiver.post("/v1/datasets", json={**body, "adopt": adopt})
    assert response.status_code in (200, 202), response.text
    assert sender.delete(f"/v1/exports/{label}").status_code == 200
    return exported, wait(receiver, body["name"])


def test_an_image_dataset_is_sent_as_one_file_and_mounted_under_the_same_key(
    two: tuple[Daemon, Daemon], source: tuple[Path, Path]
) -> None:
    tree, archive = source
    node1, node2 = two
    body = image_body(archive)
    with node1.client() as one, node2.client() as other:
        staged = ready(one, body)
        image_file = Path(staged["image"]["file"])
        answer = one.post("/v1/datasets/ds/export", json={"label": "job42-ds"}).json()
        # One file, nothing else: no parts, no manifest.
        assert answer["parts"] == 1 and answer["manifest"] is None
        assert os.listdir(Path(answer["path"]).parent) == [IMAGE_DELIVERY_NAME]
        assert Path(answer["path"]).read_bytes() == image_file.read_bytes()
        sha = hashlib.sha256(image_file.read_bytes()).hexdigest()
        assert answer["image"] == {"size": image_file.stat().st_size, "sha256": sha,
                                   "format": "erofs", "credential": None}  # fmt: skip
        assert one.delete("/v1/exports/job42-ds").status_code == 200

        delivered: list[os.stat_result] = []
        exported, adopted = send_image(one, other, body, "job42-ds", delivered=delivered)
        assert adopted["state"] == "ready", adopted["error"]
        assert adopted["key"] == staged["key"] == exported["key"]
        assert adopted["origin"]["how"] == "broadcast" and adopted["origin"]["node"] == "node1"
        found = image_mount.mounted_at(adopted["path"])
        assert found is not None and found.fstype == "erofs"
        assert {"ro", "nosuid", "nodev"} <= set(found.options.split(","))
        assert digest(Path(adopted["path"]) / "train") == digest(tree)
        received = Path(adopted["image"]["file"])
        assert received.read_bytes() == image_file.read_bytes()
        assert received.stat().st_mode & 0o777 == 0o444
        # A per-user daemon's own user wrote the delivery: hashed there and renamed in,
        # not copied (the node service copies it: test_multiuser_image_fanout.py).
        assert received.stat().st_ino == delivered[0].st_ino
        assert list((node2.cache_dir / "incoming").iterdir()) == []
        assert list((node1.cache_dir / "outgoing").iterdir()) == []
        assert metric(other, "stager_source_read_bytes_total") == 0
        assert metric(other, "stager_arrivals_total", how="broadcast") == 1
        # The next request on the receiving node is a cache hit.
        again = other.post("/v1/datasets", json=body)
        assert again.status_code == 200 and again.json()["origin"]["hit"] is True


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def cut_short(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 4096)


def another_image(tmp: Path) -> Damage:
    """An image of other files, of the same size (a user's own, swapped in after the
    source node's service took its hash)."""

    def swap(path: Path) -> None:
        other = write_tree(tmp / "other", n_files=30, seed=99)
        build_image(str(other), str(tmp / "other.erofs"))
        data = (tmp / "other.erofs").read_bytes()
        size = path.stat().st_size
        path.write_bytes(data[:size].ljust(size, b"\0"))

    return swap


@pytest.mark.parametrize("damage", ["flipped", "short", "swapped"])
def test_a_delivery_that_is_not_the_sent_image_is_never_mounted(
    two: tuple[Daemon, Daemon], source: tuple[Path, Path], tmp_path: Path, damage: str
) -> None:
    tree, archive = source
    node1, node2 = two
    body = image_body(archive)
    spoil = {"flipped": flip_a_byte, "short": cut_short,
             "swapped": another_image(tmp_path)}[damage]  # fmt: skip
    with node1.client() as one, node2.client() as other:
        ready(one, body)
        _, failed = send_image(one, other, body, "job7-ds", spoil)
        assert failed["state"] == "failed", failed
        message = failed["error"]["message"]
        assert IMAGE_DELIVERY_NAME in message and "node1" in message, message
        assert image_mount.mounts_under(str(node2.cache_dir)) == []
        assert sorted(os.listdir(node2.cache_dir / "data")) == []
        assert list((node2.cache_dir / "incoming").iterdir()) == []
        staged = ready(other, body)  # the same request, from the source this time
        assert staged["origin"]["how"] == "staged"
        assert digest(Path(staged["path"]) / "train") == digest(tree)


def test_a_delivery_that_never_arrived_is_said_to_be_the_sbcasts_from_its_node(
    two: tuple[Daemon, Daemon], source: tuple[Path, Path]
) -> None:
    """An sbcast that failed outright leaves no file: the refusal names the node the
    image was to come from and the sbcast, not the path as if the user had typed it."""
    _, archive = source
    node1, node2 = two
    body = image_body(archive)
    with node1.client() as one, node2.client() as other:
        ready(one, body)
        exported = one.post("/v1/datasets/ds/export", json={"label": "j8-ds"}).json()
        reserved = other.post("/v1/incoming", json={"label": "j8-ds", "bytes": exported["bytes"]})
        assert reserved.status_code == 200, reserved.text
        adopt = {"incoming": "j8-ds", "origin_node": "node1", "origin_key": exported["key"],
                 "job": "8", "image": exported["image"]}  # fmt: skip
        refused = other.post("/v1/datasets", json={**body, "adopt": adopt})
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "from node1 did not reach this node" in message, message
        assert IMAGE_DELIVERY_NAME in message and "sbcast" in message, message
        assert "check the path in the request" not in message
        assert image_mount.mounts_under(str(node2.cache_dir)) == []


def test_an_image_dataset_asked_for_as_a_tree_goes_in_parts_and_the_receiver_builds_it(
    two: tuple[Daemon, Daemon], source: tuple[Path, Path]
) -> None:
    """``--broadcast prepared``: the image dataset's tree, in parts with a manifest; the
    receiver checks the tree and builds its own image of it."""
    from tests.stager.test_fanout_api import send_bundle

    tree, archive = source
    node1, node2 = two
    body = image_body(archive)
    with node1.client() as one, node2.client() as other:
        staged = ready(one, body)
        adopted = send_bundle(one, other, body, "job43-ds", tree=True)
        assert adopted["state"] == "ready", adopted["error"]
        assert adopted["key"] == staged["key"] and adopted["origin"]["how"] == "broadcast"
        assert image_mount.mounted_at(adopted["path"]) is not None
        assert digest(Path(adopted["path"]) / "train") == digest(tree)


def test_an_index_image_goes_as_a_tree_in_parts(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Two files (the image and its blob, the source's tar): sent as a tree is, in parts
    with a manifest; the receiver builds its own image of the checked tree."""
    tree = write_tree(tmp_path / "t", n_files=12, seed=6)
    archive = make_tar(tree, tmp_path / "t.tar")
    env = {"STAGER_IMAGE_INDEX": "true", "STAGER_IMAGE_BACKING": "file"}
    node1 = daemon_factory(cache_dir=tmp_path / "node1", env=env)
    try:
        with node1.client() as one:
            staged = ready(one, image_body(archive))
            assert Path(staged["image"]["file"] + ".blob").exists()
            answer = one.post("/v1/datasets/ds/export", json={"label": "job9-ds"}).json()
            assert answer["image"] is None and answer["manifest"] is not None
    finally:
        node1.stop()
        unmount_under(tmp_path)
