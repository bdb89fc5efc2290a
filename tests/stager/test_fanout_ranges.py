"""Byte ranges of growing files (stager.archive.ranges): a large file goes out while the
source node still writes it, and the receiver ends with exactly the ready tree.

The source's real packing (``pack_early_part``, ``plan_rest``, ``pack_export_part``)
runs against a file a thread writes as a download or a copy does (sequential
appends), and the receiver's real ``adopt`` op takes every part. Whatever happens to
the file behind its ranges (rewritten, truncated and written again, renamed as a
download's ``.part`` is), it is sent again, never trusted; and a receiver given
ranges no sender writes refuses them without writing outside its tree.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import stat
import tarfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from stager.archive import ranges
from stager.core.errors import StagerError, VerifyFailed
from stager.fanout import bundle, early
from stager.fanout.packing import ExportPlan, Transfer, pack_early_part
from stager.fs import manifest
from stager.fs.seal import FILE_MODE
from stager.ops import adopt
from stager.ops.base import OpContext
from stager.wire import manifest_format
from stager.wire.progress import Progress
from tests.stager.test_fanout_early import (
    MUTATIONS,
    PART_BYTES,
    STABLE_S,
    Receiver,
    publish_and_adopt,
)
from tests.trees import digest, write_tree

CHUNK = PART_BYTES // 4
LEAD_BYTES = 4 * PART_BYTES
PACE_S = 2.0


class Writer(threading.Thread):
    """A sequential writer (a download, a copy): appends ``total`` bytes to ``path`` a
    chunk at a time; ``hook(written)`` runs between chunks.

    ``paced``: it keeps at most ``LEAD_BYTES`` ahead of what the sender has sent in
    ranges (or, once it waited ``PACE_S`` in vain, no longer), so that how much goes
    while the file is written follows from the ranges' rule, not from the machine's
    load."""

    def __init__(
        self,
        path: Path,
        total: int,
        hook: Callable[[int], None] = lambda n: None,
        paced: bool = False,
    ):
        super().__init__()
        self.path, self.total, self.hook, self.paced = path, total, hook, paced
        self.rng = random.Random(total)
        self.went: Callable[[], int] = lambda: total  # set by send_while_written

    def run(self) -> None:
        written = 0
        with self.path.open("ab", buffering=0) as stream:
            while written < self.total:
                self.wait_for_sender(written)
                stream.write(self.rng.randbytes(CHUNK))
                written += CHUNK
                self.hook(written)
                time.sleep(0.004)

    def wait_for_sender(self, written: int) -> None:
        deadline = time.monotonic() + PACE_S
        while self.paced and written - self.went() > LEAD_BYTES:
            if time.monotonic() > deadline:  # a sender that sends nothing: the test's
                self.paced = False  # assertions fail it, no need to wait at each chunk
                return
            time.sleep(0.002)


def early_export(
    tmp_path: Path, scratch: frozenset[str] = frozenset()
) -> tuple[ExportPlan, Transfer, Receiver]:
    """An early export (its plan and folder) and the one node that receives it."""
    receiver = Receiver(tmp_path / "incoming")
    transfer = Transfer("job1-x", tmp_path / "outgoing", 0, datetime.now(UTC))
    plan = ExportPlan(Path(), "key", [], manifest_format.Manifest(), 0, PART_BYTES, early=True,
                      scratch=scratch)  # fmt: skip
    return plan, transfer, receiver


def land_next(plan: ExportPlan, transfer: Transfer, receiver: Receiver, staging: Path) -> None:
    """Pack the next early part of ``staging`` (there is one) and land it."""
    packed, _ = pack_early_part(plan, transfer, staging)
    assert packed is not None and packed.path is not None
    receiver.land(packed.path)


def send_while_written(
    tmp_path: Path, writer: Writer, staging: Path, scratch: frozenset[str] = frozenset()
) -> tuple[ExportPlan, Transfer, Receiver, list[int]]:
    """Early parts packed and landed while ``writer`` writes into ``staging``: the plan,
    the export, the receiver, and the size of each part sent while it wrote."""
    plan, transfer, receiver = early_export(tmp_path, scratch)
    sent: list[int] = []
    writer.went = lambda: sent_in_ranges(plan)
    writer.start()
    try:
        while writer.is_alive():
            try:
                packed, _ = pack_early_part(plan, transfer, staging)
            except (OSError, StagerError):
                # Renamed or removed between the walk and the read: the daemon's room
                # answers "none yet" and looks again (stager.fanout.room).
                packed = None
            if packed is not None and packed.path is not None:
                receiver.land(packed.path)
                sent.append(packed.bytes)
            time.sleep(0.01)
    finally:
        writer.join()
    return plan, transfer, receiver, sent


def final_bytes(tmp_path: Path, plan: ExportPlan) -> int:
    """What the parts packed once the tree was ready hold (as the receiver got them)."""
    names = [f"part-{i:05d}.tar" for i in range(plan.first, plan.count)]
    return sum((tmp_path / "incoming" / name).stat().st_size for name in names)


@pytest.fixture(autouse=True)
def quick_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early, "STABLE_S", STABLE_S)


def sent_in_ranges(plan: ExportPlan) -> int:
    """The file bytes the early parts sent in ranges so far."""
    return sum(growing.sent for growing in plan.growing.values())


def unsent_bound(size: int, went_early: int) -> int:
    """The most the final parts may hold of a ``size``-byte file of which ``went_early``
    bytes went in ranges: the rest, and two parts' slack for the parts' tar headers and
    the tree's folders. Relative to what went, not to the file: how far the sender falls
    behind the writer depends on the machine's load; whether it sends a part again
    does not."""
    return size - went_early + 2 * PART_BYTES


def staging_tree(tmp_path: Path) -> Path:
    staging = tmp_path / "partial" / "tree"
    (staging / "train").mkdir(parents=True)
    return staging


@pytest.mark.parametrize("where", ["train/ILSVRC2012_img_train.tar", "alone.bin"])
def test_a_file_still_written_goes_out_in_ranges_and_only_its_end_after(
    tmp_path: Path, where: str
) -> None:
    """In a folder, or alone in the tree (then nothing but its ranges is left to send
    once it is ready)."""
    staging = staging_tree(tmp_path)
    if where == "alone.bin":
        (staging / "train").rmdir()
    total = 24 * PART_BYTES
    writer = Writer(staging / where, total, paced=True)
    plan, transfer, receiver, sent = send_while_written(tmp_path, writer, staging)
    assert sum(sent) >= total // 2  # most of the file went while it was written
    went_early = sent_in_ranges(plan)
    ready, adopted = publish_and_adopt(tmp_path, staging, plan, transfer, receiver)
    assert digest(adopted) == digest(ready)
    assert final_bytes(tmp_path, plan) <= unsent_bound(total, went_early)  # not again
    assert manifest.build(adopted).to_bytes() == manifest.build(ready).to_bytes()
    assert stat.S_IMODE((adopted / where).stat().st_mode) == FILE_MODE  # as published


def test_a_download_renamed_when_complete_is_not_sent_again(tmp_path: Path) -> None:
    """A download appends to ``x.part`` and renames it ``x`` once complete: the ranges
    follow the file (its inode), and the receiver renames what it holds."""
    staging = staging_tree(tmp_path)
    total = 16 * PART_BYTES
    part = staging / "train" / "archive.tar.part"

    def renamed_when_done(written: int) -> None:
        if written >= total:  # its last bytes come fast: its end spans several parts
            with part.open("ab") as stream:
                stream.write(os.urandom(3 * PART_BYTES))
            part.rename(part.with_name("archive.tar"))

    writer = Writer(part, total, renamed_when_done, paced=True)
    plan, transfer, receiver, sent = send_while_written(tmp_path, writer, staging)
    assert sum(sent) >= total // 2
    went_early = sent_in_ranges(plan)
    ready, adopted = publish_and_adopt(tmp_path, staging, plan, transfer, receiver)
    assert digest(adopted) == digest(ready)
    assert (adopted / "train" / "archive.tar").is_file()
    assert not (adopted / "train" / "archive.tar.part").exists()
    assert final_bytes(tmp_path, plan) <= unsent_bound(total + 3 * PART_BYTES, went_early)


@pytest.mark.parametrize("change", ["rewritten", "truncated", "started over"])
def test_a_file_changed_behind_its_ranges_is_sent_again(tmp_path: Path, change: str) -> None:
    staging = staging_tree(tmp_path)
    total = 16 * PART_BYTES
    path = staging / "train" / "data.bin"

    def change_behind(written: int) -> None:
        if written != total // 2:
            return
        if change == "rewritten":  # same size, other bytes at the start
            with path.open("r+b") as stream:
                stream.write(b"\xff" * 100)
        elif change == "truncated":  # cut behind what went; the writer appends on
            os.truncate(path, PART_BYTES)
        else:  # a download that started over: new file, same name, grows past the old
            path.unlink()
            path.write_bytes(os.urandom(total))

    writer = Writer(path, total, change_behind)
    plan, transfer, receiver, sent = send_while_written(tmp_path, writer, staging)
    ready, adopted = publish_and_adopt(tmp_path, staging, plan, transfer, receiver)
    assert digest(adopted) == digest(ready)


def test_a_sender_that_trusted_changed_ranges_is_caught_by_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver never trusts ranges: were the sender to skip its check of the
    bytes already sent, the manifest check on the receiver names the file."""
    staging = staging_tree(tmp_path)
    total = 16 * PART_BYTES
    path = staging / "train" / "data.bin"

    def rewrite_behind(written: int) -> None:
        if written == total // 2:
            with path.open("r+b") as stream:
                stream.write(b"\xff" * 100)

    monkeypatch.setattr(ranges, "still_as_sent", lambda now, growing: True)
    plan, transfer, receiver, _ = send_while_written(
        tmp_path, Writer(path, total, rewrite_behind), staging
    )
    with pytest.raises(VerifyFailed, match="train/data.bin"):
        publish_and_adopt(tmp_path, staging, plan, transfer, receiver)


def test_a_file_the_staging_removes_is_never_sent(tmp_path: Path) -> None:
    """A downloaded archive the staging extracts and removes (and its ``.part``) costs
    no byte on the wire."""
    staging = staging_tree(tmp_path)
    writer = Writer(staging / ".download" / "a.tar.gz.part", 16 * PART_BYTES)
    (staging / ".download").mkdir()
    scratch = frozenset({".download/a.tar.gz", ".download/a.tar.gz.part"})
    _, _, _, sent = send_while_written(tmp_path, writer, staging, scratch)
    assert sum(sent) < PART_BYTES  # folders at most


@pytest.mark.parametrize("seed", range(6))
def test_whatever_happens_around_a_growing_file_the_receiver_gets_the_ready_tree(
    tmp_path: Path, seed: int
) -> None:
    """A growing file among other files, and random changes to the tree (the growing
    file included) while parts go out and after."""
    rng = random.Random(seed)
    staging = write_tree(tmp_path / "partial" / "tree", n_files=30, seed=seed)
    lock = threading.Lock()

    def mutate(written: int) -> None:
        if rng.random() < 0.15:
            with lock:
                try:
                    rng.choice(MUTATIONS)(staging, rng)
                except (OSError, IndexError):
                    pass  # the writer's file moved under the mutation: fine

    growing = staging / f"big-{seed}.bin"
    plan, transfer, receiver, _ = send_while_written(
        tmp_path, Writer(growing, 12 * PART_BYTES, mutate), staging
    )
    ready, adopted = publish_and_adopt(tmp_path, staging, plan, transfer, receiver)
    assert manifest.build(adopted).to_bytes() == manifest.build(ready).to_bytes()


# ---- a receiver given ranges no sender writes ----------------------------------------


Member = tuple[str, int, bytes] | tuple[str, int, bytes, dict[str, str]]


def range_part(path: Path, *members: Member) -> None:
    """A part of ranges as a sender (or a forger) writes it: (path, offset, bytes[, more
    pax records])."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, offset, data, *more in members:
            member = tarfile.TarInfo(name)
            member.size = len(data)
            member.pax_headers[ranges.OFFSET] = str(offset)
            for records in more:
                member.pax_headers.update(records)
            tar.addfile(member, io.BytesIO(data))


def whole_part(path: Path, name: str, data: bytes) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        member = tarfile.TarInfo(name)
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))


def assemble(part: Path, tree: Path, assembly: ranges.Assembly | None = None) -> None:
    with part.open("rb") as stream:
        assert ranges.is_range_part(stream)
        ranges.assemble(stream, tree, assembly or ranges.Assembly(), "p")


@pytest.mark.parametrize(
    "members, why",
    [
        ([("../escape", 0, b"x")], "no sender writes"),
        ([("/etc/passwd", 0, b"x")], "no sender writes"),
        ([("a/./b", 0, b"x")], "no sender writes"),
        ([("f", 5, b"x")], "came first"),
        ([("f", 0, b"abc"), ("f", 5, b"x")], "does not continue"),
        ([("f", 0, b"abc"), ("f", 1, b"x")], "does not continue"),
        ([("f", 0, b"abc"), ("g", 3, b"x", {ranges.MOVED_FROM: "h"})], "cannot write"),
        ([("f", 0, b"abc"), ("g", 3, b"x", {ranges.MOVED_FROM: "link"})], "came otherwise"),
        (
            [("f", 0, b"x", {"GNU.sparse.map": "67108863,1", "GNU.sparse.size": "67108864"})],
            "mixes ranges",
        ),
        ([("link/f", 0, b"x")], "not a folder"),
    ],
)
def test_a_receiver_refuses_ranges_no_sender_writes(
    tmp_path: Path, members: list[tuple[str, int, bytes]], why: str
) -> None:
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    tree.mkdir()
    outside.mkdir()
    (tree / "link").symlink_to(outside)  # an earlier part's link
    range_part(tmp_path / "part.tar", *members)
    with pytest.raises(VerifyFailed, match=why):
        assemble(tmp_path / "part.tar", tree)
    assert list(outside.iterdir()) == []
    assert not (tmp_path / "escape").exists()


def test_a_range_at_byte_zero_replaces_what_a_link_was_without_following_it(
    tmp_path: Path,
) -> None:
    tree, target = tmp_path / "tree", tmp_path / "target"
    tree.mkdir()
    target.write_bytes(b"keep")
    (tree / "f").symlink_to(target)
    range_part(tmp_path / "part.tar", ("f", 0, b"new"))
    assemble(tmp_path / "part.tar", tree)
    assert target.read_bytes() == b"keep"
    assert not (tree / "f").is_symlink() and (tree / "f").read_bytes() == b"new"


def test_the_receiving_op_takes_a_range_part_between_ordinary_parts(tmp_path: Path) -> None:
    """The adopt op itself: an ordinary part, a part of ranges, and the manifest."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "small.txt").write_text("whole\n")
    (source / "big.bin").write_bytes(os.urandom(3 * CHUNK))
    receiver = Receiver(tmp_path / "incoming")
    with tarfile.open(tmp_path / "p0.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(source / "small.txt", "small.txt")
    data = (source / "big.bin").read_bytes()
    range_part(tmp_path / "p1.tar", ("big.bin", 0, data[:CHUNK]))
    range_part(tmp_path / "p2.tar", ("big.bin", CHUNK, data[CHUNK:]))
    for name in ("p0.tar", "p1.tar", "p2.tar"):
        receiver.land(str(tmp_path / name))
    expected = manifest.build(source)
    (tmp_path / "manifest.json").write_bytes(expected.to_bytes())
    step = receiver.end(
        str(tmp_path / "manifest.json"), manifest_format.digest(expected.to_bytes())
    )
    adopted = tmp_path / "adopted"
    ctx = OpContext(root=adopted, progress=Progress(), workers=2, cancel=threading.Event())
    adopt.run(step, ctx)
    assert digest(adopted) == digest(source)


def adopt_parts(tmp_path: Path, parts: list[Path], expected: manifest_format.Manifest) -> Path:
    """The receiving op on ``parts`` then ``expected``'s manifest: the adopted tree."""
    receiver = Receiver(tmp_path / "incoming")
    for part in parts:
        receiver.land(str(part))
    (tmp_path / "manifest.json").write_bytes(expected.to_bytes())
    sha256 = manifest_format.digest(expected.to_bytes())
    step = receiver.end(str(tmp_path / "manifest.json"), sha256)
    adopted = tmp_path / "adopted"
    ctx = OpContext(root=adopted, progress=Progress(), workers=2, cancel=threading.Event())
    adopt.run(step, ctx)
    return adopted


def test_an_ordinary_part_put_between_two_ranges_fails_the_adoption(tmp_path: Path) -> None:
    """A forged ordinary part replaces a file between its ranges, with as many bytes as
    came (and, on a kernel whose ctimes move once a tick, the same inode number, size
    and times): no range continues a path an ordinary part wrote, so the adoption
    fails instead of passing the manifest check on bytes it never held."""
    true = b"A" * 100 + b"B" * 100
    range_part(tmp_path / "p0.tar", ("f", 0, true[:100]))
    whole_part(tmp_path / "p1.tar", "f", b"X" * 100)
    range_part(tmp_path / "p2.tar", ("f", 100, true[100:]))
    expected = manifest_format.Manifest()
    expected.files["f"] = (len(true), hashlib.sha256(true).hexdigest())
    with pytest.raises(VerifyFailed, match="came first"):
        adopt_parts(tmp_path, [tmp_path / f"p{i}.tar" for i in range(3)], expected)


def test_a_damaged_part_is_named_as_such(tmp_path: Path) -> None:
    """Not a tar at all: extract names it (a corrupt archive, not an internal error);
    a part of ranges cut short: the adoption names it."""
    (tmp_path / "p0.tar").write_bytes(os.urandom(700))
    with pytest.raises(StagerError, match="p0.tar|part-00000.tar"):
        adopt_parts(tmp_path, [tmp_path / "p0.tar"], manifest_format.Manifest())
    range_part(tmp_path / "r.tar", ("f", 0, b"x" * 5000))
    (tmp_path / "r.tar").write_bytes((tmp_path / "r.tar").read_bytes()[:3072])
    tree = tmp_path / "tree"
    tree.mkdir()
    with pytest.raises(VerifyFailed, match="damaged"):
        assemble(tmp_path / "r.tar", tree)


def test_a_plain_member_after_a_range_is_refused(tmp_path: Path) -> None:
    """A header the fast reader reads itself (no pax records) after a range."""
    range_part(tmp_path / "p.tar", ("a", 0, b"x"))
    with tarfile.open(tmp_path / "q.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        plain = tarfile.TarInfo("b")
        plain.size = 1
        tar.addfile(plain, io.BytesIO(b"y"))
    first = (tmp_path / "p.tar").read_bytes().rstrip(b"\0")
    glued = first + b"\0" * (-len(first) % 512) + (tmp_path / "q.tar").read_bytes()
    (tmp_path / "glued.tar").write_bytes(glued)
    tree = tmp_path / "tree"
    tree.mkdir()
    with pytest.raises(VerifyFailed, match="mixes ranges"):
        assemble(tmp_path / "glued.tar", tree)


def listed_then_swapped(tmp_path: Path, what: str) -> tuple[Path, os.stat_result, Path]:
    """A staging tree whose ``d/f`` was listed, then replaced: its folder by a link to
    a folder outside, or the file by a link or a FIFO. (tree, the listing, outside)"""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"SECRET" * 1000)
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    (tree / "d" / "f").write_bytes(b"\0" * 6000)
    info = os.lstat(tree / "d" / "f")
    (tree / "d" / "f").unlink()
    if what == "folder":
        (tree / "d").rmdir()
        (tree / "d").symlink_to(outside)
    elif what == "file":
        (tree / "d" / "f").symlink_to(outside / "f")
    else:
        os.mkfifo(tree / "d" / "f")
    return tree, info, outside


@pytest.mark.parametrize("what", ["folder", "file", "fifo"])
def test_the_packers_read_only_the_file_they_listed(tmp_path: Path, what: str) -> None:
    """Between the walk and the read the staging put a link (or a FIFO) in the way: a
    range, a whole file and the check of bytes already sent read nothing else (and do
    not hang)."""
    tree, info, _ = listed_then_swapped(tmp_path, what)
    piece = ranges.RangePart([ranges.Range("d/f", info, 0, 6000, None, False)])
    with pytest.raises(FileNotFoundError):
        ranges.pack(tree, tmp_path / "r.tar", piece, {}, manifest_format.Manifest(),
                    manifest.Digests())  # fmt: skip
    with pytest.raises(FileNotFoundError):
        bundle.pack_part(tree, tmp_path / "w.tar", [("d/f", info)], manifest_format.Manifest())
    book = ranges.Growing("d/f", 10, hashlib.sha256(b"\0" * 10))
    assert not ranges.confirm(tree, "d/f", info, book) and book.sent == 0


def test_a_new_file_under_a_ranged_files_old_name_is_no_trouble(tmp_path: Path) -> None:
    """P goes out in ranges, is renamed Q, and a new P grows: the new P's first range
    goes first (the part is full before Q's next one), so Q starts over on the
    receivers instead of continuing the copy that P's range replaced."""
    staging = staging_tree(tmp_path)
    plan, transfer, receiver = early_export(tmp_path)

    def one_part() -> None:
        land_next(plan, transfer, receiver, staging)

    (staging / "P").write_bytes(os.urandom(2 * PART_BYTES))
    one_part()  # P at byte 0
    (staging / "P").rename(staging / "Q")
    (staging / "P").write_bytes(os.urandom(PART_BYTES))
    one_part()  # the new P at byte 0 fills the part
    one_part()  # Q
    ready, adopted = publish_and_adopt(tmp_path, staging, plan, transfer, receiver)
    assert digest(adopted) == digest(ready)


def ranges_sent(
    plan: ExportPlan, transfer: Transfer, staging: Path, receiver: Receiver
) -> list[tuple[int, int]]:
    """One early look (its part landed): the (offset, length) of each range it sent."""
    packed, _ = pack_early_part(plan, transfer, staging)
    if packed is None or packed.path is None:
        return []
    receiver.land(packed.path)
    with tarfile.open(packed.path) as tar:
        return [(int(m.pax_headers.get(ranges.OFFSET, -1)), m.size) for m in tar.getmembers()]


def test_a_download_that_stalls_goes_on_where_it_was(tmp_path: Path) -> None:
    """A download pauses longer than a file takes to settle (a slow server): its end so
    far goes as its last range; when it goes on, so do its ranges, from there; and
    renamed once complete, it is not sent again."""
    staging = staging_tree(tmp_path)
    plan, transfer, receiver = early_export(tmp_path)
    sent: list[tuple[int, int]] = []
    part = staging / "x.part"
    with part.open("ab", buffering=0) as out:
        for _ in range(8):
            out.write(os.urandom(PART_BYTES + 100))
            sent += ranges_sent(plan, transfer, staging, receiver)
        time.sleep(STABLE_S * 3)  # the server stalls: settled, its end goes
        sent += ranges_sent(plan, transfer, staging, receiver)
        assert sent[-1][0] + sent[-1][1] == part.stat().st_size
        for _ in range(8):
            out.write(os.urandom(PART_BYTES))
            sent += ranges_sent(plan, transfer, staging, receiver)
    time.sleep(STABLE_S * 3)
    sent += ranges_sent(plan, transfer, staging, receiver)
    assert [offset for offset, _ in sent if offset == 0] == [0]  # never from byte 0 again
    assert sum(length for _, length in sent) == part.stat().st_size
    part.rename(staging / "x")
    ready, adopted = publish_and_adopt(tmp_path, staging, plan, transfer, receiver)
    assert digest(adopted) == digest(ready)
    assert final_bytes(tmp_path, plan) < 64 * 1024  # renamed: headers, no data again


@pytest.mark.parametrize("grown", [PART_BYTES, 100])
def test_a_chain_of_renames_of_files_sent_in_ranges(tmp_path: Path, grown: int) -> None:
    """b -> c, then a -> b, each grown since: by a part's worth (the two go on in early
    parts) or a little (both go on in one part of the ready tree's rest). A file
    renamed onto the path where the receivers hold another's copy starts over, and
    renamed files move before others take their names."""
    staging = staging_tree(tmp_path)
    plan, transfer, receiver = early_export(tmp_path)

    def one_part() -> None:
        land_next(plan, transfer, receiver, staging)

    (staging / "a").write_bytes(os.urandom(PART_BYTES))
    (staging / "b").write_bytes(os.urandom(PART_BYTES))
    one_part()  # a from byte 0
    one_part()  # b from byte 0
    (staging / "b").rename(staging / "c")
    (staging / "a").rename(staging / "b")
    for name in ("b", "c"):
        with (staging / name).open("ab") as out:
            out.write(os.urandom(grown))
    if grown == PART_BYTES:
        one_part()
        one_part()
    ready, adopted = publish_and_adopt(tmp_path, staging, plan, transfer, receiver)
    assert digest(adopted) == digest(ready)


def range_bytes(receiver: Receiver, path: str) -> int:
    """The bytes of ``path``'s ranges in every part the receiver got."""
    total = 0
    for part in sorted(receiver.folder.glob("part-*.tar")):
        with tarfile.open(part) as tar:
            for member in tar.getmembers():
                if member.name == path and ranges.OFFSET in member.pax_headers:
                    total += member.size
    return total


def test_files_and_folders_sent_beside_a_growing_file_do_not_restart_it(tmp_path: Path) -> None:
    """Ordinary parts (its folder, finished files beside it) go out while a file grows
    in that folder: its ranges go on, each byte sent once."""
    staging = staging_tree(tmp_path)
    total = 16 * PART_BYTES
    big = staging / "train" / "big.bin"
    rng = random.Random(7)

    def finished_file_beside(written: int) -> None:
        if written % (4 * PART_BYTES) == 0:
            for n in range(3):  # small files: they go whole, once settled
                name = staging / "train" / f"done-{written}-{n}.bin"
                name.write_bytes(rng.randbytes(PART_BYTES // 2))
            time.sleep(STABLE_S * 3)  # they settle and go while the writer waits

    plan, transfer, receiver, _ = send_while_written(
        tmp_path, Writer(big, total, finished_file_beside), staging
    )
    early_parts = plan.packed
    ready, adopted = publish_and_adopt(tmp_path, staging, plan, transfer, receiver)
    assert digest(adopted) == digest(ready)
    ordinary = [p for p in sorted(receiver.folder.glob("part-*.tar"))[:early_parts]
                if not ranges.is_range_part(p.open("rb"))]  # fmt: skip
    assert ordinary, "ordinary parts should go out while the file grows"
    assert total <= range_bytes(receiver, "train/big.bin") <= total + PART_BYTES
