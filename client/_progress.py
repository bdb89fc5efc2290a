"""Progress displays for ``stager-client``: a live bar on a terminal, plain lines in logs.

A SLURM job's output is a file: a redrawn bar there is megabytes of carriage
returns, so off a terminal the CLI prints one self-contained line per dataset
every ``interval`` seconds (and one when it ends) instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TextIO

from rich.filesize import decimal

from stager.wire.schemas import DatasetPublic, ProgressPublic, State

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import TaskID


class Display(Protocol):
    def update(self, status: DatasetPublic) -> None: ...

    def close(self) -> None: ...


def describe_bytes(p: ProgressPublic) -> str:
    if p.bytes_total:
        return (
            f"{decimal(p.bytes_done)}/{decimal(p.bytes_total)} ({p.bytes_done / p.bytes_total:.0%})"
        )
    return decimal(p.bytes_done)


def describe_files(p: ProgressPublic) -> str:
    total = f"/{p.files_total}" if p.files_total else ""
    return f"{p.files_done}{total} files"


def describe_rate(p: ProgressPublic) -> str:
    return f"{decimal(int(p.rate_bytes_per_s))}/s"


def describe_eta(p: ProgressPublic) -> str:
    if p.eta_s is None:
        return "eta ?"
    minutes, seconds = divmod(int(p.eta_s), 60)
    return f"eta {minutes}:{seconds:02d}" if minutes else f"eta {seconds} s"


def describe_step(p: ProgressPublic) -> str:
    """``step_index`` as the daemon defines it (1-based; 0 = not started), unchanged."""
    if not p.steps_total or not p.step_index:
        return ""
    return f"step {p.step_index}/{p.steps_total} {p.step or ''}".rstrip()


def summary(status: DatasetPublic) -> str:
    """One line saying where a dataset is; the same words in every mode."""
    if status.state == State.READY:
        return (
            f"{status.name}: ready at {status.path} ({decimal(status.size_bytes)}{_kind(status)})"
        )
    if status.state.terminal:
        reason = f": {status.error.message}" if status.error else ""
        return f"{status.name}: {status.state}{reason}"
    p = status.progress
    if status.state == State.QUEUED:
        return f"{status.name}: queued"
    parts = [describe_step(p), describe_bytes(p), describe_files(p), describe_rate(p)]
    return f"{status.name}: staging {', '.join(x for x in parts if x)}, {describe_eta(p)}"


def _kind(status: DatasetPublic) -> str:
    """An image dataset is read-only and goes with its mount: say so where its path is."""
    image = status.image
    if image is None:
        return ""
    by = "the kernel" if image.mount == "kernel" else "FUSE"
    return f"; a read-only {image.format} image mounted by {by}"


def describe_origin(status: DatasetPublic) -> str:
    """How this node's copy arrived (staged here, broadcast by another node) and whether
    the latest request was a cache hit, for ``status`` and ``ls``."""
    origin = status.origin
    if origin is None or status.state != State.READY:
        return ""
    job = f", job {origin.job}" if origin.job else ""
    if origin.how == "broadcast":
        text = f"broadcast from {origin.node or 'another node'}{job}"
    else:
        text = f"staged here from the source{job}"
    if status.prestaged_for_job is not None:
        text += f"; pre-staged for job {status.prestaged_for_job}"
    return f"; {text}" + ("; this request was a cache hit" if origin.hit else "")


class NullDisplay:
    def update(self, status: DatasetPublic) -> None:
        pass

    def close(self) -> None:
        pass


class LogDisplay:
    """A timestamped line per dataset at most every ``interval`` s, and one when it ends."""

    def __init__(
        self,
        stream: TextIO,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        stamp: Callable[[], str] = lambda: time.strftime("%H:%M:%S"),
    ) -> None:
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self.stamp = stamp
        self._last: dict[str, float] = {}
        self._ended: set[str] = set()

    def update(self, status: DatasetPublic) -> None:
        if status.name in self._ended:
            return
        now = self.clock()
        last = self._last.get(status.name)
        if status.state.terminal:
            self._ended.add(status.name)
            if status.state != State.READY:
                return  # the CLI's error line says it, with the daemon's sentence
        elif last is not None and now - last < self.interval:
            return
        self._last[status.name] = now
        print(f"[{self.stamp()}] {summary(status)}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class BarDisplay:
    """A rich progress bar per dataset: bytes, files, rate and ETA as the daemon reports them.

    Rate and ETA come from the daemon rather than rich's own sampling: the daemon
    sees every byte, the client only the statuses it happens to poll.
    """

    def __init__(self, console: Console | None = None) -> None:
        # Imported here, by the one display that draws: every other stager-client
        # process (`ls`, `status`, a job's log lines) leaves rich's console and
        # progress unloaded (~30 ms of CPU each).
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[bytes]}"),
            TextColumn("{task.fields[files]}"),
            TextColumn("{task.fields[rate]}"),
            TextColumn("{task.fields[eta]}"),
            console=console or Console(stderr=True),
            refresh_per_second=4,
        )
        self._tasks: dict[str, TaskID] = {}
        self._progress.start()

    def update(self, status: DatasetPublic) -> None:
        p = status.progress
        fields = _bar_fields(status)
        task = self._tasks.get(status.name)
        if task is None:
            task = self._progress.add_task(status.name, total=None, **fields)
            self._tasks[status.name] = task
        total = p.bytes_total or None
        completed = p.bytes_done
        if status.state == State.READY:
            total = completed = max(status.size_bytes, p.bytes_total, 1)
        self._progress.update(task, total=total, completed=completed, **fields)

    def close(self) -> None:
        self._progress.stop()


def _bar_fields(status: DatasetPublic) -> dict[str, str]:
    p = status.progress
    if status.state.terminal:
        return {"bytes": str(status.state), "files": "", "rate": "", "eta": ""}
    step = describe_step(p)
    return {
        "bytes": f"{step} {describe_bytes(p)}".strip()
        if status.state != State.QUEUED
        else "queued",
        "files": describe_files(p),
        "rate": describe_rate(p),
        "eta": describe_eta(p),
    }
