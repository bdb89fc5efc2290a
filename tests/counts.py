"""Counts that the reliability promises quote (docs/reliability.md).

A test that checks a promise over many generated cases says how many it ran
with ``tally("...")``; tests that add up over many parametrized cases register
``summary(fn)``, a function that writes its line once they have all run. The
lines are printed at the end of the session (tests/conftest.py), so the figures
in the docs can be checked against any ``make test`` output.
"""

from __future__ import annotations

from collections.abc import Callable

LINES: list[str] = []
SUMMARIES: list[Callable[[], str | None]] = []


def tally(line: str) -> None:
    LINES.append(line)


def summary(line: Callable[[], str | None]) -> Callable[[], str | None]:
    """Register ``line`` (a decorator): called at the end; None prints nothing."""
    SUMMARIES.append(line)
    return line


def session_lines() -> list[str]:
    return LINES + [line for make in SUMMARIES if (line := make())]
