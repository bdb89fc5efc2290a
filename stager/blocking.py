"""The one doorway from the event loop to blocking work.

Two pools so that long stagings can never starve the short calls the API needs
(a status write, a stat of a source): ``run_io`` for short blocking calls on
anyio's shared thread pool, ``StagingPool`` for whole stagings on threads of
their own, sized by ``Settings.max_workers``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import anyio.to_thread

P = ParamSpec("P")
T = TypeVar("T")


async def run_io(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a short blocking call (file stat, SQLite write) off the event loop."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


class StagingPool:
    """Threads that run whole stagings; one per concurrently staged dataset."""

    def __init__(self, workers: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stage")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        # Do not wait: running ops see their cancel event and return on their own.
        self._executor.shutdown(wait=False, cancel_futures=True)
