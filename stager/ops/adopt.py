"""The ``adopt`` op: stage a prepared dataset that another node broadcasts here in
parts (docs/multinode.md, "Adopt", holds the story).

Each part goes through ``extract`` as soon as its marker (``part-N.tar.ok``) says it
is whole; a part of byte ranges goes into the file the source was still writing
(stager.archive.ranges). At the end (``end.json``) the manifest must match the sha256
the job sent, what it does not name goes, and the tree must match it path by path;
anything else fails the staging, which never publishes.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from stager.archive import ranges, tar_members
from stager.core import vouch
from stager.core.errors import VerifyFailed
from stager.fs import manifest as manifests
from stager.fs.credentials import access
from stager.fs.sources import open_source
from stager.ops import extract
from stager.ops.base import AbsoluteSource, CheckContext, OpContext, StepParams
from stager.wire import manifest_format
from stager.wire.schemas import END_NAME, MANIFEST_NAME, READY_SUFFIX, ByteCount, part_name

# A part that has not arrived this long after the one before: the sender is gone
# (the job's task normally says so at once, with an ``abort`` end).
PART_WAIT_S = 600.0
POLL_S = 0.05


class AdoptStep(StepParams):
    """Extract the parts of a tree another node broadcasts here, then check the tree
    against the manifest that node wrote."""

    folder: AbsoluteSource  # the delivery folder
    origin_node: str = Field(min_length=1, max_length=200)  # for messages
    data_bytes: ByteCount  # the tree's file data, for admission
    # Set by a node service that shares the copy with every user (stager.core.vouch): the
    # manifest must come with a credential of this uid's for entry ``vouch_key``.
    vouch_uid: int | None = Field(default=None, ge=0, le=2**32 - 1)
    vouch_key: str | None = Field(default=None, max_length=64)
    munge_socket: str | None = Field(default=None, max_length=4096)


def check(step: AdoptStep, ctx: CheckContext) -> int:
    if not Path(step.folder).is_dir():
        raise VerifyFailed(
            f"delivery folder {step.folder} is not there (released or expired); "
            "this node stages from the source"
        )
    return step.data_bytes


def run(step: AdoptStep, ctx: OpContext) -> None:
    folder, tree = Path(step.folder), ctx.destination(".")
    # Each part's files are hashed once it is extracted, while the next parts travel;
    # the check against the manifest, which comes last, re-reads only what changed
    # since (nothing, unless a later part rewrote a file).
    digests = manifests.Digests()
    assembly = ranges.Assembly()  # files that come in byte ranges (stager.archive.ranges)
    tree.mkdir(parents=True, exist_ok=True)  # the first part may be one of ranges
    index = 0
    while (end := _next(step, folder, index, ctx)) is None:
        part = folder / part_name(index)
        with open(open_source(str(part), ctx.allowed_roots), "rb") as stream:
            ranged = ranges.is_range_part(stream)
            if ranged:
                ranges.assemble(stream, tree, assembly, str(part))
        if not ranged:
            extract.run(extract.ExtractStep(src=str(part), format="tar"), ctx)
            assembly.forget(*_hash_part(tree, part, digests, ctx))
        index += 1
    ranges.finish(tree, assembly, digests)
    expected = _manifest(step, folder, end, ctx)
    if step.vouch_uid is not None:
        vouch.check(
            end.get("credential"),
            step.vouch_uid,
            step.vouch_key or "",
            str(end.get("manifest_sha256")),
            step.munge_socket,
        )
    ctx.check_cancelled()
    # Parts sent while the source node was still staging may carry files it renamed
    # or removed later (stager.fanout.early): the manifest, written from its ready
    # tree, says what stays.
    manifests.prune(tree, expected)
    manifests.verify(tree, expected, step.origin_node, digests)


def _hash_part(
    tree: Path, part: Path, digests: manifests.Digests, ctx: OpContext
) -> tuple[set[str], set[str]]:
    """Hash the files ``part`` just put in ``tree``, found from the part's own headers
    (a walk of the tree per part would cost parts times tree); returns the paths it
    wrote: files and links, and folders."""
    written: set[str] = set()
    folders: set[str] = set()
    opened = open(open_source(str(part), ctx.allowed_roots), "rb")
    with opened as headers, tar_members.open_tar(headers) as tar:
        for member, _ in tar_members.members(tar, headers):
            path = os.path.normpath(member.name)
            (folders if member.isdir() else written).add(path)
            if not member.isreg():
                continue
            try:
                info = os.lstat(tree / path)
            except OSError:
                continue  # not there: the manifest check names it
            if stat.S_ISREG(info.st_mode):
                digests.of(tree, path, info)
    return written, folders


def _next(step: AdoptStep, folder: Path, index: int, ctx: OpContext) -> dict[str, Any] | None:
    """Wait until part ``index`` is whole (None), or the end says it will not come (the
    end's contents)."""
    ready = folder / (part_name(index) + READY_SUFFIX)
    deadline = time.monotonic() + PART_WAIT_S
    while True:
        ctx.check_cancelled()
        if _there(ready):  # a marker: there or not, never followed
            return None
        end = _end(folder, ctx)
        if end is not None:
            if end.get("abort"):
                raise VerifyFailed(
                    f"the broadcast from {step.origin_node} did not complete ({end['abort']}); "
                    "this node stages from the source"
                )
            if index >= int(end["parts"]):
                return end
        elif not _there(folder, os.O_DIRECTORY):
            raise VerifyFailed(
                f"delivery folder {folder} went away (released or expired) before part "
                f"{index} came; this node stages from the source"
            )
        if time.monotonic() > deadline:
            raise VerifyFailed(
                f"part {index} of the broadcast from {step.origin_node} did not arrive "
                f"within {PART_WAIT_S:.0f} s; this node stages from the source"
            )
        time.sleep(POLL_S)


def _there(path: Path, flags: int = os.O_NOFOLLOW) -> bool:
    """Whether the delivery holds ``path``, looked up as the user it belongs to."""
    try:
        os.close(access().open(str(path), os.O_PATH | os.O_CLOEXEC | flags))
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


# The most a delivery's small files may hold: they are read whole, in memory, by a
# process of root's, and the job that wrote them is the user's (a sparse end.json of
# 3 GB took 6 GB of memory). A manifest names every file (~100 bytes each).
END_LIMIT = 64 << 10
MANIFEST_LIMIT = 1 << 30


def _read(path: Path, ctx: OpContext, limit: int) -> bytes:
    """A file of the delivery, read as the user whose job delivered it; refused past
    ``limit`` bytes (by its size, and by what a read finds if it grew meanwhile)."""
    with open(open_source(str(path), ctx.allowed_roots), "rb") as file:
        size = os.fstat(file.fileno()).st_size
        data = file.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise VerifyFailed(
                f"{path} holds {max(size, len(data))} bytes, more than such a file may "
                f"({limit}); this node stages from the source"
            )
        return data


def _end(folder: Path, ctx: OpContext) -> dict[str, Any] | None:
    try:
        end = json.loads(_read(folder / END_NAME, ctx, END_LIMIT))
    except FileNotFoundError:
        return None
    except ValueError as exc:  # written by a rename: whole, or not there
        raise VerifyFailed(f"{folder / END_NAME} is not JSON ({exc})") from exc
    if not isinstance(end, dict) or not (end.get("abort") or "parts" in end):
        raise VerifyFailed(f"{folder / END_NAME} says neither how many parts came nor why not")
    return end


def _manifest(
    step: AdoptStep, folder: Path, end: dict[str, Any], ctx: OpContext
) -> manifest_format.Manifest:
    path = folder / MANIFEST_NAME
    try:
        data = _read(path, ctx, MANIFEST_LIMIT)
    except FileNotFoundError as exc:
        raise VerifyFailed(
            f"the manifest from {step.origin_node} did not arrive ({path}); "
            "this node stages from the source"
        ) from exc
    if manifest_format.digest(data) != end.get("manifest_sha256"):
        raise VerifyFailed(
            f"the manifest broadcast from {step.origin_node} ({path}) is damaged (its "
            "sha256 differs from the one the job sent); this node stages from the source"
        )
    return manifests.read(data, str(path))
