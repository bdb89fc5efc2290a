"""The ``extract`` op: tar, tar.gz/bz2/xz/zst and zip, nested archives, never outside ``dst``.

The op checks the request (readable, a known format, a sane first header) and runs
:mod:`stager.archive.extractor` on the archive opened confined to the allowed roots.
Safety lives in :mod:`stager.archive.writer`; library errors become ours in
:func:`stager.archive.job.translate`. With any ``verify`` but ``none`` the archive must
not change while it is read. An archive a ``fetch`` is still downloading is read as
it arrives (``run_growing``, by :mod:`stager.staging.overlap`); a URL ``src`` becomes
that pair. Benchmark: bench/bench_extract.py.
"""

from __future__ import annotations

import io
import os
import tarfile
from contextlib import suppress
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator

from stager.archive.extractor import extract_archive
from stager.archive.formats import (
    ARCHIVE_SUFFIXES,
    ArchiveFormat,
    archive_suffix,
    estimate_output,
    read_first_header,
    resolve_format,
)
from stager.archive.growing import GrowingFile
from stager.archive.job import Archive, translate
from stager.core.errors import CorruptArchive, VerifyFailed
from stager.fs.seal import KnownTree
from stager.fs.sources import open_source, require_source
from stager.ops.base import (
    CheckContext,
    ImageStream,
    OpContext,
    RelativePath,
    StepParams,
    source_or_inside,
)
from stager.ops.fetch import http_url, url_file_name

# Where an extract of a URL downloads its archive, inside the dataset.
DOWNLOADS = ".download"


def _is_url(src: str) -> bool:
    return src.startswith(("http://", "https://"))


def _archive_source(value: str) -> str:
    """An absolute path, an earlier step's output, or an http(s) URL naming a file."""
    if not _is_url(value):
        if "://" in value:  # as a relative path, a folder named "ftp:": surely a mistake
            raise ValueError(
                f"src {value!r} is a URL stager cannot download; extract downloads "
                "http:// and https:// URLs, or give a path"
            )
        return source_or_inside(value)
    http_url(value)
    if url_file_name(value) is None:
        raise ValueError(
            f"url {value!r} names no file; fetch it with a 'fetch' step whose dst names "
            "the file, then extract that"
        )
    return value


class ExtractStep(StepParams):
    """Extract an archive; ``nested`` also extracts archives found inside it.

    A relative ``src`` names an archive an earlier step wrote into the dataset (a
    fetch); it is deleted once extracted unless ``keep`` is set. An http(s) URL is
    extracted as it downloads (a fetch of it into ``.download/``, then the extract of
    that, overlapped), checked against ``sha256`` when given, and kept the same way.
    """

    src: Annotated[str, AfterValidator(_archive_source)]
    dst: RelativePath = "."
    format: ArchiveFormat = "auto"
    strip_components: int = Field(default=0, ge=0, le=1024)
    nested: bool = False
    keep: bool = False  # keep an archive that an earlier step wrote into the dataset
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")  # of a URL's

    @model_validator(mode="after")
    def _sha256_of_a_download(self) -> ExtractStep:
        if self.sha256 is not None and not _is_url(self.src):
            raise ValueError(
                "sha256 checks an archive extract downloads: give it with an http(s) src; "
                "a file's own bytes are checked by verify 'sha256'"
            )
        return self


def as_fetch_then_extract(step: ExtractStep) -> list[dict[str, Any]] | None:
    """An extract of a URL as the steps it runs as: the fetch of the URL into the
    dataset's ``.download/``, then the extract of that file (which stager.staging.overlap runs
    at once). None for any other src."""
    if not _is_url(step.src):
        return None
    archive = f"{DOWNLOADS}/{url_file_name(step.src)}"
    fetched = {"op": "fetch", "url": step.src, "dst": archive, "sha256": step.sha256}
    return [fetched, {**step.model_dump(), "src": archive, "sha256": None}]


def as_image_stream(step: ExtractStep) -> ImageStream | None:
    """Image mode reads the archive straight into the image (not a zip: its directory is
    at its end, and the image builder reads tars)."""
    if step.format == "zip" or archive_suffix(step.src) == ".zip" or _is_url(step.src):
        return None
    return ImageStream(
        step.src, step.dst, step.strip_components, step.nested, step.format, step.keep
    )


def check(step: ExtractStep, ctx: CheckContext) -> int:
    """Pre-flight: the archive is readable, its format known, its first header sane;
    returns the bytes extraction will write (``estimate_output``)."""
    if not step.src.startswith("/"):
        return 0  # an earlier step's output (a fetch): nothing to look at yet
    source = require_source(step.src, "archive")
    with translate(step.src), _open_archive(str(source), ctx.allowed_roots) as raw:
        # Only a few blocks are read here, and extraction opens the archive again. On
        # a network filesystem read-ahead would fetch far more than those blocks
        # (about 0.8 MB of a .tar.gz over sshfs) and the re-open would drop it, so the
        # storage would serve those bytes twice.
        with suppress(OSError):  # advice only
            os.posix_fadvise(raw.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        fmt = resolve_format(step.src, step.format, raw.read(tarfile.BLOCKSIZE))
        size = os.fstat(raw.fileno()).st_size
        estimate = estimate_output(step.src, fmt, size, raw)
        raw.seek(0)
        read_first_header(raw, fmt)
        return estimate


def _open_archive(path: str, allowed_roots: tuple[Path, ...]) -> io.FileIO:
    """The archive, opened confined to ``allowed_roots`` through any chain of links,
    and never a FIFO or device (see :mod:`stager.fs.sources`)."""
    return open(open_source(path, allowed_roots), "rb", buffering=0)


def run(step: ExtractStep, ctx: OpContext) -> int | KnownTree | None:
    """Extract ``step.src`` into ``ctx.destination(step.dst)``; safe to re-run. Returns
    the bytes it left there when it counted them exactly (see
    :func:`stager.archive.extractor.extract_archive`), else None."""
    source = require_source(ctx.source(step.src), "archive")
    dest = ctx.destination(step.dst)
    # An absolute src is the user's and must lie under the allowed roots; a relative one
    # is an earlier step's output inside the dataset (ctx.source keeps it there).
    roots = ctx.allowed_roots if step.src.startswith("/") else ()
    with translate(step.src), _open_archive(str(source), roots) as raw:
        fd = raw.fileno()
        before = os.fstat(fd)
        ctx.progress.add_total(before.st_size, 0)
        fmt = resolve_format(step.src, step.format, os.pread(fd, tarfile.BLOCKSIZE, 0))
        archive = Archive(fd, 0, before.st_size, fmt, step.src)
        try:
            made = extract_archive(ctx, archive, str(dest), step.strip_components, step.nested)
        except CorruptArchive as exc:
            if ctx.verify != "none":
                _require_unchanged(fd, before, step.src, exc)  # a short read may be a rewrite
            raise
        if ctx.verify != "none":
            _require_unchanged(fd, before, step.src)
    if isinstance(made, KnownTree):  # what it knows is below dest: so is the tree above
        made = made.under(str(dest.relative_to(ctx.root.resolve())))
    return made


def reads_growing(step: ExtractStep) -> str | None:
    """The relative src this step can extract while an earlier step still downloads it
    (:mod:`stager.staging.overlap`), or None where its name or format says it must be whole
    first (see ``run_growing``, which decides by the first bytes)."""
    fmt = (
        step.format
        if step.format != "auto"
        else ARCHIVE_SUFFIXES.get(archive_suffix(step.src) or "", "auto")
    )
    if step.src.startswith("/") or fmt == "zip" or (fmt == "tar" and step.nested):
        return None
    return step.src


def run_growing(step: ExtractStep, ctx: OpContext, growing: GrowingFile) -> tuple[bool, int | None]:
    """Extract ``step.src`` from its download as it arrives (``growing``); returns
    (True, what ``run`` returns), or (False, None) when it must be whole first: a zip
    (its directory is at its end), or a plain tar with ``nested`` (inner archives are
    read in place, in parallel, from the whole file)."""
    dest = ctx.destination(step.dst)
    with translate(step.src):
        fmt = resolve_format(step.src, step.format, growing.head(tarfile.BLOCKSIZE))
        if fmt == "zip" or (fmt == "tar" and step.nested):
            return False, None
        archive = Archive(growing.fileno(), 0, 0, fmt, step.src, growing=growing)
        return True, extract_archive(ctx, archive, str(dest), step.strip_components, step.nested)


def _require_unchanged(
    fd: int, before: os.stat_result, label: str, cause: BaseException | None = None
) -> None:
    """Fail when the archive was written to while it was read: what was extracted may
    mix two versions. ``fstat`` on the descriptor read is cheap and cannot be fooled by
    a rename."""
    after = os.fstat(fd)
    moved = [
        what
        for what, old, new in (
            ("size", before.st_size, after.st_size),
            ("modification time", before.st_mtime_ns, after.st_mtime_ns),
            ("change time", before.st_ctime_ns, after.st_ctime_ns),
        )
        if old != new
    ]
    if moved:
        raise VerifyFailed(
            f"archive {label} changed while it was being extracted (its {' and '.join(moved)} "
            "moved); stage it again once nothing writes to it"
        ) from cause
