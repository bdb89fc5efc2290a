"""Members of a tar archive, read quickly and checked to its end.

``tarfile`` turns a header into a ``TarInfo`` in about 12 us, and the header loop is
the one part of an extraction that cannot run in parallel. So the commonest header (a
regular file or folder in ustar or GNU format, octal fields, no extensions) is read
here in about 3 us, taking only name, type, mode, size, mtime. Everything else is left
to ``tarfile`` at that offset, so the two never disagree on where a member starts
(tests/stager/archive/test_tar_members.py holds them to the same results).

``tarfile`` stops quietly at a header it cannot read or at the end of the data, so a
tar cut short between two members would extract "successfully"; as with GNU tar, the
members here must be followed by an end-of-archive (zero) block.
"""

from __future__ import annotations

import os
import struct
import tarfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import BinaryIO

BLOCK = tarfile.BLOCKSIZE
ZERO_BLOCK = bytes(BLOCK)
MAGICS = (b"ustar\x0000", tarfile.GNU_MAGIC)
POSIX_MAGIC = b"ustar\x00"  # any version: only these headers have a name prefix
_FAST_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE)


class TarInfo(tarfile.TarInfo):
    """tarfile's member, less one misreading: only a POSIX ustar header has a name
    prefix at bytes 345-500. In a GNU header (magic "ustar  ") those bytes hold the
    atime, ctime and sparse map, which incremental dumps (``tar -g``) fill in and
    tarfile glued in front of the name."""

    @classmethod
    def frombuf(cls, buf: bytes, encoding: str, errors: str) -> TarInfo:  # type: ignore[override]
        member = super().frombuf(buf, encoding, errors)
        if buf[257:263] != POSIX_MAGIC and member.type not in tarfile.GNU_TYPES:
            name = _text(buf[0:100], encoding, errors)
            member.name = name.rstrip("/") if member.isdir() else name
        return member


def open_tar(fileobj: BinaryIO) -> tarfile.TarFile:
    """``tarfile`` in random-access mode over ``fileobj``, reading names right."""
    return tarfile.open(fileobj=fileobj, mode="r:", tarinfo=TarInfo)


def members(
    tar: tarfile.TarFile,
    headers: BinaryIO,
    check: Callable[[], None] = lambda: None,
    blocks: Blocks | None = None,
    start: int = 0,
) -> Iterator[tuple[tarfile.TarInfo, int]]:
    """Yield ``(member, offset of the next header)`` for every member of ``tar`` from
    the header at ``start``; ``tarfile.ReadError`` if it ends without its end marker.

    ``headers`` is the seekable file ``tar`` reads (both readers share its buffer);
    ``blocks``, for a plain tar, serves this module's own headers from larger windows.
    ``check`` runs before each read of headers (cancellation; an index build waits
    there for its copy): before each member, or each window of ``blocks``.
    """
    check()
    member = tar.next()  # tarfile has read the first header already, when it opened
    offset = tar.offset
    encoding, errors, dirtype = tar.encoding, tar.errors, tarfile.DIRTYPE
    if start:
        # Read as the loop below reads a header after the first: a plain one here, so
        # that a field only tarfile reads (a uid) fails neither way or both.
        window, at = blocks.window(start) if blocks else _read_block(headers, start)
        member = fast_header(window, start, encoding, errors, at) if not tar.pax_headers else None
        if member is None:
            member, offset = _next_by_tarfile(tar, window[at : at + BLOCK], start)
        else:
            offset = start + BLOCK
            offset += 0 if member.type == dirtype else (member.size + 511) & ~511
    while member is not None:
        yield member, offset
        if blocks is not None:  # the header read in place, in its window
            window, at = blocks.window(offset, check)
        else:
            check()
            window, at = _read_block(headers, offset)
        if not tar.pax_headers:  # global pax headers change every later member: tarfile's job
            member = fast_header(window, offset, encoding, errors, at)
            if member is not None:
                # The next header follows the data, padded to whole blocks; a folder has none.
                offset += BLOCK if member.type == dirtype else BLOCK + ((member.size + 511) & ~511)
                continue
        tar.members.clear()  # tarfile keeps every header; 2.7M of them would be GBs
        member, offset = _next_by_tarfile(tar, window[at : at + BLOCK], offset)
    _require_end(headers, offset)


class Blocks:
    """Header blocks of a plain tar at ``base`` of ``fd``, each served from a window of
    ``_WINDOW`` bytes read with one ``pread``: with small members a window holds dozens
    of headers, and a slice of it is cheaper than a buffered file's seek and read."""

    _WINDOW = 64 << 10

    def __init__(self, fd: int, base: int, length: int) -> None:
        self._fd, self._base, self._length = fd, base, length
        self._data = b""
        self._start = 0

    def window(
        self, offset: int, before_read: Callable[[], None] = lambda: None
    ) -> tuple[bytes, int]:
        """The window that holds the block at ``offset`` of the archive (unless that is
        shorter, at its end), and where the block starts in it; ``before_read`` runs
        before a new window is read."""
        at = offset - self._start
        if at < 0 or at + BLOCK > len(self._data):
            before_read()
            count = max(0, min(self._WINDOW, self._length - offset))
            self._data, self._start, at = os.pread(self._fd, count, self._base + offset), offset, 0
        return self._data, at

    def peek(self, offset: int, count: int) -> bytes | None:
        """The ``count`` bytes at ``offset`` of the archive if the window read for the
        headers holds them (a small member's data follows its header), else None."""
        at = offset - self._start
        if at < 0 or at + count > len(self._data):
            return None
        return self._data[at : at + count]


def _read_block(headers: BinaryIO, offset: int) -> tuple[bytes, int]:
    """The block at ``offset``, as a window of its own (Blocks.window)."""
    headers.seek(offset)
    return headers.read(BLOCK), 0


def _next_by_tarfile(
    tar: tarfile.TarFile, block: bytes, offset: int
) -> tuple[tarfile.TarInfo | None, int]:
    if block == ZERO_BLOCK:
        return None, offset
    # ``TarFile.offset`` is where tarfile reads its next header from.
    tar.offset = offset
    member = tar.next()
    return member, tar.offset if member is not None else offset


class Member:
    """What extraction reads of a plain file or folder header: the fields of a
    ``tarfile.TarInfo`` it uses, made in a fraction of the time."""

    __slots__ = ("name", "type", "mode", "size", "mtime", "offset", "offset_data")
    sparse = None
    linkname = ""
    pax_headers: Mapping[str, str] = MappingProxyType({})  # a header with none

    def isreg(self) -> bool:
        return self.type in tarfile.REGULAR_TYPES

    def isdir(self) -> bool:
        return self.type == tarfile.DIRTYPE

    def issym(self) -> bool:
        return False

    def islnk(self) -> bool:
        return False


# A plain header's fields in one unpack: name, mode, size, mtime, checksum, type, magic
# and version, prefix (uid, gid, link name, user and group names, devices skipped).
_FIELDS = struct.Struct("100s8s16x12s12s8sc100x8s80x155s")


def fast_header(
    block: bytes, offset: int, encoding: str, errors: str, at: int = 0
) -> Member | None:
    """The member a plain file or directory header describes (at ``at`` of ``block``,
    a window of the archive), or None for tarfile."""
    if len(block) < at + BLOCK:
        return None
    name, mode, size, mtime, chksum, kind, magic, prefix = _FIELDS.unpack_from(block, at)
    if kind not in _FAST_TYPES or magic not in MAGICS or size[0] & 0x80:
        return None  # (a base-256 size: a member of 8 GiB or more)
    try:  # the common layout: zero-padded digits, NUL- or space-terminated
        numbers = (
            int(chksum.replace(b"\0", b" "), 8),
            int(mode.replace(b"\0", b" "), 8),
            int(size.replace(b"\0", b" "), 8),
            int(mtime.replace(b"\0", b" "), 8),
        )
    except ValueError:
        try:
            numbers = (_octal(chksum), _octal(mode), _octal(size), _octal(mtime))
        except ValueError:
            return None
    if min(numbers) < 0 or not checksum_ok(block, numbers[0], at):
        return None  # maybe a signed-char checksum (old Sun tars): tarfile decides
    # Name rules as tarfile's ``frombuf``: V7 directories end in "/", directory names
    # lose trailing slashes, and a ustar prefix comes in front.
    name = name.split(b"\0", 1)[0].decode(encoding, errors)
    if kind == tarfile.AREGTYPE and name.endswith("/"):
        kind = tarfile.DIRTYPE
    if kind == tarfile.DIRTYPE:
        name = name.rstrip("/")
    if prefix[0] and magic[:6] == POSIX_MAGIC:  # GNU headers have no prefix: see TarInfo
        name = f"{_text(prefix, encoding, errors)}/{name}"
    member = Member()
    member.name, member.type, member.offset, member.offset_data = name, kind, offset, offset + BLOCK
    _, member.mode, member.size, member.mtime = numbers
    return member


def _octal(field: bytes) -> int:
    if field[0] & 0x80:
        raise ValueError("base-256 number")
    try:
        # The common layout (zero-padded digits, NUL- or space-terminated) in one call;
        # int() strips the padding that replace() made of the NULs.
        return int(field.replace(b"\0", b" "), 8)
    except ValueError:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


# The header checksum is the sum of its 512 bytes with the checksum field read as 8
# spaces. Summing bytes in Python costs ~4 us a header; adler32's low half is
# (1 + the byte sum) mod 65521, and the sum of 256 bytes is at most 65280: over each
# half of the block it is the exact sum, at C speed.
def checksum_ok(block: bytes, chksum: int, at: int = 0) -> bool:
    """Whether the header at ``at`` of ``block`` has the checksum ``chksum``."""
    adler = zlib.adler32
    total = (adler(block[at : at + 256]) & 0xFFFF) + (adler(block[at + 256 : at + BLOCK]) & 0xFFFF)
    stored = adler(block[at + 148 : at + 156]) & 0xFFFF  # the checksum field's own bytes
    return total - stored + 8 * 32 - 1 == chksum  # (each adler32 low half: 1 + the sum)


def _text(field: bytes, encoding: str, errors: str) -> str:
    return field.split(b"\0", 1)[0].decode(encoding, errors)


def _require_end(headers: BinaryIO, offset: int) -> None:
    headers.seek(offset)
    block = headers.read(BLOCK)
    if len(block) < BLOCK:
        raise tarfile.ReadError(
            f"the archive ends at byte {offset + len(block)} without its end-of-archive "
            "marker: it was cut short"
        )
    if block != ZERO_BLOCK:
        raise tarfile.ReadError(f"the header at byte {offset} is damaged")
