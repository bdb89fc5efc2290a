"""This node's features in Slurm, read and written with scontrol (blocking: run on a
thread, each call bounded by a timeout). Only ``stg_`` features are ever added or
dropped; every other feature the node has (its slurm.conf ones, an admin's) is kept."""

from __future__ import annotations

import re

from stager.core.errors import StagerError
from stager.core.processes import NotRun, run
from stager.prestage.placement.names import PATTERN

TIMEOUT_S = 10.0  # slurmctld answers in milliseconds; a longer wait is a sick controller
_FIELD = r"(?:^|\s){}=(\S*)"


class ScontrolFailed(StagerError):
    """scontrol could not read or set this node's features."""


def _run(argv: list[str]) -> str:
    try:
        done = run(argv, TIMEOUT_S)
    except NotRun as exc:
        raise ScontrolFailed(f"`{' '.join(argv)}` failed: {exc}") from exc
    if done.returncode != 0:
        raise ScontrolFailed(f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _features(text: str, field: str) -> list[str]:
    found = re.search(_FIELD.format(field), text)
    value = found.group(1) if found else ""
    return [] if value in ("", "(null)") else value.split(",")


def read(node: str) -> tuple[list[str], list[str]]:
    """The node's (available, active) features: one RPC to slurmctld."""
    text = _run(["scontrol", "show", "node", node, "--oneliner"])
    if not re.search(_FIELD.format("NodeName"), text):
        raise ScontrolFailed(f"scontrol knows no node {node!r}; set STAGER_NODE_NAME")
    return _features(text, "AvailableFeatures"), _features(text, "ActiveFeatures")


def ours(features: list[str]) -> set[str]:
    return {f for f in features if PATTERN.fullmatch(f)}


def apply(node: str, wanted: list[str]) -> bool:
    """Make the node's ``stg_`` features ``wanted``, keeping its others; whether it
    had to write (one RPC to read, and one more to write only when they differ)."""
    available, active = read(node)
    if ours(available) == set(wanted) and ours(active) == set(wanted):
        return False
    keep = [f for f in available if not PATTERN.fullmatch(f)]
    keep_active = [f for f in active if not PATTERN.fullmatch(f)]
    # Arguments, never a shell: a feature is our hex or one Slurm printed (no blanks).
    _run(
        [
            "scontrol",
            "update",
            f"NodeName={node}",
            f"AvailableFeatures={','.join(keep + wanted)}",
            f"ActiveFeatures={','.join(keep_active + wanted)}",
        ]
    )
    return True
