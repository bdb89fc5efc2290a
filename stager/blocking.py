"""The one doorway from the event loop to blocking work.

``run_io`` runs short blocking calls (a SQLite write, a stat of a source) on
anyio's thread pool. ``run_staging`` runs a whole staging in a child process
(see ``stager.worker`` for why) and awaits it without blocking the loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import anyio.to_thread

from stager import errors
from stager.progress import Progress, SharedCounters
from stager.worker import CONTEXT, StageJob, stage_in_child

log = logging.getLogger("stager.staging")

P = ParamSpec("P")
T = TypeVar("T")


async def run_io(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a short blocking call off the event loop."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


async def run_staging(
    job: StageJob, progress: Progress, cancel: threading.Event, poll_s: float = 0.1
) -> int:
    """Stage ``job`` in a child process; return the published size or raise its error.

    ``cancel`` is forwarded to the child, which stops at its next unit of work.
    """
    counters = SharedCounters(CONTEXT)
    child_cancel = CONTEXT.Event()
    receiver, sender = CONTEXT.Pipe(duplex=False)
    process = CONTEXT.Process(
        target=stage_in_child,
        args=(job, counters, child_cancel, sender, os.getpid()),
        name=f"stager-stage-{job.final.name}",
    )
    # Started from the event-loop thread on purpose: the child's parent-death signal
    # is tied to the creating thread, and a pool thread may exit while it runs.
    process.start()
    sender.close()
    message = None
    try:
        while message is None:
            if cancel.is_set():
                child_cancel.set()
            progress.mirror(counters)
            if receiver.poll():
                message = receiver.recv()
            elif not process.is_alive():
                if receiver.poll():
                    continue
                raise errors.StagingProcessDied(
                    f"the staging process died with exit code {process.exitcode}; "
                    "see the daemon log, then stage again"
                )
            else:
                await asyncio.sleep(poll_s)
    finally:
        child_cancel.set()  # no-op when it finished; stops it when we are being cancelled
        await run_io(_reap, process)
        receiver.close()
    progress.mirror(counters)
    return _outcome(message)


def _reap(process: Any, grace_s: float = 3.0) -> None:
    process.join(grace_s)
    if process.is_alive():
        process.kill()
        process.join()


def _outcome(message: tuple[str, Any]) -> int:
    """Re-raise in the daemon what the child reported."""
    kind, payload = message
    if kind == "ok":
        return payload
    if kind == "cancelled":
        raise errors.Cancelled("staging was cancelled")
    if kind == "error":
        class_name, _type, text = payload
        raise getattr(errors, class_name, errors.StagingError)(text)
    if kind == "oserror":
        number, strerror, filename = payload
        raise OSError(number, strerror, filename)
    raise errors.StagingProcessDied(
        f"internal error in the staging process; see the daemon log:\n{payload}"
    )
