"""Atomic checkpoints: write ``*.tmp`` in the same folder, fsync, rename.

A checkpoint holds everything a resumed run needs to continue exactly where
the interrupted one stopped: the unwrapped model (loadable without DDP), the
optimizer, scheduler and AMP scaler, the position (epoch, micro-batches done in
that epoch, optimizer steps) and the RNG states. Only rank 0 writes.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import torch

NAME = "checkpoint-{iteration:09d}.pt"
_NAME_RE = re.compile(r"checkpoint-(\d{9})\.pt$")


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    # .cpu(): generator states are CPU byte tensors even for CUDA generators,
    # but a checkpoint loaded with map_location="cuda" puts them on the GPU.
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save(state: dict[str, Any], directory: Path, keep: int = 2) -> Path:
    """Write ``state`` as the newest checkpoint in ``directory``; keep the last ``keep``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / NAME.format(iteration=state["position"]["iteration"])
    tmp = final.with_name(final.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        # Without fsync a node crash after the rename can leave a renamed but
        # empty file, which would then be "the latest checkpoint".
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(directory)
    for old in all_checkpoints(directory)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def all_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (``*.tmp`` leftovers are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest(directory: Path) -> Path | None:
    found = all_checkpoints(directory)
    return found[-1] if found else None


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    # weights_only=False: the file also holds python RNG state and args, and
    # it is our own file from our own output directory.
    return torch.load(path, map_location=map_location, weights_only=False)
