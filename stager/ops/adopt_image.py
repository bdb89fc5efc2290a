"""The ``adopt_image`` op: an image dataset that another node sent here as one file
(docs/multinode.md, "Adopt", holds the story).

What is hashed is what the kernel parses: the node service copies the delivery (the
user's to write) into its own folder while a thread hashes the copy, and publishes
only a copy with the size and sha256 the source node's service measured and vouched
for (:mod:`stager.core.vouch`, checked before a byte is copied); a per-user daemon
hashes it where it lies and renames it in (``in_place``). The step is the daemon's
own (``internal``), built from a request's ``adopt``.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from stager.core import vouch
from stager.core.errors import BadRequest, SourceNotFound, VerifyFailed
from stager.fs.sources import open_source, require_source
from stager.image.mount import head_format
from stager.ops.base import AbsoluteSource, CheckContext, OpContext, StepParams
from stager.ops.image import copy_durably, hash_in_place, said_of
from stager.wire.schemas import ByteCount

# What a refused delivery leads to, at the end of each refusal's sentence.
NOT_MOUNTED = "it is not mounted, and this node stages from the source"


class AdoptImageStep(StepParams):
    """Stage an image file another node broadcast here: copied, checked against the size
    and sha256 that node measured (and, in the node service, vouched for), mounted."""

    src: AbsoluteSource  # the delivered file
    size: ByteCount
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    origin_node: str = Field(min_length=1, max_length=200)  # for messages
    credential: str | None = Field(default=None, max_length=4096)
    # Set by a node service: the hash must come with a credential of this uid's (its
    # own) for entry ``vouch_key``.
    vouch_uid: int | None = Field(default=None, ge=0, le=2**32 - 1)
    vouch_key: str | None = Field(default=None, max_length=64)
    munge_socket: str | None = Field(default=None, max_length=4096)
    # Set by a per-user daemon: the delivery is written by the one user it serves, so
    # it is hashed where it lies and renamed in, not copied.
    in_place: bool = False


def check(step: AdoptImageStep, ctx: CheckContext) -> int:
    try:
        require_source(step.src, "delivered image")
    except SourceNotFound:  # the daemon wrote the path: what failed is the sbcast
        raise SourceNotFound(
            f"the image broadcast from {step.origin_node} did not reach this node "
            f"({step.src} does not exist: its sbcast failed); this node stages from the source"
        ) from None
    return step.size


def run(step: AdoptImageStep, ctx: OpContext) -> None:
    raise BadRequest(
        f"step 'adopt_image' ({step.src}) stages an image dataset; the request must ask "
        'for an image ("image": true), as the source node\'s did'
    )


@dataclass(frozen=True)
class Adopted:
    format: str
    size: int
    sha256: str


def take_delivery(step: AdoptImageStep, ctx: OpContext, output: Path, mode: int) -> Adopted:
    """The delivery as ``output`` (made ``mode``, synced): copied and the copy hashed,
    or (``in_place``, on the same filesystem) hashed where it lies and renamed. Refused,
    with ``output`` never made, unless what ``output`` holds has the size and sha256
    that the source node measured (vouched for, when ``vouch_uid`` is set)."""
    if step.vouch_uid is not None:
        _require_vouched(step)
    fd = open_source(step.src, ctx.allowed_roots)  # as the user whose job delivered it
    try:
        st = os.fstat(fd)
        _require_size(step, st.st_size)
        ctx.progress.add_total(st.st_size, 1)
        # Never where a service vouches: there the delivery is another user's to write.
        in_place = step.in_place and step.vouch_uid is None
        if in_place and st.st_dev == os.stat(output.parent).st_dev:
            adopted = _renamed_in(step, fd, st, ctx, output, mode)
        else:
            adopted = _copied_in(step, fd, st.st_size, ctx, output, mode)
    finally:
        os.close(fd)
    ctx.progress.advance(0, 1)
    return adopted


def _copied_in(
    step: AdoptImageStep, fd: int, size: int, ctx: OpContext, output: Path, mode: int
) -> Adopted:
    """Copied out of the delivery folder, the copy hashed: what is checked is what the
    kernel parses, whatever becomes of the delivery meanwhile."""
    partial = output.with_name(output.name + ".partial")
    # The format is what the copy holds, not what the delivery held a moment ago.
    with said_of(_delivery(step), NOT_MOUNTED):
        digest, fmt = copy_durably(fd, partial, size, ctx, mode)
    try:
        _require_image(step, digest, fmt)
    except VerifyFailed:
        partial.unlink()
        raise
    os.rename(partial, output)
    return Adopted(fmt or "", size, digest)


def _renamed_in(
    step: AdoptImageStep, fd: int, st: os.stat_result, ctx: OpContext, output: Path, mode: int
) -> Adopted:
    """Hashed where it lies, renamed to ``output``, then made ``mode`` and synced: a
    per-user daemon's own user wrote it, so a copy would guard nothing. Only a file
    nothing wrote while it was hashed, with no other name, is taken; on another
    filesystem after all (a bind mount), it is copied."""
    check, advance = ctx.check_cancelled, lambda n: ctx.progress.advance(n, 0)
    with said_of(_delivery(step), NOT_MOUNTED):
        digest = hash_in_place(fd, st.st_size, check, advance)
    fmt = head_format(os.pread(fd, 1028, 0))
    after = os.fstat(fd)
    if _stamps(after) != _stamps(st) or after.st_nlink != 1:
        raise VerifyFailed(
            f"{_delivery(step)} was written to, or given another name, while it was "
            f"checked; {NOT_MOUNTED}"
        )
    _require_image(step, digest, fmt)
    try:
        os.rename(step.src, output)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        return _copied_in(step, fd, st.st_size, ctx, output, mode)
    moved = os.lstat(output)  # what the name held: a link to the hashed file is not it
    if (moved.st_dev, moved.st_ino, moved.st_size) != (st.st_dev, st.st_ino, st.st_size):
        os.unlink(output)
        raise VerifyFailed(f"{_delivery(step)} was replaced while it was checked; {NOT_MOUNTED}")
    os.fchmod(fd, mode)  # only now: a refused swap leaves what it reached as it was
    os.fsync(fd)
    return Adopted(fmt or "", st.st_size, digest)


def _stamps(st: os.stat_result) -> tuple[int, int, int]:
    """What any write, rename or chmod of a file moves (its descriptor's inode is fixed)."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _delivery(step: AdoptImageStep) -> str:
    """The delivery, as each refusal names it."""
    return f"the image {step.src} broadcast from {step.origin_node}"


def _require_size(step: AdoptImageStep, size: int) -> None:
    if size != step.size:
        raise VerifyFailed(
            f"{_delivery(step)} has {size} bytes, not the {step.size} that node sent (cut "
            f"short or replaced); {NOT_MOUNTED}"
        )


def _require_image(step: AdoptImageStep, digest: str, fmt: str | None) -> None:
    if digest != step.sha256 or fmt is None:
        what = f"sha256 {digest}, not {step.sha256}" if digest != step.sha256 else "no image"
        raise VerifyFailed(
            f"{_delivery(step)} holds {what} (damaged or replaced on its way); {NOT_MOUNTED}"
        )


def _require_vouched(step: AdoptImageStep) -> None:
    if not step.credential:
        raise VerifyFailed(
            f"the image broadcast from {step.origin_node} came without that node's service's "
            "credential for its sha256 (munge), so the kernel may not parse it here; this "
            "node stages from the source"
        )
    vouch.check(
        step.credential,
        step.vouch_uid or 0,
        step.vouch_key or "",
        step.sha256,
        step.munge_socket,
        vouch.IMAGE,
    )
