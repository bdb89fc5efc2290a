"""Byte ranges of growing files: a large file goes out while it is still being written.

Early parts (:mod:`stager.fanout.early`) carry whole files the staging finished; a
staging that writes one large file finishes it only at its end. So the bytes of a
file still being written go out as they come, in *range parts*: plain tars whose every
member is a range of a file, named by its path, its mtime the file's then, with pax
records

- ``STAGER.range.offset``: where its bytes go in the file (0: the file starts over);
- ``STAGER.range.from``: the path the receiver holds the file under, when the staging
  renamed it since its last range (a download's ``x.part`` that became ``x``).

The sender keeps, for each file, the bytes sent and their sha256 (:class:`Growing`),
by inode. A range continues where the last ended, but a file's end is never taken on
trust: before its last range the bytes sent are read again and must hash as they did,
or the file starts over from byte 0. The manifest of the ready tree then decides on
the receiving node (stager.ops.adopt).

A receiver writes each range at its offset of the file at that path (no links on the
way), and it must continue exactly what came before, in the very file the earlier
ranges wrote; anything else fails the adoption, which then stages from the source.
Once every part came, the assembled files take the published mode.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from stager.archive import tar_members
from stager.archive.writer import PATH_MAX
from stager.core.errors import VerifyFailed
from stager.fs.file_copy import remove
from stager.fs.manifest import Digests, folder_of, identity, open_listed
from stager.fs.seal import FILE_MODE
from stager.wire.manifest_format import HASH_CHUNK, Manifest

OFFSET = "STAGER.range.offset"
MOVED_FROM = "STAGER.range.from"

# A file a receiver assembles from ranges, until every part came: its owner may write.
PARTIAL_MODE = 0o600
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Growing:
    """A file sent in ranges: the path it had at its last range, the bytes sent, and
    the sha256 of those bytes as they were read to be sent."""

    path: str
    sent: int = 0
    sha: Any = field(default_factory=hashlib.sha256)

    def start_over(self, path: str) -> None:
        """Its receivers' copy cannot be continued: it goes again from byte 0."""
        self.path, self.sent, self.sha = path, 0, hashlib.sha256()


@dataclass(frozen=True)
class Range:
    """Bytes ``offset`` .. ``offset + length`` of the file at ``path`` (``info``: its
    lstat before the read); ``last``: they end the file."""

    path: str
    info: os.stat_result
    offset: int
    length: int
    moved_from: str | None
    last: bool


@dataclass
class RangePart:
    """A part of ranges (as opposed to a part of whole entries, ``bundle.Entries``)."""

    ranges: list[Range] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(r.length for r in self.ranges)


# ---- the sending node ----------------------------------------------------------------


def reread(root: Path, path: str, info: os.stat_result, growing: Growing) -> Any:
    """The sha256 (a hash object) of the first ``growing.sent`` bytes of the file at
    ``path`` under ``root`` (``info``: ``growing``'s, maybe renamed since) as they are
    now; None if it holds fewer or is not that file any more."""
    sha = hashlib.sha256()
    left = growing.sent
    try:
        fd = open_listed(root, path, info)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb", buffering=0) as stream:
        while left:
            chunk = stream.read(min(HASH_CHUNK, left))
            if not chunk:
                return None
            sha.update(chunk)
            left -= len(chunk)
    return sha


def still_as_sent(now: Any, growing: Growing) -> bool:
    """Whether the bytes a file starts with ``now`` (:func:`reread`) are those sent."""
    return bool(now.digest() == growing.sha.digest())


def confirm(root: Path, path: str, info: os.stat_result, growing: Growing) -> bool:
    """Before a file's last range: whether it still starts with what was sent of it.
    If so, ``growing`` goes on from the bytes as read now (the manifest's digest is
    the file's own, not taken on trust from the ranges); if not, it starts over."""
    now = reread(root, path, info, growing)
    if now is None or not still_as_sent(now, growing):
        growing.start_over(path)
        return False
    growing.sha = now
    return True


def next_range(
    root: Path,
    path: str,
    info: os.stat_result,
    growing: Growing | None,
    room: int,
    ends: bool,
    held: dict[str, int],
) -> Range | None:
    """The next range of the file at ``path`` (``info``), at most ``room`` bytes: where
    its ranges (``growing``) ended, or from byte 0 if the file is new, shrank, was
    renamed onto another file's copy (``held``: inodes by path), or (``ends``: it is
    complete) no longer starts as sent. None while a file still written lacks a whole
    ``room``."""
    if growing is not None and (info.st_size < growing.sent or _onto_another(path, info, held)):
        growing.start_over(path)
    if growing is not None and ends and info.st_size - growing.sent <= room:
        confirm(root, path, info, growing)  # its last range: only if it starts as sent
    offset = growing.sent if growing is not None else 0
    length = min(info.st_size - offset, room)
    last = ends and offset + length == info.st_size
    if length <= 0 and not last:
        return None
    if not ends and length < room:
        return None
    moved = growing.path if growing is not None and growing.path != path and offset else None
    return Range(path, info, offset, length, moved, last)


def _onto_another(path: str, info: os.stat_result, held: dict[str, int]) -> bool:
    return held.get(path, info.st_ino) != info.st_ino


def booked_paths(growing: dict[int, Growing]) -> dict[str, int]:
    """Where the receivers hold each booked file's copy: its inode by that path."""
    return {book.path: ino for ino, book in growing.items()}


def cut(
    files: list[tuple[str, os.stat_result, Growing]], room: int, held: dict[str, int]
) -> list[RangePart]:
    """The rest of each file of a ready tree (``files``, with what went of each), in
    range parts of about ``room`` bytes, in the receivers' order (:func:`in_order`);
    each file's last range ends it. One renamed onto a path where the receivers hold
    another file's copy (``held``) starts over."""
    for path, info, growing in files:
        if growing.path != path and _onto_another(path, info, held):
            growing.start_over(path)
    parts = [RangePart()]
    for path, info, growing in sorted(files, key=lambda found: found[2].path == found[0]):
        offset = growing.sent  # renamed files first, as in_order puts them
        moved = growing.path if growing.path != path and offset else None  # first range
        while True:
            space = max(room - parts[-1].nbytes, 0)
            length = min(info.st_size - offset, space)
            last = offset + length == info.st_size
            parts[-1].ranges.append(Range(path, info, offset, length, moved, last))
            moved = None
            offset += length
            if last:
                break
            parts.append(RangePart())
    return [part for part in parts if part.ranges]


def replaced(
    growing: dict[int, Growing],
    paths: set[str],
    folders: set[str] = frozenset(),
    keep: int | None = None,
) -> None:
    """Something new went to ``paths`` (whole files, links, a file's range from byte
    0) and ``folders``: a file sent in ranges (but ``keep``) whose receivers' copy
    they replaced (:meth:`Assembly.forget`'s rule, the receivers' side of it) starts
    over, wherever it is now."""
    gone = [i for i, b in growing.items() if i != keep and _touches(b.path, paths, folders)]
    for ino in gone:
        del growing[ino]


def in_order(pieces: list[Range]) -> list[Range]:
    """The ranges of a part in the order the receivers take them: a file moves away
    from a path before another takes that path (a renamed file's range first)."""
    return sorted(pieces, key=lambda piece: piece.moved_from is None)


def pack(
    root: Path,
    out: Path,
    part: RangePart,
    growing: dict[int, Growing],
    manifest: Manifest,
    sent: Digests,
) -> None:
    """Write ``part`` to ``out`` (a tar of ranges). Once it is whole: what went of each
    file is booked in ``growing`` (by inode), and a file its last range ended is in
    ``manifest`` and ``sent`` instead."""
    done: list[tuple[Range, Growing]] = []
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for piece in part.ranges:
            before = growing.get(piece.info.st_ino)
            book = Growing(piece.path)
            if before is not None and piece.offset:
                book = Growing(piece.path, before.sent, before.sha.copy())
            data = _read(root, piece)
            book.sha.update(data)
            book.sent += len(data)
            tar.addfile(_member(piece), io.BytesIO(data))
            done.append((piece, book))
    for piece, book in done:
        ino = piece.info.st_ino
        if not piece.offset:  # the receivers' file at that path is this one from now on
            replaced(growing, {piece.path}, keep=ino)
        # Kept after its last range: should the file grow again (a download that
        # stalled longer than a file takes to settle), it goes on from there.
        growing[ino] = book
        if piece.last:
            digest = (book.sent, book.sha.hexdigest())
            manifest.files[piece.path] = digest
            sent.remember(piece.path, piece.info, digest)


def _read(root: Path, piece: Range) -> bytes:
    fd = open_listed(root, piece.path, piece.info)
    try:
        data = os.pread(fd, piece.length, piece.offset) if piece.length else b""
    finally:
        os.close(fd)
    if len(data) != piece.length:
        raise VerifyFailed(
            f"{root / piece.path} holds fewer bytes than when it was listed; it is sent later"
        )
    return data


def _member(piece: Range) -> tarfile.TarInfo:
    member = tarfile.TarInfo(piece.path)
    member.size = piece.length
    member.mode = FILE_MODE
    member.mtime = int(piece.info.st_mtime)
    member.pax_headers[OFFSET] = str(piece.offset)
    if piece.moved_from is not None:
        member.pax_headers[MOVED_FROM] = piece.moved_from
    return member


# ---- a receiving node ---------------------------------------------------------------


def is_range_part(stream: BinaryIO) -> bool:
    """Whether the part open in ``stream`` is a part of ranges (its first member is one).
    A part that is no tar at all is not: extracting it says what is wrong with it."""
    try:
        with tar_members.open_tar(stream) as tar:
            first = tar.next()
    except (tarfile.TarError, EOFError):
        first = None
    stream.seek(0)
    return first is not None and OFFSET in first.pax_headers


@dataclass
class _Assembling:
    size: int  # the bytes written so far
    sha: Any  # their sha256
    identity: tuple[int, int, int, int]  # the file's as the last range left it


@dataclass
class Assembly:
    """A receiving node's files that came in ranges, by path: what was written of each,
    and the file as it was left then. A range continues only that same file, so no
    ordinary part can put other bytes behind it unseen."""

    files: dict[str, _Assembling] = field(default_factory=dict)

    def forget(self, names: set[str], folders: set[str]) -> None:
        """An ordinary part wrote ``names`` (files, links) and ``folders``: no range
        continues a file at one of them, under one of ``names`` (its folder replaced),
        or above any of them (it became a folder), whatever the file there looks like
        now (extraction replaced it)."""
        for path in [p for p in self.files if _touches(p, names, folders)]:
            del self.files[path]


def _touches(path: str, names: set[str], folders: set[str] = frozenset()) -> bool:
    """Whether ``path`` is one of ``names`` or ``folders``, lies under one of
    ``names``, or holds one of either."""
    if path in folders:
        return True
    above = path.split("/")
    if any("/".join(above[:n]) in names for n in range(1, len(above) + 1)):
        return True
    inside = path + "/"
    return any(name.startswith(inside) for name in (*names, *folders))


def assemble(stream: BinaryIO, tree: Path, assembly: Assembly, label: str) -> None:
    """Write each range of the part open in ``stream`` (``label``) into ``tree``."""
    top = os.open(tree, _DIR_FLAGS)
    try:
        with tar_members.open_tar(stream) as tar:
            for member, _ in tar_members.members(tar, stream):
                _place(tar, member, top, assembly, label)
    except (tarfile.TarError, EOFError) as exc:
        raise VerifyFailed(f"{label} is damaged ({exc}); this node stages from the source") from exc
    finally:
        os.close(top)


def finish(tree: Path, assembly: Assembly, digests: Digests) -> None:
    """Every part came: each file assembled from ranges, still as its last range left
    it, takes the mode every published file has, and goes in ``digests`` with the
    sha256 of the bytes written (the manifest check then reads only what changed)."""
    top = os.open(tree, _DIR_FLAGS)
    try:
        for path, done in assembly.files.items():
            try:
                folder, name = _folder(top, path, "", create=False)
            except VerifyFailed:
                continue  # gone (a later part put something else there): checked as is
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=folder)
            except OSError:
                continue
            finally:
                os.close(folder)
            try:
                if identity(os.fstat(fd)) == done.identity:
                    os.fchmod(fd, FILE_MODE)
                    digests.remember(path, os.fstat(fd), (done.size, done.sha.hexdigest()))
            finally:
                os.close(fd)
    finally:
        os.close(top)


def _place(
    tar: tarfile.TarFile, member: tarfile.TarInfo, top: int, assembly: Assembly, label: str
) -> None:
    path = _relative(member.name, label)
    try:
        offset = int(member.pax_headers[OFFSET])
    except (KeyError, ValueError):
        offset = -1
    if not member.isreg() or member.sparse is not None or offset < 0:
        raise VerifyFailed(f"{label} mixes ranges with other members ({member.name!r})")
    folder, name = _folder(top, path, label)
    try:
        moved = member.pax_headers.get(MOVED_FROM)
        if moved is not None and offset:
            _move(top, _relative(moved, label), folder, name, assembly, path, label)
        if offset == 0:
            fd = _create(folder, name)
            assembly.files[path] = _Assembling(0, hashlib.sha256(), identity(os.fstat(fd)))
        elif path in assembly.files:
            fd = os.open(name, _APPEND_FLAGS, dir_fd=folder)
        else:
            raise VerifyFailed(f"{label}: a range of {path!r} at byte {offset} came first")
        try:
            done = assembly.files[path]
            if identity(os.fstat(fd)) != done.identity or done.size != offset:
                raise VerifyFailed(
                    f"{label}: the range of {path!r} at byte {offset} does not continue "
                    "the file its earlier ranges wrote"
                )
            source = tar.extractfile(member)
            assert source is not None  # a regular member
            while chunk := source.read(HASH_CHUNK):
                done.sha.update(chunk)
                view = memoryview(chunk)
                while view:
                    written = os.pwrite(fd, view, done.size)
                    view, done.size = view[written:], done.size + written
            os.utime(fd, (member.mtime, member.mtime))
            done.identity = identity(os.fstat(fd))
        finally:
            os.close(fd)
    except OSError as exc:
        raise VerifyFailed(f"{label}: cannot write the range of {path!r} ({exc})") from exc
    finally:
        os.close(folder)


def _relative(name: str, label: str) -> str:
    """A range's path as its sender writes it: relative, normal, no '..'."""
    if (
        not name
        or "\0" in name
        or name.startswith("/")
        or posixpath.normpath(name) != name
        or name == "."
        or ".." in name.split("/")
        or len(os.fsencode(name)) > PATH_MAX
    ):
        raise VerifyFailed(f"{label} has a range of a path no sender writes: {name[:200]!r}")
    return name


def _folder(top: int, path: str, label: str, create: bool = True) -> tuple[int, str]:
    """The folder of ``path`` under ``top``, never through a link (made where missing,
    with ``create``); and the file's name in it."""
    try:
        return folder_of(top, path, create)
    except OSError as exc:
        raise VerifyFailed(f"{label}: the folder of {path!r} is not a folder here ({exc})") from exc


def _create(folder: int, name: str) -> int:
    try:
        return os.open(name, _CREATE_FLAGS, PARTIAL_MODE, dir_fd=folder)
    except FileExistsError:
        remove(folder, name)  # whatever an earlier part put there, never followed
        return os.open(name, _CREATE_FLAGS, PARTIAL_MODE, dir_fd=folder)


def _move(
    top: int, old: str, folder: int, name: str, assembly: Assembly, path: str, label: str
) -> None:
    """The file a range continues was at ``old``: it moves to ``path`` (replacing what
    is there, never followed), and what was written of it with it."""
    old_folder, old_name = _folder(top, old, label, create=False)
    try:
        info = os.stat(old_name, dir_fd=old_folder, follow_symlinks=False)
        done = assembly.files.get(old)
        if done is None or identity(info) != done.identity:
            raise VerifyFailed(f"{label}: {path!r} continues {old!r}, which came otherwise")
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
                remove(folder, name)  # a rename replaces a file or a link, not a folder
        except FileNotFoundError:
            pass
        os.rename(old_name, name, src_dir_fd=old_folder, dst_dir_fd=folder)
        done.identity = identity(os.stat(name, dir_fd=folder, follow_symlinks=False))
        assembly.files[path] = assembly.files.pop(old)
    finally:
        os.close(old_folder)
