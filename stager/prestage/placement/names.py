"""The node feature of a ``#STAGER`` declaration: ``stg_`` and 8 hex digits of FNV-1a
(32 bits) over the line's words, as the script has them (after ``#STAGER`` and its
blanks, without trailing blanks). deploy/slurm/job_submit.lua computes the same at
submit, in milliseconds and without asking stager, for the job's ``--prefer``.

The words, not the parsed request: the lua cannot run the stage parser. Two spellings
of one dataset are two features (each job still hits on the data; it is only not
steered by the other spelling). No uid: the words name the source, so the same words
are the same data, and one copy of data everyone may read serves every user's jobs.
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
