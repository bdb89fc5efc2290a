"""The node feature of a ``#STAGER`` declaration: ``stg_`` and 8 hex digits of FNV-1a
(32 bits) over the line's words as the script has them, which deploy/slurm/job_submit.lua
computes the same at submit for the job's ``--prefer``. The words, not the parsed
request (the lua cannot run the stage parser), and no uid: the same words are the same
data (docs/prestaging.md, "Placement").
"""

from __future__ import annotations

import re

PREFIX = "stg_"
PATTERN = re.compile(r"stg_[0-9a-f]{8}")  # ours: what the node service may add or drop


def fnv1a_32(data: bytes) -> int:
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def feature(words: str) -> str:
    """The feature of a declaration's words (read from the script as UTF-8, any byte
    kept: client.declare.read_script)."""
    return f"{PREFIX}{fnv1a_32(words.encode('utf-8', 'surrogateescape')):08x}"
