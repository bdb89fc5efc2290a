"""A large plain tar's plain files, written by GNU tars side by side: the reading
process checks headers and makes folders, and ``cores`` tars get whole runs of members
through pipes (why, and when it pays: docs/performance.md).

What a tar writes is exactly what was checked here: every header is checked (a ustar
or GNU header with a good checksum, a regular file or a folder, octal numbers as GNU
tar reads them, a clean relative name, data inside the archive) and a tar reads those
very bytes (the window they were checked in); only a file's data past the window is
spliced from the archive, so an archive rewritten meanwhile changes at most a file's
content (which the op's own check then fails), never what a member is. Folders are
made here, in archive order, so a tar never creates one.

What may differ from the ordered writer is refused rather than reasoned about: the
destination starts empty and the tars run with ``--keep-old-files``, so a name written
twice fails a tar; everything here is then removed and the ordered writer extracts
the whole archive. Any other member (a link, a pax or long-name header, a sparse
file, a mode the tars' ``umask 0333`` would not make 0444) ends the run: the ordered
writer goes on from it, knowing the folders made here.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import functools
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field

from stager.archive import tar_members
from stager.archive.job import Archive, ExtractContext
from stager.archive.writer import _HELD_OVERHEAD, HELD_NAMES_BYTES
from stager.core.processes import NotRun, Spawned, run, spawn
from stager.fs.deletion import delete_tree
from stager.fs.forked import cores
from stager.fs.sizes import ENTRY_BYTES, FOLDER_BYTES, entry_bytes
from stager.wire.progress import ProgressSink, report_written

# Archives smaller than this are not worth the tars' start (~3 ms each).
SPLIT_MIN_BYTES = 64 << 20
# Members sent to one tar at a time (a chunk): at most this many files or bytes, so
# that the tar with the least waiting gets the next one and both stay busy.
CHUNK_FILES = 4096
CHUNK_BYTES = 4 << 20
# A chunk ends where a new folder starts once it holds this many files: two tars
# creating files in one folder take turns on its lock, in different folders they do not.
FOLDER_CHUNK_FILES = 256
# Once the files sent average more than SMALL bytes (judged from SAMPLE_FILES on), the
# writer takes the rest: it is faster from ~8 KiB a file (docs/performance.md).
SMALL = 4 << 10
SAMPLE_FILES = 256
# Bytes found here that the tars have not taken yet, at most (see _Tars._drain); most
# are held in memory (the windows headers were checked in).
AHEAD_BYTES = 32 << 20
_TAR_UMASK = 0o333  # with the modes _FILE takes: every file 0444, as the writer's
_BLOCK = tar_members.BLOCK
_WINDOW = 64 << 10  # headers are read a window at a time, as tar_members.Blocks does
# Bytes 100-265 of a plain file's or a folder's header as GNU tar, tarfile and
# libarchive write it, and only that layout: octal digits (int() would also take a sign
# or underscores), no link name, the ustar or GNU magic. A file's mode is readable by
# all with no set-id or sticky bit, so the umask 0333 leaves exactly 0444. Group 1: a
# file's size or a folder's mtime; 2: the checksum; 3: the magic.
_POSIX = b"ustar\x0000"
_MAGIC = rb"(ustar\x0000|ustar  \0)"
_FILE = re.compile(
    rb"(?:[0-7]{3}0[4-7]{3}[ \0]|[0-7]{2}0[4-7]{3}[ \0]{2}).{16}"
    rb"([0-7]{11})[ \0][0-7]{11}[ \0]([0-7]{6})\0 0\0{100}" + _MAGIC,
    re.DOTALL,
)
_FOLDER = re.compile(
    rb"(?:[0-7]{7}[ \0]|[0-7]{6}[ \0]{2}).{16}0{11}[ \0]([0-7]{11})[ \0]([0-7]{6})\0 5\0{100}"
    + _MAGIC,
    re.DOTALL,
)
# A name the ordered writer takes as it is (writer.clean_name): relative, no empty, "."
# or ".." component, no ":" in the first five bytes (a drive letter is the writer's to
# judge); "./" in front is dropped (group 1 is the rest); a trailing "/" (group 2) is a
# folder's. It ends at a NUL or at the field's end.
_COMPONENT = rb"(?!\.\.?(?:/|\0|\Z))[^/\0]+"
_NAME = re.compile(
    rb"(?:\./)?((?![\\/])(?![^/\0]{1,4}:)"
    + _COMPONENT
    + rb"(?:/"
    + _COMPONENT
    + rb")*)(/?)(?:\0|\Z)",
    re.DOTALL,
)


@dataclass
class Head:
    """What the tars wrote: the archive up to ``end`` (a header they did not take, or
    the end marker when ``complete``), the folders made for it, and their mtimes."""

    end: int = 0
    complete: bool = False
    made: int = 0  # bytes of the files written
    files: int = 0
    folder_bytes: int = 0  # of folder headers, counted as progress here
    folders: set[str] = field(default_factory=set)
    folder_mtimes: dict[str, float] = field(default_factory=dict)
    # Bytes of the folder names kept above: past HELD_NAMES_BYTES the head stops, and
    # the writer, taking the folders over, refuses the archive.
    held: int = 0


@functools.cache
def gnu_tar() -> str | None:
    """The path of GNU tar, if that is what ``tar`` is here."""
    path = shutil.which("tar")
    if path is None:
        return None
    try:
        done = run([path, "--version"], 10)
    except NotRun:
        return None
    return path if done.returncode == 0 and "GNU tar" in done.stdout else None


def applies(ctx: ExtractContext, archive: Archive, dest: str, strip: int, nested: bool) -> bool:
    """Whether ``archive`` is extracted here first: a large plain tar, nothing asked
    of it that the tars do not do the writer's way, an empty destination, two cores,
    GNU tar."""
    if archive.fmt != "tar" or archive.growing is not None or nested or strip:
        return False
    if ctx.verify == "sha256" or archive.length < SPLIT_MIN_BYTES or cores(ctx.workers) < 2:
        return False
    try:
        with os.scandir(dest) as listing:
            if next(listing, None) is not None:
                return False
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        return False  # the writer's error
    return gnu_tar() is not None


def extract_head(ctx: ExtractContext, archive: Archive, dest: str) -> Head:
    """Extract the archive's leading plain files and folders under ``dest`` (see the
    module's docstring); an empty ``Head`` when the tars refused a name (nothing is
    left of what they wrote)."""
    os.makedirs(dest, exist_ok=True)
    head = Head()
    tars = _Tars(cores(ctx.workers), dest, archive, ctx)
    try:
        _read_headers(ctx, archive, dest, head, tars)
        ok = tars.finish()
    finally:
        tars.stop()
    if not ok:
        _empty(dest)
        ctx.progress.advance(-tars.counted_bytes - head.folder_bytes, -tars.counted_files)
        return Head()
    return head


def _read_headers(
    ctx: ExtractContext, archive: Archive, dest: str, head: Head, tars: _Tars
) -> None:
    """Check headers from the first, make folders and send files to ``tars``, up to
    the first member that is not a plain file or folder (see _FILE, _FOLDER) or the
    end marker. The loop a 200,000-file archive runs 200,000 times: kept flat. A file
    goes as the window its header was checked in, then the rest of its data spliced."""
    fd, base, length = archive.fd, archive.base, archive.length
    folders, mtimes = head.folders, head.folder_mtimes
    folders.add("")
    chunk: list[Segment] = []  # for the next tar
    chunk_files = chunk_bytes = 0
    held = memoryview(b"")  # the window's bytes being gathered for the chunk
    held_from = held_to = 0  # their span in the window
    parent = b""  # the folder of the last file, known to be made
    window, window_start = b"", 0
    offset = 0
    while True:
        at = offset - window_start
        if at + _BLOCK > len(window):
            ctx.check_cancelled()  # here too for folders, which no tar is sent
            chunk.append(held[held_from:held_to])
            window, window_start, at = os.pread(fd, _WINDOW, base + offset), offset, 0
            held, held_from, held_to = memoryview(window), 0, 0
        block = window[at : at + _BLOCK]
        kind = block[156:157]
        fields = (_FILE if kind == b"0" else _FOLDER).match(block, 100, 265)
        # A header cut short by the archive's end is the writer's error (its checksum
        # holds when what is missing was zeros).
        ok = fields is not None and len(block) == _BLOCK
        if not ok or not tar_members.checksum_ok(block, int(fields[2], 8)):
            head.complete = block == tar_members.ZERO_BLOCK
            break
        posix_prefix = fields[3] == _POSIX and block[345]
        named = _NAME.match(block, 0, 100) if not posix_prefix else _prefixed_name(block)
        if kind == b"5":
            # "." is the top folder only alone: after a prefix it is the prefix's folder.
            if named is not None:
                rel = named[1]
            else:
                rel = None if posix_prefix else _top_folder(block)
            if rel is None or offset + _BLOCK > length:  # cut short: the writer's error
                break
            if not _make_folders(dest, _text(rel), head, ctx.progress):
                break
            if rel:
                mtimes[_text(rel)] = int(fields[1], 8)
            end = offset + _BLOCK
            ctx.progress.advance(_BLOCK, 0)
            head.folder_bytes += _BLOCK
            chunk.append(held[held_from:held_to])  # a folder's header is not sent
            held_from = held_to = at + _BLOCK
        else:
            sent = tars.files_sent
            if not chunk_files and sent >= SAMPLE_FILES and head.made > sent * SMALL:
                break  # files this large are the writer's (see SMALL)
            size = int(fields[1], 8)
            end = offset + _BLOCK + ((size + 511) & ~511)
            if named is None or named[2] or end > length:  # a tar reads the padding too
                break
            folder = named[1].rpartition(b"/")[0]
            if folder != parent:
                if not _make_folders(dest, _text(folder), head, ctx.progress):
                    break
                parent = folder
                if chunk_files >= FOLDER_CHUNK_FILES:  # the folder's files to one tar
                    chunk.append(held[held_from:held_to])
                    held_from = held_to = at
                    tars.send(chunk, chunk_files)
                    chunk, chunk_files, chunk_bytes = [], 0, 0
            if held_to != at:  # not right after the last file's bytes: a new span
                chunk.append(held[held_from:held_to])
                held_from = at
            held_to = min(end - window_start, len(window))
            if end > window_start + held_to:  # the rest of its data, past the window
                chunk.append(held[held_from:held_to])
                chunk.append((window_start + held_to, end - window_start - held_to))
                held_from = held_to = len(window)
            head.made += size
            report_written(ctx.progress, size + ENTRY_BYTES + len(named[1]), 1)  # and its name
            chunk_files += 1
            chunk_bytes += end - offset
            if chunk_files == CHUNK_FILES or chunk_bytes >= CHUNK_BYTES:
                chunk.append(held[held_from:held_to])
                held_from = held_to
                tars.send(chunk, chunk_files)
                chunk, chunk_files, chunk_bytes = [], 0, 0
        offset = end
    chunk.append(held[held_from:held_to])
    if chunk_files:
        tars.send(chunk, chunk_files)
    head.files = tars.files_sent
    head.end = offset
    folders.discard("")


def _prefixed_name(block: bytes) -> re.Match[bytes] | None:
    """The name of a ustar header with a prefix (bytes 345-500, before the name)."""
    prefix = block[345:500].split(b"\0", 1)[0]
    return _NAME.fullmatch(prefix + b"/" + block[0:100].split(b"\0", 1)[0])


def _top_folder(block: bytes) -> bytes | None:
    """b"" for the archive's own top folder ("." or "./"), which is not made; else None."""
    return b"" if block[0:100].split(b"\0", 1)[0] in (b".", b"./") else None


def _text(name: bytes) -> str:
    return os.fsdecode(name)  # as tarfile (its encoding: the file system's) and the writer


def _make_folders(dest: str, rel: str, head: Head, progress: ProgressSink) -> bool:
    """``rel`` and its parents as real folders, each charged as it is made and its name
    kept in ``head``; False where a component is something else (a file a tar wrote),
    or past HELD_NAMES_BYTES: the ordered writer decides what follows."""
    folders = head.folders
    missing = []
    while rel not in folders:
        missing.append(rel)
        rel = rel.rpartition("/")[0]
    for here in reversed(missing):
        cost = len(here) + _HELD_OVERHEAD
        if head.held + cost > HELD_NAMES_BYTES:
            return False
        head.held += cost
        report_written(progress, FOLDER_BYTES + entry_bytes(here), 1)
        path = os.path.join(dest, here)
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path) or os.path.islink(path):
                return False
        folders.add(here)
    return True


def _empty(dest: str) -> None:
    """Remove what the tars' part left in ``dest`` (which it found empty)."""
    with os.scandir(dest) as listing:
        for entry in listing:
            delete_tree(entry.path, threading.Event())


class _Tars:
    """GNU tars reading members from non-blocking pipes this thread fills (``write``,
    ``splice``): a chunk goes to the tar with the least waiting, and the header loop
    waits only once AHEAD_BYTES wait. Started at the first chunk."""

    def __init__(self, count: int, dest: str, archive: Archive, ctx: ExtractContext) -> None:
        self._count, self._dest, self._archive, self._ctx = count, dest, archive, ctx
        self._tars: list[_Tar] = []
        self._errors = tempfile.TemporaryFile()
        self.failed = False
        # Progress counted as the pipes took the bytes: taken back if the tars failed.
        self.counted_bytes = self.counted_files = 0
        self.files_sent = 0

    def send(self, segments: list[Segment], files: int) -> None:
        """``segments`` (``files`` whole files) to the tar with the least waiting."""
        self._ctx.check_cancelled()
        self.files_sent += files
        while len(self._tars) < self._count:  # each kept as it starts: stop() ends it
            self._tars.append(self._start())
        tar = min(self._tars, key=lambda t: t.waiting)
        tar.queue(segments, files)
        self._drain(AHEAD_BYTES)

    def _drain(self, ahead: int) -> None:
        """Pump until at most ``ahead`` bytes wait for the tars: the headers read here
        stay close to what the tars read, so the archive's pages are read once even
        where it is larger than the memory. Naps between pumps, not a wait for room in a
        pipe, which wakes for every page a tar reads (docs/performance.md)."""
        self._pump()
        while sum(tar.waiting for tar in self._tars if tar.pipe >= 0) > ahead:
            time.sleep(_NAP_S)
            self._ctx.check_cancelled()
            self._pump()

    def _start(self) -> _Tar:
        path = gnu_tar()
        assert path is not None
        read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            with contextlib.suppress(OSError):  # a smaller pipe only costs wake-ups
                fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
            os.set_blocking(read_end, True)
            proc = spawn(
                [path, "-x", *_TAR_FLAGS, "-C", self._dest, "-f", "-"],
                stdin=read_end,
                stderr=self._errors,
                umask=_TAR_UMASK,
                env=_TAR_ENV,
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        return _Tar(proc, write_end)

    def _pump(self) -> None:
        """Move what each pipe takes now."""
        for tar in self._tars:
            if tar.pipe >= 0 and not tar.pump(self._archive, self):
                self.failed = True

    def count(self, nbytes: int, files: int) -> None:
        self._ctx.progress.advance(nbytes, files)
        self.counted_bytes += nbytes
        self.counted_files += files

    def finish(self) -> bool:
        """Send the rest, wait for every tar; whether each wrote every member it got."""
        for tar in self._tars:
            tar.queue_end()
        self._drain(0)
        for tar in self._tars:
            tar.close()
        codes = [tar.proc.wait() for tar in self._tars]
        return not self.failed and not any(codes)

    def stop(self) -> None:
        """On an error or cancel: no tar writes after this returns."""
        for tar in self._tars:
            tar.proc.kill()
            tar.close()
            tar.proc.wait()
        self._errors.close()


# Refuse any name already there (a tar never replaces), owner and mode not taken
# from the archive (the umask makes them 0444), whole records read from the pipe.
_TAR_FLAGS = ("--keep-old-files", "--no-same-owner", "--no-same-permissions", "--read-full-records")
# Nothing from the daemon's environment: TAR_OPTIONS or POSIXLY_CORRECT would change
# what a tar does.
_TAR_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
_PIPE_BYTES = 1 << 20
_NAP_S = 0.001
_END_MARKER = bytes(2 * _BLOCK)
_NOT_COUNTED = -1  # the end marker's "files": not the archive's bytes, not progress


# What goes to a tar: bytes checked here (headers, and data read with them), or a
# file's data past them, (offset, length) of the archive.
Segment = memoryview | tuple[int, int]


class _Tar:
    """One tar, its pipe, and the segments waiting to go into it."""

    def __init__(self, proc: Spawned[bytes], pipe: int) -> None:
        self.proc, self.pipe = proc, pipe
        self._segments: collections.deque[tuple[Segment, int]] = collections.deque()
        self.waiting = 0  # bytes queued, not yet in the pipe

    def queue(self, segments: list[Segment], files: int) -> None:
        """The non-empty ``segments``; ``files`` are counted done with the last of them."""
        lengths = [len(s) if isinstance(s, memoryview) else s[1] for s in segments]
        kept = [(s, n) for s, n in zip(segments, lengths, strict=True) if n]
        for i, (segment, length) in enumerate(kept):
            self._segments.append((segment, files if i == len(kept) - 1 else 0))
            self.waiting += length

    def queue_end(self) -> None:
        self._segments.append((memoryview(_END_MARKER), _NOT_COUNTED))
        self.waiting += len(_END_MARKER)

    def pump(self, archive: Archive, tars: _Tars) -> bool:
        """Fill the pipe from the queued segments until it is full; False if the tar is
        gone."""
        while self._segments:
            segment, files = self._segments[0]
            try:
                if isinstance(segment, memoryview):
                    moved = os.write(self.pipe, segment)
                    left: Segment = segment[moved:]
                    length = len(segment)
                else:
                    offset, length = segment
                    moved = _splice(archive, offset, length, self.pipe)
                    left = (offset + moved, length - moved)
            except BlockingIOError:
                return True
            except BrokenPipeError:
                self._segments.clear()
                self.waiting = 0
                self.close()
                return False
            self.waiting -= moved
            if moved < length:
                self._segments[0] = (left, files)
            else:
                self._segments.popleft()
            if files != _NOT_COUNTED:
                tars.count(moved, files if moved == length else 0)
        return True

    def close(self) -> None:
        if self.pipe >= 0:
            os.close(self.pipe)
            self.pipe = -1


def _splice(archive: Archive, offset: int, length: int, pipe: int) -> int:
    """Move up to ``length`` bytes at ``offset`` of the archive into ``pipe``, by the
    kernel where it can; raises BlockingIOError when the pipe is full."""
    start = archive.base + offset
    try:
        moved = os.splice(archive.fd, pipe, length, offset_src=start, flags=os.SPLICE_F_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        # This file cannot be spliced from: through memory, as much as the pipe takes.
        data = os.pread(archive.fd, min(length, _PIPE_BYTES), start)
        moved = os.write(pipe, data) if data else 0
    if moved == 0:
        raise EOFError("the archive ended inside a member")
    return moved
