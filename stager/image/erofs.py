"""An EROFS image written in one pass: each file as it arrives, the folders at the end.

Debian 12's ``mkfs.erofs`` (erofs-utils 1.5) builds only from a tree of files, which
is what image mode exists to avoid writing, and holds every inode in memory (1 GB of
RSS at 200,000 files). This writer takes files one at a time, from a tar stream or a
walk, and writes the uncompressed EROFS format that Linux mounts since 5.4 (docs:
the kernel's ``Documentation/filesystems/erofs.rst``; the layout is its
``erofs_fs.h``):

* 4 KiB blocks. Block 0 holds the superblock (at byte 1024) and the root folder's
  inode at byte 1152: the superblock names the root by a 16-bit nid, so it must sit
  near the start, and it is written last, into its reserved slot.
* ``meta_blkaddr`` is 0, so a nid (an inode's byte offset / 32) can address any
  32-byte slot of the image. Metadata blocks and data blocks are therefore mixed in
  arrival order: a file's whole 4 KiB blocks go at the end of the image, then its
  64-byte inode into the current metadata block, followed by the file's last partial
  block inline ("tail packing"), so a 512-byte file costs 576 bytes, not a block.
  An inode and its inline tail never cross a block boundary (the kernel refuses it).
* Extended (64-byte) inodes only: they carry each file's mtime, as an extraction
  keeps it. Files are 0444, folders 0555, symlinks 0777, all owned by root: the image
  is read-only by construction and nothing in it is anyone's to change.
* Folders are written at the end: their inodes in one run of slots, then their
  entry blocks, each block's entries sorted by name bytes across the whole folder
  (the kernel's lookup is a binary search), "." and ".." included.

Memory stays flat whatever the file count: what a folder lists is not kept. Each
entry (its folder's number, name, nid, kind, arrival order) is appended to an
SQLite table in a spill file beside the image, and SQLite sorts it at the end with a
bounded cache. What is kept per folder (its name, parent, mtime, child folders) is
in memory: thousands of folders, not millions of files. A name that comes twice (a
tar appended to with ``tar -r``) ends as GNU tar leaves it: the last one wins.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from stager.fs.fastcopy import copy_range
from stager.image.names import (
    DIR_MODE,
    FILE_MODE,
    FT_DIR,
    FT_REG,
    LINK_MODE,
    ImageConflict,
    NameTable,
    RangeFile,
    Reader,
    SortedRows,
    _Folder,
)

BLOCK = 4096
_BLKSZBITS = 12
SMALL_BLKSZBITS = 9  # a tar's own block: what an index image is counted in
_MAGIC = 0xE0F5E1E2
_SUPER_OFFSET = 1024
_ROOT_OFFSET = 1152  # right after the 128-byte superblock, 32-byte aligned
ROOT_NID = _ROOT_OFFSET // 32
# The device table (one 128-byte slot, for an index image's blob) right after the root's
# inode: in the superblock's block at any block size from 512 bytes.
_DEVT_SLOTOFF = 10
_DEVT_SLOT = struct.Struct("<64sII56s")  # tag, blocks, mapped_blkaddr, reserved
_FEATURE_DEVICE_TABLE = 0x8  # feature_incompat
_INODE = 64  # extended inode
_SLOT = 32  # inodes sit on 32-byte slots: nid = offset // 32

# erofs_fs.h: the data layouts of an uncompressed inode, and the file types of entries.
_FLAT_PLAIN, _FLAT_INLINE = 0, 2

# struct erofs_super_block (128 bytes) and struct erofs_inode_extended (64 bytes).
_SUPER = struct.Struct("<IIIBBHQQIIII16s16sIHHHBBIQB23s")
_EXTENDED = struct.Struct("<HHHHQIIIIQII16s")
_DIRENT = struct.Struct("<QHBB")  # nid, nameoff, file_type, reserved
_NLINK_AT = 44  # i_nlink's offset in an extended inode
assert _SUPER.size == 128 and _EXTENDED.size == _INODE and _DIRENT.size == 12


# Where an embedded blob's copy starts in its image: the first 4 KiB page after the
# superblock's, so a page of a file maps to a page's span of the tar, as a blob's does.
EMBEDDED_AT = 4096


@dataclass(frozen=True)
class Blob:
    """The file an index image's files are read from (a plain tar): the image holds
    only metadata, and each file's inode points at its content's blocks in the blob,
    mounted as the image's extra device (``device=``). The blob's blocks are mapped to
    the top of EROFS's 32-bit block space, so their address is known before the
    image's own size is: 2 TiB in all, at 512-byte blocks.

    ``embedded``: the blob is copied into the image itself, at ``EMBEDDED_AT``, and the
    metadata follows it: one file, mounted as any image (no extra device), at the
    copy's speed all the same."""

    fd: int  # what the builder reads members from: file_range calls with it are mapped
    size: int
    tag: bytes = b"blob"  # the device slot's tag (the kernel reads it only without device=)
    embedded: bool = False

    def blocks(self, block: int) -> int:
        return -(-self.size // block)

    def mapped_blkaddr(self, block: int) -> int:
        if self.embedded:
            return EMBEDDED_AT // block
        blocks = self.blocks(block)
        # Kept on a 4 KiB boundary, so a page of a file maps to a page's span of the blob.
        mapped = ((1 << 32) - blocks) & ~(4096 // block - 1)
        if mapped <= 0:
            raise ValueError(f"a blob of {self.size} bytes is past an index image's 2 TiB")
        return mapped


class ErofsWriter(NameTable):
    """One EROFS image being written to ``fd``; ``spill`` is a path for the entry table
    (on the same disk as the image, deleted by ``finish`` or ``close``)."""

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
        """``charge``: as :class:`NameTable` says."""
        super().__init__(fd, spill, build_time, top_owner, top_mode, charge)
        self._blob = blob
        self._early_writeback = early_writeback
        self._blkszbits = SMALL_BLKSZBITS if blob is not None else _BLKSZBITS
        self.block = 1 << self._blkszbits
        self._folder_charge = self.block + _INODE  # its inode and its first block
        self._mapped = blob.mapped_blkaddr(self.block) if blob is not None else 0
        # The blocks up to the device table's end hold the superblock and the root inode;
        # an embedded blob's copy comes next, then everything else.
        self._next_blk = -(-(_DEVT_SLOTOFF + 1) * _DEVT_SLOT.size // self.block)
        if blob is not None and blob.embedded:
            self._next_blk = self._mapped + blob.blocks(self.block)
        self._meta = bytearray(self.block)
        self._meta_blk = -1  # no metadata block open yet
        self._meta_used = self.block

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
        """A regular file whose content is ``size`` bytes at ``offset`` of ``src_fd``
        (a plain tar, or a file of a tree): whole blocks are copied in the kernel. Its
        last partial block is read unless the caller has it already (``tail``).

        In an index image, content that starts on a block of the blob is not copied:
        the inode points at it there."""
        if self._blob is not None and src_fd == self._blob.fd and offset % self.block == 0:
            blk = self._mapped + offset // self.block if size else 0
            self._entry(parent, name, FT_REG, self._inode(FILE_MODE, size, mtime, blk, b""))
            self.files += 1
            self.data_bytes += size
            return
        whole = size - size % self.block
        blk = self._data(whole, lambda: self._copy(src_fd, offset, whole)) if whole else 0
        if tail is None:
            tail = os.pread(src_fd, size - whole, offset + whole) if size > whole else b""
        if len(tail) != size - whole:
            raise EOFError(f"the source ended inside {name!r}")
        self._entry(parent, name, FT_REG, self._inode(FILE_MODE, size, mtime, blk, tail))
        self.files += 1
        self.data_bytes += size

    def files_range(self, parent: int, src_fd: int, files: list[RangeFile]) -> None:
        """Files of one folder, each as ``file_range`` takes it."""
        for name, size, mtime, offset, tail, label in files:
            try:
                self.file_range(parent, name, size, mtime, src_fd, offset, tail)
            except ImageConflict as exc:
                raise ImageConflict(label or exc.path, exc.why) from exc

    def file_stream(self, parent: int, name: str, size: int, mtime: int, read: Reader) -> None:
        """A regular file whose ``size`` bytes come from ``read`` (a decompressed tar)."""
        whole = size - size % self.block
        blk = self._data(whole, lambda: self._write_stream(read, whole, name))
        tail = read(size - whole) if size > whole else b""
        if len(tail) != size - whole:
            raise EOFError(f"the source ended inside {name!r}")
        self._entry(parent, name, FT_REG, self._inode(FILE_MODE, size, mtime, blk, tail))
        self.files += 1
        self.data_bytes += size

    def _link_inode(self, target: bytes, mtime: int) -> tuple[int, int]:
        whole = len(target) - len(target) % self.block
        blk = self._data(whole, lambda: self._write_at(target[:whole]))
        return self._inode(LINK_MODE, len(target), mtime, blk, target[whole:]), 0

    def _data(self, nbytes: int, write: Callable[[], None]) -> int:
        """Whole blocks at the end of the image, filled by ``write`` at the file's
        position; their first block's number (0 for none)."""
        if not nbytes:
            return 0
        blk = self._next_blk
        self._next_blk += nbytes // self.block
        os.lseek(self._fd, blk * self.block, os.SEEK_SET)
        write()
        if self._early_writeback:  # one test a file when not durable: a million files
            self._write_back(self._next_blk * self.block)
        return blk

    def _copy(self, src_fd: int, offset: int, nbytes: int) -> None:
        copy_range(src_fd, self._fd, offset, nbytes)

    def _write_stream(self, read: Reader, nbytes: int, name: str) -> None:
        while nbytes:
            data = read(min(nbytes, 4 << 20))
            if not data:
                raise EOFError(f"the source ended inside {name!r}")
            self._write_at(data)
            nbytes -= len(data)

    def _write_at(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def _inode(self, mode: int, size: int, mtime: int, blk: int, tail: bytes) -> int:
        """Write an inode (and its tail inline, or in a block of its own); its nid."""
        layout = _FLAT_PLAIN
        if tail:
            room = _INODE + len(tail)
            if room <= self.block - self._meta_used or (
                len(tail) <= self.block // 2 and self._open_meta()
            ):
                layout = _FLAT_INLINE
            else:  # the tail in a block of its own, right after the file's whole blocks
                tail_blk = self._data(
                    self.block, lambda: self._write_at(tail.ljust(self.block, b"\0"))
                )
                blk = blk or tail_blk
                tail = b""
        self._inodes += 1
        self._charged(_INODE)
        inode = self._pack_inode(layout, mode, size, blk, mtime, 1, self._inodes)
        return self._put_meta(inode + tail)

    def _pack_inode(
        self,
        layout: int,
        mode: int,
        size: int,
        blk: int,
        mtime: int,
        nlink: int,
        ino: int,
        uid: int = 0,
    ) -> bytes:
        fmt = (layout << 1) | 1  # bit 0: the extended inode
        return _EXTENDED.pack(fmt, 0, mode, 0, size, blk, ino, uid, 0, mtime, 0, nlink, b"")

    def _open_meta(self) -> bool:
        """Close the current metadata block and open the next; True."""
        self._flush_meta()
        self._meta_blk = self._next_blk
        self._next_blk += 1
        self._meta[:] = bytes(self.block)
        self._meta_used = 0
        return True

    def _put_meta(self, record: bytes) -> int:
        if self._meta_used + len(record) > self.block:
            self._open_meta()
        at = self._meta_used
        self._meta[at : at + len(record)] = record
        self._meta_used = at + (-(-len(record) // _SLOT) * _SLOT)
        return (self._meta_blk * self.block + at) // _SLOT

    def write_block(self, data: bytes) -> int:
        """One block at the end of the image; its number."""
        blk = self._next_blk
        self._next_blk += 1
        os.pwrite(self._fd, data, blk * self.block)
        return blk

    def _flush_meta(self) -> None:
        if self._meta_blk >= 0:
            os.pwrite(self._fd, self._meta, self._meta_blk * self.block)

    # -- the end ----------------------------------------------------------------

    def finish(self) -> int:
        """Write the folders, the hard links' counts and the superblock; the image's
        size in bytes."""
        self.charge_now()
        self._spill()
        self._meta_used = self.block  # nothing more goes into the last metadata block
        self._flush_meta()
        self._link_hardlinks()
        self._judge_links()
        self._place_folder_inodes()
        rows = SortedRows(self._db)
        for number, entry in enumerate(self._folders):
            self._write_folder(number, entry, rows)
        self._db.execute("COMMIT")
        self._write_super()
        size = self._next_blk * self.block
        os.ftruncate(self._fd, size)
        self.close()
        return size

    def _link_hardlinks(self) -> None:
        counts, added = self._hardlink_rows()
        self._db.executemany("INSERT INTO e VALUES (?, ?, ?, ?, ?, ?)", added)
        for nid, count in counts.items():
            os.pwrite(self._fd, struct.pack("<I", count), nid * _SLOT + _NLINK_AT)

    def _place_folder_inodes(self) -> None:
        """One run of inode slots for every folder but the root (whose slot is fixed)."""
        self._folders[0].nid = ROOT_NID
        slots = len(self._folders) - 1
        first = self._next_blk
        self._next_blk += -(-slots * _INODE // self.block)
        for number in range(1, len(self._folders)):
            self._folders[number].nid = (first * self.block + (number - 1) * _INODE) // _SLOT

    def _write_folder(self, number: int, entry: _Folder, rows: SortedRows) -> None:
        """Entry blocks of one folder, and its inode."""
        parent_nid = self._folders[entry.parent].nid if number else ROOT_NID
        dots = [(b".", 0, entry.nid, FT_DIR, 0), (b"..", 0, parent_nid, FT_DIR, 0)]
        subdirs = 0
        packer = _DirPacker(self)
        for name, _seq, nid, kind, _ino in self._listing(number, rows, dots):
            packer.add(name, nid, kind)
            subdirs += kind == FT_DIR and name not in (b".", b"..")
        blk, size = packer.done()
        nlink = 2 + subdirs
        uid, mode = self._top if number == 0 else (0, DIR_MODE)
        inode = self._pack_inode(_FLAT_PLAIN, mode, size, blk, entry.mtime, nlink, entry.ino, uid)
        os.pwrite(self._fd, inode, entry.nid * _SLOT)

    def _write_super(self) -> None:
        device = self._blob is not None and not self._blob.embedded
        if device and self._next_blk > self._mapped:
            raise ImageConflict("", "the index outgrew the space before its blob's blocks")
        if self._next_blk >= 1 << 32:
            raise ImageConflict("", "the image is past EROFS's 2**32 blocks")
        features, devices = (_FEATURE_DEVICE_TABLE, 1) if device else (0, 0)
        sb = _SUPER.pack(
            _MAGIC, 0, 0, self._blkszbits, 0, ROOT_NID, self._inodes, self.build_time, 0,
            self._next_blk, 0, 0, bytes(16), b"stager".ljust(16, b"\0"), features, 0,
            devices, _DEVT_SLOTOFF if devices else 0, 0, 0, 0, 0, 0, b"",
        )  # fmt: skip
        os.pwrite(self._fd, sb, _SUPER_OFFSET)
        if device:
            assert self._blob is not None
            blocks = self._blob.blocks(self.block)
            slot = _DEVT_SLOT.pack(self._blob.tag[:63], blocks, self._mapped, b"")
            os.pwrite(self._fd, slot, _DEVT_SLOTOFF * _DEVT_SLOT.size)


class _DirPacker:
    """A folder's entries packed into blocks as they come (sorted), each block its
    dirents then its names; written to the end of the image as each fills."""

    def __init__(self, writer: ErofsWriter) -> None:
        self._writer = writer
        self._entries: list[tuple[bytes, int, int]] = []
        self._used = 0
        self._first = 0
        self._blocks = 0

    def add(self, name: bytes, nid: int, kind: int) -> None:
        need = _DIRENT.size + len(name)
        if self._used + need > self._writer.block:
            self._emit(self._writer.block)
        self._entries.append((name, nid, kind))
        self._used += need

    def _emit(self, length: int) -> None:
        names_at = _DIRENT.size * len(self._entries)
        block = bytearray(length)
        offset = names_at
        for index, (name, nid, kind) in enumerate(self._entries):
            _DIRENT.pack_into(block, index * _DIRENT.size, nid, offset, kind, 0)
            block[offset : offset + len(name)] = name
            offset += len(name)
        blk = self._writer.write_block(bytes(block).ljust(self._writer.block, b"\0"))
        if not self._blocks:
            self._first = blk
        self._blocks += 1
        self._entries, self._used = [], 0

    def done(self) -> tuple[int, int]:
        """(first block, the folder's size in bytes)."""
        last = self._used
        self._emit(last)
        return self._first, (self._blocks - 1) * self._writer.block + last
