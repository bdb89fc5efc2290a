"""Image datasets through a real daemon: an archive (or a folder, or a prebuilt image)
staged as one read-only image, mounted at the dataset's path, and everything else on
it: a hit that checks the image without a walk, links, leases, eviction of one file,
restarts after kill -9 and after a reboot, a changed or deleted image never served."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stager.image import mount as image_mount
from stager.image.build import build_image
from stager.image.erofs import EMBEDDED_AT
from tests.daemon import Daemon, unmount_under
from tests.trees import digest, make_tar, wait_until_empty, write_tree

TIMEOUT = 30

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="kernel mounts need root"),
    pytest.mark.forked_daemons,  # tests/daemon_zygote.py
]


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, Path]:
    """A tree and its .tar.gz (top folder ``t``)."""
    tree = write_tree(tmp_path / "t", n_files=24, seed=3)
    return tree, make_tar(tree, tmp_path / "t.tar.gz")


def image_body(archive: Path, name: str = "ds", **extra: object) -> dict:
    steps = [{"op": "extract", "src": str(archive)}, {"op": "rename", "src": "t", "dst": "train"}]
    return {"name": name, "steps": steps, "image": True, **extra}


def ready(client, body: dict) -> dict:  # noqa: ANN001
    response = client.post("/v1/datasets", json=body)
    assert response.status_code in (200, 202), response.text
    status = client.get(f"/v1/datasets/{body['name']}/wait", params={"timeout": TIMEOUT}).json()
    assert status["state"] == "ready", status
    return status


def mounted(path: str) -> image_mount.Mounted | None:
    return image_mount.mounted_at(path)


@pytest.fixture
def unmounts(tmp_path: Path) -> Iterator[None]:
    """Whatever a test kills leaves mounted under its folder is taken down after it."""
    yield
    unmount_under(tmp_path)


def test_an_archive_staged_as_an_image_is_mounted_read_only_with_its_renames(
    daemon: Daemon, source: tuple[Path, Path]
) -> None:
    tree, archive = source
    with daemon.client() as client:
        status = ready(client, image_body(archive))
        found = mounted(status["path"])
        assert found is not None and found.fstype == "erofs"
        assert {"ro", "nosuid", "nodev"} <= set(found.options.split(","))
        assert digest(Path(status["path"]) / "train") == digest(tree)  # the rename applied
        assert os.listdir(status["path"]) == ["train"]
        image = status["image"]
        assert image["format"] == "erofs" and image["mount"] == "kernel"
        assert image["files"] == 24 and image["size_bytes"] == status["size_bytes"] > 0
        file = Path(image["file"])
        # Beside its mount point, behind a gate (stager.state.layout): the mount table
        # lists every user's mounts, and data/<key> would name the dataset.
        assert file == Path(f"{status['path']}.erofs")
        assert file.parent.parent == daemon.cache_dir / "data" / "u"
        assert status["key"] not in status["path"]
        assert file.stat().st_mode & 0o777 == 0o444 and file.stat().st_uid == 0
        # Read-only by construction: the kernel refuses any change.
        with pytest.raises(OSError, match="Read-only"):
            (Path(status["path"]) / "train" / "new").write_bytes(b"x")
        # Nothing of the staging is left: no tree beside the image.
        assert sorted(p.name for p in file.parent.iterdir()) == ["dataset", file.name]
        assert [p.name for p in (daemon.cache_dir / "data").iterdir()] == ["u"]
        progress = status["progress"]
        assert progress["bytes_done"] == progress["bytes_total"] == archive.stat().st_size
        assert progress["files_done"] >= 24
        # The same request again: a hit (its image checked, no walk).
        again = client.post("/v1/datasets", json=image_body(archive))
        assert again.status_code == 200 and again.json()["origin"]["hit"] is True


def test_an_image_and_a_tree_of_the_same_data_are_two_entries(
    daemon: Daemon, source: tuple[Path, Path]
) -> None:
    tree, archive = source
    with daemon.client() as client:
        image = ready(client, image_body(archive, "img"))
        plain = dict(image_body(archive, "plain"))
        del plain["image"]
        tree_status = ready(client, plain)
        assert image["key"] != tree_status["key"]
        assert mounted(tree_status["path"]) is None and tree_status["image"] is None
        assert digest(Path(tree_status["path"]) / "train") == digest(tree)


def test_eviction_unmounts_and_deletes_one_file_but_never_a_leased_image(
    daemon: Daemon, source: tuple[Path, Path], tmp_path: Path
) -> None:
    _tree, archive = source
    link = tmp_path / "links" / "ds"
    with daemon.client() as client:
        body = image_body(archive, link=str(link), lease={"holder": "job-7"})
        status = ready(client, body)
        assert link.resolve() == Path(status["path"])
        assert client.delete("/v1/datasets/ds").status_code == 409  # leased
        assert client.post("/v1/gc", json={"all": True}).json()["evicted"] == []
        assert mounted(status["path"]) is not None
        client.delete("/v1/datasets/ds/leases", params={"holder": "job-7"}).raise_for_status()
        gone = client.delete("/v1/datasets/ds")
        assert gone.status_code == 200, gone.text
    assert mounted(status["path"]) is None
    data = daemon.cache_dir / "data"
    assert [p for p in data.rglob("*") if p != data / "u"] == []  # its gate gone with it
    assert not link.is_symlink()


def test_an_image_in_use_without_a_lease_is_unmounted_lazily_at_eviction(
    daemon: Daemon, source: tuple[Path, Path]
) -> None:
    tree, archive = source
    with daemon.client() as client:
        status = ready(client, image_body(archive))
        inside = Path(status["path"]) / "train"
        first = sorted(digest(tree))[0]
        reader = open(inside / first, "rb")  # noqa: SIM115 - held across the eviction
        try:
            assert client.delete("/v1/datasets/ds").status_code == 200
            assert mounted(status["path"]) is None  # gone from the tree of mounts at once
            assert not os.path.exists(status["image"]["file"])
            # The reader that opened a file reads on, the same bytes.
            assert hashlib.sha256(reader.read()).hexdigest() == digest(tree)[first]
        finally:
            reader.close()


def test_a_restart_after_kill_9_finds_its_mounts_and_a_reboot_mounts_them_again(
    daemon_factory: Callable[..., Daemon], source: tuple[Path, Path], unmounts: None
) -> None:
    tree, archive = source
    daemon = daemon_factory()
    with daemon.client() as client:
        status = ready(client, image_body(archive))
    daemon.kill()
    assert mounted(status["path"]) is not None  # the kernel's, not the daemon's
    daemon.start()
    with daemon.client() as client:
        again = client.get("/v1/datasets/ds").json()
        assert again["state"] == "ready"
        assert len([m for m in image_mount.mounts() if m.target == status["path"]]) == 1
    # A reboot: the daemon stops, every mount goes, then the daemon starts.
    daemon.stop()
    image_mount.unmount(status["path"])
    daemon.start()
    with daemon.client() as client:
        again = client.get("/v1/datasets/ds").json()
        assert again["state"] == "ready"
        assert digest(Path(again["path"]) / "train") == digest(tree)


def test_a_mount_whose_image_is_gone_or_changed_is_never_served(
    daemon_factory: Callable[..., Daemon], source: tuple[Path, Path], unmounts: None
) -> None:
    _tree, archive = source
    daemon = daemon_factory()
    with daemon.client() as client:
        status = ready(client, image_body(archive))
    daemon.kill()
    os.unlink(status["image"]["file"])  # the mount stays, over a deleted file
    daemon.start()
    with daemon.client() as client:
        assert client.get("/v1/datasets/ds").json()["state"] == "evicted"
    assert mounted(status["path"]) is None, "a mount over a deleted image was left"
    # A changed image (its ctime moves) is caught by the next hit and staged again.
    with daemon.client() as client:
        status = ready(client, image_body(archive))
        os.chmod(status["image"]["file"], 0o444)  # the same mode: only its ctime moves
        again = client.post("/v1/datasets", json=image_body(archive))
        assert again.status_code == 202, again.text  # not served: staged again
        status = client.get("/v1/datasets/ds/wait", params={"timeout": TIMEOUT}).json()
        assert status["state"] == "ready" and mounted(status["path"]) is not None
        # Unmounted by hand: the next hit mounts it again.
        image_mount.unmount(status["path"])
        assert client.post("/v1/datasets", json=image_body(archive)).status_code == 200
        assert mounted(status["path"]) is not None


def test_a_folder_copy_is_packed_into_an_image_and_its_tree_dropped(
    daemon: Daemon, tmp_path: Path
) -> None:
    tree = write_tree(tmp_path / "folder", n_files=12, seed=5)
    os.symlink("class_0", tree / "alias")  # a link inside the tree, kept as a link
    body = {"name": "copied", "steps": [{"op": "copy", "src": str(tree)}], "image": True}
    with daemon.client() as client:
        status = ready(client, body)
    root = Path(status["path"])
    assert mounted(status["path"]) is not None
    assert digest(root) == digest(tree)
    assert os.readlink(root / "alias") == "class_0"
    wait_until_empty(daemon.cache_dir / "partial")  # the packed tree, deleted after


def test_a_prebuilt_image_is_copied_checked_by_its_sha256_and_mounted(
    daemon: Daemon, source: tuple[Path, Path], tmp_path: Path
) -> None:
    tree, _archive = source
    prebuilt = tmp_path / "prebuilt.erofs"
    build_image(str(tree), str(prebuilt))
    sha = hashlib.sha256(prebuilt.read_bytes()).hexdigest()
    step = {"op": "image", "src": str(prebuilt), "sha256": sha}
    with daemon.client() as client:
        status = ready(client, {"name": "pre", "steps": [step]})  # image mode implied
        assert status["image"]["sha256"] == sha
        assert digest(Path(status["path"])) == digest(tree)
        published = Path(status["image"]["file"])
        assert published.read_bytes() == prebuilt.read_bytes()  # copied, not unpacked
        wrong = {**step, "sha256": "0" * 64}
        response = client.post("/v1/datasets", json={"name": "wrong", "steps": [wrong]})
        assert response.status_code == 202
        failed = client.get("/v1/datasets/wrong/wait", params={"timeout": TIMEOUT}).json()
        assert failed["state"] == "failed" and "not the" in failed["error"]["message"]
        # Not an image at all: refused at the request.
        not_one = {"op": "image", "src": str(tree / "class_0" / "img_0000.jpg")}
        bad = client.post("/v1/datasets", json={"name": "bad", "steps": [not_one]})
        assert bad.status_code == 400 and "neither an EROFS" in bad.json()["error"]["message"]


def test_what_no_image_can_hold_is_refused_with_a_sentence(
    daemon: Daemon, source: tuple[Path, Path]
) -> None:
    tree, archive = source
    with daemon.client() as client:
        links = {"name": "links", "steps": [{"op": "symlink", "src": str(tree)}], "image": True}
        response = client.post("/v1/datasets", json=links)
        assert response.status_code == 400
        assert "links to its source" in response.json()["error"]["message"]
        sha = client.post("/v1/datasets", json=image_body(archive, verify="sha256"))
        assert sha.status_code == 400 and "verify 'size'" in sha.json()["error"]["message"]


def test_the_client_stages_and_waits_on_an_image(
    daemon: Daemon, source: tuple[Path, Path], tmp_path: Path
) -> None:
    tree, archive = source
    link = tmp_path / "data"
    client = [sys.executable, "-m", "client.cli"]
    step = json.dumps({"op": "extract", "src": str(archive)})
    env = {**os.environ, "STAGER_URL": daemon.url}
    argv = [*client, "stage", "cli", "--step", step, "--as-image", "--link", str(link)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout
    waited = subprocess.run(
        [*client, "wait", "cli"], env=env, capture_output=True, text=True, timeout=60
    )
    assert waited.returncode == 0, waited.stderr
    assert digest(link / "t") == digest(tree)
    assert mounted(str(link.resolve())) is not None


def test_a_plain_tar_staged_as_an_index_image_keeps_its_blob_beside_it(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, unmounts: None
) -> None:
    """``image_index``: the tar copied whole as ``data/<key>.erofs.blob``, the image its
    metadata only, mounted with the blob as its extra device; a hit checks both files, a
    restart and a reboot mount them again, an eviction deletes both."""
    tree = write_tree(tmp_path / "t", n_files=24, seed=4)
    archive = make_tar(tree, tmp_path / "t.tar")
    env = {"STAGER_IMAGE_INDEX": "true", "STAGER_IMAGE_BACKING": "file"}
    daemon = daemon_factory(env=env)
    data = daemon.cache_dir / "data"
    with daemon.client() as client:
        status = ready(client, image_body(archive))
        file = Path(status["image"]["file"])
        blob = file.with_name(file.name + ".blob")
        assert blob.read_bytes() == archive.read_bytes()
        assert blob.stat().st_mode & 0o777 == 0o444
        assert file.stat().st_size < archive.stat().st_size // 4  # metadata only
        assert status["size_bytes"] == file.stat().st_size + blob.stat().st_size
        assert sorted(p.name for p in file.parent.iterdir()) == ["dataset", file.name, blob.name]
        assert digest(Path(status["path"]) / "train") == digest(tree)
        again = client.post("/v1/datasets", json=image_body(archive))
        assert again.status_code == 200 and again.json()["origin"]["hit"] is True
    rebooted(daemon, status, tree)
    with daemon.client() as client:
        # A changed blob (its ctime moves) is caught by the next hit: staged again.
        os.chmod(blob, 0o444)
        again = client.post("/v1/datasets", json=image_body(archive))
        assert again.status_code == 202, again.text
        status = client.get("/v1/datasets/ds/wait", params={"timeout": TIMEOUT}).json()
        assert status["state"] == "ready" and digest(Path(status["path"]) / "train") == digest(tree)
        gone = client.delete("/v1/datasets/ds")
        assert gone.status_code == 200, gone.text
    assert mounted(status["path"]) is None
    assert [p for p in data.rglob("*") if p != data / "u"] == []  # its gate gone with it


def test_a_plain_tar_staged_as_an_image_carries_the_tar_inside_one_file(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, unmounts: None
) -> None:
    """By default a staging whose one input is a plain tar copies the tar into the image
    whole (cp's speed) and writes only the metadata after it: one file, 512-byte blocks,
    mounted as any image; a hit, a reboot and an eviction treat it as any image."""
    tree = write_tree(tmp_path / "t", n_files=24, seed=5)
    archive = make_tar(tree, tmp_path / "t.tar")
    daemon = daemon_factory()
    data = daemon.cache_dir / "data"
    with daemon.client() as client:
        status = ready(client, image_body(archive))
        file = Path(status["image"]["file"])
        with open(file, "rb") as image:
            image.seek(EMBEDDED_AT)
            assert image.read(archive.stat().st_size) == archive.read_bytes()
        assert sorted(p.name for p in file.parent.iterdir()) == ["dataset", file.name]
        assert status["size_bytes"] == file.stat().st_size
        assert digest(Path(status["path"]) / "train") == digest(tree)
        progress = status["progress"]
        assert progress["bytes_done"] == progress["bytes_total"] == archive.stat().st_size
        again = client.post("/v1/datasets", json=image_body(archive))
        assert again.status_code == 200 and again.json()["origin"]["hit"] is True
    rebooted(daemon, status, tree)
    with daemon.client() as client:
        gone = client.delete("/v1/datasets/ds")
        assert gone.status_code == 200, gone.text
    assert mounted(status["path"]) is None
    assert [p for p in data.rglob("*") if p != data / "u"] == []  # its gate gone with it


def rebooted(daemon: Daemon, status: dict, tree: Path) -> None:
    """``daemon`` killed and its dataset's mount gone, as after a reboot; started again,
    it has mounted the ready image again."""
    daemon.kill()
    daemon.stop()
    image_mount.unmount(status["path"])
    daemon.start()
    with daemon.client() as client:
        assert client.get(f"/v1/datasets/{status['name']}").json()["state"] == "ready"
    assert digest(Path(status["path"]) / "train") == digest(tree)
