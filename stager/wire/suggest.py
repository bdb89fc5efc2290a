""" "Did you mean": the close matches of a mistyped name, for an error's sentence."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str], cutoff: float = 0.6) -> str:
    """``"did you mean 'inat2021'? "`` (with its trailing space), or ``""``. ``cutoff``:
    how alike (0-1, difflib's ratio) a choice must be to be offered."""
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=cutoff)
    return f"did you mean {close[0]!r}? " if close else ""
