"""Pre-staging: the planner, the node side of its orders, placement by features."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, text: str, durable: bool = True) -> None:
    """Replace ``path`` whole with ``text``, 0600, never through a link; ``durable``:
    synced before the rename."""
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
        if durable:
            out.flush()
            os.fsync(out.fileno())
    os.replace(partial, path)
