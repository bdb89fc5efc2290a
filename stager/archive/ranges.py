"""Byte ranges of growing files: a large file goes out while it is still being written.

Early parts (:mod:`stager.fanout.early`) carry whole files that the staging finished.
A staging that writes one large file (a download, the copy of an
``ILSVRC2012_img_train.tar``) finishes it only at its end, so without ranges that
file would go out after the staging, one whole send later. So the bytes of a file
still being written go out as they come, in *range parts*: plain tars whose every
member is a range of a file, a regular member named by the file's path, with pax
records

- ``STAGER.range.offset``: where its bytes go in the file (0: the file starts over);
- ``STAGER.range.from``: the path the receiver holds the file under, when the staging
  renamed it since its last range (a download's ``x.part`` that became ``x``);
- ``STAGER.range.last``: present on the range that completes the file, which then
  takes the member's mtime and the mode every published file has.

The sender keeps, for each file it sends in ranges, how many bytes went and their
sha256 (:class:`Growing`), by inode, so a rename does not lose it. A range continues
where the last one ended; only a sequential writer's bytes are taken on trust that
way, never a file's end: before a file's last range (once it settled, or once the
tree is ready), the bytes already sent are read again and must hash as they did, or
the file starts over from byte 0 (sent again). The manifest, written from the ready
tree, then decides on the receiving node as for every file (stager.ops.adopt).

A receiver writes each range at its offset of the file at that path (folders on the
way are never links, and neither is the file), and a range must continue exactly
what came before (no gap, no overlap); anything else fails the adoption, which
then stages from the source.
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
from stager.errors import VerifyFailed
from stager.fs.file_copy import remove
from stager.fs.manifest import Digests
from stager.fs.seal import FILE_MODE
from stager.manifest_format import HASH_CHUNK, Manifest

OFFSET = "STAGER.range.offset"
MOVED_FROM = "STAGER.range.from"
LAST = "STAGER.range.last"

# A file that a receiver holds only in part, until its last range: its owner may write.
PARTIAL_MODE = 0o600
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Growing:
    """A file sent in ranges: the path it had at its last range, the bytes sent, and
    the sha256 of those bytes as they were read to be sent."""

    path: str
    sent: int = 0
    sha: Any = field(default_factory=hashlib.sha256)


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


def reread(root: Path, path: str, growing: Growing) -> Any:
    """The sha256 (a hash object) of the first ``growing.sent`` bytes of the file at
    ``path`` under ``root`` (``growing``'s, maybe renamed since) as they are now; None
    if it holds fewer or is gone."""
    sha = hashlib.sha256()
    left = growing.sent
    try:
        with open(root / path, "rb", buffering=0) as stream:
            while left:
                chunk = stream.read(min(HASH_CHUNK, left))
                if not chunk:
                    return None
                sha.update(chunk)
                left -= len(chunk)
    except FileNotFoundError:
        return None
    return sha


def still_as_sent(now: Any, growing: Growing) -> bool:
    """Whether the bytes a file starts with ``now`` (:func:`reread`) are those sent."""
    return bool(now.digest() == growing.sha.digest())


def confirm(root: Path, path: str, growing: Growing) -> bool:
    """Before a file's last range: whether it still starts with what was sent of it.
    If so, ``growing`` goes on from the bytes as read now (the manifest's digest is
    the file's own, not taken on trust from the ranges); if not, it starts over."""
    now = reread(root, path, growing)
    if now is None or not still_as_sent(now, growing):
        growing.path, growing.sent, growing.sha = path, 0, hashlib.sha256()
        return False
    growing.sha = now
    return True


def next_range(
    root: Path, path: str, info: os.stat_result, growing: Growing | None, room: int, ends: bool
) -> Range | None:
    """The next range of the file at ``path`` (``info``), at most ``room`` bytes: where
    its ranges so far (``growing``) ended, or from byte 0 if the file is new, shrank,
    or (``ends``: it is complete) no longer starts with what was sent. None when it
    has nothing worth a range yet: a file still written sends only whole ``room``s."""
    if growing is not None and info.st_size < growing.sent:
        growing.sent, growing.sha = 0, hashlib.sha256()
    if growing is not None and ends and info.st_size - growing.sent <= room:
        confirm(root, path, growing)  # its last range: only if it starts as sent
    offset = growing.sent if growing is not None else 0
    length = min(info.st_size - offset, room)
    last = ends and offset + length == info.st_size
    if length <= 0 and not last:
        return None
    if not ends and length < room:
        return None
    moved = growing.path if growing is not None and growing.path != path and offset else None
    return Range(path, info, offset, length, moved, last)


def cut(files: list[tuple[str, os.stat_result, Growing]], room: int) -> list[RangePart]:
    """The rest of each file of a ready tree (``files``, with what went of each), in
    range parts of about ``room`` bytes; each file's last range ends it."""
    parts = [RangePart()]
    # A renamed file moves on the receivers before a file takes its old name.
    for path, info, growing in sorted(files, key=lambda found: found[2].path == found[0]):
        offset = growing.sent
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


def replaced(growing: dict[int, Growing], paths: set[str]) -> None:
    """Files were sent whole at ``paths``: one sent in ranges under such a path, if
    still there under another name, starts over (the receivers' copy is gone)."""
    for ino in [ino for ino, book in growing.items() if book.path in paths]:
        del growing[ino]


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
            data = _read(root / piece.path, piece.offset, piece.length)
            book.sha.update(data)
            book.sent += len(data)
            tar.addfile(_member(piece), io.BytesIO(data))
            done.append((piece, book))
    for piece, book in done:
        ino = piece.info.st_ino
        if piece.last:
            growing.pop(ino, None)
            digest = (book.sent, book.sha.hexdigest())
            manifest.files[piece.path] = digest
            sent.remember(piece.path, piece.info, digest)
        else:
            growing[ino] = book


def _read(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        data = os.pread(fd, length, offset) if length else b""
    finally:
        os.close(fd)
    if len(data) != length:
        raise VerifyFailed(f"{path} holds fewer bytes than when it was listed; it is sent later")
    return data


def _member(piece: Range) -> tarfile.TarInfo:
    member = tarfile.TarInfo(piece.path)
    member.size = piece.length
    member.mode = FILE_MODE
    member.mtime = int(piece.info.st_mtime)
    member.pax_headers[OFFSET] = str(piece.offset)
    if piece.moved_from is not None:
        member.pax_headers[MOVED_FROM] = piece.moved_from
    if piece.last:
        member.pax_headers[LAST] = "1"
    return member


# ---- a receiving node ---------------------------------------------------------------


def is_range_part(stream: BinaryIO) -> bool:
    """Whether the part open in ``stream`` is a part of ranges (its first member is one)."""
    with tar_members.open_tar(stream) as tar:
        first = tar.next()
    stream.seek(0)
    return first is not None and OFFSET in first.pax_headers


@dataclass
class Assembly:
    """A receiving node's files that came in ranges: the sha256 of each so far, by path."""

    hashes: dict[str, tuple[int, Any]] = field(default_factory=dict)


def assemble(
    stream: BinaryIO, tree: Path, assembly: Assembly, digests: Digests, label: str
) -> None:
    """Write each range of the part open in ``stream`` into ``tree``. A file its last
    range completed goes in ``digests`` with its sha256, taken from the bytes written."""
    top = os.open(tree, _DIR_FLAGS)
    try:
        with tar_members.open_tar(stream) as tar:
            for member, _ in tar_members.members(tar, stream):
                _place(tar, member, top, assembly, digests, label)
    finally:
        os.close(top)


def _place(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    top: int,
    assembly: Assembly,
    digests: Digests,
    label: str,
) -> None:
    path = _relative(member.name, label)
    try:
        offset = int(member.pax_headers[OFFSET])
    except (KeyError, ValueError):
        offset = -1
    if not member.isreg() or offset < 0:
        raise VerifyFailed(f"{label} mixes ranges with other members ({member.name!r})")
    folder, name = _folder(top, path, label)
    try:
        moved = member.pax_headers.get(MOVED_FROM)
        if moved is not None and offset:
            _move(top, _relative(moved, label), folder, name, assembly, path, label)
        if offset == 0:
            fd = _create(folder, name)
            assembly.hashes[path] = (0, hashlib.sha256())
        elif path in assembly.hashes:
            fd = os.open(name, _APPEND_FLAGS, dir_fd=folder)
        else:
            raise VerifyFailed(f"{label}: a range of {path!r} at byte {offset} came first")
        try:
            size = os.fstat(fd).st_size
            if size != offset or assembly.hashes[path][0] != offset:
                raise VerifyFailed(
                    f"{label}: the range of {path!r} at byte {offset} does not continue the "
                    f"{size} bytes that came before it"
                )
            sha = assembly.hashes[path][1]
            source = tar.extractfile(member)
            assert source is not None  # a regular member
            position = offset
            while chunk := source.read(HASH_CHUNK):
                sha.update(chunk)
                view = memoryview(chunk)
                while view:
                    written = os.pwrite(fd, view, position)
                    view, position = view[written:], position + written
            assembly.hashes[path] = (position, sha)
            if LAST in member.pax_headers:
                os.fchmod(fd, FILE_MODE)
                os.utime(fd, (member.mtime, member.mtime))
                digests.remember(path, os.fstat(fd), (position, sha.hexdigest()))
                del assembly.hashes[path]
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
    ):
        raise VerifyFailed(f"{label} has a range of a path no sender writes: {name!r}")
    return name


def _folder(top: int, path: str, label: str) -> tuple[int, str]:
    """The folder of ``path`` under ``top``, made where missing, never through a link;
    and the file's name in it."""
    *folders, name = path.split("/")
    fd = os.dup(top)
    try:
        for component in folders:
            try:
                inner = os.open(component, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(component, 0o755, dir_fd=fd)
                inner = os.open(component, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
    except OSError as exc:
        os.close(fd)
        raise VerifyFailed(f"{label}: the folder of {path!r} is not a folder here ({exc})") from exc
    return fd, name


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
    is there, never followed), and its hash with it."""
    old_folder, old_name = _folder(top, old, label)
    try:
        info = os.stat(old_name, dir_fd=old_folder, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode) or old not in assembly.hashes:
            raise VerifyFailed(f"{label}: {path!r} continues {old!r}, which came otherwise")
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
                remove(folder, name)  # a rename replaces a file or a link, not a folder
        except FileNotFoundError:
            pass
        os.rename(old_name, name, src_dir_fd=old_folder, dst_dir_fd=folder)
        assembly.hashes[path] = assembly.hashes.pop(old)
    finally:
        os.close(old_folder)
