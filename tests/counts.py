"""Counts that the reliability promises quote (docs/reliability.md).

A test that checks a promise over many generated cases says how many it ran
with ``tally("...")``; the lines are printed at the end of the session, so the
figures in the docs can be checked against any ``make test`` output.
"""

from __future__ import annotations

LINES: list[str] = []


def tally(line: str) -> None:
    LINES.append(line)
