"""One read-only image of a dataset, built from its source in one pass.

A tar stream (plain, gz, bz2, xz, zst) is read once, front to back, and each member
goes straight into the image (:mod:`stager.image.erofs`): no tree of files is written
on the way. A plain tar's file data is copied into the image in the kernel
(``copy_file_range``); a compressed one's is decompressed as it arrives, with the
decompressors extraction uses (:func:`stager.archive.formats.open_decompressed`). A
tree source is packed from a streaming walk of it (:func:`stager.fs.sources.walk`).

Members are judged by the rules of extraction, with its own code: names by
:func:`stager.archive.writer.clean_name` (no absolute path, no ``..``, no NUL),
links by :func:`stager.archive.job.judge_link` (the rule of ``tarfile``'s data filter: no link
that leads outside the dataset by its words) as they arrive and, once the image is
whole, as the kernel will resolve them through the image's own names and links
(:mod:`stager.image.erofs`), device files and FIFOs refused, hard links only to a
file an earlier member wrote, names within the kernel's limits. Then the request's
names apply: ``strip`` components, ``into`` a folder, and ``renames`` in order, as a
recipe's rename steps would move them after an extraction. Every file is 0444 and
every folder 0555, whatever the archive says; the image itself is left 0444.

What differs from an extraction, on purpose: a file's holes are written out as
zeros (EROFS's flat layout has none), and a folder that only implicit parents made
gets the image's own time (GNU tar gives it the time of extraction).

One image may take several inputs (:func:`build_from`): a staging's archives, each
with its own names, and the small tree of what its other steps made. With ``nested``,
archives inside a plain tar (ImageNet's 1,000 class tars) are read in place from
their byte range, each into the folder named after it, as extraction does.

The image is written as ``OUTPUT.partial`` beside ``OUTPUT``, synced, and renamed
into place: nothing half-built ever carries the final name.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stager.archive import tar_members
from stager.archive.formats import StreamReader, resolve_format, sniff
from stager.archive.job import Archive, judge_link, nested_suffix, translate
from stager.archive.tar_reader import (
    DUMPDIR,
    NOT_FILES,
    open_stream,
    require_inside,
    skipped,
)
from stager.archive.writer import clean_name, refused, through_link, too_many_names, unsafe
from stager.core.errors import UnknownFormat
from stager.fs import sources
from stager.fs.credentials import access
from stager.fs.durable_names import sync_folder
from stager.image.erofs import Blob, ErofsWriter
from stager.image.names import ImageConflict, LinkLeaves, RangeFile, TooManyNames
from stager.image.squashfs import SquashfsWriter
from stager.wire.progress import ProgressSink, report_written

_HEADER_READAHEAD = 16384
# The writers, by format: driven alike (folder, file_range, file_stream, symlink,
# hardlink, is_folder, folders, finish, close).
Writer = ErofsWriter | SquashfsWriter
WRITERS: dict[str, type[Writer]] = {"erofs": ErofsWriter, "squashfs": SquashfsWriter}
# A run of files given to the writer at once spans at most this much of the archive,
# or one member: its progress is told at its end (an index build's copy waits on it,
# stager.image.index._AHEAD).
RUN_BYTES = 32 << 10


@dataclass(frozen=True)
class Names:
    """Where a member's clean name lands in the image: ``strip`` leading components
    dropped, put ``into`` a folder, then each ``(old, new)`` of ``renames`` applied in
    order to the name and everything under it (a recipe's rename steps)."""

    strip: int = 0
    into: str = ""
    renames: tuple[tuple[str, str], ...] = ()

    def place(self, rel: str) -> str:
        if self.into:
            rel = f"{self.into}/{rel}"
        for old, new in self.renames:
            if rel == old:
                rel = new
            elif rel.startswith(old) and rel[len(old)] == "/":
                rel = new + rel[len(old) :]
        return rel


@dataclass(frozen=True)
class TarInput:
    """An archive to read into the image: ``path`` names it (and is opened unless
    ``fd``, a descriptor opened already, e.g. through a staging's gateway, is given;
    the caller closes it), its members placed by ``names``; ``nested``: archives
    inside a plain tar are read too, each into the folder of its name."""

    path: str
    names: Names = field(default_factory=Names)
    fd: int | None = None
    nested: bool = False
    format: str = "auto"
    # A download still arriving (stager.archive.growing): read once, front to back, as
    # a stream whatever its format, each read waiting for its bytes; ``fd`` is its file.
    growing: io.RawIOBase | None = None


@dataclass(frozen=True)
class TreeInput:
    """A folder to pack into the image. ``owned``: a tree stager made itself (an
    attempt's), walked with this process's rights and never through a link; else a
    source, opened as whoever reads sources here (:mod:`stager.fs.credentials`)."""

    path: str
    names: Names = field(default_factory=Names)
    owned: bool = False


Input = TarInput | TreeInput


@dataclass
class Built:
    """What a build made."""

    path: str
    size: int  # of the image, in bytes
    files: int  # files, symlinks and hard links
    folders: int
    data_bytes: int  # of file content
    seconds: float


class _NoProgress:
    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        pass

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        pass


@dataclass
class BuildOptions:
    names: Names = field(default_factory=Names)
    progress: ProgressSink = field(default_factory=_NoProgress)
    # Called before each window of headers and each member not in a run (cancel).
    check: Callable[[], None] = lambda: None
    build_time: int = 0  # the image's own time stamp (0: reproducible images)
    # fsync the image before its rename: a staging publishes only what is on the disk
    # (a benchmark turns it off to compare with a plain cp).
    sync: bool = True
    # The image file's mode: 0444, or 0400 for data only its user may read through the
    # mount (the node service's private copies: the file itself is root's alone).
    mode: int = 0o444
    # The image's top folder owned by this uid, mode 0500 (None: root's, 0555): a
    # private copy's mount that only its user may enter, read-only all the same.
    top_owner: int | None = None
    # The image's format: "erofs" (the kernel's, or erofsfuse) or "squashfs" (a user's
    # own daemon's, read by squashfuse_ll): the same members, the same names.
    format: str = "erofs"


def build_image(source: str, output: str, options: BuildOptions | None = None) -> Built:
    """Build the image ``output`` from ``source`` (a tar, compressed or not, or a folder)."""
    options = options or BuildOptions()
    if os.path.isdir(source):
        return build_from([TreeInput(source, options.names)], output, options)
    return build_from([TarInput(source, options.names)], output, options)


def build_from(
    inputs: list[Input],
    output: str,
    options: BuildOptions | None = None,
    blob: Blob | None = None,
    before_publish: Callable[[], None] = lambda: None,
    opened: Callable[[str], None] = lambda partial: None,
) -> Built:
    """Build the image ``output`` from ``inputs``, in order (a name given twice: the
    last one wins, as in a tar appended to). With ``blob``, an index image: the files
    of the input read from ``blob.fd`` stay there (:class:`stager.image.erofs.Blob`);
    ``opened`` is told the image's partial file once it is open (an embedded blob's
    copy goes into it), and ``before_publish`` runs once the image is whole, before
    its fsync and its rename (the blob's rename, or the end of its copy)."""
    options = options or BuildOptions()
    started = time.monotonic()
    partial, spill = output + ".partial", output + ".spill"
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    top = (options.top_owner, 0o500) if options.top_owner is not None else (0, 0o555)
    writer = WRITERS[options.format](
        fd,
        spill,
        options.build_time,
        top_owner=top[0],
        top_mode=top[1],
        blob=blob,
        early_writeback=options.sync,
        charge=lambda nbytes: report_written(options.progress, nbytes),
    )
    label = inputs[0].path if inputs else output
    try:
        opened(partial)
        try:
            starting = getattr(options.progress, "starting", None)
            own = _own_files(fd, spill, output)
            for source in inputs:
                label = source.path
                if starting is not None:
                    starting(source.path)
                if isinstance(source, TreeInput):
                    _TreeSource(source, writer, options, own).run()
                else:
                    _TarSource(source, writer, options, output).run()
            size = writer.finish()
        except LinkLeaves as exc:  # the image's links judged at the end, by its final names
            raise unsafe(label, exc.path, exc.why) from exc
        except TooManyNames as exc:  # a tree's folders (an archive's: by its member)
            raise too_many_names(label, exc.path) from exc
        except ImageConflict as exc:  # found at the end, when the folders are written
            raise refused(label, exc.path, exc.why) from exc
        before_publish()
        os.fchmod(fd, options.mode)
        if options.sync:
            os.fsync(fd)
        os.rename(partial, output)
        if options.sync:
            sync_folder(os.path.dirname(os.path.abspath(output)))
    except BaseException:
        writer.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
    finally:
        os.close(fd)
    elapsed = time.monotonic() - started
    return Built(output, size, writer.files, writer.folders, writer.data_bytes, elapsed)


def _own_files(fd: int, spill: str, output: str) -> frozenset[tuple[int, int]]:
    """The files a build makes beside its output (the partial image, open as ``fd``;
    the ``spill``), and an older image of the same name: a folder that holds the output
    must not be packed with them (``mksquashfs`` leaves its output out the same way)."""
    st = os.fstat(fd)
    own = {(st.st_dev, st.st_ino)}
    for path in (spill, output):
        with contextlib.suppress(FileNotFoundError):
            found = os.stat(path, follow_symlinks=False)
            own.add((found.st_dev, found.st_ino))
    return frozenset(own)


def _split(rel: str) -> tuple[str, str]:
    parent, _, name = rel.rpartition("/")
    return parent, name


class _Placer:
    """Names into folders of the image. A member under one of the archive's own
    symlinks goes where GNU tar puts it, through the link, resolved here by the
    archive's names (a link whose target is absolute or climbs with ``..`` is not
    followed: GNU tar does not write through it either)."""

    def __init__(self, writer: Writer, label: str) -> None:
        self.writer = writer
        self.label = label
        self.symlinks: dict[str, str] = {}  # few: kept to place members under them

    def parent(self, rel: str, member: str) -> tuple[int, str]:
        parent, name = _split(rel)
        return self.folder(parent, member), name

    def folder(self, folder: str, member: str) -> int:
        if self.symlinks and not self.writer.is_folder(folder):
            folder = self.through_links(folder, member)
        return self.writer.folder(folder)

    def through_links(self, folder: str, member: str) -> str:
        parts, done, hops = folder.split("/") if folder else [], "", 0
        while parts:
            here = f"{done}/{parts[0]}" if done else parts[0]
            target = self.symlinks.get(here)
            if target is None:
                done, parts = here, parts[1:]
                continue
            hops += 1
            parts = through_link(self.label, member, here, target, hops) + parts[1:]
            done = ""
        return done


class _TarSource:
    def __init__(
        self,
        source: TarInput,
        writer: Writer,
        options: BuildOptions,
        output: str,
        place: _Placer | None = None,
        inner: bool = False,
    ) -> None:
        self.source = source
        self.path = source.path
        self.names = source.names
        self.writer = writer
        self.options = options
        self.output = output
        self.place = place or _Placer(writer, source.path)
        # An archive inside another: its bytes are counted by the outer one's progress.
        self.inner = inner
        # Links are judged as if the image were extracted here: a path never made, so
        # that judge_link resolves their targets by the names alone.
        self.judge_root = os.path.abspath(output) + ".links"

    def run(self) -> None:
        fd = self.source.fd
        if fd is None:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        growing = self.source.growing
        try:
            # A growing file's size is not its length yet: the download's own progress
            # counts its bytes (stager.staging.overlap).
            length = os.fstat(fd).st_size if growing is None else 0
            head = os.pread(fd, tarfile.BLOCKSIZE, 0) if growing is None else growing.head(512)
            fmt = resolve_format(self.path, self.source.format, head)
            if fmt == "zip":
                raise UnknownFormat(
                    f"archive {self.path} is a zip; an image is built from a tar (plain, gz, "
                    "bz2, xz or zst) or a folder; extract it or re-pack it as a tar"
                )
            self.options.progress.add_total(length, 0)
            with translate(self.path):
                self._read(Archive(fd, 0, length, fmt, self.path, growing=growing))
        finally:
            if self.source.fd is None:
                os.close(fd)

    def _read(self, archive: Archive) -> None:
        raw = archive.reader()
        stream = open_stream(archive, raw)
        with stream if stream is not None else contextlib.nullcontext():
            headers = stream or io.BufferedReader(raw, _HEADER_READAHEAD)  # type: ignore[arg-type]
            fd, base, length = archive.fd, archive.base, archive.length
            blocks = None if stream else tar_members.Blocks(fd, base, length)
            self._blocks = blocks  # a plain tar's: a small file's data is in its window
            progress, check = self.options.progress, self.options.check
            # A plain tar's files in the fast header format (tar_members.Member), in one
            # folder, go to the writer as a run (files_range): the folder found once, the
            # content charged before, the progress told after. Any other member or an
            # error ends the run first (a folder or a link may change where names land).
            plain = stream is None and not self.source.nested
            fast, dirtype, path = tar_members.Member, tarfile.DIRTYPE, self.path
            strip, place = self.names.strip, self.names.place
            peek = blocks.peek if blocks is not None else None
            block = self.writer.block
            run: list[RangeFile] = []  # files of the folder ``known``, not yet written
            known, number, run_bytes, run_end = None, 0, 0, 0
            consumed = 0  # the archive's bytes counted as done

            def end_run() -> None:
                nonlocal consumed, run_bytes
                if run:
                    files = run.copy()
                    run.clear()  # given once, whatever happens
                    report_written(progress, run_bytes)
                    run_bytes = 0
                    try:
                        self.writer.files_range(number, fd, files)
                    except ImageConflict as exc:
                        raise refused(path, exc.path, exc.why) from exc
                    progress.advance(0 if self.inner else run_end - consumed, len(files))
                    consumed = run_end

            with tar_members.open_tar(headers) as tar:  # type: ignore[arg-type]
                try:
                    for member, next_header in tar_members.members(tar, headers, check, blocks):  # type: ignore[arg-type]
                        if plain and member.__class__ is fast and member.type != dirtype:
                            clean = clean_name(path, member.name, strip)
                            if clean is not None:
                                folder, _, name = place(clean).rpartition("/")
                                at, size = member.offset_data, member.size
                                if folder != known or next_header - consumed > RUN_BYTES:
                                    end_run()
                                    known = folder
                                    try:
                                        number = self.place.folder(folder, member.name)
                                    except ImageConflict as exc:
                                        raise self._conflict(member, exc) from exc
                                if at + size > length:
                                    require_inside(archive, member, size)
                                tail = peek(at + size - size % block, size % block)  # type: ignore[misc]
                                run.append((name, size, member.mtime, base + at, tail, member.name))
                                run_bytes, run_end = run_bytes + size, next_header
                                if run_end - consumed > RUN_BYTES:
                                    end_run()  # a big member: told before the next window
                                continue
                        end_run()
                        known = None
                        # Any other member may write far more than it spans (a sparse
                        # file's holes): cancel is looked at before each, not only
                        # before each window of a plain tar's headers (a stream's member
                        # loop looks before each member already).
                        if blocks is not None:
                            check()
                        self._member(archive, stream, member)
                        if self.inner:
                            progress.advance(0, 1)
                            continue
                        now = stream.compressed_pos() if stream is not None else next_header
                        progress.advance(now - consumed, 1)
                        consumed = now
                    end_run()
                except BaseException:
                    end_run()  # an earlier member's error first, as member by member
                    raise
            if stream is not None:
                stream.drain()  # lets the decompressor check its trailer
            if not self.inner:
                length = archive.length if archive.growing is None else raw.tell()
                progress.advance(max(0, length - consumed), 0)

    def _conflict(self, member: tarfile.TarInfo, exc: ImageConflict) -> Exception:
        """A writer's refusal, worded for this archive's member."""
        if isinstance(exc, TooManyNames):
            return too_many_names(self.path, member.name)
        return refused(self.path, member.name, exc.why)

    def _member(
        self, archive: Archive, stream: StreamReader | None, member: tarfile.TarInfo
    ) -> None:
        if skipped(self.path, member):
            return
        names = self.names
        clean = clean_name(self.path, member.name, names.strip)
        if clean is None:
            return
        rel = names.place(clean)
        writer, mtime = self.writer, _mtime(member.mtime)
        if self.source.nested and stream is None and member.isreg():
            if self._inner(archive, member, clean):
                return
        try:
            if member.isdir() or member.type == DUMPDIR:
                if self.place.symlinks:
                    self.place.symlinks.pop(rel, None)  # a folder replaces a symlink
                    head, name = _split(rel)
                    if not writer.is_folder(head):
                        head = self.place.through_links(head, member.name)
                    rel = f"{head}/{name}" if head else name
                writer.folder(rel, mtime)
            elif member.isreg() or member.type not in NOT_FILES:
                parent, name = self.place.parent(rel, member.name)
                self._file(archive, stream, member, parent, name, mtime)
            elif member.issym():
                judge_link(rel, member.linkname, False, self.judge_root, self.path, member.name)
                parent, name = self.place.parent(rel, member.name)
                writer.symlink(parent, name, member.linkname, mtime, member.name)
                self.place.symlinks[rel] = member.linkname
            elif member.islnk():
                self._hardlink(member, rel)
            else:
                raise unsafe(self.path, member.name, "a device file or FIFO")
        except ImageConflict as exc:
            raise self._conflict(member, exc) from exc

    def _file(
        self,
        archive: Archive,
        stream: StreamReader | None,
        member: tarfile.TarInfo,
        parent: int,
        name: str,
        mtime: int,
    ) -> None:
        if member.sparse is None and stream is None:  # read from its byte range
            size, offset, block = member.size, member.offset_data, self.writer.block
            require_inside(archive, member, size)
            tail = self._blocks.peek(offset + size - size % block, size % block)  # type: ignore[union-attr]
            self.writer.file_range(
                parent, name, size, mtime, archive.fd, archive.base + offset, tail
            )
            report_written(self.options.progress, size)
            return
        if member.sparse is not None:
            # Its holes are written out as zeros: counted as they are written, so that a
            # staging's bound stops a small archive that makes a huge file part way.
            read = _counted(_sparse_reader(archive, stream, member), self.options.progress)
        else:
            stream.seek(member.offset_data)  # type: ignore[union-attr]
            read = _counted(stream.read, self.options.progress)  # type: ignore[union-attr]
        self.writer.file_stream(parent, name, member.size, mtime, read)

    def _inner(self, archive: Archive, member: tarfile.TarInfo, clean: str) -> bool:
        """An archive member of a plain tar read in place into the folder of its name
        (``n01440764.tar`` -> ``n01440764/``), as extraction's ``nested`` does; False
        when it is not an archive after all (then it is a file like any other)."""
        suffix = nested_suffix(clean)
        if suffix is None:
            return False
        require_inside(archive, member, member.size)
        base = archive.base + member.offset_data
        fmt = sniff(os.pread(archive.fd, tarfile.BLOCKSIZE, base)) if member.size else None
        if fmt is None or fmt == "zip":
            return False
        folder = clean[: -len(suffix)]
        into = f"{self.names.into}/{folder}" if self.names.into else folder
        names = Names(0, into, self.names.renames)
        label = f"{self.path}:{clean}"
        inner = TarInput(label, names, archive.fd, nested=False)
        self.writer.folder(self.names.place(folder), _mtime(member.mtime))
        reader = _TarSource(inner, self.writer, self.options, self.output, self.place, inner=True)
        with translate(label):
            reader._read(Archive(archive.fd, base, member.size, fmt, label))
        return True

    def _hardlink(self, member: tarfile.TarInfo, rel: str) -> None:
        names = self.names
        label = f"{member.name} -> {member.linkname}"
        target = clean_name(self.path, member.linkname, names.strip, label)
        if target is None:
            return
        target = names.place(target)
        judge_link(rel, target, True, self.judge_root, self.path, member.name)
        target_folder, target_name = _split(target)
        if not self.writer.is_folder(target_folder):
            raise ImageConflict(
                rel, f"is a hard link to {target!r}, which no earlier member wrote as a file"
            )
        parent, name = self.place.parent(rel, member.name)
        folder = self.writer.folder(target_folder)
        self.writer.hardlink(parent, name, folder, target_name, member.name)


def _mtime(value: float) -> int:
    return max(0, int(value))


def _counted(read: Callable[[int], bytes], progress: ProgressSink) -> Callable[[int], bytes]:
    """``read``, each piece it gives counted as written (it goes into the image)."""

    def counted(count: int) -> bytes:
        piece = read(count)
        report_written(progress, len(piece))
        return piece

    return counted


def _sparse_reader(
    archive: Archive, stream: StreamReader | None, member: tarfile.TarInfo
) -> Callable[[int], bytes]:
    """A reader of a sparse member's whole content: its data regions, zeros between."""
    regions = [(position, length) for position, length in member.sparse if length]
    stored = sum(length for _, length in regions)
    if stream is None:
        require_inside(archive, member, stored)
    else:
        stream.seek(member.offset_data)
    data_at = archive.base + member.offset_data
    state = {"pos": 0, "region": 0, "in_region": 0, "stored": 0}

    def read(count: int) -> bytes:
        out = bytearray()
        while count and state["pos"] < member.size:
            index = state["region"]
            if index < len(regions) and state["pos"] >= regions[index][0]:
                position, length = regions[index]
                take = min(count, length - state["in_region"])
                if stream is None:
                    piece = os.pread(archive.fd, take, data_at + state["stored"])
                else:
                    piece = stream.read(take)
                if len(piece) != take:
                    raise EOFError(f"archive ended inside member {member.name!r}")
                state["in_region"] += take
                state["stored"] += take
                if state["in_region"] == length:
                    state["region"], state["in_region"] = index + 1, 0
            else:
                next_data = regions[index][0] if index < len(regions) else member.size
                take = min(count, next_data - state["pos"])
                piece = bytes(take)
            out += piece
            state["pos"] += take
            count -= take
        return bytes(out)

    return read


class _TreeSource(sources.Visitor):
    """A folder packed from a streaming walk of it: files, folders and links, never a
    list of the tree's files."""

    def __init__(
        self,
        source: TreeInput,
        writer: Writer,
        options: BuildOptions,
        own: frozenset[tuple[int, int]] = frozenset(),
    ) -> None:
        self.path = os.path.abspath(source.path)
        self.source = source
        self.writer = writer
        self.options = options
        self.own = own  # the build's own files, left out (:func:`_own_files`)
        self.judge_root = self.path
        # Files with more than one name, by inode: later names become hard links, as
        # in the tree (only these are kept: few in a dataset).
        self.linked: dict[tuple[int, int], tuple[int, str]] = {}

    def run(self) -> None:
        if self.source.owned:
            top = sources.open_top_unconfined(self.path)
        else:
            top = sources.open_top(self.path, sources.Roots())
        try:
            sources.walk(top, self, check=self.options.check)
        finally:
            os.close(top.fd)

    def _rel(self, folder: sources.Folder, name: str) -> str:
        return self.source.names.place(folder.child_rel(name))

    def subdir(self, folder: sources.Folder, entry: os.DirEntry[str]) -> sources.Folder | None:
        child = sources.open_child(folder, entry.name)
        self.writer.folder(self._rel(folder, entry.name), _mtime(child.st.st_mtime))
        return child

    def file(self, folder: sources.Folder, entry: os.DirEntry[str]) -> None:
        flags = sources.READ_FLAGS | os.O_NOFOLLOW
        if folder.source:
            fd = access().open(entry.name, flags, dir_fd=folder.fd)
        else:
            fd = os.open(entry.name, flags, dir_fd=folder.fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # swapped since the listing
                raise sources.refuse_special(folder.join(entry.name), st.st_mode)
            if (st.st_dev, st.st_ino) in self.own:
                return
            parent, name = _split(self._rel(folder, entry.name))
            number = self.writer.folder(parent)
            first = self.linked.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
            if first is not None:
                self.writer.hardlink(number, name, *first, folder.join(entry.name))
            else:
                self.writer.file_range(number, name, st.st_size, _mtime(st.st_mtime), fd, 0)
                report_written(self.options.progress, st.st_size)
                if st.st_nlink > 1:
                    self.linked[(st.st_dev, st.st_ino)] = (number, name)
        finally:
            os.close(fd)
        self.options.progress.advance(st.st_size, 1)

    def link(self, folder: sources.Folder, entry: os.DirEntry[str]) -> sources.Folder | None:
        if folder.source:
            target = access().readlink(entry.name, dir_fd=folder.fd)
        else:
            target = os.readlink(entry.name, dir_fd=folder.fd)
        rel = self._rel(folder, entry.name)
        judge_link(rel, target, False, self.judge_root, self.path, folder.join(entry.name))
        parent, name = _split(rel)
        st = entry.stat(follow_symlinks=False)
        number = self.writer.folder(parent)
        self.writer.symlink(number, name, target, _mtime(st.st_mtime), folder.join(entry.name))
        self.options.progress.advance(0, 1)
        return None
