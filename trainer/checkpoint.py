"""Atomic checkpoints, ordered by training progress, a bounded number kept.

A checkpoint holds everything a resumed run needs to continue exactly where
the interrupted one stopped: the unwrapped model (loadable without DDP), its
EMA, the optimizer and AMP scaler, and the position (epoch, samples seen in
it, samples and steps in all). No RNG state: every random draw is reseeded
from the position (`trainer.seeding`). Only rank 0 writes, to ``*.tmp`` in the
same folder, fsynced, then renamed: a file with the final name is complete.

Which checkpoint is the latest, and which ones pruning keeps, follows the
progress each one records, never the order of file names alone: a file's
name carries the *attempt* that wrote it (one more than the highest attempt
already in the folder when a run starts, resumed or not) and the samples seen
when it was written, and checkpoints sort by (attempt, samples). So a run
started afresh in an old output folder (or resumed from an older file) makes
checkpoints that rank above the old ones, and pruning removes the old ones
first instead of the new.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

NAME = "checkpoint-a{attempt:04d}-s{samples:013d}.pt"
_NAME_RE = re.compile(r"checkpoint-a(\d{4,})-s(\d{13,})\.pt$")


@dataclass(frozen=True, order=True)
class Entry:
    attempt: int
    samples: int
    path: Path


def save(state: dict[str, Any], directory: Path, attempt: int, keep: int = 2) -> Path:
    """Write ``state`` as the newest checkpoint of ``attempt``; keep the ``keep`` latest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    samples = int(state["position"]["samples"])
    final = directory / NAME.format(attempt=attempt, samples=samples)
    tmp = final.with_name(final.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        # Without fsync a node crash after the rename can leave a renamed but
        # empty file, which would then be "the latest checkpoint".
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(directory)
    if keep > 0:
        for old in entries(directory)[:-keep]:
            old.path.unlink(missing_ok=True)
    for leftover in directory.glob("checkpoint-*.pt.tmp"):  # from a save a crash cut short
        leftover.unlink(missing_ok=True)
    return final


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def entries(directory: Path) -> list[Entry]:
    """Complete checkpoints, oldest first by (attempt, samples); ``*.tmp`` ignored."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [
        Entry(int(m.group(1)), int(m.group(2)), p)
        for p in directory.iterdir()
        if (m := _NAME_RE.match(p.name))
    ]
    return sorted(found)


def latest(directory: Path) -> Path | None:
    found = entries(directory)
    return found[-1].path if found else None


def next_attempt(directory: Path) -> int:
    found = entries(directory)
    return (max(e.attempt for e in found) + 1) if found else 1


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    # weights_only=False: the file also holds args, and it is our own file
    # from our own output directory.
    return torch.load(path, map_location=map_location, weights_only=False)


def load_latest(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; an unreadable one is skipped with a warning.

    A file is complete once renamed, but the disk under it can still lose it
    (a node crash before the directory fsync, a full quota on a network
    filesystem): resuming from the one before beats failing the requeued job.
    """
    for entry in reversed(entries(directory)):
        try:
            return entry.path, load(entry.path)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            log.warning("checkpoint %s cannot be read (%s); trying the one before", entry.path, exc)
    return None
