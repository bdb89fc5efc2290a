"""adopt / check_delivered: a broadcast copy is trusted only once it matches what the
source node packed: a tree packed by stager.fanout.bundle comes out byte for byte
(checked against GNU tar's reading of the same bundle), and every kind of damage to
the bundle or the manifest fails the op with a sentence naming the path."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from stager.errors import BadRequest, StagingError, UnsafeArchiveMember, VerifyFailed
from stager.fanout import bundle, manifest
from stager.ops import adopt, check_delivered
from stager.ops.adopt import AdoptStep
from stager.ops.base import CheckContext, OpContext
from stager.ops.check_delivered import CheckDeliveredStep
from stager.progress import Progress
from tests.trees import digest, write_tree

pytestmark = pytest.mark.usefixtures("pool")


def odd_tree(root: Path) -> Path:
    """Names and shapes a real dataset has: nested folders, an empty folder, spaces,
    non-ASCII, a name too long for a plain tar header, a relative link, modes."""
    write_tree(root, n_files=40, max_size=60_000)
    (root / "empty dir").mkdir()
    (root / "ünï cödé" / "x").mkdir(parents=True)
    (root / "ünï cödé" / "x" / "é.txt").write_text("accents\n")
    long = root / ("d" * 90) / ("f" * 120 + ".bin")
    long.parent.mkdir()
    long.write_bytes(os.urandom(3000))
    (root / "class_0" / "link.jpg").symlink_to("img_0000.jpg")
    (root / "class_1" / "run.sh").write_text("#!/bin/sh\n")
    (root / "class_1" / "run.sh").chmod(0o755)
    (root / "class_2" / "empty.bin").write_bytes(b"")
    return root


def export(tree: Path, out: Path) -> AdoptStep:
    out.mkdir()
    packed = bundle.pack(tree, out / "bundle.tar")
    data = packed.to_bytes()
    (out / "manifest.json").write_bytes(data)
    return AdoptStep(
        bundle=str(out / "bundle.tar"),
        manifest=str(out / "manifest.json"),
        manifest_sha256=manifest.digest(data),
        origin_node="mn1",
    )


def run_adopt(step: AdoptStep, root: Path) -> None:
    ctx = OpContext(root=root, progress=Progress(), workers=2)
    adopt.check(step, CheckContext())
    adopt.run(step, ctx)


def test_a_packed_tree_is_adopted_byte_for_byte(tmp_path: Path) -> None:
    tree = odd_tree(tmp_path / "tree")
    step = export(tree, tmp_path / "out")
    run_adopt(step, tmp_path / "dest")
    assert digest(tmp_path / "dest") == digest(tree)
    assert os.readlink(tmp_path / "dest/class_0/link.jpg") == "img_0000.jpg"
    assert (tmp_path / "dest/empty dir").is_dir()
    assert (tmp_path / "dest/class_1/run.sh").stat().st_mode & 0o777 == 0o755
    # The manifest agrees with what GNU tar reads from the bundle, and with the tree.
    listed = subprocess.run(
        ["tar", "-tf", step.bundle], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    packed = manifest.Manifest.from_bytes(Path(step.manifest).read_bytes(), "m")
    names = {n.rstrip("/") for n in listed if n}
    assert names == set(packed.files) | packed.dirs | set(packed.links)
    assert manifest.build(tree).to_bytes() == packed.to_bytes()


def flip_byte_of_member(bundle_path: str, member: str) -> None:
    with tarfile.open(bundle_path) as tar:
        offset = tar.getmember(member).offset_data
    with open(bundle_path, "r+b") as stream:
        stream.seek(offset)
        byte = stream.read(1)
        stream.seek(offset)
        stream.write(bytes([byte[0] ^ 0xFF]))


def test_a_changed_byte_in_the_bundle_fails_naming_the_file(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=12)
    step = export(tree, tmp_path / "out")
    flip_byte_of_member(step.bundle, "class_1/img_0004.jpg")
    with pytest.raises(VerifyFailed, match=r"class_1/img_0004\.jpg.*mn1|mn1.*class_1/img_0004"):
        run_adopt(step, tmp_path / "dest")


def test_a_truncated_bundle_fails(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=12)
    step = export(tree, tmp_path / "out")
    size = Path(step.bundle).stat().st_size
    os.truncate(step.bundle, size // 2)
    with pytest.raises(StagingError):
        run_adopt(step, tmp_path / "dest")


def test_a_damaged_manifest_is_refused_before_anything_is_extracted(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=5)
    step = export(tree, tmp_path / "out")
    text = Path(step.manifest).read_text().replace('"class_0', '"class_9', 1)
    Path(step.manifest).write_text(text)
    with pytest.raises(VerifyFailed, match="manifest broadcast from mn1.*damaged"):
        run_adopt(step, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_a_bundle_with_a_file_the_manifest_lacks_fails(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=5)
    step = export(tree, tmp_path / "out")
    with tarfile.open(step.bundle, "a") as tar:
        extra = tmp_path / "extra.txt"
        extra.write_text("smuggled\n")
        tar.add(extra, arcname="class_0/extra.txt")
    with pytest.raises(VerifyFailed, match="class_0/extra.txt.*not in the manifest"):
        run_adopt(step, tmp_path / "dest")


def test_a_bundle_that_escapes_is_refused_by_the_hardened_extraction(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=3)
    step = export(tree, tmp_path / "out")
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 0
        tar.addfile(info)
    os.replace(evil, step.bundle)
    with pytest.raises(UnsafeArchiveMember):
        run_adopt(step, tmp_path / "dest")
    assert not (tmp_path / "escaped.txt").exists()


def test_a_tree_linking_outside_itself_is_not_packed(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=3)
    (tree / "data").symlink_to("/network/datasets/x")
    with pytest.raises(BadRequest, match="links to /network/datasets/x"):
        bundle.pack(tree, tmp_path / "b.tar")


def test_delivered_copies_must_match_size_and_sha256(tmp_path: Path) -> None:
    good = tmp_path / "a.tar.gz"
    good.write_bytes(os.urandom(50_000))
    expected = {str(good): manifest.file_digest(good)}
    ctx = OpContext(root=tmp_path / "dest", progress=Progress())
    step = CheckDeliveredStep(files=expected, origin_node="mn2")
    check_delivered.check(step, CheckContext())
    check_delivered.run(step, ctx)
    assert ctx.progress.snapshot().bytes_done == 50_000
    with open(good, "r+b") as stream:
        stream.seek(1000)
        stream.write(b"\0\0\0")
    with pytest.raises(VerifyFailed, match="a.tar.gz broadcast from mn2 has different content"):
        check_delivered.run(step, ctx)
    os.truncate(good, 10)
    with pytest.raises(VerifyFailed, match="10 bytes, not 50000"):
        check_delivered.run(step, ctx)
