"""Sealing a finished tree (stager.fs.seal): read-only, measured as the one-process
walk measures it, inline or on workers; and every change made after the seal, of any
kind, at any depth, is found by the check, while an untouched tree passes."""

from __future__ import annotations

import os
import random
import shutil
import stat
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from stager.fs import seal
from stager.fs.sizes import sum_sizes


def generated_tree(root: Path, seed: int, files: int) -> None:
    rng = random.Random(seed)
    folders = [root]
    root.mkdir()
    for i in range(files):
        if rng.random() < 0.05:
            child = rng.choice(folders) / f"dir{i}"
            child.mkdir()
            folders.append(child)
            continue
        folder = rng.choice(folders)
        kind = rng.random()
        if kind < 0.8:
            (folder / f"f{i}").write_bytes(b"x" * rng.randrange(0, 3000))
            if rng.random() < 0.1:  # set-id and writable bits a source may carry
                os.chmod(folder / f"f{i}", 0o6777)
        elif kind < 0.9:
            target = rng.choice(["/etc/hostname", "../nowhere", str(rng.choice(folders))])
            os.symlink(target, folder / f"l{i}")
        else:
            os.mkfifo(folder / f"p{i}")


def published(tmp_path: Path, seed: int = 1, files: int = 300) -> tuple[Path, seal.Seal]:
    """A tree sealed in an attempt folder, renamed into data/ and its top protected, as
    a staging and the registry's publish do it."""
    tree = tmp_path / "partial" / "tree"
    tree.parent.mkdir()
    generated_tree(tree, seed, files)
    sealed = seal.seal_tree(tree, workers=2)
    final = tmp_path / "data" / "key"
    final.parent.mkdir()
    os.rename(tree, final)
    seal.protect_top(final)
    return final, sealed


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("parallel_after", [10**9, 50], ids=["inline", "workers"])
def test_the_seal_measures_as_the_single_process_walk_and_leaves_all_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, parallel_after: int
) -> None:
    monkeypatch.setattr(seal, "PARALLEL_AFTER", parallel_after)
    monkeypatch.setattr(seal, "BATCH", 16)
    generated_tree(tmp_path / "tree", seed, files=600)
    expected = sum_sizes(str(tmp_path / "tree"))
    assert expected > 0
    sealed = seal.seal_tree(tmp_path / "tree", workers=2)
    assert sealed.nbytes == expected
    entries = 0
    for dirpath, dirnames, filenames in os.walk(tmp_path / "tree"):
        for name in dirnames + filenames:
            entries += 1
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                assert stat.S_IMODE(st.st_mode) == seal.FILE_MODE, name
            elif stat.S_ISDIR(st.st_mode):
                assert stat.S_IMODE(st.st_mode) == seal.DIR_MODE, name
    assert sealed.entries == entries
    assert seal.check_seal(tmp_path / "tree", sealed) is not None  # top not protected yet


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_an_untouched_published_tree_passes_its_check(tmp_path: Path, seed: int) -> None:
    final, sealed = published(tmp_path, seed)
    assert seal.check_seal(final, sealed) is None
    assert seal.check_seal(final, sealed) is None  # checking changes nothing


def _files(final: Path) -> list[Path]:
    return sorted(p for p in final.rglob("*") if p.is_file() and not p.is_symlink())


def _dirs(final: Path) -> list[Path]:
    return sorted(p for p in final.rglob("*") if p.is_dir() and not p.is_symlink())


def _rewrite_same_size_keeping_mtime(final: Path, rng: random.Random) -> None:
    victim = rng.choice(_files(final))
    st = victim.stat()
    os.chmod(victim, 0o644)
    victim.write_bytes(b"y" * st.st_size)
    os.chmod(victim, 0o444)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # hide it from an mtime check


def _append(final: Path, rng: random.Random) -> None:
    victim = rng.choice(_files(final))
    os.chmod(victim, 0o644)
    with open(victim, "ab") as out:
        out.write(b"!")


def _chmod_writable(final: Path, rng: random.Random) -> None:
    os.chmod(rng.choice(_files(final)), 0o666)


def _add_file(final: Path, rng: random.Random) -> None:
    folder = rng.choice([final, *_dirs(final)])
    os.chmod(folder, 0o755)
    (folder / "planted").write_bytes(b"")
    os.chmod(folder, 0o555)


def _remove_file(final: Path, rng: random.Random) -> None:
    victim = rng.choice(_files(final))
    os.chmod(victim.parent, 0o755)
    victim.unlink()
    os.chmod(victim.parent, 0o555)


def _rename_file(final: Path, rng: random.Random) -> None:
    victim = rng.choice(_files(final))
    os.chmod(victim.parent, 0o755)
    victim.rename(victim.with_name(victim.name + ".moved"))
    os.chmod(victim.parent, 0o555)


def _swap_for_a_link(final: Path, rng: random.Random) -> None:
    victim = rng.choice(_files(final))
    os.chmod(victim.parent, 0o755)
    victim.unlink()
    victim.symlink_to("/etc/passwd")
    os.chmod(victim.parent, 0o555)


def _hard_link_out(final: Path, rng: random.Random) -> None:
    victim = rng.choice(_files(final))
    os.link(victim, final.parent / "outside-link")  # its inode's ctime moves


CHANGES: list[Callable[[Path, random.Random], None]] = [
    _rewrite_same_size_keeping_mtime,
    _append,
    _chmod_writable,
    _add_file,
    _remove_file,
    _rename_file,
    _swap_for_a_link,
    _hard_link_out,
]


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: c.__name__.strip("_"))
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("parallel_after", [10**9, 20], ids=["inline", "workers"])
def test_every_kind_of_change_after_the_seal_is_found(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[Path, random.Random], None],
    seed: int,
    parallel_after: int,
) -> None:
    final, sealed = published(tmp_path, seed)
    monkeypatch.setattr(seal, "PARALLEL_AFTER", parallel_after)
    monkeypatch.setattr(seal, "BATCH", 8)
    assert seal.check_seal(final, sealed, workers=2) is None
    change(final, random.Random(seed))
    found = seal.check_seal(final, sealed, workers=2)
    assert found is not None, change.__name__


def test_a_swapped_top_folder_is_found(tmp_path: Path) -> None:
    final, sealed = published(tmp_path)
    os.rename(final, tmp_path / "elsewhere")
    os.mkdir(final)
    seal.protect_top(final)
    assert seal.check_seal(final, sealed) is not None
    os.rmdir(final)
    assert "is gone" in (seal.check_seal(final, sealed) or "")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
@pytest.mark.skipif(os.geteuid() != 0, reason="a private top is made for another user by root")
def test_a_private_copys_top_is_its_users_alone_to_read_and_nobodys_to_change(
    shared_tmp: Path,
) -> None:
    """The top stays the service's (so root never deletes a tree its user could write),
    with an ACL that lets its user in and nobody else; any change to it is seen."""
    final, sealed = published(shared_tmp)
    os.chmod(final.parent, 0o755)
    seal.protect_top(final, owner=65534)
    st = final.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o550)
    assert seal.check_seal(final, sealed, owner=65534) is None
    assert seal.check_seal(final, sealed) is not None  # not shared: a shared top is 0555
    assert seal.check_seal(final, sealed, owner=65533) is not None  # another user's ACL
    as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    other = ["setpriv", "--reuid=65533", "--regid=65533", "--clear-groups"]
    assert subprocess.run([*as_user, "ls", str(final)], capture_output=True).returncode == 0
    assert subprocess.run([*other, "ls", str(final)], capture_output=True).returncode != 0
    chmod = subprocess.run([*as_user, "chmod", "0700", str(final)], capture_output=True)
    assert chmod.returncode != 0  # not theirs to change
    os.chmod(final, 0o750)  # root can: it is seen
    assert "owner, mode or ACL" in (seal.check_seal(final, sealed, owner=65534) or "")


@pytest.mark.parametrize("op", ["copy", "extract"])
@pytest.mark.parametrize("seed", [1, 2])
def test_an_ops_own_count_seals_as_the_full_walk_does(tmp_path: Path, op: str, seed: int) -> None:
    """A one-op staging into a fresh tree is sealed from a listing and the op's count of
    its bytes (the op table's read_only_files): the same seal a full walk gives, and
    nothing left to make read-only."""
    from stager.ops import table
    from stager.ops.base import OpContext
    from stager.wire.progress import Progress
    from tests.trees import make_tar

    source = tmp_path / "source"
    generated_tree(source, seed, files=400)
    for fifo in [p for p in source.rglob("p*") if p.is_fifo()]:
        fifo.unlink()  # a copy refuses them; sealing them is tested above
    if op == "extract":  # an archive's links to absolute paths are refused
        for link in [p for p in source.rglob("*") if p.is_symlink()]:
            if os.readlink(link).startswith("/"):
                link.unlink()
    for path in source.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o644)
    ops = table.load(())
    if op == "copy":
        step = {"op": "copy", "src": str(source)}
    else:
        step = {"op": "extract", "src": str(make_tar(source, tmp_path / "s.tar"))}
    [typed] = ops.validate_steps([step])
    assert ops.op_of(typed).read_only_files
    tree = tmp_path / "tree"
    tree.mkdir()
    made = ops.run(typed, OpContext(root=tree, progress=Progress(), workers=2))
    files = [p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()]
    assert files and {stat.S_IMODE(p.stat().st_mode) for p in files} == {seal.FILE_MODE}
    if made is None:  # an op that does not count its bytes is sealed by the full walk
        return
    listed = seal.seal_listed(tree, made)
    full = seal.seal_tree(tree, workers=2)
    assert (listed.entries, listed.nbytes) == (full.entries, full.nbytes)


@pytest.mark.parametrize("dst", [".", "x/y"])
def test_a_tree_gnu_tars_wrote_whole_is_sealed_from_what_it_knows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dst: str
) -> None:
    """A plain tar's files all written by GNU tars (stager.archive.split_tar): the op
    knows every entry and folder, the seal lists nothing, and it is the full walk's
    seal, every folder read-only."""
    from stager.archive import split_tar
    from stager.ops import table
    from stager.ops.base import OpContext
    from stager.wire.progress import Progress

    monkeypatch.setattr(split_tar, "SPLIT_MIN_BYTES", 0)
    source = tmp_path / "source"
    for i in range(5):
        (source / f"d{i}" / "sub").mkdir(parents=True)
        for j in range(4):
            (source / f"d{i}" / ("sub" if j % 2 else "") / f"f{j}").write_bytes(b"x" * (i * j))
    archive = tmp_path / "s.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(source), "."], check=True)
    ops = table.load(())
    step = {"op": "extract", "src": str(archive), "dst": dst}
    [typed] = ops.validate_steps([step])
    tree = tmp_path / "tree"
    tree.mkdir()
    made = ops.run(typed, OpContext(root=tree, progress=Progress(), workers=2))
    assert isinstance(made, seal.KnownTree)
    listing = monkeypatch.context()
    with listing as patch:
        patch.setattr(seal, "_list_tree", None)  # nothing is listed
        listed = seal.seal_listed(tree, made)
    folders = [p for p in tree.rglob("*") if p.is_dir()]
    assert folders and {stat.S_IMODE(p.stat().st_mode) for p in folders} == {seal.DIR_MODE}
    full = seal.seal_tree(tree, workers=2)
    assert (listed.entries, listed.nbytes) == (full.entries, full.nbytes)


def changes_after_publish(folder: Path, rounds: int, pause: float = 0.0) -> list[float]:
    """Seal a tree ``rounds`` times, each right after a change (the staging's last),
    then change it at once, as anyone may once it is published: a file's mode, a new
    file renamed in its folder. Every such change must be stamped after the seal.
    Returns how long each seal took, in ms."""
    tree = folder / "tree"
    tree.mkdir()
    victim = tree / "f"
    victim.write_bytes(b"x")
    took = []
    for i in range(rounds):
        os.chmod(victim, 0o444 if i % 2 else 0o400)  # the staging's last change
        start = time.perf_counter()
        sealed = seal.seal_listed(tree, seal.KnownTree(nbytes=1, entries=1, folders=()))
        took.append((time.perf_counter() - start) * 1000)
        os.chmod(victim, 0o400 if i % 2 else 0o444)
        (tree / f"n{i}").write_bytes(b"")
        os.rename(tree / f"n{i}", tree / f"m{i}")
        for path in (victim, tree / f"m{i}", tree):
            assert os.stat(path).st_ctime_ns > sealed.sealed_ns, (i, path.name)
        time.sleep(pause)
    return took


def test_every_change_after_the_seal_is_stamped_after_it(tmp_path: Path) -> None:
    """A seal is handed out once any later change is stamped after it, so the registry
    publishes at once (at once too where the kernel stamps from the fine clock). The
    same changes made with no wait after a seal taken from the clock are mostly
    stamped at or before it where the coarse clock lags the fine one: what the check
    guards; the printed count says how often here."""
    took = changes_after_publish(tmp_path, rounds=300)
    victim, unnoticed = tmp_path / "tree" / "f", 0
    for i in range(300):
        os.chmod(victim, 0o444 if i % 2 else 0o400)
        sealed_ns = time.time_ns()
        os.chmod(victim, 0o400 if i % 2 else 0o444)
        unnoticed += os.stat(victim).st_ctime_ns <= sealed_ns
    print(
        f"seal of a known tree: median {statistics.median(took):.2f} ms, max "
        f"{max(took):.2f}; changes with no wait unnoticed: {unnoticed}/300"
    )


def test_a_filesystem_that_stamps_whole_seconds_is_published_after_its_second(
    tmp_path: Path,
) -> None:
    """ext4 with 128-byte inodes keeps no nanoseconds: a change a tick after the seal
    is still stamped at or before it, until the second turns. The rule heeds the
    probe's stamp, truncated as the tree's are, not the clock."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 to mount an ext4 image")
    image, mount = tmp_path / "ext4.img", tmp_path / "ext4"
    mount.mkdir()
    with open(image, "wb") as out:
        out.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", str(image)], check=True)
    done = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=False)
    if done.returncode != 0:
        pytest.skip("cannot mount a loop device here")
    try:
        (mount / "f").write_bytes(b"")
        assert os.stat(mount / "f").st_ctime_ns % 1_000_000_000 == 0, "not whole seconds"
        changes_after_publish(mount, rounds=3, pause=0.3)
    finally:
        subprocess.run(["umount", str(mount)], check=False)
