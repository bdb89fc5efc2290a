"""Archive formats for ``extract``: detection by magic bytes, size estimates, the
first-header check, decompressed streams.

Detection looks at content, never at the name alone: a ``.tar.gz`` that is
really a zstd stream is read as zstd only when the step asks for ``auto``.
"""

from __future__ import annotations

import bz2
import io
import lzma
import os
import tarfile
import zipfile
from typing import BinaryIO, Literal

import zstandard
from isal import igzip, igzip_threaded

from stager.archive import tar_members
from stager.core.errors import CorruptArchive, UnknownFormat

# What an extract or unpack step may name as its archive format.
ArchiveFormat = Literal["auto", "tar", "tar.gz", "tar.bz2", "tar.xz", "tar.zst", "zip"]

COMPRESSED_TARS = ("tar.gz", "tar.bz2", "tar.xz", "tar.zst")
FORMATS = ("tar", *COMPRESSED_TARS, "zip")

# Longest first so ".tar.gz" wins over ".gz"; used for names only (nested
# archives, messages), the format itself always comes from the magic bytes.
ARCHIVE_SUFFIXES = {
    ".tar.gz": "tar.gz",
    ".tgz": "tar.gz",
    ".tar.bz2": "tar.bz2",
    ".tbz2": "tar.bz2",
    ".tar.xz": "tar.xz",
    ".txz": "tar.xz",
    ".tar.zst": "tar.zst",
    ".tzst": "tar.zst",
    ".tar": "tar",
    ".zip": "zip",
}

_MAGIC = (
    (b"\x1f\x8b", "tar.gz"),
    (b"BZh", "tar.bz2"),
    (b"\xfd7zXZ\x00", "tar.xz"),
    (b"\x28\xb5\x2f\xfd", "tar.zst"),
    (b"PK\x03\x04", "zip"),
    (b"PK\x05\x06", "zip"),  # an empty zip is only its end-of-directory record
)

# Decompressed bytes pulled per read: large enough that per-call overhead and
# GIL hand-offs stay negligible, small enough to keep memory flat.
STREAM_CHUNK = 4 << 20


def archive_suffix(name: str) -> str | None:
    """The archive extension of ``name`` (".tar.gz", ".zip", ...) or None."""
    lower = name.lower()
    for suffix in ARCHIVE_SUFFIXES:
        if lower.endswith(suffix) and len(lower) > len(suffix):
            return suffix
    return None


def sniff(head: bytes) -> str | None:
    """Format from the first bytes of an archive, or None when nothing matches."""
    for magic, fmt in _MAGIC:
        if head.startswith(magic):
            return fmt
    if len(head) >= tarfile.BLOCKSIZE and _is_tar_header(head[: tarfile.BLOCKSIZE]):
        return "tar"
    return None


def _is_tar_header(block: bytes) -> bool:
    # ustar/GNU archives carry "ustar" at 257; old v7 ones only a valid checksum.
    if block[257:262] == b"ustar":
        return True
    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def resolve_format(path: str, requested: str, head: bytes) -> str:
    """The format to read ``path`` as; raise with a sentence saying what to change."""
    detected = sniff(head)
    if requested != "auto":
        if detected is not None and detected != requested:
            raise CorruptArchive(
                f"archive {path} is not {requested} (its content looks like {detected}); "
                "set format to 'auto' or to the right one"
            )
        if detected is None:
            raise CorruptArchive(
                f"archive {path} does not start like a {requested} archive: it is truncated "
                "or corrupt; re-download or re-create it"
            )
        return requested
    if detected is not None:
        return detected
    if not head:
        raise CorruptArchive(f"archive {path} is empty; re-download or re-create it")
    suffix = archive_suffix(path)
    if suffix is not None:
        # Named like an archive but unreadable as one: the file is damaged.
        raise CorruptArchive(
            f"archive {path} does not look like a {ARCHIVE_SUFFIXES[suffix]} archive: it is "
            "truncated or corrupt; re-download or re-create it"
        )
    raise UnknownFormat(
        f"format of archive {path} is not recognised; set format to one of {', '.join(FORMATS)}"
    )


def open_decompressed(raw: BinaryIO, fmt: str, read_ahead: bool = False) -> BinaryIO:
    """A readable stream of the tar inside a compressed archive read from ``raw`` (a
    plain tar: ``raw`` itself). The stream must be closed: that stops its thread.

    gzip goes through python-isal: ~1.5x faster than zlib, and (unlike rapidgzip) a
    truncated stream raises instead of ending quietly. With ``read_ahead`` (an
    extraction, not a check that reads a few KiB) an isal thread decompresses ahead.
    """
    if fmt == "tar":
        return raw
    if fmt == "tar.gz":
        if read_ahead:
            # Blocks of a quarter chunk: ahead of the reader it holds 2 decompressed
            # blocks and reads 8 compressed ones at a time (10 MiB at 4 MiB chunks).
            block = STREAM_CHUNK // 4
            return igzip_threaded.open(raw, "rb", threads=1, block_size=block)
        return igzip.IGzipFile(fileobj=raw, mode="rb")
    if fmt == "tar.bz2":
        return bz2.BZ2File(raw, "rb")
    if fmt == "tar.xz":
        return lzma.LZMAFile(raw, "rb")
    if fmt == "tar.zst":
        reader = zstandard.ZstdDecompressor().stream_reader(
            raw, read_size=1 << 20, read_across_frames=True
        )
        return reader  # type: ignore[return-value]
    raise ValueError(f"not a compressed tar format: {fmt}")


def estimate_output(path: str, fmt: str, size: int, raw: BinaryIO) -> int:
    """Bytes extraction will write, for the free-space check before staging: a tar's or
    zip's own size (a close upper bound: media are mostly stored); a tar.gz's trailer
    size (modulo 4 GiB: the smallest such value at least the archive's size, exact for
    one member of incompressible data); a tar.zst's frame content size when recorded;
    else twice the archive's size (images compress ~1x, text 3-5x)."""
    if fmt in ("tar", "zip"):
        return size
    if fmt == "tar.gz" and size >= 18:
        raw.seek(size - 4)
        isize = int.from_bytes(raw.read(4), "little")
        estimate = isize
        while estimate < size:
            estimate += 1 << 32
        return estimate
    if fmt == "tar.zst":
        raw.seek(0)
        try:
            content = zstandard.frame_content_size(raw.read(18))
        except zstandard.ZstdError:
            content = -1
        if content > 0:
            return content
    return 2 * size


def read_first_header(raw: io.RawIOBase, fmt: str) -> None:
    """Read the first header of the archive ``raw`` holds, as ``fmt``: the request-time
    check that it is readable. A zip's central directory is read whole (it is at the
    end); a compressed tar's first block is decompressed and must be a tar header."""
    if fmt == "zip":
        zipfile.ZipFile(raw).close()
    elif fmt == "tar":
        tar_members.open_tar(raw).close()  # type: ignore[arg-type]
    else:
        with open_decompressed(_SmallReads(raw), fmt) as stream:  # type: ignore[arg-type]
            head = stream.read(tarfile.BLOCKSIZE)
        if sniff(head) != "tar":
            raise tarfile.ReadError("the decompressed data is not a tar archive")


class _SmallReads(io.RawIOBase):
    """``raw``, handing out at most ``_SIP`` bytes per read: decompressors fill large
    buffers (igzip 512 KiB, zstd 1 MiB) where the check needs 512 bytes of output."""

    _SIP = 16 << 10

    def __init__(self, raw: io.RawIOBase) -> None:
        super().__init__()
        self._raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int | None:  # type: ignore[override]
        return self._raw.readinto(memoryview(buffer)[: self._SIP])


class StreamReader(io.RawIOBase):
    """A forward-seekable file over a decompressed stream, for ``tarfile`` mode 'r:'
    (the fast one: it seeks over file data). tarfile seeks one byte back before each
    header: the previous chunk is kept for that, where ``bz2``/``lzma`` files would
    rewind to the start."""

    def __init__(self, stream: BinaryIO, raw: BinaryIO, arriving: bool = False) -> None:
        super().__init__()
        self._stream = stream
        self._raw = raw
        # A download still arriving: each chunk is what one read of the stream gives
        # (read1: what is decompressed so far), not a whole STREAM_CHUNK, so that the
        # members in its last bytes are not held back until the download ends.
        self._read = getattr(stream, "read1", stream.read) if arriving else stream.read
        self._prev = b""  # chunk before ``_chunk``, for short backward seeks
        self._chunk = b""
        self._start = 0  # stream offset of ``_chunk[0]``
        self._pos = 0
        self._eof = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def compressed_pos(self) -> int:
        """Bytes of the archive consumed so far, for progress."""
        return self._raw.tell()

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            pos += self._pos
        elif whence != os.SEEK_SET:
            raise io.UnsupportedOperation("a compressed stream cannot seek from its end")
        if pos < self._start - len(self._prev):
            raise io.UnsupportedOperation("a compressed stream cannot seek backwards")
        self._pos = pos
        return pos

    def _fill(self) -> bool:
        if self._eof:
            return False
        data = self._read(STREAM_CHUNK)
        if not data:
            self._eof = True
            return False
        self._start += len(self._chunk)
        self._prev, self._chunk = self._chunk, data
        return True

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = 1 << 62
        parts: list[bytes] = []
        while size > 0:
            offset = self._pos - self._start
            if offset < 0:  # inside the previous chunk after a backward seek
                piece = self._prev[len(self._prev) + offset :][:size]
            elif offset < len(self._chunk):
                piece = self._chunk[offset : offset + size]
            elif self._fill():
                continue
            else:
                break
            parts.append(piece)
            self._pos += len(piece)
            size -= len(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def drain(self) -> None:
        """Read to the end, so the decompressor checks its trailer (CRC, size)."""
        while self._fill():
            pass
        self._pos = self._start + len(self._chunk)

    def close(self) -> None:
        # The raw file first: a decompressor's read-ahead thread waiting on it (a growing
        # download) is released before closing the stream waits for that thread.
        self._raw.close()
        self._stream.close()
        super().close()
