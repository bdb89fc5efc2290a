"""adopt / check_delivered: a broadcast copy is trusted only once it matches what the
source node packed: a tree packed in parts by stager.fanout.bundle comes out byte
for byte (checked against GNU tar's reading of the same parts), and every kind of
damage to a part, the manifest or the delivery fails the op with a sentence naming
the path; a part that never comes fails it too, and a cancel stops the wait."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from stager.core.errors import (
    BadRequest,
    Cancelled,
    StagingError,
    UnsafeArchiveMember,
    VerifyFailed,
)
from stager.fanout import bundle
from stager.fs import manifest
from stager.ops import adopt, check_delivered
from stager.ops.adopt import AdoptStep
from stager.ops.base import CheckContext, OpContext
from stager.ops.check_delivered import CheckDeliveredStep
from stager.wire import manifest_format
from stager.wire.progress import Progress
from stager.wire.schemas import END_NAME, MANIFEST_NAME, READY_SUFFIX, part_name
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


def deliver(tree: Path, folder: Path, part_bytes: int = 100_000, end: bool = True) -> AdoptStep:
    """What a receiving node gets: the parts (each announced whole), the manifest, and
    the end file with the manifest's sha256, as the job's task writes it."""
    folder.mkdir()
    packed = manifest_format.Manifest()
    parts = bundle.plan(tree, part_bytes)
    for index, entries in enumerate(parts):
        bundle.pack_part(tree, folder / part_name(index), entries, packed)
        (folder / (part_name(index) + READY_SUFFIX)).touch()
    data = packed.to_bytes()
    (folder / MANIFEST_NAME).write_bytes(data)
    if end:
        ending = {"parts": len(parts), "manifest_sha256": manifest_format.digest(data)}
        (folder / END_NAME).write_text(json.dumps(ending))
    return AdoptStep(folder=str(folder), origin_node="mn1", data_bytes=packed.total_bytes)


def run_adopt(step: AdoptStep, root: Path, cancel: threading.Event | None = None) -> None:
    ctx = OpContext(root=root, progress=Progress(), workers=2, cancel=cancel or threading.Event())
    assert adopt.check(step, CheckContext()) == step.data_bytes
    adopt.run(step, ctx)


def test_a_tree_packed_in_parts_is_adopted_byte_for_byte(tmp_path: Path) -> None:
    tree = odd_tree(tmp_path / "tree")
    step = deliver(tree, tmp_path / "in")
    parts = sorted((tmp_path / "in").glob("part-*.tar"))
    assert len(parts) > 3
    listed = set()
    for part in parts:  # what GNU tar reads from the parts is what the manifest lists
        out = subprocess.run(["tar", "-tf", str(part)], capture_output=True, text=True)
        listed |= {n.rstrip("/") for n in out.stdout.splitlines() if n}
    packed = manifest_format.Manifest.from_bytes(
        (tmp_path / "in" / MANIFEST_NAME).read_bytes(), "m"
    )
    assert listed == set(packed.files) | packed.dirs | set(packed.links)
    assert manifest.build(tree).to_bytes() == packed.to_bytes()
    run_adopt(step, tmp_path / "dest")
    assert digest(tmp_path / "dest") == digest(tree)
    assert os.readlink(tmp_path / "dest/class_0/link.jpg") == "img_0000.jpg"
    assert (tmp_path / "dest/empty dir").is_dir()
    # Created as the published tree keeps every file: 0444, whatever the source said.
    assert (tmp_path / "dest/class_1/run.sh").stat().st_mode & 0o7777 == 0o444


def flip_byte_of_member(folder: Path, member: str) -> None:
    for part in sorted(folder.glob("part-*.tar")):
        with tarfile.open(part) as tar:
            try:
                offset = tar.getmember(member).offset_data
            except KeyError:
                continue
        with open(part, "r+b") as stream:
            stream.seek(offset)
            byte = stream.read(1)
            stream.seek(offset)
            stream.write(bytes([byte[0] ^ 0xFF]))
        return
    raise AssertionError(f"{member} is in no part")


def test_a_changed_byte_in_a_part_fails_naming_the_file(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=12)
    step = deliver(tree, tmp_path / "in")
    flip_byte_of_member(tmp_path / "in", "class_1/img_0004.jpg")
    with pytest.raises(VerifyFailed, match=r"mn1.*class_1/img_0004\.jpg"):
        run_adopt(step, tmp_path / "dest")


def test_a_truncated_part_fails(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=12)
    step = deliver(tree, tmp_path / "in")
    part = tmp_path / "in" / part_name(0)
    os.truncate(part, part.stat().st_size // 2)
    with pytest.raises(StagingError):
        run_adopt(step, tmp_path / "dest")


def test_a_damaged_manifest_fails_and_nothing_past_it_is_trusted(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=5)
    step = deliver(tree, tmp_path / "in")
    path = tmp_path / "in" / MANIFEST_NAME
    path.write_text(path.read_text().replace('"class_0', '"class_9', 1))
    with pytest.raises(VerifyFailed, match="manifest broadcast from mn1.*damaged"):
        run_adopt(step, tmp_path / "dest")


def test_a_file_the_manifest_lacks_never_reaches_the_dataset(tmp_path: Path) -> None:
    """Parts sent while the source node still staged may hold files it renamed or
    removed later (stager.fanout.early): what the manifest does not name is removed,
    so the adopted tree is exactly the manifest's."""
    tree = write_tree(tmp_path / "tree", n_files=5)
    step = deliver(tree, tmp_path / "in")
    with tarfile.open(tmp_path / "in" / part_name(0), "a") as tar:
        extra = tmp_path / "extra.txt"
        extra.write_text("smuggled\n")
        tar.add(extra, arcname="class_0/extra.txt")
        tar.add(tmp_path / "tree" / "class_0", arcname="smuggled dir")
    run_adopt(step, tmp_path / "dest")
    assert digest(tmp_path / "dest") == digest(tree)
    assert not (tmp_path / "dest" / "class_0" / "extra.txt").exists()
    assert not (tmp_path / "dest" / "smuggled dir").exists()


def test_a_part_that_escapes_is_refused_by_the_hardened_extraction(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=3)
    step = deliver(tree, tmp_path / "in")
    with tarfile.open(tmp_path / "in" / part_name(0), "w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 0
        tar.addfile(info)
    with pytest.raises(UnsafeArchiveMember):
        run_adopt(step, tmp_path / "dest")
    assert not (tmp_path / "escaped.txt").exists()


def test_an_aborted_broadcast_fails_with_its_reason(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=5)
    step = deliver(tree, tmp_path / "in", end=False)
    (tmp_path / "in" / END_NAME).write_text(json.dumps({"abort": "sbcast: mn3 timed out"}))
    # Parts already announced are taken; then the abort is read, not waited past.
    for ok in (tmp_path / "in").glob("*" + READY_SUFFIX):
        ok.unlink()
    with pytest.raises(VerifyFailed, match="from mn1 did not complete .sbcast: mn3 timed out"):
        run_adopt(step, tmp_path / "dest")


@pytest.mark.parametrize("name", [END_NAME, MANIFEST_NAME])
def test_a_delivered_end_or_manifest_past_its_limit_is_refused_unread(
    name: str, tmp_path: Path
) -> None:
    """The job writes them, the staging process reads them whole: a sparse one claiming
    far more bytes than such a file may hold is refused by its size, not read into
    memory (a 3 GB end.json took 6 GB before)."""
    tree = write_tree(tmp_path / "tree", n_files=5)
    step = deliver(tree, tmp_path / "in")
    limit = adopt.END_LIMIT if name == END_NAME else adopt.MANIFEST_LIMIT
    with open(tmp_path / "in" / name, "r+b") as file:
        file.truncate(limit + 1)  # a hole: nothing on the disk
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(VerifyFailed, match=f"holds {limit + 1} bytes, more than such a file may"):
        run_adopt(step, tmp_path / "dest")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    assert grown_kib < 64 << 10, grown_kib  # nowhere near the file's size


def test_a_part_that_never_comes_fails_and_a_cancel_stops_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = write_tree(tmp_path / "tree", n_files=12)
    step = deliver(tree, tmp_path / "in", end=False)
    last = max((tmp_path / "in").glob("*" + READY_SUFFIX))
    last.unlink()  # its sbcast never finished
    monkeypatch.setattr(adopt, "PART_WAIT_S", 0.5)
    with pytest.raises(VerifyFailed, match="did not arrive within"):
        run_adopt(step, tmp_path / "dest")
    monkeypatch.setattr(adopt, "PART_WAIT_S", 60)
    step = deliver(tree, tmp_path / "in2", end=False)
    max((tmp_path / "in2").glob("*" + READY_SUFFIX)).unlink()
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(Cancelled):
        run_adopt(step, tmp_path / "dest2", cancel)
    assert time.monotonic() - started < 5


def test_a_tree_linking_outside_itself_is_not_packed(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", n_files=3)
    (tree / "data").symlink_to("/network/datasets/x")
    with pytest.raises(BadRequest, match="links to /network/datasets/x"):
        deliver(tree, tmp_path / "in")


def test_delivered_copies_must_match_size_and_sha256(tmp_path: Path) -> None:
    good = tmp_path / "a.tar.gz"
    good.write_bytes(os.urandom(50_000))
    expected = {str(good): manifest_format.file_digest(good)}
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


def test_a_file_a_later_part_rewrites_is_checked_as_it_ends_up(tmp_path: Path) -> None:
    """Each part's files are hashed as soon as it is extracted (manifest.Digests); a
    later part that rewrites one of them (same name and size, other bytes) must not
    pass on the earlier hash."""
    tree = write_tree(tmp_path / "tree", n_files=12)
    step = deliver(tree, tmp_path / "in", part_bytes=20_000, end=False)
    folder = tmp_path / "in"
    parts = len(list(folder.glob("part-*.tar")))
    assert parts > 2
    victim = "class_0/img_0000.jpg"
    forged = bytes(255 - b for b in (tree / victim).read_bytes())
    (tmp_path / "forged" / "class_0").mkdir(parents=True)
    (tmp_path / "forged" / victim).write_bytes(forged)
    with tarfile.open(folder / part_name(parts), "w", format=tarfile.GNU_FORMAT) as tar:
        tar.add(tmp_path / "forged" / victim, arcname=victim)
    (folder / (part_name(parts) + READY_SUFFIX)).touch()
    data = (folder / MANIFEST_NAME).read_bytes()
    (folder / END_NAME).write_text(
        json.dumps({"parts": parts + 1, "manifest_sha256": manifest_format.digest(data)})
    )
    with pytest.raises(VerifyFailed, match=rf"mn1.*{victim}.*different content"):
        run_adopt(step, tmp_path / "dest")


def test_digests_read_again_a_file_changed_since_it_was_hashed(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "tree", n_files=6)
    digests = manifest.Digests()
    first = manifest.build(root, digests)
    name = sorted(first.files)[0]
    path = root / name
    before = path.stat()
    path.write_bytes(bytes(255 - b for b in path.read_bytes()))  # same size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the same mtime
    again = manifest.build(root, digests)
    assert again.files[name] == manifest_format.file_digest(path) != first.files[name]
    assert manifest.build(root).to_bytes() == again.to_bytes()
