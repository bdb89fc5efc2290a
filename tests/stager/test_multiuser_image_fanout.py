"""An image dataset fanned out as one file between node services, as real users: two
services stand for two nodes, a file copy made as the job's user stands for sbcast, and
a private munged stands for the cluster's.

What must hold (docs/multinode.md): the kernel of a receiving node parses only an image
whose sha256 the source node's service measured and vouched for (stager.core.vouch), never
one that a job carried with a hash of its own; the copy the source node sends is one
the job's user cannot change (a shared image's), or only spoil for themselves (a
private one's, theirs to read alone)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from stager.image import mount as image_mount
from stager.image.build import build_image
from stager.wire.schemas import IMAGE_DELIVERY_NAME
from tests.daemon import Daemon
from tests.stager.test_multiuser_fanout import call, munge_socket, nodes, ready  # noqa: F401
from tests.stager.test_multiuser_images import own
from tests.stager.test_multiuser_security import public_tree
from tests.trees import digest, make_tar, write_tree
from tests.users import User


def image_request(archive: Path) -> dict:
    return {"name": "ds", "steps": [{"op": "extract", "src": str(archive)}], "image": True}


@pytest.fixture
def public_archive(shared_tmp: Path) -> tuple[Path, Path]:
    tree = public_tree(shared_tmp / "datasets" / "imgs", n_files=12)
    archive = make_tar(tree, shared_tmp / "datasets" / "imgs.tar")
    archive.chmod(0o644)
    return tree, archive


def deliver(user: User, node: Daemon, label: str, image: Path) -> Path:
    """Room on ``node`` and the image copied into it as ``user`` (sbcast's part)."""
    answer = call(user, node, "POST", "/v1/incoming", {"label": label, "bytes": 1 << 24})
    target = Path(answer["path"]) / IMAGE_DELIVERY_NAME
    done = user.run(["cp", str(image), str(target)])
    assert done.returncode == 0, done.stderr
    return target


def adopt(user: User, node: Daemon, body: dict, label: str, key: str, image: dict) -> dict:
    adopt = {"incoming": label, "origin_node": "node1", "origin_key": key, "job": "7",
             "image": image, "vouched": image.get("credential") is not None}  # fmt: skip
    code, answer = user.curl(node.socket, "POST", "/v1/datasets", {**body, "adopt": adopt})
    assert code in (200, 202), answer
    return call(user, node, "GET", "/v1/datasets/ds/wait?timeout=60")


def test_a_vouched_image_is_mounted_shared_and_bob_hits_it(
    nodes: tuple[Daemon, Daemon],  # noqa: F811
    users: tuple[User, User],
    public_archive: tuple[Path, Path],
) -> None:
    node1, node2 = nodes
    alice, bob = users
    tree, archive = public_archive
    body = image_request(archive)
    staged = ready(alice, node1, body)
    exported = call(alice, node1, "POST", "/v1/datasets/ds/export", {"label": "j1-ds"})
    sent = Path(exported["path"])
    # The copy alice's sbcast reads: the service's, which nobody else may change.
    assert (sent.stat().st_uid, sent.stat().st_mode & 0o777) == (0, 0o444)
    assert exported["vouched"] is True and exported["image"]["credential"]
    delivery = deliver(alice, node2, "j1-ds", sent).stat()
    adopted = adopt(alice, node2, body, "j1-ds", staged["key"], exported["image"])
    assert adopted["state"] == "ready", adopted
    assert adopted["key"] == staged["key"]  # the shared key: every user's
    # Mounted from the service's own copy, never from the file alice's job wrote.
    mounted = Path(adopted["image"]["file"]).stat()
    assert mounted.st_ino != delivery.st_ino and mounted.st_uid == 0
    assert image_mount.mounted_at(adopted["path"]) is not None
    assert digest(Path(adopted["path"]) / "imgs") == digest(tree)
    code, hit = bob.curl(node2.socket, "POST", "/v1/datasets", body)
    assert code == 200 and hit["origin"]["hit"] is True and hit["key"] == staged["key"]


def forge(kind: str, alice: User, socket: Path, key: str, sha256: str, genuine: dict) -> dict:
    """What alice's job sends along with an image of her own making (``sha256``)."""
    if kind == "no credential":
        return {**genuine, "sha256": sha256, "credential": None}
    if kind == "the job's own":  # alice's munge: a credential of alice's uid
        payload = json.dumps({"what": "stager fan-out image", "key": key,
                              "manifest_sha256": sha256})  # fmt: skip
        done = alice.run(["munge", "--socket", str(socket), "--string", payload])
        assert done.returncode == 0, done.stderr
        return {**genuine, "sha256": sha256, "credential": done.stdout.strip()}
    if kind == "a tree's credential":  # the service's, for a manifest of that sha256
        payload = json.dumps({"what": "stager fan-out manifest", "key": key,
                              "manifest_sha256": sha256})  # fmt: skip
        done = subprocess.run(["munge", "--socket", str(socket), "--string", payload],
                              capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return {**genuine, "sha256": sha256, "credential": done.stdout.strip()}
    return genuine  # the genuine hash and credential, relayed with her own bytes


@pytest.mark.parametrize(
    "kind", ["no credential", "the job's own", "a tree's credential", "relayed genuine"]
)
def test_an_image_of_the_jobs_making_is_never_mounted(
    nodes: tuple[Daemon, Daemon],  # noqa: F811
    users: tuple[User, User],
    public_archive: tuple[Path, Path],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
    kind: str,
) -> None:
    node1, node2 = nodes
    alice, bob = users
    tree, archive = public_archive
    body = image_request(archive)
    staged = ready(alice, node1, body)
    exported = call(alice, node1, "POST", "/v1/datasets/ds/export", {"label": "j2-ds"})
    genuine = exported["image"]
    poison = write_tree(shared_tmp / "poison", n_files=3, seed=7)
    forged = shared_tmp / "forged.erofs"
    build_image(str(poison), str(forged))
    forged.chmod(0o644)
    sha = hashlib.sha256(forged.read_bytes()).hexdigest()
    image = forge(kind, alice, munge_socket, staged["key"], sha, genuine)
    image["size"] = forged.stat().st_size
    deliver(alice, node2, "j2-ds", forged)
    failed = adopt(alice, node2, body, "j2-ds", staged["key"], image)
    assert failed["state"] == "failed", failed
    why = {"no credential": "without that node's service's credential",
           "the job's own": f"made by uid {alice.uid}",
           "a tree's credential": "vouches for something else",
           "relayed genuine": f"holds sha256 {sha}"}[kind]  # fmt: skip
    assert why in failed["error"]["message"], failed
    assert image_mount.mounts_under(str(node2.cache_dir)) == []
    # bob asks for the same data on node2: the source's own bytes, staged there.
    theirs = ready(bob, node2, body)
    assert theirs["origin"]["hit"] is False
    assert digest(Path(theirs["path"]) / "imgs") == digest(tree)


def test_a_private_image_goes_to_its_user_alone_and_is_mounted_theirs(
    nodes: tuple[Daemon, Daemon],  # noqa: F811
    users: tuple[User, User],
    alice_home: Path,
) -> None:
    node1, node2 = nodes
    alice, bob = users
    tree = write_tree(alice_home / "mine", n_files=6, seed=1)
    archive = make_tar(tree, alice_home / "mine.tar")
    own(tree, alice, 0o600)
    own(archive, alice, 0o600)  # only alice may read it: her copy is private
    body = image_request(archive)
    staged = ready(alice, node1, body)
    exported = call(alice, node1, "POST", "/v1/datasets/ds/export", {"label": "j3-ds"})
    sent = Path(exported["path"])
    assert (sent.stat().st_uid, sent.stat().st_mode & 0o777) == (alice.uid, 0o400)
    assert bob.run(["cat", str(sent)]).returncode != 0
    assert exported["image"]["credential"]  # vouched: the kernel parses it, whoever's
    deliver(alice, node2, "j3-ds", sent)
    adopted = adopt(alice, node2, body, "j3-ds", staged["key"], exported["image"])
    assert adopted["state"] == "ready", adopted
    assert adopted["key"] == staged["key"]  # alice's own key on both nodes
    top = Path(adopted["path"])
    assert (top.stat().st_uid, top.stat().st_mode & 0o777) == (alice.uid, 0o500)
    file = Path(adopted["image"]["file"])
    assert (file.stat().st_uid, file.stat().st_mode & 0o777) == (0, 0o400)
    assert bob.run(["ls", str(top)]).returncode != 0
