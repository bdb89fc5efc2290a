"""A bundle: plain tars that carry a ready dataset to the other nodes of a job.

sbcast moves whole files, so the tree is packed, in parts of about ``PART_BYTES``:
while part *i* travels, the sender packs *i+1* and the receivers extract *i-1*. Each
part is a complete plain tar (the receivers' hardened extraction reads it; compression
is sbcast's own), parents first. Each file is read once: the manifest's sha256 is of
the very bytes that go into the tar.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from pathlib import Path
from typing import BinaryIO

from stager.core.errors import BadRequest
from stager.fs.manifest import Digests, open_listed, walk
from stager.wire.manifest_format import HASH_CHUNK, Manifest


class _Hashing:
    """A reader that hashes what tarfile copies out of it."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self.sha = hashlib.sha256()
        self.size = 0

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self.sha.update(data)
        self.size += len(data)
        return data


PART_BYTES = 32 << 20

Entries = list[tuple[str, os.stat_result]]


def plan(root: Path, part_bytes: int = PART_BYTES) -> list[Entries]:
    return cut(walk(root), part_bytes)


def cut(entries: Entries, part_bytes: int) -> list[Entries]:
    """``entries`` (parents first) in parts of about ``part_bytes``; at least one part."""
    parts: list[Entries] = []
    current: Entries = []
    size = 0
    for path, info in entries:
        current.append((path, info))
        if stat.S_ISREG(info.st_mode):
            size += info.st_size
            if size >= part_bytes:
                parts.append(current)
                current, size = [], 0
    if current or not parts:
        parts.append(current)
    return parts


def pack_part(
    root: Path, out: Path, entries: Entries, manifest: Manifest, sent: Digests | None = None
) -> None:
    """``entries`` of ``root`` into the tar ``out`` and ``manifest`` (files, with the
    identity they had before they were read, into ``sent``)."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT, copybufsize=HASH_CHUNK) as tar:
        for path, info in entries:
            member = _member(root, path, info)
            if stat.S_ISREG(info.st_mode):
                with os.fdopen(open_listed(root, path, info), "rb") as stream:
                    reader = _Hashing(stream)
                    tar.addfile(member, reader)  # type: ignore[arg-type]
                manifest.files[path] = (reader.size, reader.sha.hexdigest())
                if sent is not None:
                    sent.remember(path, info, manifest.files[path])
            else:
                tar.addfile(member)
                if member.isdir():
                    manifest.dirs.add(path)
                else:
                    manifest.links[path] = member.linkname


def _member(root: Path, path: str, info: os.stat_result) -> tarfile.TarInfo:
    member = tarfile.TarInfo(path)
    member.mode = stat.S_IMODE(info.st_mode)
    member.mtime = int(info.st_mtime)
    if stat.S_ISDIR(info.st_mode):
        member.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(info.st_mode):
        member.type = tarfile.SYMTYPE
        member.linkname = os.readlink(root / path)
        if member.linkname.startswith("/"):
            raise BadRequest(
                f"{root / path} links to {member.linkname}, outside the dataset; a dataset "
                "of links (symlink mode) is cheap to stage on every node, so stage it there "
                "instead of broadcasting it"
            )
    elif stat.S_ISREG(info.st_mode):
        member.size = info.st_size
    else:
        raise BadRequest(
            f"{root / path} is neither a file, a folder nor a link; a dataset holding "
            "devices or sockets cannot be broadcast, stage it on every node instead"
        )
    return member
