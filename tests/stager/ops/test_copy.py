from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from stager.core.errors import Cancelled, SourceNotFound, StagingIOError, VerifyFailed
from stager.fs import file_copy, forked, mounts
from stager.fs.sizes import sum_sizes
from stager.ops import copy
from stager.ops.base import CheckContext, OpContext
from stager.ops.copy import CopyStep
from stager.wire.progress import Progress
from tests.trees import digest, write_tree

OLD = 1_500_000_000_123_456_789  # an mtime in ns that a fresh write can never produce


@pytest.fixture(autouse=True, params=["inline", "processes", "network"])
def pool(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Small trees are copied on the walking process, large ones on forked workers,
    a network filesystem's on more workers from the first file: every test runs each
    way, so each path is held to the same results and errors."""
    if request.param == "processes":
        monkeypatch.setattr(copy, "PARALLEL_AFTER_FILES", 0)
        monkeypatch.setattr(copy, "BATCH_FILES", 16)
    if request.param == "network":  # this test's own filesystem classified as remote
        here = mounts.fs_type(os.path.realpath(tmp_path))
        monkeypatch.setattr(mounts, "NETWORK_TYPES", mounts.NETWORK_TYPES | {here})
    return request.param


class HookProgress(Progress):
    """Real progress counters that also call a test's hook after each advance."""

    def __init__(self, hook: Callable[[Progress], None]) -> None:
        super().__init__()
        self.hook = hook

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        super().advance(nbytes, files)
        self.hook(self)


def make_ctx(root: Path, verify: str = "size", progress: Progress | None = None) -> OpContext:
    root.mkdir(parents=True, exist_ok=True)
    return OpContext(root=root, progress=progress or Progress(), workers=4, verify=verify)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A nested tree with old mtimes and a few unusual modes."""
    src = write_tree(tmp_path / "src", n_files=120, max_size=40_000)
    deep = src / "class_0" / "deep" / "er"
    deep.mkdir(parents=True)
    (deep / "leaf.bin").write_bytes(os.urandom(3000))
    (src / "empty.bin").write_bytes(b"")
    (src / "class_1" / "img_0001.jpg").chmod(0o640)
    for path in sorted(src.rglob("*"), reverse=True):
        os.utime(path, ns=(OLD, OLD + len(path.name)))
    os.utime(src, ns=(OLD, OLD))
    return src


def file_mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.lstat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_tree_copy_keeps_bytes_mtimes_and_modes(source: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "root", verify="sha256")
    step = CopyStep(src=str(source), dst="data")
    expected = copy.check(step, CheckContext())

    made = copy.run(step, ctx)

    out = ctx.root / "data"
    assert made == sum_sizes(str(out))  # the staging takes it as the entry's size
    assert digest(out) == digest(source)
    assert file_mtimes(out) == file_mtimes(source)
    assert (out / "class_0" / "deep").stat().st_mtime_ns == (
        source / "class_0" / "deep"
    ).stat().st_mtime_ns
    # Created as the published tree keeps every file: 0444, whatever the source said.
    assert (out / "class_1" / "img_0001.jpg").stat().st_mode & 0o7777 == 0o444
    snap = ctx.progress.snapshot()
    assert snap.bytes_done == snap.bytes_total == expected
    assert snap.files_done == snap.files_total == 122


def test_single_file_destinations(source: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "root")
    leaf = source / "class_0" / "deep" / "er" / "leaf.bin"
    made = [
        copy.run(CopyStep(src=str(leaf), dst="."), ctx),
        copy.run(CopyStep(src=str(leaf), dst="inside/"), ctx),
        copy.run(CopyStep(src=str(leaf), dst="sub/renamed.bin"), ctx),
        copy.run(CopyStep(src=str(leaf), dst="sub/renamed.bin"), ctx),  # complete already
    ]
    assert made == [leaf.stat().st_size] * 4
    for path in ("leaf.bin", "inside/leaf.bin", "sub/renamed.bin"):
        assert (ctx.root / path).read_bytes() == leaf.read_bytes()
        assert (ctx.root / path).stat().st_mtime_ns == leaf.stat().st_mtime_ns


def test_file_into_an_existing_directory_goes_inside(source: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "root")
    (ctx.root / "train" / "kept").mkdir(parents=True)
    leaf = source / "class_0" / "deep" / "er" / "leaf.bin"
    copy.run(CopyStep(src=str(leaf), dst="train"), ctx)
    assert (ctx.root / "train" / "leaf.bin").read_bytes() == leaf.read_bytes()
    assert (ctx.root / "train" / "kept").is_dir()


def test_symlinks_inside_kept_outside_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("outside content")
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "x.txt").write_text("x")
    (src / "a" / "b" / "rel").symlink_to("../x.txt")
    (src / "abs").symlink_to(src / "a")  # absolute, but inside the tree
    (src / "out").symlink_to(outside)
    (src / "dangling").symlink_to("/nonexistent/target")
    ctx = make_ctx(tmp_path / "root")

    made = copy.run(CopyStep(src=str(src), dst="."), ctx)

    root = ctx.root
    assert made == sum_sizes(str(root))  # links by their length, followed files by size
    assert os.readlink(root / "a" / "b" / "rel") == "../x.txt"
    assert os.readlink(root / "abs") == "a"  # rewritten relative: points into the copy
    assert (root / "abs" / "x.txt").read_text() == "x"
    assert not (root / "out").is_symlink()
    assert (root / "out").read_text() == "outside content"
    assert os.readlink(root / "dangling") == "/nonexistent/target"


def test_restart_after_interruption_ends_identical(source: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "root")
    step = CopyStep(src=str(source), dst=".")
    copy.run(step, ctx)
    root = ctx.root
    untouched = root / "class_2" / "img_0002.jpg"
    ctime_before = untouched.stat().st_ctime_ns
    # What a crash and a dirty partial directory can leave behind:
    half = root / "class_0" / "img_0000.jpg"
    half.write_bytes(half.read_bytes()[:100])  # partially written, fresh mtime
    same_size = root / "class_1" / "img_0004.jpg"
    same_size.write_bytes(b"\0" * same_size.stat().st_size)  # right size, wrong bytes/mtime
    (root / "class_2" / "img_0005.jpg").unlink()  # never started
    victim = tmp_path / "victim.txt"
    victim.write_text("must not be written through")
    linked = root / "class_0" / "img_0003.jpg"
    linked.unlink()
    linked.symlink_to(victim)  # a link where a file belongs must be replaced, not followed
    as_dir = root / "class_1" / "img_0007.jpg"
    as_dir.unlink()
    (as_dir / "junk").mkdir(parents=True)

    copy.run(step, ctx)

    assert digest(root) == digest(source)
    assert file_mtimes(root) == file_mtimes(source)
    assert victim.read_text() == "must not be written through"
    assert untouched.stat().st_ctime_ns == ctime_before  # complete files are skipped


def test_cancel_mid_tree_raises_cancelled(tmp_path: Path) -> None:
    """Stops within the chunks already handed out: at most a few per worker."""
    source = write_tree(tmp_path / "src", n_files=3000, max_size=100)

    def cancel_after_first_file(progress: Progress) -> None:
        if progress.files_done >= 1:
            ctx.cancel.set()

    ctx = make_ctx(tmp_path / "root", progress=HookProgress(cancel_after_first_file))
    with pytest.raises(Cancelled):
        copy.run(CopyStep(src=str(source), dst="."), ctx)
    assert ctx.progress.files_done < 1000


def test_source_shrinking_during_copy_is_copied_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen on the descriptor after the copy (size, mtime, ctime): copied once more, as
    it is now. (tests/stager/ops/test_walks.py covers every kind of change.)"""
    monkeypatch.setattr(file_copy, "CHUNK", 4096)
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(64 * 1024))

    def shrink(progress: Progress) -> None:
        if src.stat().st_size > 8192:
            os.truncate(src, 8192)

    ctx = make_ctx(tmp_path / "root", progress=HookProgress(shrink))
    made = copy.run(CopyStep(src=str(src), dst="."), ctx)
    assert made == 8192  # as copied the second time, not the first time's 64 KB
    assert (ctx.root / "big.bin").read_bytes() == src.read_bytes()
    assert len(src.read_bytes()) == 8192


def test_a_copy_corrupted_on_the_local_disk_fails_sha256_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source is stable; the bytes that land are not (a bad disk): only the
    digests can tell, and ``verify: sha256`` must."""
    src = tmp_path / "big.bin"
    src.write_bytes(b"a" * 64 * 1024)
    real_copy_chunk = file_copy.copy_chunk

    def corrupting(src_fd: int, dst_fd: int, offset: int, count: int) -> int:
        done = real_copy_chunk(src_fd, dst_fd, offset, count)
        os.pwrite(dst_fd, b"b", offset)
        return done

    monkeypatch.setattr(file_copy, "copy_chunk", corrupting)
    copy.run(CopyStep(src=str(src), dst="sized"), make_ctx(tmp_path / "root", verify="size"))
    ctx = make_ctx(tmp_path / "root", verify="sha256")
    with pytest.raises(VerifyFailed, match="sha256"):
        copy.run(CopyStep(src=str(src), dst="."), ctx)
    # No mtime was set on the bad copy, so a restart would copy it again.
    assert (ctx.root / "big.bin").stat().st_mtime_ns != src.stat().st_mtime_ns


@pytest.mark.parametrize("disable", [["copy_file_range"], ["copy_file_range", "sendfile"]])
def test_fallbacks_copy_the_same_bytes(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disable: list[str]
) -> None:
    for name in disable:
        monkeypatch.delattr(os, name)
    ctx = make_ctx(tmp_path / "root", verify="sha256")
    copy.run(CopyStep(src=str(source), dst="."), ctx)
    assert digest(ctx.root) == digest(source)


def test_missing_source_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "train"
    step = CopyStep(src=str(missing), dst=".")
    with pytest.raises(SourceNotFound, match=str(missing)):
        copy.check(step, CheckContext())
    with pytest.raises(SourceNotFound, match=str(missing)):
        copy.run(step, make_ctx(tmp_path / "root"))


def test_full_disk_says_so(tmp_path: Path, tmpfs: Callable[[str], Path]) -> None:
    tiny_disk = tmpfs("256k")
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(1024 * 1024))
    with pytest.raises(StagingIOError, match="disk filled up"):
        copy.run(CopyStep(src=str(src), dst="."), make_ctx(tiny_disk))


def test_check_past_its_budget_scales_up_what_it_walked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree too large to walk at request time still gets an estimate (admission needs
    one): the walked top-level folders' bytes, scaled to all of them."""
    src = tmp_path / "src"
    for i in range(20):
        (src / f"class_{i:02d}").mkdir(parents=True)
        for j in range(5):
            (src / f"class_{i:02d}" / f"f{j}").write_bytes(b"x" * 1000)
    ticks = iter(range(1_000_000))  # a clock that moves one second per look
    monkeypatch.setattr(copy.time, "monotonic", lambda: float(next(ticks)))
    monkeypatch.setattr(copy, "CHECK_BUDGET_S", 6.5)
    assert copy.check(CopyStep(src=str(src)), CheckContext()) == 20 * 5 * 1000
    assert next(ticks) < 12  # it stopped early: 20 folders would have taken 20 looks


def test_a_large_trees_chunks_grow_so_the_hand_overs_stay_few(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool: str
) -> None:
    """Each chunk handed to a worker costs the walking process the pool's pickling and
    waking; at a fixed 256 files that was a third of its time on 200,000 small files.
    Chunks start small (a small tree still spreads over every worker) and grow with the
    files seen, each at most 1/CHUNKS_SEEN of them, up to LARGE_BATCH_FILES; a network
    source's stay small (its time is round trips, spread over more processes)."""
    # 6,000 files: enough that a chunk of 1/CHUNKS_SEEN of those seen (~370 at most)
    # outgrows BATCH_FILES, which fixed chunks never do.
    src = tmp_path / "src"
    for d in range(6):
        (src / f"d{d:02d}").mkdir(parents=True)
        for f in range(1000):
            (src / f"d{d:02d}" / f"f{f:04d}").touch()
    chunks: list[int] = []
    submit = forked.Workers.submit

    def counted(self: forked.Workers, fn: Callable[..., None], *args: object, **kw: int) -> None:
        chunks.append(kw["files"])
        submit(self, fn, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(forked.Workers, "submit", counted)
    ctx = make_ctx(tmp_path / "root")
    copy.run(CopyStep(src=str(src), dst="out"), ctx)
    assert sum(chunks) == 6_000
    assert len(os.listdir(tmp_path / "root" / "out" / "d05")) == 1000
    if pool == "network":
        assert max(chunks) <= copy.NETWORK_BATCH_FILES
        return
    assert chunks[0] <= copy.BATCH_FILES
    assert max(chunks) > copy.BATCH_FILES + 1  # grown (+1: a chunk may close a folder)
    seen = 0
    for files in chunks:
        assert files <= max(copy.BATCH_FILES, seen // copy.CHUNKS_SEEN) + 1
        seen += files
