"""The ``unpack`` op: bring a release archive into the dataset and extract it.

How the archive travels is one field per step:

- ``direct`` (the default): extract straight from the source; one sequential read,
  nothing extra on the local disk.
- ``copy``: copy the archive in first (under ``keep``, e.g. ``2021_train.tgz``) and
  extract the local copy: a failed extraction re-runs from local disk, and the
  archive stays beside the data, at its size again on the disk.
- ``symlink``: leave a link to the source under ``keep`` and extract through it.

A directory source is copied (``direct``/``copy``) or mirrored as links
(``symlink``). ``verify_md5`` costs a full read of the archive, so it is off unless
asked for.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from stager.archive.formats import ArchiveFormat, archive_suffix
from stager.core.errors import BadRequest, VerifyFailed, from_os_error
from stager.fs.sources import open_source, require_source
from stager.ops import copy, extract, symlink
from stager.ops.base import (
    AbsoluteSource,
    CheckContext,
    ImageStream,
    OpContext,
    RelativePath,
    StepParams,
)
from stager.ops.copy import CopyStep
from stager.ops.extract import ExtractStep
from stager.ops.symlink import SymlinkStep


class UnpackStep(StepParams):
    """Bring an archive into the dataset and extract it: straight from the source
    (``direct``), from a local copy (``copy``) or through a link (``symlink``) kept at
    ``keep``. A directory source is copied (``direct``/``copy``) or tree-linked."""

    src: AbsoluteSource
    dst: RelativePath = "."
    mode: Literal["direct", "copy", "symlink"] = "direct"
    keep: RelativePath | None = None  # where the copy or link goes; default: src's name
    format: ArchiveFormat = "auto"
    strip_components: int = Field(default=0, ge=0, le=1024)
    nested: bool = False
    md5: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{32}$")  # of the release
    verify_md5: bool = False  # one extra pass over the archive; off unless asked


MD5_CHUNK = 8 << 20


def check(step: UnpackStep, ctx: CheckContext) -> int:
    """Validate the source; the estimate is what extraction (plus a copy) writes."""
    source = require_source(step.src, "archive" if not Path(step.src).is_dir() else "source")
    _require_md5(step)
    if source.is_dir():
        if step.strip_components or step.nested or step.format != "auto":
            raise BadRequest(
                f"source {step.src} is a directory, but strip_components, nested and format "
                "apply to archives only; point the source at the folder to stage instead"
            )
        if step.mode == "symlink":
            return symlink.check(_tree_link(step), ctx)
        return copy.check(_tree_copy(step), ctx)
    estimate = extract.check(_extract(step, step.src), ctx)
    if step.mode == "copy":
        estimate += source.stat().st_size
    return estimate


def run(step: UnpackStep, ctx: OpContext) -> None:
    source = require_source(step.src)
    if source.is_dir():
        if step.mode == "symlink":
            symlink.run(_tree_link(step), ctx)
        else:
            copy.run(_tree_copy(step), ctx)
        return
    archive = step.src
    if step.mode == "copy":
        copy.run(CopyStep(src=step.src, dst=_keep(step)), ctx)
        archive = _keep(step)  # relative: the dataset's own copy, not a source to confine
    elif step.mode == "symlink":
        symlink.run(SymlinkStep(src=step.src, dst=_keep(step)), ctx)
    if step.verify_md5:
        _verify_md5(step, archive, ctx)
    extract.run(_extract(step, archive), ctx)


def as_image_stream(step: UnpackStep) -> ImageStream | None:
    """Image mode reads an archive read straight from its source (``direct``) into the
    image; a folder, a local copy or a link is made as a tree and packed."""
    if step.mode != "direct" or step.format == "zip" or os.path.isdir(step.src):
        return None
    if archive_suffix(step.src) == ".zip":
        return None
    before = (lambda ctx: _verify_md5(step, step.src, ctx)) if step.verify_md5 else None
    return ImageStream(
        step.src, step.dst, step.strip_components, step.nested, step.format, before=before
    )


def _keep(step: UnpackStep) -> str:
    return step.keep or os.path.basename(step.src.rstrip("/"))


def _extract(step: UnpackStep, archive: str) -> ExtractStep:
    return ExtractStep(
        src=archive,
        dst=step.dst,
        format=step.format,
        strip_components=step.strip_components,
        nested=step.nested,
    )


def _tree_copy(step: UnpackStep) -> CopyStep:
    return CopyStep(src=step.src, dst=step.dst)


def _tree_link(step: UnpackStep) -> SymlinkStep:
    return SymlinkStep(src=step.src, dst=step.dst, mode="tree")


def _require_md5(step: UnpackStep) -> str:
    if step.verify_md5 and step.md5 is None:
        raise BadRequest(
            f"verify_md5 is set for {step.src}, but no md5 is known for it; "
            "add 'md5' to the step or turn verify_md5 off"
        )
    return (step.md5 or "").lower()


def _verify_md5(step: UnpackStep, archive: str, ctx: OpContext) -> None:
    expected = _require_md5(step)
    digest = hashlib.md5(usedforsecurity=False)
    roots = ctx.allowed_roots if archive.startswith("/") else ()
    try:
        with open(open_source(ctx.source(archive), roots), "rb", buffering=0) as stream:
            ctx.progress.add_total(os.fstat(stream.fileno()).st_size, 0)
            while chunk := stream.read(MD5_CHUNK):
                ctx.check_cancelled()
                digest.update(chunk)  # hashlib releases the GIL on large buffers
                ctx.progress.advance(len(chunk), 0)
    except OSError as exc:
        raise from_os_error(exc, f"checking the md5 of {step.src}") from exc
    if digest.hexdigest() != expected:
        raise VerifyFailed(
            f"archive {step.src} has md5 {digest.hexdigest()}, not the release's {step.md5}; "
            "re-download it, or stage with verify_md5=false if it is a deliberate variant"
        )
