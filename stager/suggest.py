""" "Did you mean": the close matches of a mistyped name, for an error's sentence."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"did you mean 'inat2021'? "`` (with its trailing space), or ``""``."""
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""
