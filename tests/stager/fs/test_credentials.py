"""Reading sources with the asking user's rights (stager.fs.credentials): a staging
process reaches sources only through a gateway process that became the reader
(stager.rights), so the kernel refuses what that user may not read, whatever path
leads there (another process's ``/proc/<pid>/cwd`` included), while the staging
process keeps writing as root; and a staging to be shared refuses any source that
not everyone may read, an ACL included. Needs root (it takes other users' rights)."""

from __future__ import annotations

import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.core.errors import NotPublic, SourceUnreadable
from stager.fs import credentials
from stager.fs.credentials import Reader
from stager.fs.sources import Folder, Roots, Visitor, open_source, open_top, require_source, walk
from stager.rights.become import effective_capabilities

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="taking another user's rights needs root")

NOBODY = 65534
OTHER = 65533  # another user, and a group the reader is not in


@pytest.fixture
def reader() -> Iterator[Reader]:
    """This process reads sources as uid 65534 (``nobody``), as a staging process would."""
    reader = Reader(NOBODY, NOBODY, (NOBODY,))
    credentials.read_sources_as(reader)
    try:
        yield reader
    finally:
        _stop_reading()


def _stop_reading() -> None:
    gateway = credentials.access()
    credentials.read_sources_as(None)
    close = getattr(gateway, "close", None)
    if close is not None:
        close()
        os.waitpid(gateway.pid, 0)


def tree(root: Path) -> Path:
    """A world-readable tree with one private file and one private folder inside."""
    root.mkdir(mode=0o755)
    os.chmod(root.parent, 0o755)
    (root / "public.txt").write_text("everyone")
    (root / "secret.txt").write_text("owner only")
    os.chmod(root / "public.txt", 0o644)
    os.chmod(root / "secret.txt", 0o600)
    (root / "locked").mkdir(mode=0o700)
    (root / "locked" / "inner.txt").write_text("inner")
    os.chmod(root / "locked" / "inner.txt", 0o644)
    return root


def test_the_gateway_became_the_reader_entirely(shared_tmp: Path, reader: Reader) -> None:
    os.close(open_source(str(tree(shared_tmp / "src") / "public.txt")))
    gateway = credentials.access()
    gateway.realpath("/")  # answered after it closed what it opened for the last request
    status = Path(f"/proc/{gateway.pid}/status").read_text()
    assert effective_capabilities(gateway.pid) == 0
    assert f"Uid:\t{NOBODY}\t{NOBODY}\t{NOBODY}\t{NOBODY}" in status
    assert f"Groups:\t{NOBODY} " in status
    assert "NoNewPrivs:\t1" in status
    # Nothing of root's is open in it: only its channel (a socket) and /dev/null.
    held = [
        os.readlink(f"/proc/{gateway.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{gateway.pid}/fd")
    ]
    assert all(t.startswith("socket:") or t == "/dev/null" for t in held), held


def test_group_rights_follow_the_readers_groups(shared_tmp: Path) -> None:
    shared = shared_tmp / "group.txt"
    shared.write_text("members")
    os.chown(shared, 0, OTHER)
    os.chmod(shared, 0o640)
    os.chmod(shared_tmp, 0o755)
    try:
        credentials.read_sources_as(Reader(NOBODY, NOBODY, (NOBODY, OTHER)))
        os.close(open_source(str(shared)))
    finally:
        _stop_reading()
    try:
        credentials.read_sources_as(Reader(NOBODY, NOBODY, (NOBODY,)))
        with pytest.raises(PermissionError):
            open_source(str(shared))
    finally:
        _stop_reading()


def test_another_users_cwd_is_refused(shared_tmp: Path, reader: Reader) -> None:
    """Through ``/proc/<pid>/cwd`` a root thread with a switched fsuid reads past the
    folders above a process's working folder; a process that became the reader does not."""
    home = shared_tmp / "other-home"
    (home / "work").mkdir(parents=True)
    (home / "work" / "notes.txt").write_text("private notes")
    os.chmod(shared_tmp, 0o755)
    for path in (home, home / "work", home / "work" / "notes.txt"):
        os.chown(path, OTHER, OTHER)
    os.chmod(home, 0o700)
    sitting = subprocess.Popen(
        ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", "sleep", "30"],
        cwd=home / "work",
    )
    try:
        path = f"/proc/{sitting.pid}/cwd/notes.txt"
        assert Path(path).read_text() == "private notes"  # root may
        with pytest.raises(PermissionError):
            open_source(path)
    finally:
        sitting.kill()
        sitting.wait()


def test_every_way_to_a_private_file_is_refused_by_the_kernel(
    shared_tmp: Path, reader: Reader
) -> None:
    src = tree(shared_tmp / "src")
    (shared_tmp / "top-link").symlink_to(src / "secret.txt")
    (src / "deep-link").symlink_to("locked/inner.txt")
    assert os.read(open_source(str(src / "public.txt")), 100) == b"everyone"
    for path in (src / "secret.txt", shared_tmp / "top-link", src / "deep-link"):
        with pytest.raises(PermissionError):
            open_source(str(path))
        with pytest.raises(SourceUnreadable, match=str(path)):
            require_source(str(path))
    with pytest.raises(PermissionError):
        open_top(str(src / "locked"), Roots())


def test_a_walk_cannot_enter_a_folder_the_user_may_not(shared_tmp: Path, reader: Reader) -> None:
    src = tree(shared_tmp / "src")
    top = open_top(str(src), Roots())
    with pytest.raises(PermissionError):
        walk(top, Visitor())
    os.close(top.fd)


def test_the_process_still_writes_as_root_between_reads(shared_tmp: Path, reader: Reader) -> None:
    cache = shared_tmp / "cache"
    cache.mkdir(mode=0o700)
    os.close(open_source(str(tree(shared_tmp / "src") / "public.txt")))
    (cache / "written").write_text("by the service")
    assert (cache / "written").stat().st_uid == 0


def _acl(path: Path, denied_uid: int) -> None:
    """An access ACL denying one named user (everyone else may read)."""
    entries = [(1, 6, -1), (2, 0, denied_uid), (4, 4, -1), (0x10, 4, -1), (0x20, 4, -1)]
    blob = struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", tag, perm, ident & 0xFFFFFFFF) for tag, perm, ident in entries
    )
    os.setxattr(path, "system.posix_acl_access", blob)


class _Opener(Visitor):
    def file(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        os.close(open_source(folder.join(entry.name)))


@pytest.mark.parametrize(
    "narrowing",
    ["group-unreadable file", "owner-unreadable file", "unsearchable folder", "acl"],
)
def test_a_shared_staging_refuses_any_source_not_everyone_may_read(
    shared_tmp: Path, narrowing: str
) -> None:
    src = shared_tmp / "src"
    (src / "a" / "b").mkdir(parents=True)
    for folder in (shared_tmp, src, src / "a", src / "a" / "b"):
        os.chmod(folder, 0o755)
    for name in ("x.txt", "a/y.txt", "a/b/z.txt"):
        (src / name).write_text(name)
        os.chmod(src / name, 0o644)
    victim = {
        "group-unreadable file": src / "a" / "b" / "z.txt",
        "owner-unreadable file": src / "a" / "y.txt",
        "unsearchable folder": src / "a" / "b",
        "acl": src / "x.txt",
    }[narrowing]
    credentials.read_sources_as(Reader(NOBODY, NOBODY, (NOBODY,), public=True))
    try:
        top = open_top(str(src), Roots())
        walk(top, _Opener())  # everything readable by everyone: shared
        os.close(top.fd)
        mode = {"group-unreadable file": 0o604, "owner-unreadable file": 0o044}.get(narrowing)
        if narrowing == "unsearchable folder":
            os.chmod(victim, 0o754)
        elif narrowing == "acl":
            _acl(victim, denied_uid=12345)  # nobody may still read it; user 12345 may not
        else:
            os.chmod(victim, mode)
        top = open_top(str(src), Roots())
        with pytest.raises(NotPublic, match=str(victim)):
            walk(top, _Opener())
        os.close(top.fd)
    finally:
        _stop_reading()
