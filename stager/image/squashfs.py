"""A squashfs image written in one pass: each file as it arrives, the folders at the end.

What a user's own daemon mounts with ``squashfuse_ll`` (no FUSE reader of EROFS on
Debian 12). The format is squashfs 4.0, as the kernel's
``Documentation/filesystems/squashfs.rst`` and its ``squashfs_fs.h`` lay it out,
written so that nothing needs a compressor:

* The superblock (96 bytes) in the first 4 KiB; file data from 4 KiB on. A file's
  data is one run of 128 KiB blocks, each stored as it is (its size word's
  "uncompressed" bit set), the last one just shorter: no fragments. A block needs no
  alignment, so a plain tar's member can be read in place: an *embedded* build copies
  the whole tar to 4 KiB in one ``copy_file_range`` (:mod:`stager.image.index`) and
  each file points at its data inside that copy; anything else is appended after it.
  A whole block of zeros in a streamed file (a sparse member's hole) is a sparse
  block: nothing stored.
* The inode table, the directory table and the id table follow the data, as
  uncompressed metadata blocks (8 KiB of payload behind a 2-byte header whose top bit
  says "uncompressed"); the superblock's flags say so (NOI, NOD, NOF, NO_FRAGMENTS,
  no xattrs). An inode or a listing may run over into the next metadata block.
* Files' inodes are written as the files arrive, into a spill file beside the image
  (copied in at the end); a hard link is one inode with its count of names (an
  extended file inode, written once every name is known: the first inode of that
  file is left unused). Folders are written last, children before parents (a
  parent's listing names its children's inodes): each listing sorted by name bytes,
  split into headers of at most 256 entries that share one inode metadata block and
  an inode number within 16 bits of each other, and a folder whose listing runs past
  one metadata block gets an index (the first name of each block's first header),
  which the kernel and squashfuse use to find a name without reading the whole
  listing.
* Files are 0444, folders 0555, symlinks 0777, owned by root (uid 0; the top folder
  the private user's, where asked), as the EROFS writer makes them. Inode numbers run
  from 1, the root first, with no gap (unsquashfs sizes a table by their count).

The names (folders, the spill of entries, hard links, a name given twice, symlinks
judged as the kernel resolves them) are :class:`stager.image.names.NameTable`'s.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

from stager.fs.fastcopy import copy_range
from stager.image.erofs import EMBEDDED_AT, Blob
from stager.image.names import (
    FT_DIR,
    FT_REG,
    FT_SYMLINK,
    NameTable,
    RangeFile,
    Reader,
    SortedRows,
    _Folder,
)

BLOCK = 128 << 10
_BLOCK_LOG = 17
_METADATA = 8192  # a metadata block's payload
_MAGIC = 0x73717368
_GZIP = 1  # named, never used: nothing is compressed
# Superblock flags: inodes, data, fragments stored as they are; no fragments; xattrs
# stored as they are, and none; ids stored as they are.
_FLAGS = 0x1 | 0x2 | 0x8 | 0x10 | 0x100 | 0x200 | 0x800
_UNCOMPRESSED_META = 0x8000
_UNCOMPRESSED_BLOCK = 1 << 24
_INVALID = 0xFFFF_FFFF_FFFF_FFFF
_NONE32 = 0xFFFF_FFFF  # no fragment, no xattr
DATA_AT = EMBEDDED_AT  # where file data starts (a plain tar's embedded copy)

# Inode types, and what a folder's entry calls each kind.
_DIR, _FILE, _SYMLINK, _LDIR, _LFILE = 1, 2, 3, 8, 9
_ENTRY_TYPE = {FT_DIR: _DIR, FT_REG: _FILE, FT_SYMLINK: _SYMLINK}

_SUPER = struct.Struct("<IIIIIHHHHHHQQQQQQQQ")
_BASE = struct.Struct("<HHHHII")  # type, mode, uid index, gid index, mtime, inode number
_FILE_INODE = struct.Struct("<IIII")  # blocks start, fragment, offset, size
_LFILE_INODE = struct.Struct("<QQQIIII")  # start, size, sparse, nlink, fragment, offset, xattr
_SYMLINK_INODE = struct.Struct("<II")  # nlink, target size
_DIR_INODE = struct.Struct("<IIHHI")  # start, nlink, size, offset, parent
_LDIR_INODE = struct.Struct("<IIIIHHI")  # nlink, size, start, parent, index count, offset, xattr
_DIR_HEADER = struct.Struct("<III")  # count - 1, inode block, base inode number
_DIR_ENTRY = struct.Struct("<HhHH")  # offset, inode number - base, type, name size - 1
_DIR_INDEX = struct.Struct("<III")  # offset in the listing, its block, name size - 1
_ONE_BLOCK_FILE = struct.Struct("<HHHHIIIIIII")  # a basic file inode and its one block
assert _SUPER.size == 96 and _BASE.size == 16 and _LFILE_INODE.size == 40

_HEADER_MAX = 256  # entries under one folder header
_BUFFER = 1 << 20  # small files' data and metadata written in pieces this large
# A file this small, not read with its header already, is read and buffered; a larger
# one is copied in the kernel (copy_file_range).
_SMALL = 16 << 10


def _block_start(position: int) -> int:
    """Where the metadata block holding payload byte ``position`` starts in its table."""
    return position // _METADATA * (_METADATA + 2)


def _ref(position: int) -> int:
    """An inode's reference: its block's start in the table, its offset in the block."""
    return _block_start(position) << 16 | position % _METADATA


class _Table:
    """A table of uncompressed metadata blocks, written to a scratch file from its
    start as its payload grows; positions are in the payload."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self.pos = 0  # payload bytes added
        self._buffer = bytearray()  # payload not written yet, from a block's start
        self._written = 0  # payload bytes written

    def add(self, data: bytes) -> int:
        """``data`` appended; the payload position it starts at."""
        at = self.pos
        self._buffer += data
        self.pos += len(data)
        if len(self._buffer) >= _BUFFER:
            self._write(whole_blocks=True)
        return at

    def _write(self, whole_blocks: bool) -> None:
        end = len(self._buffer) - len(self._buffer) % _METADATA if whole_blocks else None
        taken = len(self._buffer) if end is None else end
        out = bytearray()
        for at in range(0, taken, _METADATA):
            piece = self._buffer[at : min(at + _METADATA, taken)]
            out += struct.pack("<H", _UNCOMPRESSED_META | len(piece))
            out += piece
        os.pwrite(self.fd, out, _block_start(self._written))
        self._written += taken
        del self._buffer[:taken]

    def read(self, position: int, count: int) -> bytes:
        """Payload bytes back (a file's inode, when it turns out to be hard-linked)."""
        out = bytearray()
        while count:
            if position >= self._written:
                at = position - self._written
                return bytes(out + self._buffer[at : at + count])
            take = min(count, _METADATA - position % _METADATA)
            out += os.pread(self.fd, take, _block_start(position) + 2 + position % _METADATA)
            position, count = position + take, count - take
        return bytes(out)

    def finish(self) -> int:
        """Everything written; the table's size in bytes."""
        if self._buffer:
            self._write(whole_blocks=False)
        return _block_start(self.pos) + (2 + self.pos % _METADATA if self.pos % _METADATA else 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SquashfsWriter(NameTable):
    """One squashfs image being written to ``fd``, driven as :class:`ErofsWriter` is
    (:mod:`stager.image.build`); ``spill`` is a path for the scratch tables (beside
    the image, deleted by ``finish`` or ``close``). ``blob``: only embedded (a plain
    tar copied to ``DATA_AT`` by the caller, its files pointed at in place)."""

    block = BLOCK  # what a caller peeks of a small member's data (all of it, here)

    def __init__(
        self,
        fd: int,
        spill: str,
        build_time: int = 0,
        top_owner: int = 0,
        top_mode: int = 0o555,
        blob: Blob | None = None,
        early_writeback: bool = False,
        charge: Callable[[int], None] | None = None,
    ) -> None:
        if blob is not None and not blob.embedded:
            raise ValueError("a squashfs image holds its data: a blob can only be embedded")
        super().__init__(fd, spill, build_time, top_owner, top_mode, charge)
        self._folder_charge = _BASE.size + _LDIR_INODE.size + _DIR_HEADER.size
        self._blob = blob
        self._inode_table = _Table(spill + ".inodes")
        self._dir_table = _Table(spill + ".dirs")
        # The ids the image names: root's, and the private user's for the top folder.
        self._ids = [0] if not top_owner else [0, top_owner]
        self._end = DATA_AT + (blob.size if blob is not None else 0)  # where data goes next
        self._data = bytearray()  # data not written yet, to be at ``_end - len(_data)``
        self._early_writeback = early_writeback
        self._written_back = DATA_AT

    # -- files --------------------------------------------------------------

    def file_range(
        self,
        parent: int,
        name: str,
        size: int,
        mtime: int,
        src_fd: int,
        offset: int,
        tail: bytes | None = None,
    ) -> None:
        """A regular file whose content is ``size`` bytes at ``offset`` of ``src_fd``."""
        self.files_range(parent, src_fd, [(name, size, mtime, offset, tail, "")])

    def files_range(self, parent: int, src_fd: int, files: list[RangeFile]) -> None:
        """Regular files of one folder, each ``size`` bytes at ``offset`` of ``src_fd`` (a
        plain tar, or a file of a tree): pointed at in an embedded tar, else copied in
        the kernel, or from ``tail`` when that is all of it (a small member's data, read
        with its header). One loop makes their inodes and entries (a million files of a
        tar: the builder's hottest loop); ``label`` names a file in an error."""
        embedded = self._blob is not None and src_fd == self._blob.fd
        self._folders[parent].filled = True
        table, pack = self._inode_table, _ONE_BLOCK_FILE.pack
        inodes = bytearray()  # added to the table at the end, or before a larger file's
        for name, size, mtime, offset, tail, label in files:
            start = DATA_AT + offset if embedded else self._place(src_fd, size, offset, tail, name)
            if not (0 < size <= BLOCK and start < 1 << 32):  # more than one block, or none
                self._charged(len(inodes))  # before they are added (as _add_inode)
                table.add(inodes)
                inodes.clear()
                sizes = [BLOCK | _UNCOMPRESSED_BLOCK] * (size // BLOCK)
                if size % BLOCK:
                    sizes.append(size % BLOCK | _UNCOMPRESSED_BLOCK)
                self._file(parent, name, size, mtime, start, sizes, label)
                continue
            self._inodes += 1
            inode = pack(_FILE, 0o444, 0, 0, mtime, self._inodes, start, _NONE32, 0, size,
                         size | _UNCOMPRESSED_BLOCK)  # fmt: skip
            self._entry(parent, name, FT_REG, table.pos + len(inodes), self._inodes, label)
            inodes += inode
            self.data_bytes += size
            self.files += 1
        self._charged(len(inodes))
        table.add(inodes)

    def _place(self, src_fd: int, size: int, offset: int, tail: bytes | None, name: str) -> int:
        """A file's data appended (buffered, or copied in the kernel); where it starts."""
        if tail is not None and len(tail) == size:
            return self._append(tail)
        if size <= _SMALL:
            data = os.pread(src_fd, size, offset)
            if len(data) != size:
                raise EOFError(f"the source ended inside {name!r}")
            return self._append(data)
        start = self._flush_data()
        os.lseek(self._fd, start, os.SEEK_SET)
        copy_range(src_fd, self._fd, offset, size)
        self._end += size
        self._write_back(self._end)
        return start

    def file_stream(self, parent: int, name: str, size: int, mtime: int, read: Reader) -> None:
        """A regular file whose ``size`` bytes come from ``read`` (a decompressed tar);
        a whole block of zeros is stored as a sparse block (nothing)."""
        start, sizes, left = self._end, [], size
        while left:
            want = min(BLOCK, left)
            piece = _read_exactly(read, want, name)
            if want == BLOCK and piece.count(0) == BLOCK:
                sizes.append(0)
            else:
                self._append(piece)
                sizes.append(want | _UNCOMPRESSED_BLOCK)
            left -= want
        self._file(parent, name, size, mtime, start, sizes)

    def _link_inode(self, target: bytes, mtime: int) -> tuple[int, int]:
        ino = self._new_ino()
        inode = _BASE.pack(_SYMLINK, 0o777, 0, 0, mtime, ino)
        return self._add_inode(inode + _SYMLINK_INODE.pack(1, len(target)) + target), ino

    def _file(
        self,
        parent: int,
        name: str,
        size: int,
        mtime: int,
        start: int,
        sizes: list[int],
        label: str = "",
    ) -> None:
        ino = self._new_ino()
        blocks = struct.pack(f"<{len(sizes)}I", *sizes)
        if start < 1 << 32 and size < 1 << 32:
            body = _FILE_INODE.pack(start if size else 0, _NONE32, 0, size)
            inode = _BASE.pack(_FILE, 0o444, 0, 0, mtime, ino) + body + blocks
        else:
            inode = _extended_file(ino, mtime, start, size, 1) + blocks
        self._entry(parent, name, FT_REG, self._add_inode(inode), ino, label)
        self.files += 1
        self.data_bytes += size

    def _new_ino(self) -> int:
        self._inodes += 1
        return self._inodes

    def _add_inode(self, inode: bytes) -> int:
        self._charged(len(inode))
        return self._inode_table.add(inode)

    # -- data ---------------------------------------------------------------

    def _append(self, data: bytes) -> int:
        """``data`` at the end of the data (buffered); where it starts."""
        start = self._end
        self._data += data
        self._end += len(data)
        if len(self._data) >= _BUFFER:
            self._flush_data()
        return start

    def _flush_data(self) -> int:
        """The buffered data written; the end of the data."""
        if self._data:
            os.pwrite(self._fd, self._data, self._end - len(self._data))
            self._data.clear()
            self._write_back(self._end)
        return self._end

    # -- the end --------------------------------------------------------------

    def finish(self) -> int:
        """Write the hard links' inodes, the folders, the tables and the superblock; the
        image's size in bytes."""
        self.charge_now()
        self._spill()
        self._flush_data()
        self._link_hardlinks()
        self._judge_links()
        rows = SortedRows(self._db, descending=True)
        for number in range(len(self._folders) - 1, -1, -1):
            self._write_folder(number, self._folders[number], rows)
        self._db.execute("COMMIT")
        if self._dir_table.pos % _METADATA == 0:
            # An empty folder's listing "starts" at the end: a block must be there.
            self._dir_table.add(bytes(4))
        inode_table = self._end
        at = self._copy_table(self._inode_table, inode_table)
        dir_table = at
        at = self._copy_table(self._dir_table, dir_table)
        ids = struct.pack(f"<{len(self._ids)}I", *self._ids)
        id_block = at
        os.pwrite(self._fd, struct.pack("<H", _UNCOMPRESSED_META | len(ids)) + ids, id_block)
        id_table = id_block + 2 + len(ids)
        os.pwrite(self._fd, struct.pack("<Q", id_block), id_table)
        used = id_table + 8
        root = _ref(self._folders[0].nid)
        sb = _SUPER.pack(
            _MAGIC, self._inodes, self.build_time, BLOCK, 0, _GZIP, _BLOCK_LOG, _FLAGS,
            len(self._ids), 4, 0, root, used, id_table, _INVALID, inode_table, dir_table,
            id_block, _INVALID,
        )  # fmt: skip
        os.pwrite(self._fd, sb, 0)
        size = -(-used // 4096) * 4096
        os.ftruncate(self._fd, size)
        self.close()
        return size

    def _copy_table(self, table: _Table, at: int) -> int:
        nbytes = table.finish()
        os.lseek(self._fd, at, os.SEEK_SET)
        copy_range(table.fd, self._fd, 0, nbytes)
        return at + nbytes

    def close(self) -> None:
        """Drop the scratch tables (after ``finish``, or on failure)."""
        super().close()
        self._inode_table.close()
        self._dir_table.close()

    def _link_hardlinks(self) -> None:
        """A file with several names gets one extended inode that counts them, and every
        name points at it."""
        counts, added = self._hardlink_rows()
        moved = {}
        for position, count in counts.items():
            base = _BASE.unpack(self._inode_table.read(position, _BASE.size))
            kind, ino, mtime = base[0], base[5], base[4]
            at = position + _BASE.size
            if kind == _FILE:
                start, _, _, size = _FILE_INODE.unpack(self._inode_table.read(at, 16))
                at += _FILE_INODE.size
            else:
                fields = _LFILE_INODE.unpack(self._inode_table.read(at, _LFILE_INODE.size))
                start, size = fields[0], fields[1]
                at += _LFILE_INODE.size
            blocks = self._inode_table.read(at, 4 * -(-size // BLOCK))
            moved[position] = self._add_inode(
                _extended_file(ino, mtime, start, size, count) + blocks
            )
        if moved:
            self._db.execute("CREATE INDEX e_nid ON e (nid)")
            self._db.executemany(
                "UPDATE e SET nid = ? WHERE nid = ?", [(new, old) for old, new in moved.items()]
            )
        rows = [(p, n, s, moved.get(nid, nid), kind, ino) for p, n, s, nid, kind, ino in added]
        self._db.executemany("INSERT INTO e VALUES (?, ?, ?, ?, ?, ?)", rows)

    def _write_folder(self, number: int, folder: _Folder, rows: SortedRows) -> None:
        """One folder's listing, then its inode (its children's are written already)."""
        table = self._dir_table
        start = table.pos
        listing = _Listing(table, start)
        subdirs = 0
        for name, _seq, position, kind, ino in self._listing(number, rows):
            listing.add(name, position, ino, _ENTRY_TYPE[kind])
            subdirs += kind == FT_DIR
        listing.done()
        size = table.pos - start + 3  # what the readers count: "." and ".." too
        nlink = 2 + subdirs
        parent = self._folders[folder.parent].ino if number else self._inodes + 1
        uid, mode = (1 if len(self._ids) > 1 else 0, self._top[1]) if number == 0 else (0, 0o555)
        base = (0o7777 & mode, uid, 0, folder.mtime, folder.ino)
        if listing.index or size > 0xFFFF:
            inode = _BASE.pack(_LDIR, *base) + _LDIR_INODE.pack(
                nlink, size, _block_start(start), parent, len(listing.index),
                start % _METADATA, _NONE32,
            )  # fmt: skip
            inode += b"".join(listing.index)
        else:
            inode = _BASE.pack(_DIR, *base) + _DIR_INODE.pack(
                _block_start(start), nlink, size, start % _METADATA, parent
            )
        folder.nid = self._add_inode(inode)


class _Listing:
    """A folder's entries, in name order, written to the directory table as headers of
    entries that share an inode block (at most 256, inode numbers within 16 bits of
    the header's), with an index entry for each header that starts a metadata block."""

    def __init__(self, table: _Table, start: int) -> None:
        self._table, self._start = table, start
        self._entries: list[bytes] = []
        self._block = -1  # the inode block the pending header's entries share
        self._base = 0  # its inode number
        self._first = b""  # its first name
        self.index: list[bytes] = []
        self._indexed = start // _METADATA  # the metadata block of the last index entry

    def add(self, name: bytes, position: int, ino: int, kind: int) -> None:
        block = position // _METADATA * (_METADATA + 2)  # _block_start, inline: per entry
        if (
            len(self._entries) == _HEADER_MAX
            or block != self._block
            or not -32768 <= ino - self._base <= 32767
        ):
            self.done()
            self._block, self._base, self._first = block, ino, name
        entry = _DIR_ENTRY.pack(position % _METADATA, ino - self._base, kind, len(name) - 1)
        self._entries.append(entry + name)

    def done(self) -> None:
        """The pending header written, with its entries."""
        if not self._entries:
            return
        at = self._table.pos
        if at // _METADATA != self._indexed:
            offset = at - self._start
            entry = _DIR_INDEX.pack(offset, _block_start(at), len(self._first) - 1)
            self.index.append(entry + self._first)
            self._indexed = at // _METADATA
        header = _DIR_HEADER.pack(len(self._entries) - 1, self._block, self._base)
        self._table.add(header + b"".join(self._entries))
        self._entries = []


def _extended_file(ino: int, mtime: int, start: int, size: int, nlink: int) -> bytes:
    base = _BASE.pack(_LFILE, 0o444, 0, 0, mtime, ino)
    return base + _LFILE_INODE.pack(start if size else 0, size, 0, nlink, _NONE32, 0, _NONE32)


def _read_exactly(read: Reader, count: int, name: str) -> bytes:
    piece = read(count)
    if len(piece) == count:
        return piece
    pieces = bytearray(piece)
    while len(pieces) < count:
        more = read(count - len(pieces))
        if not more:
            raise EOFError(f"the source ended inside {name!r}")
        pieces += more
    return bytes(pieces)
