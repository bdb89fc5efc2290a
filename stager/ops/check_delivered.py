"""The ``check_delivered`` op: check source files another node broadcast as they are.

When every source of a request is a plain file (release archives), a multi-node
job sbcasts the files themselves (docs/multinode.md) and each node stages from its
copy. This op runs first: each copy must have the size and sha256 that the source
node found in its own. The request's steps, pointed at the copies, then run as
usual, through the same hardened extraction as any archive.
"""

from __future__ import annotations

import os

from pydantic import Field

from stager.core.errors import VerifyFailed
from stager.fs.sources import open_source, require_source
from stager.ops.base import AbsoluteSource, CheckContext, OpContext, StepParams
from stager.wire.manifest_format import file_digest
from stager.wire.schemas import ByteCount


class CheckDeliveredStep(StepParams):
    """Check broadcast copies of source files: each path's size and sha256."""

    files: dict[AbsoluteSource, tuple[ByteCount, str]]
    origin_node: str = Field(min_length=1, max_length=200)


def check(step: CheckDeliveredStep, ctx: CheckContext) -> int:
    for path in step.files:
        require_source(path, "delivered copy")
    return 0  # the request's own steps write the data


def run(step: CheckDeliveredStep, ctx: OpContext) -> None:
    total = sum(size for size, _ in step.files.values())
    ctx.progress.add_total(total, len(step.files))
    for path, (size, sha256) in sorted(step.files.items()):
        ctx.check_cancelled()
        # Opened as the user whose job delivered it, never by root's rights: a link
        # planted in the delivery reads only what that user could.
        have_size, have_sha = file_digest(open_source(path, ctx.allowed_roots))
        if (have_size, have_sha) != (size, sha256):
            what = f"{have_size} bytes, not {size}" if have_size != size else "different content"
            raise VerifyFailed(
                f"the copy of {os.path.basename(path)} broadcast from {step.origin_node} has "
                f"{what}; this node stages from the source instead"
            )
        ctx.progress.advance(size, 1)
