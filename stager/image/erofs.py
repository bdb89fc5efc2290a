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
import sqlite3
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from stager.fs.fastcopy import copy_range
from stager.fs.writeback import start_writeback

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
FT_REG, FT_DIR, FT_SYMLINK = 1, 2, 7

FILE_MODE = stat.S_IFREG | 0o444
DIR_MODE = stat.S_IFDIR | 0o555
LINK_MODE = stat.S_IFLNK | 0o777

# struct erofs_super_block (128 bytes) and struct erofs_inode_extended (64 bytes).
_SUPER = struct.Struct("<IIIBBHQQIIII16s16sIHHHBBIQB23s")
_EXTENDED = struct.Struct("<HHHHQIIIIQII16s")
_DIRENT = struct.Struct("<QHBB")  # nid, nameoff, file_type, reserved
_NLINK_AT = 44  # i_nlink's offset in an extended inode
assert _SUPER.size == 128 and _EXTENDED.size == _INODE and _DIRENT.size == 12

# Entries go to the spill in batches: executemany's cost is per call.
_SPILL_BATCH = 4096
# What a build charges for each name as it adds it, beyond content (see ``charge``): its
# entry in its folder's blocks (12 bytes and the name) and its row in the spill; a
# folder's inode and block, a file's inode, are charged as they are made.
_ENTRY_CHARGE = 12 + 48
_CHARGE_EVERY = 64 << 10  # charges are told in sums this large (one call per few files)
# The most bytes of folder paths (and ``_FOLDER_OVERHEAD`` each, for the objects that
# hold it) one build keeps in memory: 150,000 folders of short names, or fewer deep ones;
# what bounds the building process's memory whatever the source's depth and count.
HELD_NAMES_BYTES = 64 << 20
_FOLDER_OVERHEAD = 400
# What the kernel takes: a name of at most 255 bytes, a link target shorter than a page
# (a longer one is cut at 4095 bytes when it is read: other words than those judged).
NAME_MAX = 255
LINK_MAX = 4095
# Symlinks followed in one lookup before the kernel gives up (ELOOP).
_LINK_HOPS = 40
# How much data a durable build writes before it starts that part's writeback.
_WRITEBACK_STEP = 16 << 20


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


class ImageConflict(Exception):
    """Two members the image cannot hold both of; the builder words it for its source."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(why)
        self.path, self.why = path, why


class TooManyNames(ImageConflict):
    """The image's folders passed the names one build may keep (``HELD_NAMES_BYTES``)."""


class LinkLeaves(ImageConflict):
    """A symlink that, read through the mounted image as the kernel resolves it,
    leads outside the image."""


@dataclass(slots=True)
class _Folder:
    parent: int
    name: bytes
    seq: int  # arrival order of its last explicit member (or of its first child)
    mtime: int
    children: dict[bytes, int] = field(default_factory=dict)  # child folders by name
    nid: int = 0
    ino: int = 1
    explicit: bool = False  # named by a member of its own, not only as a parent
    filled: bool = False  # some member was placed in it


# Reads ``n`` bytes of a file's content, in order (a compressed stream's member).
Reader = Callable[[int], bytes]


class ErofsWriter:
    """One image being written to ``fd``; ``spill`` is a path for the entry table (on
    the same disk as the image, deleted by ``finish`` or ``close``)."""

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
        """``charge`` is told the bytes of metadata the image will hold (folders, inodes,
        entries) as each is added, before it is written: a staging's write bound counts
        them as it counts content (stager.wire.progress.report_written)."""
        self._fd = fd
        self._charge = charge
        self._uncharged = 0
        self._held = 0  # bytes of folder paths kept (HELD_NAMES_BYTES)
        self._blob = blob
        # A durable build starts its data's writeback as it goes (stager.fs.writeback),
        # so that the fsync before the image is published finds little left to write.
        self._early_writeback = early_writeback
        self._written_back = 0  # the bytes before this offset have had theirs started
        self._blkszbits = SMALL_BLKSZBITS if blob is not None else _BLKSZBITS
        self.block = 1 << self._blkszbits
        self._mapped = blob.mapped_blkaddr(self.block) if blob is not None else 0
        self.build_time = build_time
        # The top folder's owner and mode: a private copy's is its user's, 0500 (the
        # image is read-only all the same: nobody can change its mode or entries).
        self._top = (top_owner, stat.S_IFDIR | top_mode)
        self._folders: list[_Folder] = [_Folder(0, b"", 0, build_time)]
        self._folder_ids: dict[str, int] = {"": 0}
        # The blocks up to the device table's end hold the superblock and the root inode;
        # an embedded blob's copy comes next, then everything else.
        self._next_blk = -(-(_DEVT_SLOTOFF + 1) * _DEVT_SLOT.size // self.block)
        if blob is not None and blob.embedded:
            self._next_blk = self._mapped + blob.blocks(self.block)
        self._meta = bytearray(self.block)
        self._meta_blk = -1  # no metadata block open yet
        self._meta_used = self.block
        self._seq = 0
        self._inodes = 1  # the root
        self._pending: list[tuple[int, bytes, int, int, int]] = []
        self._spill_path = spill
        self._remove_spill()  # a crashed build's: scratch, never resumed
        self._db = sqlite3.connect(spill, isolation_level=None)
        # A scratch table: nothing to recover after a crash, so no journal, no syncs;
        # a 16 MiB cache, and SQLite's sort spills to temporary files past it.
        for pragma in (
            "journal_mode=OFF",
            "synchronous=OFF",
            "cache_size=-16384",
            "temp_store=FILE",
        ):
            self._db.execute(f"PRAGMA {pragma}")
        self._db.execute("CREATE TABLE e (parent INT, name BLOB, seq INT, nid INT, type INT)")
        self._db.execute(
            "CREATE TABLE h (parent INT, name BLOB, seq INT, tparent INT, tname BLOB, label TEXT)"
        )
        self._db.execute("CREATE TABLE l (nid INT PRIMARY KEY, target BLOB, label TEXT)")
        self._symlinks = 0
        self._db.execute("BEGIN")
        self.files = 0
        self.data_bytes = 0
        # Only a file with something in it is cut: on ext4 a truncate to 0, even of an
        # empty file, makes the file's close wait for the writeback of all it holds
        # then (its auto_da_alloc; 0.5 s for a 1 GB image here).
        if os.fstat(fd).st_size:
            os.ftruncate(fd, 0)

    # -- folders ------------------------------------------------------------

    def folder(self, path: str, mtime: int | None = None) -> int:
        """The folder at ``path`` (relative, "/"-separated, already clean), made with its
        parents if new; an explicit folder member passes its ``mtime``. A loop up to the
        nearest folder known, then down: no stack grows with the depth."""
        known = self._folder_ids.get(path)
        if known is not None:
            if mtime is not None:
                self._seq += 1
                entry = self._folders[known]
                entry.mtime, entry.seq, entry.explicit = mtime, self._seq, True
            return known
        missing = [path]
        while (known := self._folder_ids.get(head := missing[-1].rpartition("/")[0])) is None:
            missing.append(head)
        parent = known
        for here in reversed(missing):
            parent = self._new_folder(parent, here, mtime if here is path else None)
        return parent

    def _new_folder(self, parent: int, path: str, mtime: int | None) -> int:
        encoded = self._named(parent, path.rpartition("/")[2])
        self._held += len(path) + _FOLDER_OVERHEAD
        if self._held > HELD_NAMES_BYTES:
            raise TooManyNames(
                path,
                f"passes the {HELD_NAMES_BYTES >> 20} MiB of folder names one image build "
                "keeps track of (too many folders, or folders too deep)",
            )
        self._charged(self.block + _INODE + _ENTRY_CHARGE + len(encoded))
        self._seq += 1
        number = len(self._folders)
        when = self.build_time if mtime is None else mtime
        self._inodes += 1
        made = _Folder(
            parent, encoded, self._seq, when, ino=self._inodes, explicit=mtime is not None
        )
        self._folders.append(made)
        self._folders[parent].children[made.name] = number
        self._folders[parent].filled = True
        self._folder_ids[path] = number
        return number

    def _charged(self, nbytes: int) -> None:
        self._uncharged += nbytes
        if self._uncharged >= _CHARGE_EVERY:
            self.charge_now()

    def charge_now(self) -> None:
        """Tell ``charge`` what was added since it was last told."""
        if self._charge is not None and self._uncharged:
            self._charge(self._uncharged)
        self._uncharged = 0

    def is_folder(self, path: str) -> bool:
        return path in self._folder_ids

    @property
    def folders(self) -> int:
        return len(self._folders)

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

    def symlink(self, parent: int, name: str, target: str, mtime: int, label: str = "") -> None:
        """A symlink; whether it stays inside the image is judged at the end, against the
        image's final names (``label`` names it then)."""
        data = os.fsencode(target)
        if len(data) > LINK_MAX:
            raise ImageConflict(label or name, f"is a symlink whose target has {len(data)} "
                                f"bytes; the kernel reads at most {LINK_MAX}")  # fmt: skip
        whole = len(data) - len(data) % self.block
        blk = self._data(whole, lambda: self._write_at(data[:whole]))
        nid = self._inode(LINK_MODE, len(data), mtime, blk, data[whole:])
        self._entry(parent, name, FT_SYMLINK, nid)
        self._db.execute("INSERT INTO l VALUES (?, ?, ?)", (nid, data, label or name))
        self._symlinks += 1
        self.files += 1

    def hardlink(self, parent: int, name: str, target_parent: int, target: str, label: str) -> None:
        """A second name for the file ``target`` holds at this point of the stream
        (resolved at the end, when every file's nid is known)."""
        self._folders[parent].filled = True
        self._seq += 1
        encoded = self._named(parent, name)
        self._charged(2 * _ENTRY_CHARGE + len(encoded) + len(target) + len(label))
        row = (parent, encoded, self._seq, target_parent, os.fsencode(target), label)
        self._db.execute("INSERT INTO h VALUES (?, ?, ?, ?, ?, ?)", row)
        self.files += 1

    # -- blocks ---------------------------------------------------------------

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
            end = self._next_blk * self.block
            if end - self._written_back >= _WRITEBACK_STEP:
                start_writeback(self._fd, self._written_back, end - self._written_back)
                self._written_back = end
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

    def _entry(self, parent: int, name: str, kind: int, nid: int) -> None:
        self._folders[parent].filled = True
        self._seq += 1
        encoded = self._named(parent, name)
        self._charged(_ENTRY_CHARGE + len(encoded))
        self._pending.append((parent, encoded, self._seq, nid, kind))
        if len(self._pending) >= _SPILL_BATCH:
            self._spill()

    def _named(self, parent: int, name: str) -> bytes:
        """``name`` as the image holds it; refused past the kernel's NAME_MAX."""
        encoded = os.fsencode(name)
        if len(encoded) > NAME_MAX:
            folder = self._path(parent)
            raise ImageConflict(f"{folder}/{name}" if folder else name, _name_too_long(encoded))
        return encoded

    def _spill(self) -> None:
        self._db.executemany("INSERT INTO e VALUES (?, ?, ?, ?, ?)", self._pending)
        self._pending.clear()

    # -- the end ----------------------------------------------------------------

    def finish(self) -> int:
        """Write the folders, the hard links' counts and the superblock; the image's
        size in bytes."""
        self.charge_now()
        self._spill()
        self._meta_used = self.block  # nothing more goes into the last metadata block
        self._flush_meta()
        self._link_hardlinks()
        if self._symlinks:
            _LinkJudge(self).judge_all()
        self._place_folder_inodes()
        rows = self._db.execute(
            "SELECT parent, name, seq, nid, type FROM e ORDER BY parent, name, seq"
        )
        rows_iter = iter(rows)
        pending = next(rows_iter, None)
        for number, entry in enumerate(self._folders):
            pending = self._write_folder(number, entry, rows_iter, pending)
        self._db.execute("COMMIT")
        self._write_super()
        size = self._next_blk * self.block
        os.ftruncate(self._fd, size)
        self.close()
        return size

    def close(self) -> None:
        """Drop the spill (after ``finish``, or on failure)."""
        if self._db is not None:
            self._db.close()
            self._db = None  # type: ignore[assignment]
            self._remove_spill()

    def _remove_spill(self) -> None:
        for suffix in ("", "-journal", "-wal", "-shm"):
            try:
                os.unlink(self._spill_path + suffix)
            except FileNotFoundError:
                pass

    def _index_names(self) -> None:
        self._db.execute("CREATE INDEX IF NOT EXISTS e_name ON e (parent, name, seq)")

    def _link_hardlinks(self) -> None:
        links = self._db.execute("SELECT count(*) FROM h").fetchone()[0]
        if not links:
            return
        self._index_names()
        counts: dict[int, int] = {}
        added = []
        for parent, name, seq, tparent, tname, label in self._db.execute("SELECT * FROM h"):
            found = self._db.execute(
                "SELECT nid, type FROM e WHERE parent = ? AND name = ? AND seq < ? "
                "ORDER BY seq DESC LIMIT 1",
                (tparent, tname, seq),
            ).fetchone()
            if found is None or found[1] != FT_REG:
                what = "no earlier member wrote as a file" if found is None else "not a file"
                raise ImageConflict(label, f"is a hard link to {os.fsdecode(tname)!r}, {what}")
            counts[found[0]] = counts.get(found[0], 1) + 1
            added.append((parent, name, seq, found[0], FT_REG))
        self._db.executemany("INSERT INTO e VALUES (?, ?, ?, ?, ?)", added)
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

    def _write_folder(
        self,
        number: int,
        entry: _Folder,
        rows: Iterator[tuple[int, bytes, int, int, int]],
        pending: tuple[int, bytes, int, int, int] | None,
    ) -> tuple[int, bytes, int, int, int] | None:
        """Entry blocks of one folder from the sorted rows (its own at their head);
        returns the first row of the next folder."""

        def own() -> Iterator[tuple[bytes, int, int, int]]:
            nonlocal pending
            while pending is not None and pending[0] == number:
                yield pending[1], pending[2], pending[3], pending[4]
                pending = next(rows, None)

        parent_nid = self._folders[entry.parent].nid if number else ROOT_NID
        dots = [(b".", 0, entry.nid, FT_DIR), (b"..", 0, parent_nid, FT_DIR)]
        subfolders = sorted(
            (name, self._folders[child].seq, self._folders[child].nid, FT_DIR, child)
            for name, child in entry.children.items()
        )
        merged = _merge_sorted(own(), [(n, s, nid, t) for n, s, nid, t, _ in subfolders], dots)
        subdirs = 0
        packer = _DirPacker(self)
        for name, _seq, nid, kind in self._last_of_each(merged, entry):
            packer.add(name, nid, kind)
            subdirs += kind == FT_DIR and name not in (b".", b"..")
        blk, size = packer.done()
        nlink = 2 + subdirs
        uid, mode = self._top if number == 0 else (0, DIR_MODE)
        inode = self._pack_inode(_FLAT_PLAIN, mode, size, blk, entry.mtime, nlink, entry.ino, uid)
        os.pwrite(self._fd, inode, entry.nid * _SLOT)
        return pending

    def _last_of_each(
        self, entries: Iterator[tuple[bytes, int, int, int]], folder: _Folder
    ) -> Iterator[tuple[bytes, int, int, int]]:
        """One entry per name: the last to arrive, as GNU tar leaves a name given twice
        (sorted by name, then arrival). As in GNU tar, a folder that other members
        filled is not replaced by a file, and a file is not made a folder by a member
        under it (a folder member replaces it)."""
        held: tuple[bytes, int, int, int] | None = None
        for entry in entries:
            if held is not None and held[0] != entry[0]:
                yield held
            elif held is not None and held[3] == FT_DIR and entry[3] != FT_DIR:
                if self._folders[folder.children[held[0]]].filled:
                    path = self._path(folder.children[held[0]])
                    raise ImageConflict(path, "replaces a folder that other members filled")
            elif held is not None and entry[3] == FT_DIR and held[3] != FT_DIR:
                child = folder.children[entry[0]]
                if not self._folders[child].explicit:  # a member under what is a file
                    path = self._path(child)
                    raise ImageConflict(path, f"needs the folder {path!r}, a file")
            held = entry
        if held is not None:
            yield held

    def _path(self, number: int) -> str:
        parts = []
        while number:
            parts.append(os.fsdecode(self._folders[number].name))
            number = self._folders[number].parent
        return "/".join(reversed(parts))

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


def _name_too_long(name: bytes) -> str:
    return f"has a name of {len(name)} bytes; a file system allows at most {NAME_MAX}"


class _LinkJudge:
    """Every symlink of a finished image resolved as the kernel will resolve it in the
    mounted image: component by component from the link's folder, through the image's
    own final names (the last of a name given twice, renames applied) and its other
    symlinks, ``..`` to the physical parent. A link is refused if that walk ever climbs
    above the image's top, which at a mount point leads into the folder around it.

    Judging each link where it arrives, by its words, is not enough: ``a -> .`` makes
    ``a/a/../..`` climb out although its words stay inside, and a later member can
    replace a folder that an earlier link was judged through. A walk that ends at a
    file, at a missing name, or in a loop (ELOOP) stays inside: the image never changes.
    """

    def __init__(self, writer: ErofsWriter) -> None:
        self._writer = writer
        self._db = writer._db
        writer._index_names()
        self._found: dict[tuple[int, bytes], tuple[int, int] | None] = {}

    def judge_all(self) -> None:
        rows = self._db.execute(  # read as it goes: a million links are not held at once
            "SELECT e.parent, e.name, e.nid, l.target, l.label FROM l JOIN e ON e.nid = l.nid"
        )
        for parent, name, nid, target, label in rows:
            if self._entry(parent, name) != (FT_SYMLINK, nid):
                continue  # a later member of that name replaced it
            try:
                self._walk(parent, target, [0])
            except _Climbs:
                raise LinkLeaves(label, f"is a symlink to {os.fsdecode(target)!r}, which leads "
                                 "outside the dataset once the image's own links on its way "
                                 "are followed, as the kernel follows them") from None  # fmt: skip

    def _entry(self, folder: int, name: bytes) -> tuple[int, int] | None:
        """What ``name`` in ``folder`` is in the image: (FT_DIR, folder number) or
        (kind, nid) of its last member; None if the image has no such name."""
        key = (folder, name)
        if key in self._found:
            return self._found[key]
        row = self._db.execute(
            "SELECT nid, type, seq FROM e WHERE parent = ? AND name = ? ORDER BY seq DESC LIMIT 1",
            key,
        ).fetchone()
        folders = self._writer._folders
        child = folders[folder].children.get(name)
        if child is not None and (row is None or folders[child].seq > row[2]):
            found: tuple[int, int] | None = (FT_DIR, child)
        else:
            found = None if row is None else (row[1], row[0])
        if len(self._found) >= 1 << 16:
            self._found.clear()  # bounded: a million links resolve in turn
        self._found[key] = found
        return found

    def _target(self, nid: int) -> bytes:
        return self._db.execute("SELECT target FROM l WHERE nid = ?", (nid,)).fetchone()[0]

    def _walk(self, folder: int, target: bytes, hops: list[int]) -> int | None:
        """The folder ``target`` leads to from ``folder`` (None: a file, nothing, or a
        loop); raises _Climbs where it leaves the top, or is absolute."""
        if target.startswith(b"/"):
            raise _Climbs
        here = folder
        for part in target.split(b"/"):
            if part in (b"", b"."):
                continue
            if part == b"..":
                if here == 0:
                    raise _Climbs
                here = self._writer._folders[here].parent
                continue
            found = self._entry(here, part)
            if found is None:
                return None
            kind, number = found
            if kind == FT_DIR:
                here = number
            elif kind == FT_SYMLINK:
                hops[0] += 1
                if hops[0] > _LINK_HOPS:
                    return None
                reached = self._walk(here, self._target(number), hops)
                if reached is None:
                    return None
                here = reached
            else:
                return None
        return here


class _Climbs(Exception):
    """A walk that left the image's top."""


def _merge_sorted(
    files: Iterator[tuple[bytes, int, int, int]],
    folders: list[tuple[bytes, int, int, int]],
    dots: list[tuple[bytes, int, int, int]],
) -> Iterator[tuple[bytes, int, int, int]]:
    """The folder's entries in name order (then arrival order): its files as SQLite
    sorted them, merged with its child folders and "." and ".." (few, sorted here)."""
    others = sorted(folders + dots)
    at = 0
    for row in files:
        while at < len(others) and others[at][:2] <= row[:2]:
            yield others[at]
            at += 1
        yield row
    yield from others[at:]


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
