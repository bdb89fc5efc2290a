"""Wait for the node's stager before reading data (``--stager-wait NAME``).

Local rank 0 of each node asks its own node's daemon (each node stages its own
copy); the other ranks wait in a collective. Errors from the client are
translated here, once, into `StagingError` whose message is the daemon's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from trainer import distributed as dist_utils
from trainer.distributed import World

log = logging.getLogger(__name__)


class StagingError(RuntimeError):
    """The dataset never became ready (failed, timed out, or no daemon)."""


def _wait(name: str, timeout: float) -> Path:
    # Lazy import: the client is only needed when --stager-wait is used.
    try:
        from client.errors import StagerError

        from client import StagerClient
    except ImportError as exc:
        raise StagingError(
            f"--stager-wait {name} needs the stager client package ({exc}); "
            "install stager or drop --stager-wait"
        ) from exc
    try:
        status = StagerClient().wait(name, timeout=timeout)
    except StagerError as exc:
        raise StagingError(f"dataset {name!r} is not available: {exc}") from exc
    if getattr(status, "state", None) != "ready":
        raise StagingError(f"dataset {name!r} ended in state {status.state!r}, not ready")
    return Path(status.path)


def wait_for_dataset(name: str, timeout: float, world: World, device: torch.device) -> Path:
    """This node's staged dataset path; `StagingError` on every rank if any rank failed."""
    error: StagingError | None = None
    path: Path | None = None
    if world.is_local_main:
        log.info("waiting for staged dataset %r (timeout %.0fs)", name, timeout)
        try:
            path = _wait(name, timeout)
        except StagingError as exc:
            error = exc
    # A MAX all-reduce instead of a bare barrier: if one node's staging fails,
    # every rank learns it now instead of hanging until the collective timeout.
    failed = dist_utils.all_reduce_max(torch.tensor([1.0 if error else 0.0], device=device))
    if error is not None:
        raise error
    if failed.item():
        raise StagingError(f"dataset {name!r} failed to stage on another node; see rank logs")
    if path is None:
        # Ready now, so this returns at once; each rank gets its own node's path.
        path = _wait(name, timeout)
    log.info("dataset %r ready at %s", name, path)
    return path
