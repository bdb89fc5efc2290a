"""Wait for the node's stager before reading data (``--stager-wait NAME``).

Local rank 0 of each node asks its own node's daemon (each node stages its own
copy); the other ranks wait in a collective. Errors from the client are
translated here, once, into `StagingError` whose message is the daemon's.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ProcessGroup

from trainer import distributed as dist_utils
from trainer.distributed import World

log = logging.getLogger(__name__)
# Slack on top of --stager-timeout for the other ranks: local rank 0 gives up
# at the timeout itself and then still has to reach the collective.
WAIT_GRACE_S = 120.0


class StagingError(RuntimeError):
    """The dataset never became ready (failed, timed out, or no daemon)."""


@dataclass(frozen=True)
class Staged:
    """A ready dataset on this node: its path and how torchvision loads it."""

    path: Path
    # The daemon's ``usage`` entries as plain dicts: {"class", "kwargs", "root"}.
    usage: list[dict[str, Any]] = field(default_factory=list)


def _wait(name: str, timeout: float) -> Staged:
    # Lazy import: the client is only needed when --stager-wait is used.
    try:
        from client import StagerClient
        from client.errors import StagerError
    except ImportError as exc:
        raise StagingError(
            f"--stager-wait {name} needs the stager client package ({exc}); "
            "install stager or drop --stager-wait"
        ) from exc
    try:
        # The prolog may stage it while this job already runs: wait for its request too.
        status = StagerClient().wait(
            name, timeout=timeout, on_not_requested=log.warning, await_request=timeout
        )
    except StagerError as exc:
        raise StagingError(f"dataset {name!r} is not available: {exc}") from exc
    if getattr(status, "state", None) != "ready":
        raise StagingError(f"dataset {name!r} ended in state {status.state!r}, not ready")
    usage = [
        {"class": u.class_, "kwargs": dict(u.kwargs), "root": u.root}
        for u in getattr(status, "usage", None) or []
    ]
    return Staged(Path(status.path), usage)


def wait_for_dataset(name: str, timeout: float, world: World) -> Staged:
    """This node's staged dataset; `StagingError` on every rank if any rank failed."""
    # The other ranks wait for the stagers in a gloo group of its own whose
    # timeout covers --stager-timeout: the default group's 30 minutes would end
    # a day-long staging early. It is made first because making a group is
    # itself a collective, which must not wait on the stager.
    group = None
    if dist_utils.active():
        group = dist_utils.new_gloo_group(datetime.timedelta(seconds=timeout + WAIT_GRACE_S))
    try:
        staged = _wait_everywhere(name, timeout, world, group)
    finally:
        dist_utils.destroy_group(group)
    log.info("dataset %r ready at %s", name, staged.path)
    return staged


def _wait_everywhere(name: str, timeout: float, world: World, group: ProcessGroup | None) -> Staged:
    error: StagingError | None = None
    staged: Staged | None = None
    if world.is_local_main:
        log.info("waiting for staged dataset %r (timeout %.0fs)", name, timeout)
        try:
            staged = _wait(name, timeout)
        except StagingError as exc:
            error = exc
    failed = _any_failed(name, timeout, error is not None, group)
    if error is not None:
        raise error
    if failed:
        raise StagingError(f"dataset {name!r} failed to stage on another node; see rank logs")
    # Ready now, so this returns at once; each rank gets its own node's path.
    return staged if staged is not None else _wait(name, timeout)


def _any_failed(name: str, timeout: float, failed_here: bool, group: ProcessGroup | None) -> bool:
    """True on every rank if any rank failed; the other ranks wait here for the stagers.

    A MAX all-reduce instead of a bare barrier: if one node's staging fails,
    every rank learns it now instead of hanging until a collective timeout.
    The flag is a CPU tensor, so no GPU is involved in the wait.
    """
    flag = torch.tensor([1.0 if failed_here else 0.0])
    try:
        return bool(dist_utils.all_reduce_max(flag, group=group).item())
    except RuntimeError as exc:  # gloo reports a timeout or a dead peer this way
        raise StagingError(
            f"gave up after {timeout + WAIT_GRACE_S:.0f}s waiting for the stager wait for "
            f"{name!r} on the other ranks ({exc}); raise --stager-timeout if staging "
            "takes longer, else see the local rank 0 log"
        ) from exc
