"""A staging runs in a child process of its own.

Ops do Python work per file; in the daemon's threads they would hold the GIL against
the event loop (status replies from ~1 ms to tens of ms), and a crash in an op would
take the daemon down.

The child runs the steps of one attempt in its folder (``Attempt`` in
:mod:`stager.staging.publish`), records each finished step in the attempt's marker,
and stops there: publishing is the daemon's. Progress goes through shared counters
(:mod:`stager.wire.progress`) that :func:`stager.staging.blocking.run_staging`
mirrors; the outcome through a pipe.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from stager.core.durable import CrashPoints, Durable
from stager.core.errors import InsufficientSpace, QuotaExceeded
from stager.core.processes import SPARE_NAME, STAGE_NAME, die_with, die_with_parent, name_process
from stager.fs.credentials import Reader, read_sources_as
from stager.fs.deletion import delete_tree
from stager.ops import table
from stager.ops.base import OpContext
from stager.rights import channel
from stager.rights.become import drop_capabilities
from stager.staging import overlap
from stager.staging.publish import Attempt, write_atomically
from stager.wire.progress import SharedCounters, WorkerCounters

# What sets a staging's written-bytes limit (past_bound words each).
WriteBound = Literal["quota", "disk"]


class KindStaging(Protocol):
    """A dataset kind's part of a staging (stager.kinds: a tree sealed, an image built),
    picklable into the child; what ``stage`` returns is the staging's outcome."""

    def published(self, final: Path, attempt: Attempt) -> Any | None:
        """Every step done: the outcome of a publish the daemon died after, or None."""

    def built(self, attempt: Attempt) -> bool:
        """Whether the attempt made its outcome already (its tree then gone)."""

    def stage(self, staging: Steps) -> Any:
        """The steps run (``staging.run``), made into the outcome."""


@dataclass
class StageJob:
    """What a staging process needs, all of it picklable into the child. Steps travel
    as dicts, validated again in the child by the same op table (site ops included)."""

    steps: list[dict[str, Any]]
    op_modules: tuple[str, ...]
    attempt: Attempt
    final: Path  # where the daemon publishes it: already there if it did before a crash
    workers: int
    verify: str
    allowed_roots: tuple[Path, ...] = ()
    # Whose rights sources are read with (stager.fs.credentials); None: the daemon's own.
    reader: Reader | None = None
    nice: int = 10
    crash_after: str | None = None  # see stager.faults
    # The most bytes it may leave in its tree and inodes it may make (None: no limit),
    # counted as written, and what sets each: its user's quota, or the disk's floor.
    write_bytes: int | None = None
    write_bound: WriteBound = "quota"
    write_inodes: int | None = None
    inode_bound: WriteBound = "quota"
    # What the steps are made into (stager.kinds: a tree, an image).
    kind: KindStaging | None = None


# How often the cancel event and the parent are looked at, at most: ops ask as often as
# once per archive member, and a look costs ~0.7 us (a semaphore, a system call), a
# tenth of writing a small file; a cancel acted on 10 ms later is as prompt.
_LOOK_EVERY_S = 0.01


class _ParentWatch:
    """Cancel event that also fires when the parent (the fork server) is gone."""

    def __init__(self, cancel: Any) -> None:
        self._cancel, self._parent = cancel, os.getppid()
        self._fired = False
        self._next_look = 0.0

    def is_set(self) -> bool:
        if not self._fired and (now := time.monotonic()) >= self._next_look:
            self._next_look = now + _LOOK_EVERY_S
            self._fired = self._cancel.is_set() or os.getppid() != self._parent
        return self._fired

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` (ops use it for backoff), waking early on cancel."""
        deadline = time.monotonic() + timeout
        while not self.is_set() and (remaining := deadline - time.monotonic()) > 0:
            if self._cancel.wait(min(remaining, 0.5)):
                self._fired = True
        return self.is_set()


def stage_in_child(
    job: StageJob,
    counters: SharedCounters,
    cancel: Any,
    conn: multiprocessing.connection.Connection,
    daemon_pid: int,
    watching: bool = False,
) -> None:
    """Entry point of a child forked for ``job`` (and of a spare once its job came,
    ``watching`` the daemon already): run every step, report its seal or its error as a
    user's process answers (stager.rights.channel)."""
    if not watching:
        _die_with_daemon(daemon_pid)
    # Staging is bulk I/O; the daemon's event loop must win the CPU whenever it wants it.
    os.nice(job.nice)
    if hasattr(os, "SCHED_BATCH"):  # batch threads never preempt the daemon's (Linux)
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which cancels us
    try:
        read_sources_as(job.reader)
        if job.reader is not None and os.geteuid() == 0 and not job.reader.identity.is_root:
            drop_capabilities()  # it acts for a user: root's powers stay out of its reach
        name_process(STAGE_NAME)  # what ps shows from here on holds no more than it needs
        conn.send(channel.ok(_stage(job, counters, _ParentWatch(cancel), daemon_pid)))
    except Exception as exc:  # a bug in an op too: the parent logs it and fails the entry
        conn.send(channel.failure(exc))
    finally:
        conn.close()


def stage_when_sent(
    jobs: multiprocessing.connection.Connection,
    counters: SharedCounters,
    cancel: Any,
    conn: multiprocessing.connection.Connection,
    daemon_pid: int,
) -> None:
    """Entry point of a spare (stager.staging.blocking): forked before its job, it waits for it
    on ``jobs``, then runs it as :func:`stage_in_child` does. The daemon closing
    ``jobs`` without a job ends it."""
    _die_with_daemon(daemon_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops us
    name_process(SPARE_NAME)
    _own_pages(jobs)
    try:
        job = jobs.recv()
    except EOFError:
        return
    finally:
        jobs.close()
    stage_in_child(job, counters, cancel, conn, daemon_pid, watching=True)


# A spare idle this long is likely to stay idle for a while: it makes its pages its
# own then, looking for its job between pieces of this many objects.
_IDLE_BEFORE_TOUCH_S = 0.5
_TOUCH_BETWEEN_LOOKS = 1000


def _own_pages(jobs: multiprocessing.connection.Connection) -> None:
    """Make the fork server's objects this process's own while it waits for its job: a
    forked child copies each page it first writes (a reference count is a write), ~1,200
    pages, 3-4 ms before a download's first byte. Done only once idle (~15 ms of CPU,
    ~16 MB), so back-to-back stagings do not share the CPU with it."""
    if jobs.poll(_IDLE_BEFORE_TOUCH_S):
        return
    # The server's objects are frozen (stager.engine.preload), and the collector lists
    # only those it watches: thawed for the listing (each a constant-time move).
    gc.unfreeze()
    try:
        for done, _ in enumerate(gc.get_objects()):
            if done % _TOUCH_BETWEEN_LOOKS == 0 and jobs.poll():
                return
    finally:
        gc.freeze()


def _die_with_daemon(daemon_pid: int) -> None:
    die_with(daemon_pid)  # the daemon is not our parent: the fork server is
    die_with_parent()


def _stage(job: StageJob, counters: SharedCounters, cancel: Any, daemon_pid: int) -> Any:
    """Run the steps this attempt has not finished, and make them what the job's kind
    makes of them (a sealed tree, an image): its outcome."""
    attempt, crash = job.attempt, CrashPoints(job.crash_after, daemon_pid=daemon_pid)
    kind = job.kind
    assert kind is not None, "a staging job names its kind"
    ops = table.load(job.op_modules)
    steps = ops.validate_steps(job.steps)
    done = attempt.steps_done()
    if done == len(steps) and (before := kind.published(job.final, attempt)) is not None:
        return before
    fresh = not attempt.tree.is_dir() and not kind.built(attempt)
    if fresh:
        attempt.tree.mkdir(parents=True)
        crash.reached(Durable.ATTEMPT_CREATED)
    progress = WorkerCounters(counters)
    progress.limit_written(
        job.write_bytes,
        functools.partial(past_bound, job.write_bound),
        job.write_inodes,
        functools.partial(past_inode_bound, job.inode_bound),
    )
    ctx = OpContext(
        root=attempt.tree,
        progress=progress,
        cancel=cancel,
        workers=job.workers,
        verify=job.verify,
        allowed_roots=job.allowed_roots,
    )
    return kind.stage(Steps(ops, steps, ctx, attempt, crash, progress, fresh, done))


@dataclass
class Steps:
    """A staging's steps in its process, as its kind's ``stage`` gets them; ``fresh``:
    its tree made now, not resumed; ``done``: how many steps an earlier try did."""

    ops: table.OpTable
    steps: list[Any]
    ctx: OpContext
    attempt: Attempt
    crash: CrashPoints
    progress: WorkerCounters
    fresh: bool
    done: int

    def run(
        self, runs: Callable[[int], bool] = lambda index: True, at_turn: Any = None
    ) -> tuple[Any, bool]:
        """Run the steps not done yet, writing the marker after each; returns what the
        last op run returned and whether it ran paired with the one before. ``runs(index)``
        says which steps run as ops; ``at_turn(index)`` is called at each other's turn."""
        ops, steps, ctx, attempt = self.ops, self.steps, self.ctx, self.attempt
        crash, progress, done = self.crash, self.progress, self.done
        made: Any = None  # what the last op run returned (see stager.kinds.tree)
        paired = False

        for index, step in enumerate(steps, start=1):
            if not runs(index):
                at_turn(index)
                if index > done:
                    write_atomically(attempt.marker, str(index))
                    crash.reached(Durable.STEP_DONE)
                continue
            if index > done:
                ctx.check_cancelled()
                progress.start_step(index)
                following = steps[index] if index < len(steps) else None
                pairs = following is not None and runs(index + 1)
                if pairs and ops.overlaps(step, following, ctx):
                    # A download and its extraction at once (stager.staging.overlap): one
                    # marker for both; the next turn only removes what it used up.
                    after = functools.partial(progress.start_step, index + 1)
                    made = overlap.run_pair(ops, step, following, ctx, downloaded=after)
                    done, paired = index + 1, True
                else:
                    made = ops.run(step, ctx)
                    done = index
                progress.flush()
                write_atomically(attempt.marker, str(done))
                crash.reached(Durable.STEP_DONE)
            # After the marker, so a crash in between finds the step done and its input
            # still there; repeated for done steps on resume.
            if used_up := ops.used_up(step, ctx):
                self.put_aside(index, used_up)
        return made, paired

    def put_aside(self, index: int, used_up: str | Path) -> Path:
        """Move step ``index``'s used-up input out of the tree in one rename (if not done
        before a crash), and the folder it alone was in. Not deleted here: deleting a
        large archive takes up to seconds, which the dataset would wait for; it goes with
        the attempt's folder, after the publish (stager.engine.lifecycle)."""
        aside = self.attempt.set_aside(index)
        if os.path.lexists(used_up):
            if os.path.lexists(aside):
                delete_tree(aside, threading.Event())
            os.rename(used_up, aside)
            self.crash.reached(Durable.INPUT_USED_UP)
        if (folder := Path(used_up).parent) != self.ctx.destination("."):
            with contextlib.suppress(OSError):  # not empty: something else is kept there
                os.rmdir(folder)
        return aside


def past_bound(bound: WriteBound, written: int) -> InsufficientSpace:
    """A staging stopped once it had written ``written`` bytes, past what ``bound`` lets
    it: its user's quota ("quota"), or the room its disk had above the floor ("disk")."""
    if bound == "quota":
        return QuotaExceeded(
            f"staging stopped after writing {written} bytes, which with the data you hold "
            "already passes your quota on this node; free some (stager-client ls, then "
            "cancel what you no longer need) or ask the admin for a larger --user-quota"
        )
    return InsufficientSpace(
        f"staging stopped after writing {written} bytes, all the room the cache's disk had "
        "above its floor (--min-free-bytes) when it started: its sources make far more "
        "than their size said (a sparse file, or an archive that decompresses to much "
        "more than it holds); stage less at once, or free room on the disk"
    )


def past_inode_bound(bound: WriteBound, made: int) -> InsufficientSpace:
    """A staging stopped once it had made ``made`` inodes (folders, files, links), past
    what ``bound`` lets it: its user's inode quota, or the disk's free inodes above its
    inode floor."""
    if bound == "quota":
        return QuotaExceeded(
            f"staging stopped after making {made} files and folders, which with the data "
            "you hold already passes your inode quota on this node (--user-inode-quota); "
            "free some (stager-client ls, then cancel what you no longer need), stage "
            "fewer files (an image: --as-image), or ask the admin for a larger quota"
        )
    return InsufficientSpace(
        f"staging stopped after making {made} files and folders, all the inodes the "
        "cache's disk had free above its floor (--min-free-inodes) when it started: its "
        "sources make far more names than their size said (an archive of empty files or "
        "folders); stage fewer files at once, or free inodes on the disk"
    )
