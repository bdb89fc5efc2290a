"""Early parts (stager.fanout.early): files sent while the source node still stages.

Whatever the staging does to a file after it went out early (writes it again, renames
it, removes it, turns it into a folder, changes its mode, replaces it by a copy), the
receiving node ends with exactly the ready tree: the test plays a staging that
mutates its tree at random between and after the early parts, then publishes it (a
rename, as the registry does), and runs the receiver's real ``adopt`` op on every
part. Files unchanged since they went out are not sent again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from stager.fanout import early
from stager.fanout.packing import (
    ExportPlan,
    Transfer,
    pack_early_part,
    pack_export_part,
    plan_rest,
)
from stager.fanout.room import Transfers
from stager.fs import manifest
from stager.fs.seal import FILE_MODE
from stager.ops import adopt
from stager.ops.adopt import AdoptStep
from stager.ops.base import OpContext
from stager.wire import manifest_format
from stager.wire.progress import Progress
from stager.wire.schemas import END_NAME, READY_SUFFIX, part_name
from tests.trees import digest, write_tree

STABLE_S = 0.05  # the test's staging is quick; the rule is the same at any length
PART_BYTES = 1 << 16


def _files(tree: Path) -> list[Path]:
    return sorted(p for p in tree.rglob("*") if p.is_file() and not p.is_symlink())


def rewrite(tree: Path, rng: random.Random) -> None:
    path = rng.choice(_files(tree))
    data = bytearray(path.read_bytes() or b"x")
    data[rng.randrange(len(data))] ^= 0xFF  # same size, other content
    path.write_bytes(bytes(data))


def append(tree: Path, rng: random.Random) -> None:
    with rng.choice(_files(tree)).open("ab") as stream:
        stream.write(rng.randbytes(100))


def truncate(tree: Path, rng: random.Random) -> None:
    path = rng.choice(_files(tree))
    os.truncate(path, path.stat().st_size // 2)


def remove(tree: Path, rng: random.Random) -> None:
    rng.choice(_files(tree)).unlink()


def rename(tree: Path, rng: random.Random) -> None:
    path = rng.choice(_files(tree))
    path.rename(tree / f"renamed-{rng.randrange(10**6)}.jpg")


def new_file(tree: Path, rng: random.Random) -> None:
    (tree / f"new-{rng.randrange(10**6)}.bin").write_bytes(rng.randbytes(rng.randrange(5000)))


def file_to_folder(tree: Path, rng: random.Random) -> None:
    path = rng.choice(_files(tree))
    path.unlink()
    path.mkdir()
    (path / "inside.txt").write_text("was a file\n")


def folder_renamed(tree: Path, rng: random.Random) -> None:
    folders = sorted(p for p in tree.iterdir() if p.is_dir())
    if folders:
        rng.choice(folders).rename(tree / f"class-renamed-{rng.randrange(10**6)}")


def folder_removed(tree: Path, rng: random.Random) -> None:
    folders = sorted(p for p in tree.iterdir() if p.is_dir())
    if folders:
        shutil.rmtree(rng.choice(folders))


def chmod(tree: Path, rng: random.Random) -> None:
    rng.choice(_files(tree)).chmod(0o600)


def replaced_by_a_copy(tree: Path, rng: random.Random) -> None:
    """Same name, same content, a new inode: what a copy-then-rename writer leaves."""
    path = rng.choice(_files(tree))
    tmp = path.with_name(path.name + ".tmp")
    shutil.copyfile(path, tmp)
    os.replace(tmp, path)


def link(tree: Path, rng: random.Random) -> None:
    target = rng.choice(_files(tree))
    (tree / f"link-{rng.randrange(10**6)}").symlink_to(os.path.relpath(target, tree))


MUTATIONS: list[Callable[[Path, random.Random], None]] = [
    rewrite, append, truncate, remove, rename, new_file, file_to_folder, folder_renamed,
    folder_removed, chmod, replaced_by_a_copy, link,
]  # fmt: skip


class Receiver:
    """The delivery folder of a receiving node: each part lands (a copy, as sbcast's)
    as soon as it is packed, announced whole as the job's task does."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir()
        self.parts = 0

    def land(self, part: str) -> None:
        shutil.copyfile(part, self.folder / part_name(self.parts))
        (self.folder / (part_name(self.parts) + READY_SUFFIX)).touch()
        self.parts += 1

    def end(self, manifest_path: str, sha256: str) -> AdoptStep:
        shutil.copyfile(manifest_path, self.folder / Path(manifest_path).name)
        end = {"parts": self.parts, "manifest_sha256": sha256}
        (self.folder / END_NAME).write_text(json.dumps(end))
        return AdoptStep(folder=str(self.folder), origin_node="mn1", data_bytes=0)


def stage_and_send(tmp_path: Path, rng: random.Random, mutations: int) -> tuple[Path, Path, int]:
    """A staging that mutates its tree while early parts go out, then is published;
    the receiver adopts every part. (ready tree, adopted tree, bytes sent early)."""
    staging = write_tree(tmp_path / "partial" / "tree", n_files=60, seed=rng.randrange(1000))
    receiver = Receiver(tmp_path / "incoming")
    transfer = Transfer("job1-x", tmp_path / "outgoing", 0, datetime.now(UTC))
    plan = ExportPlan(Path(), "key", [], manifest_format.Manifest(), 0, PART_BYTES, early=True)
    sent_early = 0
    for _ in range(30):
        time.sleep(STABLE_S * 2)
        packed, _ = pack_early_part(plan, transfer, staging)
        if packed is not None and packed.path is not None:
            receiver.land(packed.path)
            sent_early += packed.bytes
        for _ in range(rng.randrange(3)):
            if mutations:
                rng.choice(MUTATIONS)(staging, rng)
                mutations -= 1
        if packed is None and not mutations:
            break
    for _ in range(mutations):
        rng.choice(MUTATIONS)(staging, rng)
    return (*publish_and_adopt(tmp_path, staging, plan, transfer, receiver), sent_early)


def publish_and_adopt(
    tmp_path: Path, staging: Path, plan: ExportPlan, transfer: Transfer, receiver: Receiver
) -> tuple[Path, Path]:
    """The staging ends: its tree is published (a rename, as the registry does), the
    parts it still needs land, and the receiver adopts them all. (ready, adopted)"""
    ready = tmp_path / "data" / "key"
    ready.parent.mkdir()
    staging.rename(ready)
    plan_rest(plan, ready)
    while plan.packed < plan.count:
        packed = pack_export_part(plan, transfer)
        receiver.land(str(packed.path))
    assert packed.manifest is not None and packed.manifest_sha256 is not None
    step = receiver.end(packed.manifest, packed.manifest_sha256)
    adopted = tmp_path / "adopted"
    ctx = OpContext(root=adopted, progress=Progress(), workers=2, cancel=threading.Event())
    adopt.run(step, ctx)
    return ready, adopted


@pytest.fixture(autouse=True)
def quick_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early, "STABLE_S", STABLE_S)


@pytest.mark.parametrize("seed", range(10))
def test_whatever_the_staging_does_after_early_parts_the_receiver_gets_the_ready_tree(
    tmp_path: Path, seed: int
) -> None:
    ready, adopted, sent_early = stage_and_send(tmp_path, random.Random(seed), mutations=8)
    assert sent_early > 0  # early parts did go out
    # Every path, file size and sha256, link target: the same (links may dangle).
    assert manifest.build(adopted).to_bytes() == manifest.build(ready).to_bytes()
    kinds = {p.relative_to(ready): stat.S_IFMT(p.lstat().st_mode) for p in ready.rglob("*")}
    assert {p.relative_to(adopted): stat.S_IFMT(p.lstat().st_mode) for p in adopted.rglob("*")} == (
        kinds
    )
    # Every file arrives as a published tree keeps it (stager.fs.seal): read-only.
    files = [p for p in adopted.rglob("*") if p.is_file() and not p.is_symlink()]
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {FILE_MODE}


def test_a_file_unchanged_since_it_went_out_early_is_not_sent_again(tmp_path: Path) -> None:
    ready, adopted, sent_early = stage_and_send(tmp_path, random.Random(0), mutations=0)
    assert digest(adopted) == digest(ready)
    final_parts = sorted((tmp_path / "outgoing").glob("part-*.tar"))[-1:]
    data = sum(p.stat().st_size for p in _files(ready))
    assert sent_early >= data  # every file went early (with tar headers)
    # The ready tree's part holds folders only: its size is headers, not file data.
    assert final_parts[0].stat().st_size < 64 * 1024


def test_a_file_still_being_written_is_not_taken(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "b-done.bin").write_bytes(os.urandom(PART_BYTES))
    time.sleep(STABLE_S * 2)
    growing = tree / "a-growing.bin"  # walked first
    stop = threading.Event()

    def writer() -> None:
        with growing.open("ab", buffering=0) as stream:
            while not stop.wait(STABLE_S / 5):
                stream.write(os.urandom(1000))

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(5):
            time.sleep(STABLE_S)
            found = early.pick(tree, manifest.Digests(), set(), PART_BYTES, time.time())
            entries, retry = found
            assert entries is not None and retry >= early.RETRY_MIN_S
            assert [path for path, _ in entries] == ["b-done.bin"]
    finally:
        stop.set()
        thread.join()
    # Not enough finished data for a part: no part yet.
    entries, _ = early.pick(tree, manifest.Digests(), set(), 10 * PART_BYTES, time.time())
    assert entries is None


def test_an_export_lives_as_long_as_parts_are_asked_for(tmp_path: Path) -> None:
    """A staging longer than an export's time to live sends early parts all along:
    each part asked for renews it (the daemon's room renews on every export call)."""
    exports = Transfers(tmp_path, "export")
    exports.add("job1-x", "job1-x", 0, ttl_s=0.05)
    for _ in range(4):
        time.sleep(0.03)
        exports.renew("job1-x", 0.05)
        assert exports.expired() == {}
    time.sleep(0.06)
    assert [t.label for t in exports.expired().values()] == ["job1-x"]


def test_files_of_a_part_that_failed_midway_are_sent_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staging renames a file between the walk and the read: that part fails, and
    the files read before it in that part were not sent, so they go later."""
    staging = tmp_path / "partial" / "tree"
    staging.mkdir(parents=True)
    for i in range(4):
        (staging / f"f{i}.bin").write_bytes(os.urandom(PART_BYTES // 2))
    time.sleep(STABLE_S * 2)
    transfer = Transfer("job1-x", tmp_path / "outgoing", 0, datetime.now(UTC))
    plan = ExportPlan(Path(), "key", [], manifest_format.Manifest(), 0, PART_BYTES, early=True)
    pick = early.pick

    def pick_then_rename(tree: Path, *args: object) -> tuple[object, float]:
        found = pick(tree, *args)  # type: ignore[arg-type]
        (tree / "f1.bin").rename(tree / "g1.bin")  # a temporary name, renamed
        return found

    monkeypatch.setattr(early, "pick", pick_then_rename)
    with pytest.raises(FileNotFoundError):
        pack_early_part(plan, transfer, staging)
    monkeypatch.setattr(early, "pick", pick)
    receiver = Receiver(tmp_path / "incoming")
    ready, adopted = publish_and_adopt(tmp_path, staging, plan, transfer, receiver)
    assert digest(adopted) == digest(ready)


def test_whole_second_ctimes_wait_until_a_later_write_would_move_them() -> None:
    """A filesystem that keeps ctimes in whole seconds: a file 0.6 s "old" may have
    been written later in that same second, and a write now would not move its
    ctime; it is taken only once any later write must land in another second."""
    now = 1_000_000.9

    def stat_with_ctime(ctime_ns: int) -> os.stat_result:
        return os.stat_result((0o100644, 1, 1, 1, 0, 0, 10, 0, 0, 0),
                              {"st_ctime": ctime_ns / 1e9, "st_ctime_ns": ctime_ns})  # fmt: skip

    fine = stat_with_ctime(int((now - 0.6) * 1e9) + 1)
    assert early.settled(fine, now)
    whole = stat_with_ctime(int(now - 0.6) * 1_000_000_000)  # floor: 1.5 s before now
    assert not early.settled(whole, now)
    assert not early.settled(whole, now + 0.9)
    assert early.settled(whole, now + early.COARSE_S + 0.1)
