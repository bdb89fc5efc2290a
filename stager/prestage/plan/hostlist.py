"""Slurm hostlists (``node[01-04,7],gpu1``) as host names, as `scontrol show hostnames`
prints them.

A few dozen lines of our own rather than a dependency (python-hostlist does more,
but the planner needs only expansion, and the node service's Python is the admin's).
tests/stager/plan/test_hostlist.py checks it against the real scontrol.
"""

from __future__ import annotations

import functools
import re

# Slurm's words for "none yet".
EMPTY = frozenset({"", "(null)", "N/A", "None", "n/a"})
# A hostlist that expands past this is not a plan but a mistake; refuse it.
MAX_HOSTS = 100_000
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class HostlistError(ValueError):
    pass


@functools.lru_cache(maxsize=65536)  # a cluster's queue repeats its hostlists
def expand(text: str) -> tuple[str, ...]:
    """Every host of ``text``, in order, duplicates kept as Slurm keeps them."""
    text = text.strip()
    if text in EMPTY:
        return ()
    if "[" not in text and "]" not in text:  # most lists: plain names
        return tuple(item for item in text.split(",") if item)
    hosts: list[str] = []
    for item in _split_top(text):
        hosts.extend(_expand_one(item, text))
        if len(hosts) > MAX_HOSTS:
            raise HostlistError(f"hostlist {text[:80]!r} names more than {MAX_HOSTS} hosts")
    return tuple(hosts)


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"hostlist {text!r} has a ']' without its '['")
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise HostlistError(f"hostlist {text!r} has a '[' without its ']'")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(item: str, whole: str) -> list[str]:
    """``pre[1-2]mid[a]...``: the product of its bracket groups, left to right."""
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    head, body, tail = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    rests, numbers = _expand_one(tail, whole), _numbers(body, whole)
    if len(rests) * len(numbers) > MAX_HOSTS:  # before building it: rack[..]-n[..]
        raise HostlistError(f"hostlist {whole[:80]!r} names more than {MAX_HOSTS} hosts")
    return [f"{head}{number}{rest}" for number in numbers for rest in rests]


def _numbers(body: str, whole: str) -> list[str]:
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise HostlistError(f"hostlist {whole!r}: {part!r} is not a number or a range a-b")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low or high - low > MAX_HOSTS:
            raise HostlistError(f"hostlist {whole!r}: range {part!r} is empty or too long")
        width = len(low_text)  # node[01-10]: node01 ... node10, as Slurm pads
        numbers.extend(str(n).zfill(width) for n in range(low, high + 1))
    return numbers
