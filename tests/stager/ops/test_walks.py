"""Every walk of a source tree keeps the same three promises, on generated trees:

- special files (FIFOs, sockets, devices, links to them) at random depths are
  never opened: refused with a sentence naming one, or left out with ``skip``;
  nothing blocks (a watchdog fails the test instead of hanging the suite);
- with allowed roots, a link anywhere in the tree, through a chain of random
  length crossing the root's boundary at random points, is refused exactly when
  the kernel's own resolution (``realpath``) ends outside the roots;
- a file that changes while it is copied (rewritten, grown, shrunk, touched,
  replaced) is either copied as it ends up or fails with a sentence naming it.

The walks: copy (check and run), symlink tree (check and run), unpack of a folder
(copy and symlink modes), both fingerprints and the tree delete.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stager.core.errors import SpecialSource, UnsafePath, VerifyFailed
from stager.fs import file_copy
from stager.fs.deletion import delete_tree
from stager.fs.sizes import sum_sizes
from stager.ops import copy, symlink, unpack
from stager.ops.base import CheckContext, OpContext
from stager.ops.copy import CopyStep
from stager.ops.symlink import SymlinkStep
from stager.ops.unpack import UnpackStep
from stager.request.fingerprint import sources_fingerprint
from stager.wire.progress import Progress
from tests.trees import write_tree

WATCHDOG_S = 15


@pytest.fixture(autouse=True, params=["inline", "processes"])
def pool(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Small trees are walked with the work done inline; large ones with forked workers."""
    if request.param == "processes":
        for module in (copy, symlink):
            monkeypatch.setattr(module, "PARALLEL_AFTER_FILES", 0)
        monkeypatch.setattr(copy, "BATCH_FILES", 4)
        monkeypatch.setattr(symlink, "BATCH", 4)
    return request.param


def within(fn: Callable[[], Any], fifos: list[Path] = ()) -> Any:  # type: ignore[assignment]
    """Run ``fn`` on a thread; if it blocks, fail and unblock it (open each FIFO for
    writing, so a reader stuck on one gets EOF) instead of hanging the suite."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(WATCHDOG_S)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(WATCHDOG_S)
        pytest.fail(f"blocked for {WATCHDOG_S} s (a special file was opened?)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def ctx_at(root: Path, roots: tuple[Path, ...] = (), verify: str = "size") -> OpContext:
    root.mkdir(parents=True, exist_ok=True)
    return OpContext(root=root, progress=Progress(), workers=4, verify=verify, allowed_roots=roots)


def random_folder(rng: random.Random, top: Path) -> Path:
    """An existing folder of ``top`` or a new one up to three levels below it."""
    folder = top
    for _ in range(rng.randint(0, 3)):
        subs = [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()]
        if subs and rng.random() < 0.6:
            folder = rng.choice(subs)
        else:
            folder = folder / f"d{rng.randrange(1000)}"
            folder.mkdir(exist_ok=True)
    return folder


def make_special(kind: str, path: Path) -> Path:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        # Bound through its folder's descriptor: a deep path can be past AF_UNIX's 107
        # bytes (pytest-xdist's temporary folders are longer than pytest's).
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.bind(f"/proc/self/fd/{folder}/{path.name}")
        finally:
            os.close(folder)
    elif kind == "chr":
        os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's numbers
    else:
        os.mknod(path, stat.S_IFBLK | 0o644, os.makedev(7, 250))
    return path


SPECIAL_KINDS = ["fifo", "socket"] + (["chr", "blk"] if os.geteuid() == 0 else [])


def plant_specials(rng: random.Random, top: Path) -> tuple[list[Path], list[Path]]:
    """Each special kind at a random depth, and a link to one of them elsewhere."""
    planted = [
        make_special(kind, random_folder(rng, top) / f"special-{kind}") for kind in SPECIAL_KINDS
    ]
    link = random_folder(rng, top) / "link-to-special"
    link.symlink_to(rng.choice(planted))
    fifos = [p for p in planted if p.name.endswith("fifo")]
    return [*planted, link], fifos


def regular_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 of each regular file (links followed only to files)."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            if stat.S_ISREG(path.stat().st_mode):
                out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def no_special_under(root: Path) -> bool:
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            mode = os.lstat(Path(dirpath) / name).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                return False
            if stat.S_ISLNK(mode) and os.path.exists(Path(dirpath) / name):
                target = os.stat(Path(dirpath) / name).st_mode
                if not (stat.S_ISREG(target) or stat.S_ISDIR(target)):
                    return False
    return True


def walks(src: Path, root: Path, special: str) -> dict[str, Callable[[], Any]]:
    """Every walk of ``src``, each into its own destination under ``root``."""
    check = CheckContext()
    return (
        {
            "copy check": lambda: copy.check(CopyStep(src=str(src), special=special), check),
            "copy": lambda: copy.run(CopyStep(src=str(src), dst="copy", special=special), ctx),
            "tree link check": lambda: symlink.check(
                SymlinkStep(src=str(src), mode="tree", special=special), check
            ),
            "tree link": lambda: symlink.run(
                SymlinkStep(src=str(src), dst="links", mode="tree", special=special), ctx
            ),
            "unpack folder": lambda: unpack.run(UnpackStep(src=str(src), dst="unpacked"), ctx),
            "unpack folder as links": lambda: unpack.run(
                UnpackStep(src=str(src), dst="unpacked-links", mode="symlink"), ctx
            ),
        }
        if (ctx := ctx_at(root))
        else {}
    )


@pytest.mark.parametrize("seed", range(3))
def test_special_files_are_never_opened(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    src = write_tree(tmp_path / "src", n_files=40, seed=seed, max_size=3000)
    for _ in range(6):
        random_folder(rng, src)  # deeper folders for the specials to land in
    specials, fifos = plant_specials(rng, src)
    named = "|".join(str(p) for p in specials)

    for what, call in walks(src, tmp_path / "refuse", "refuse").items():
        with pytest.raises(SpecialSource, match=f"source ({named}) is ") as refused:
            within(call, fifos)
        assert "special to 'skip'" in refused.value.message, what

    # skip: every regular file arrives, no special file does, nothing blocks.
    skip = tmp_path / "skip"
    made = {}
    for what, call in walks(src, skip, "skip").items():
        if "unpack" not in what:  # unpack has no special field: it refuses
            made[what] = within(call, fifos)
    # What the ops say they left is what is there (a staging takes it as its size).
    assert made["copy"] == sum_sizes(str(skip / "copy"))
    assert made["tree link"] == sum_sizes(str(skip / "links"))
    assert regular_digest(skip / "copy") == regular_digest(src)
    assert regular_digest(skip / "links") == regular_digest(src)
    assert no_special_under(skip / "copy") and no_special_under(skip / "links")

    for deep in (False, True):
        within(lambda deep=deep: sources_fingerprint([CopyStep(src=str(src))], deep), fifos)
    assert within(lambda: delete_tree(src, threading.Event()), fifos)
    assert not src.exists()


# -- confinement ---------------------------------------------------------------------


def plant_chain(rng: random.Random, src: Path, places: list[Path]) -> Path:
    """A link at a random depth of ``src`` starting a chain of 1-5 links, each hop in
    a random place (the tree, elsewhere under the allowed root, outside it), written
    absolute or relative, ending at a file, a folder or nothing (dangling)."""
    end_place = rng.choice(places)
    end_place.mkdir(parents=True, exist_ok=True)
    end = end_place / f"end-{rng.randrange(10**9)}"
    kind = rng.choice(["file", "folder", "dangling"])
    if kind == "file":
        end.write_bytes(b"end")
    elif kind == "folder":
        end.mkdir()
        (end / "inner.bin").write_bytes(b"inner")
    current = end
    hops = rng.randint(1, 5)
    for hop in range(hops):
        where = random_folder(rng, src) if hop == hops - 1 else rng.choice(places)
        where.mkdir(parents=True, exist_ok=True)
        link = where / f"link-{rng.randrange(10**9)}"
        text = current if rng.random() < 0.5 else Path(os.path.relpath(current, where))
        link.symlink_to(text)
        current = link
    return current


def escaping_links(src: Path, allowed: Path) -> list[Path]:
    """The reference: every link in the tree (chain starts and hops that landed in it)
    whose resolution by the kernel (``realpath``) ends outside ``allowed``."""
    links = [Path(d) / n for d, dirs, files in os.walk(src) for n in dirs + files]
    return [
        p for p in links if p.is_symlink() and not os.path.realpath(p).startswith(f"{allowed}/")
    ]


@pytest.mark.parametrize("seed", range(8))
def test_links_at_any_depth_are_confined(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    src = write_tree(allowed / "src", n_files=20, seed=seed, max_size=2000)
    places = [src, allowed / "other", allowed / "other" / "deep", outside, outside / "deep"]
    for _ in range(rng.randint(1, 3)):
        plant_chain(rng, src, places)
    escaping = escaping_links(src, allowed)
    roots = (allowed,)
    check = CheckContext(allowed_roots=roots)
    ctx = ctx_at(tmp_path / "root", roots)
    calls = {
        "copy check": lambda: copy.check(CopyStep(src=str(src)), check),
        "copy": lambda: copy.run(CopyStep(src=str(src), dst="copy"), ctx),
        "tree link check": lambda: symlink.check(SymlinkStep(src=str(src), mode="tree"), check),
        "tree link": lambda: symlink.run(SymlinkStep(src=str(src), dst="ln", mode="tree"), ctx),
        "unpack folder": lambda: unpack.run(UnpackStep(src=str(src), dst="up"), ctx),
    }
    for call in calls.values():
        if escaping:
            named = "|".join(str(s) for s in escaping)
            with pytest.raises(UnsafePath, match=f"source ({named}) resolves to "):
                call()
        else:
            call()
    # A link named as the source itself (a single-file copy, a ``link`` step's
    # target) is confined the same way: the whole chain is resolved, not the name.
    for i, link in enumerate(p for p in escaping if p.exists()):
        for step, op in (
            (CopyStep(src=str(link), dst=f"one-{i}/"), copy),
            (SymlinkStep(src=str(link), dst=f"ln-{i}", mode="link"), symlink),
        ):
            with pytest.raises(UnsafePath, match=f"source {link} resolves to "):
                op.run(step, ctx)
        assert not os.path.lexists(ctx.root / f"ln-{i}")
    if not escaping:
        assert calls["copy"]() == sum_sizes(str(ctx.root / "copy"))  # again: complete
        assert calls["tree link"]() == sum_sizes(str(ctx.root / "ln"))
        # Nothing from outside was copied; every link made resolves inside the root.
        for path in (ctx.root / "copy").rglob("*"):
            if path.is_file():
                assert os.path.realpath(path).startswith(f"{ctx.root}/")
        for path in (ctx.root / "ln").rglob("*"):
            if path.is_symlink() and os.path.exists(path):
                assert os.path.realpath(path).startswith(f"{allowed}/")


def test_generated_chains_cover_both_outcomes() -> None:
    """The seeds above must exercise refusals and successes both (else they prove little)."""
    outcomes = set()
    for seed in range(8):
        rng = random.Random(seed)
        base = Path(f"/tmp/stager-chain-probe-{os.getpid()}-{seed}")
        try:
            allowed, outside = base / "allowed", base / "outside"
            src = write_tree(allowed / "src", n_files=20, seed=seed, max_size=2000)
            places = [src, allowed / "other", allowed / "other" / "deep", outside, outside / "deep"]
            for _ in range(rng.randint(1, 3)):
                plant_chain(rng, src, places)
            outcomes.add(bool(escaping_links(src, allowed)))
        finally:
            import shutil

            shutil.rmtree(base, ignore_errors=True)
    assert outcomes == {True, False}


# -- sources that change while they are copied ------------------------------------------


def _mutations(path: Path) -> dict[str, Callable[[], None]]:
    def rewrite() -> None:
        data = path.read_bytes()
        path.write_bytes(bytes(255 - b for b in data))  # same size, other bytes

    def replace() -> None:
        tmp = path.with_name(path.name + ".new")
        tmp.write_bytes(b"replaced " + path.read_bytes())
        os.replace(tmp, path)  # a new inode under the same name

    return {
        "rewrite": rewrite,
        "append": lambda: path.open("ab").write(b"more"),
        "truncate": lambda: os.truncate(path, max(0, path.stat().st_size // 2)),
        "touch": lambda: os.utime(path),
        "chmod": lambda: path.chmod(0o600),
        "replace": replace,
    }


def writer_during_copy(
    monkeypatch: pytest.MonkeyPatch, victim: Path, mutate: Callable[[], None], times: int, log: Path
) -> None:
    """A real writer, deterministic: right after the copy of ``victim``'s bytes (in
    whichever process copies it), change the source ``times`` times in all."""
    real_copy_chunk = file_copy.copy_chunk

    def copy_then_write(src_fd: int, dst_fd: int, offset: int, count: int) -> int:
        done = real_copy_chunk(src_fd, dst_fd, offset, count)
        if os.readlink(f"/proc/self/fd/{src_fd}") == str(victim):
            with open(log, "a+") as f:  # counted on disk: workers are other processes
                f.seek(0)
                if len(f.read()) < times:
                    f.write("x")
                    f.flush()
                    mutate()
        return done

    monkeypatch.setattr(file_copy, "copy_chunk", copy_then_write)


@pytest.mark.parametrize("seed", range(6))
def test_a_source_changing_during_the_copy_is_never_published_stale(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    src = write_tree(tmp_path / "src", n_files=30, seed=seed, max_size=5000)
    victim = rng.choice(sorted(p for p in src.rglob("*") if p.is_file()))
    kind, mutate = rng.choice(sorted(_mutations(victim).items()))
    single = rng.random() < 0.3  # the file alone, or inside a tree
    step = CopyStep(src=str(victim if single else src), dst="out/" if single else "out")

    # Once: the retry copies the file as it ends up.
    writer_during_copy(monkeypatch, victim, mutate, 1, tmp_path / "once.log")
    ctx = ctx_at(tmp_path / "once")
    made = copy.run(step, ctx)
    assert made == sum_sizes(str(ctx.root)), kind  # the file counted as it ended up
    copied = ctx.root / "out" / (victim.name if single else victim.relative_to(src))
    assert copied.read_bytes() == victim.read_bytes(), kind
    assert copied.stat().st_mtime_ns == victim.stat().st_mtime_ns, kind

    # Every time: a sentence naming the file, never a stale copy reported complete.
    writer_during_copy(monkeypatch, victim, _mutations(victim)[kind], 1000, tmp_path / "all.log")
    ctx = ctx_at(tmp_path / "always")
    with pytest.raises(VerifyFailed, match=f"source {victim} changed while it was copied"):
        copy.run(step, ctx)
