"""Names made durable: a rename or an unlink is on the disk once its folder is synced.

A crash after ``os.rename`` but before the folder's sync can lose the rename; what the
state store says happened must not run ahead of what the disk kept.
"""

from __future__ import annotations

import os
from pathlib import Path


def sync_folder(folder: str | Path) -> None:
    """The folder's entries (names made, renamed or removed in it) written to the disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_durably(source: Path, target: Path) -> None:
    """``source`` renamed to ``target`` (in the same folder or another on the same
    filesystem), the rename durable before this returns."""
    os.rename(source, target)
    sync_folder(target.parent)
