"""An image dataset sent whole: a copy of its image file in the export's folder, for one
``sbcast``. Blocking. A copy, not the file or a hard link (sbcast runs as the job's
user; a private image's file is root's 0400; a link would change the ctime every hit
checks), hashed as it is written, the published file checked against its stamps before
and after; the reasons and modes: docs/multinode.md, "How it works", *the image*.
"""

from __future__ import annotations

import os
from pathlib import Path

from stager.fanout.packing import Transfer, hand_over
from stager.image.identity import ImageChanged, ImageIdentity
from stager.ops.image import copy_and_hash, said_of
from stager.wire.schemas import IMAGE_DELIVERY_NAME

EXPORT_NAME = IMAGE_DELIVERY_NAME  # sent under the name it has on the receivers


def export_image(
    image: Path, identity: ImageIdentity, transfer: Transfer, private: bool
) -> tuple[Path, int, str]:
    """Copy ``image`` (published with ``identity``) into ``transfer``'s folder; the copy's
    path, size and sha256."""
    out_path = transfer.path / EXPORT_NAME
    partial = transfer.path / (EXPORT_NAME + ".partial")
    fd = os.open(image, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _require_same(fd, identity, image)
        out = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            # No fsync: the copy lives only until it is sent, and a daemon that starts
            # again deletes every export an earlier run left.
            with said_of(f"image {image}", "it is not sent"):
                sha256 = copy_and_hash(
                    fd, out, identity.size, lambda: None, lambda n: None, durable=False
                )
            os.fchmod(out, 0o400 if private else 0o444)
        finally:
            os.close(out)
        _require_same(fd, identity, image)
    finally:
        os.close(fd)
    os.rename(partial, out_path)
    if private:
        hand_over(out_path, transfer)  # the owner's 0400, as a packed part
    return out_path, identity.size, sha256


def _require_same(fd: int, identity: ImageIdentity, image: Path) -> None:
    st = os.fstat(fd)
    now = (st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    if now != (identity.size, identity.device, identity.inode, identity.mtime_ns,
               identity.ctime_ns):  # fmt: skip
        raise ImageChanged(
            f"image {image} changed since it was published; it is not sent (the next "
            "request stages it again)"
        )
