"""The names of an image being written, whatever its format: its folders, kept in
memory, and its entries, spilled to SQLite and sorted at the end.

Both writers (:mod:`stager.image.erofs`, :mod:`stager.image.squashfs`) take members one
at a time, in arrival order, from a tar stream or a walk, and lay out their folders only
at the end. What they share is here: the folder tree (a path to its number, each
folder's parent, name, mtime and child folders), the spill of entries (a folder's
number, a name, the arrival order, the format's handle of the inode, the entry's kind,
its inode number), the hard links resolved once every file is known, a name given twice
ending as GNU tar leaves it, and every symlink judged as the kernel will resolve it in
the mounted image (:class:`_LinkJudge`).

Memory stays flat whatever the file count: what a folder lists is not kept. What is
kept per folder is in memory: thousands of folders, not millions of files.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from stager.fs.writeback import start_writeback

FS_ENCODING, FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()
# The kinds of an entry (EROFS's file types; each format maps them to its own).
FT_REG, FT_DIR, FT_SYMLINK = 1, 2, 7

FILE_MODE = stat.S_IFREG | 0o444
DIR_MODE = stat.S_IFDIR | 0o555
LINK_MODE = stat.S_IFLNK | 0o777

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
# How much data a durable build writes before it starts that part's writeback.
_WRITEBACK_STEP = 16 << 20
# Symlinks followed in one lookup before the kernel gives up (ELOOP).
_LINK_HOPS = 40


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


# An entry of a folder: name, arrival order, the format's handle of its inode, kind, and
# its inode number (squashfs names it in the folder; EROFS does not: 0).
Row = tuple[bytes, int, int, int, int]


class SortedRows:
    """The spill's entries sorted by folder (ascending, or ``descending``), then name,
    then arrival; taken one folder at a time, in that order."""

    def __init__(self, db: sqlite3.Connection, descending: bool = False) -> None:
        order = "parent DESC" if descending else "parent"
        query = f"SELECT parent, name, seq, nid, type, ino FROM e ORDER BY {order}, name, seq"
        self._rows = iter(db.execute(query))
        self._next = next(self._rows, None)

    def of(self, number: int) -> Iterator[Row]:
        while self._next is not None and self._next[0] == number:
            yield self._next[1:]
            self._next = next(self._rows, None)


# A file for a writer's ``files_range``: name, size, mtime, the offset of its content,
# its content if read already (or None), what names it in an error ("": its path).
RangeFile = tuple[str, int, int, int, bytes | None, str]

# Reads ``n`` bytes of a file's content, in order (a compressed stream's member).
Reader = Callable[[int], bytes]


class NameTable:
    """The names of one image being written to ``fd``; ``spill`` is a path for the
    entry table (on the same disk as the image, deleted by ``finish`` or ``close``). A
    writer sets ``_folder_charge``: the bytes a new folder adds besides its entry."""

    _folder_charge = 0
    _early_writeback = False  # a durable build's (see _write_back)
    _written_back = 0  # the data before this offset has had its writeback started

    def __init__(
        self,
        fd: int,
        spill: str,
        build_time: int = 0,
        top_owner: int = 0,
        top_mode: int = 0o555,
        charge: Callable[[int], None] | None = None,
    ) -> None:
        """``charge`` is told the bytes of metadata the image will hold (folders, inodes,
        entries) as each is added, before it is written: a staging's write bound counts
        them as it counts content (stager.wire.progress.report_written)."""
        self._fd = fd
        self._charge = charge
        self._uncharged = 0
        self._held = 0  # bytes of folder paths kept (HELD_NAMES_BYTES)
        self.build_time = build_time
        # The top folder's owner and mode: a private copy's is its user's, 0500 (the
        # image is read-only all the same: nobody can change its mode or entries).
        self._top = (top_owner, stat.S_IFDIR | top_mode)
        self._folders: list[_Folder] = [_Folder(0, b"", 0, build_time)]
        self._folder_ids: dict[str, int] = {"": 0}
        self._seq = 0
        self._inodes = 1  # the root
        self._pending: list[tuple[int, bytes, int, int, int, int]] = []
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
        self._db.execute(
            "CREATE TABLE e (parent INT, name BLOB, seq INT, nid INT, type INT, ino INT)"
        )
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
        self._charged(self._folder_charge + _ENTRY_CHARGE + len(encoded))
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

    def symlink(self, parent: int, name: str, target: str, mtime: int, label: str = "") -> None:
        """A symlink; whether it stays inside the image is judged at the end, against the
        image's final names (``label`` names it then)."""
        data = os.fsencode(target)
        if len(data) > LINK_MAX:
            raise ImageConflict(label or name, f"is a symlink whose target has {len(data)} "
                                f"bytes; the kernel reads at most {LINK_MAX}")  # fmt: skip
        nid, ino = self._link_inode(data, mtime)
        self._entry(parent, name, FT_SYMLINK, nid, ino)
        self._db.execute("INSERT INTO l VALUES (?, ?, ?)", (nid, data, label or name))
        self._symlinks += 1
        self.files += 1

    def _link_inode(self, target: bytes, mtime: int) -> tuple[int, int]:
        """The writer's: a symlink's inode written; its handle (nid) and inode number."""
        raise NotImplementedError

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

    def _write_back(self, end: int) -> None:
        """A durable build starts its data's writeback as it goes (stager.fs.writeback),
        so that the fsync before the image is published finds little left to write."""
        if self._early_writeback and end - self._written_back >= _WRITEBACK_STEP:
            start_writeback(self._fd, self._written_back, end - self._written_back)
            self._written_back = end

    # -- entries ------------------------------------------------------------

    def _entry(
        self, parent: int, name: str, kind: int, nid: int, ino: int = 0, label: str = ""
    ) -> None:
        """``name`` in folder ``parent``: a ``kind`` whose inode is ``nid`` (``label``
        names it in an error). Every entry of every writer, squashfs's files_range (a
        million files of a tar) too: inlined there, it saved 0.2 us a file, under 2% of
        the build (docs/benchmarks.md, "Per-user squashfs")."""
        self._folders[parent].filled = True
        self._seq += 1
        encoded = self._named(parent, name, label)
        self._charged(_ENTRY_CHARGE + len(encoded))
        self._pending.append((parent, encoded, self._seq, nid, kind, ino))
        if len(self._pending) >= _SPILL_BATCH:
            self._spill()

    def _named(self, parent: int, name: str, label: str = "") -> bytes:
        """``name`` as the image holds it; refused past the kernel's NAME_MAX (the error
        names it by ``label``, else by its path in the image)."""
        encoded = name.encode(FS_ENCODING, FS_ERRORS)  # os.fsencode, less its call
        if len(encoded) > NAME_MAX:
            folder = self._path(parent)
            path = label or (f"{folder}/{name}" if folder else name)
            raise ImageConflict(path, _name_too_long(encoded))
        return encoded

    def _spill(self) -> None:
        self._db.executemany("INSERT INTO e VALUES (?, ?, ?, ?, ?, ?)", self._pending)
        self._pending.clear()

    # -- the end ----------------------------------------------------------------
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

    def _hardlink_rows(self) -> tuple[dict[int, int], list[tuple[int, bytes, int, int, int, int]]]:
        """Each hard link resolved to the file its target named at its point of the
        stream: each such file's handle with its count of names, and the links' rows
        (not yet added: a writer may give the file a new handle first)."""
        counts: dict[int, int] = {}
        added: list[tuple[int, bytes, int, int, int, int]] = []
        if not self._db.execute("SELECT count(*) FROM h").fetchone()[0]:
            return counts, added
        self._index_names()
        for parent, name, seq, tparent, tname, label in self._db.execute("SELECT * FROM h"):
            found = self._db.execute(
                "SELECT nid, type, ino FROM e WHERE parent = ? AND name = ? AND seq < ? "
                "ORDER BY seq DESC LIMIT 1",
                (tparent, tname, seq),
            ).fetchone()
            if found is None or found[1] != FT_REG:
                what = "no earlier member wrote as a file" if found is None else "not a file"
                raise ImageConflict(label, f"is a hard link to {os.fsdecode(tname)!r}, {what}")
            counts[found[0]] = counts.get(found[0], 1) + 1
            added.append((parent, name, seq, found[0], FT_REG, found[2]))
        return counts, added

    def _judge_links(self) -> None:
        if self._symlinks:
            _LinkJudge(self).judge_all()

    def _listing(
        self, number: int, rows: SortedRows, dots: list[Row] | tuple[()] = ()
    ) -> Iterator[Row]:
        """The entries of folder ``number`` in name order, one per name (its own rows,
        its child folders, and the format's ``dots`` if it stores them)."""
        entry = self._folders[number]
        subfolders = []
        for name, child in entry.children.items():
            folder = self._folders[child]
            subfolders.append((name, folder.seq, folder.nid, FT_DIR, folder.ino))
        return self._last_of_each(_merge_sorted(rows.of(number), subfolders, list(dots)), entry)

    def _last_of_each(self, entries: Iterator[Row], folder: _Folder) -> Iterator[Row]:
        """One entry per name: the last to arrive, as GNU tar leaves a name given twice
        (sorted by name, then arrival). As in GNU tar, a folder that other members
        filled is not replaced by a file, and a file is not made a folder by a member
        under it (a folder member replaces it)."""
        held: Row | None = None
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

    def __init__(self, writer: NameTable) -> None:
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


def _merge_sorted(files: Iterator[Row], folders: list[Row], dots: list[Row]) -> Iterator[Row]:
    """The folder's entries in name order (then arrival order): its files as SQLite
    sorted them, merged with its child folders and "." and ".." (few, sorted here)."""
    others = sorted(folders + dots)
    if not others:  # most folders: files alone
        yield from files
        return
    at = 0
    for row in files:
        while at < len(others) and others[at][:2] <= row[:2]:
            yield others[at]
            at += 1
        yield row
    yield from others[at:]
