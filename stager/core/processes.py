"""Every process and thread stager starts is started here, and nowhere else.

``run`` a command to its end (a timeout, and a sentence when it cannot run); ``spawn``
one that runs beside us; ``start_child`` a child of the fork server; ``fork_pool`` a
pool of forked workers; ``fork_child`` a bare fork; ``thread``, ``bare_thread`` and
``thread_pool`` for a process's own threads. The loop's blocking calls go to anyio's
pool through stager.staging.blocking.run_io.

Who asks for which process, with which rights: stager.rights' table
(tests/test_owner_rooms.py fails on a start anywhere else). No process outlives the
daemon: a staging still writing into its partial folder after a kill -9 of the daemon
would race with the resumed one.
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import functools
import gc
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import resource_tracker
from multiprocessing.context import BaseContext, ForkServerContext
from pathlib import Path
from typing import Any

from stager.core.libc import LIBC
from stager.core.prestart import MAX_SOCKET_PATH, raise_descriptor_limit, unheld

# Staging and user processes are children of the fork server (the daemon runs threads,
# which a plain fork would clone mid-state); a staging's own pools fork it directly.
FORKSERVER = multiprocessing.get_context("forkserver")
FORK = multiprocessing.get_context("fork")
# The fork server's preload: imported there and nowhere else.
PRELOAD = "stager.engine.preload"
DEVNULL, STDOUT = subprocess.DEVNULL, subprocess.STDOUT
Spawned = subprocess.Popen  # what ``spawn`` returns
ThreadPool = ThreadPoolExecutor  # what ``thread_pool`` returns


class NotRun(OSError):
    """A command that could not be started, or did not end within its time (an OSError,
    as a command that cannot start always was)."""

    def __init__(self, sentence: str, timed_out: bool = False) -> None:
        super().__init__(sentence)
        self.timed_out = timed_out


def run(
    argv: Sequence[str], timeout_s: float | None, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``argv`` run to its end, its output as text (bytes not UTF-8 kept as surrogates),
    its exit status the caller's to judge; NotRun if it cannot start or outlives timeout_s."""
    return Stoppable().run(argv, timeout_s, input)


class Stoppable:
    """:func:`run`, that another thread may end at once with :meth:`kill`: a service
    that is stopping must not wait for a command that does not answer."""

    def __init__(self) -> None:
        self._running: subprocess.Popen[str] | None = None

    def run(
        self, argv: Sequence[str], timeout_s: float | None, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        name = os.path.basename(argv[0])
        try:
            with subprocess.Popen(
                list(argv),
                stdin=None if input is None else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                encoding="utf-8",
                errors="surrogateescape",
            ) as self._running:
                try:
                    out, err = self._running.communicate(input, timeout=timeout_s)
                except subprocess.TimeoutExpired as exc:
                    self._running.kill()
                    raise NotRun(f"{name} did not answer within {timeout_s:g} s", True) from exc
                return subprocess.CompletedProcess(list(argv), self._running.returncode, out, err)
        except NotRun:
            raise
        except OSError as exc:
            raise NotRun(f"{name} could not be started: {exc.strerror or exc}") from exc
        finally:
            self._running = None

    def kill(self) -> None:
        running = self._running
        if running is not None:
            running.kill()


def spawn(
    argv: Sequence[str],
    stdin: Any = DEVNULL,
    stdout: Any = DEVNULL,
    stderr: Any = DEVNULL,
    **options: Any,
) -> subprocess.Popen[bytes]:
    """``argv`` started beside us (``options``: Popen's), on none of our streams."""
    return subprocess.Popen(list(argv), stdin=stdin, stdout=stdout, stderr=stderr, **options)


def exited(process: subprocess.Popen[bytes], within_s: float) -> bool:
    """Whether a spawned process has ended, waiting at most ``within_s``."""
    try:
        process.wait(within_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def start_fork_server(keep_in: Path | None = None) -> ForkServerContext:
    """The fork server's context, its server started (once per process; it imports
    its preload in the background and forks nothing until that is done). The descriptor
    limit is raised first: every child inherits the server's (stager.core.prestart).
    ``keep_in``: the daemon's private folder, where the server's socket goes
    (:func:`temp_folder_in`). Where this process runs one thread, the server is a fork
    of it (:func:`_fork_or_spawn`); otherwise a new interpreter, as multiprocessing's own."""
    raise_descriptor_limit()
    if keep_in is not None:
        temp_folder_in(keep_in)
    FORKSERVER.set_forkserver_preload([PRELOAD])
    # A server that is a new interpreter starts as `python -c ...`, which reads modules
    # from the current folder (a user's, where `stager serve` was typed): PYTHONSAFEPATH
    # keeps that folder out, for the server only (a forked one drops it: _as_new_interpreter).
    before = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    spawnv = multiprocessing.util.spawnv_passfds
    # ensure_running starts the server (and the resource tracker before it) through
    # util.spawnv_passfds, which it looks up at each call: ours for this call only.
    multiprocessing.util.spawnv_passfds = functools.partial(_fork_or_spawn, spawnv)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = spawnv
        if before is None:
            del os.environ["PYTHONSAFEPATH"]
        else:
            os.environ["PYTHONSAFEPATH"] = before
    return FORKSERVER


# multiprocessing starts its fork server as a new interpreter (util.spawnv_passfds: a
# fork, then an exec of `python -c COMMAND`), which imported again ~550 modules the
# daemon has imported already (~0.55 s of CPU at every daemon start). A fork of the
# daemon instead runs the same COMMAND in the state an exec would leave
# (_as_new_interpreter), and its preload imports only the ~40 modules the daemon has
# not. stager.cli forks it once the daemon has imported the app and before
# ``serve`` runs: before any thread, socket, log file or token. Its memory then holds
# the settings, all read from the command line and the environment, which the stagings
# and user processes held already (multiprocessing passes them the daemon's sys.argv;
# the environment is inherited). A child that becomes a user (stager.rights) is not
# dumpable after its setuid: the user cannot read its memory.
# The resource tracker (the same `python -c`, before the server) stays a new
# interpreter: it needs a few MB, where a fork would keep the daemon's ~60 MB (+10 MB
# of PSS per daemon, measured), to save ~50 ms of CPU on the other core.
_FORK_SERVER_COMMAND = "from multiprocessing.forkserver import main"
FORK_SERVER_TITLE = "stager forkserver (daemon {pid})"


def _fork_or_spawn(spawnv: Callable[..., int], path: str, args: list[str], passfds: Any) -> int:
    """multiprocessing.util.spawnv_passfds for the fork server, forked where that is
    safe (and a new interpreter after all where its title cannot be set): its pid."""
    if not args[-1].startswith(_FORK_SERVER_COMMAND) or not _one_thread():
        # Another thread may hold a lock a fork would copy held forever (the import
        # lock, a logging handler's, malloc's): a new interpreter, as multiprocessing's.
        return spawnv(path, args, passfds)
    try:
        import setproctitle
    except ImportError:  # an install without it (a dependency): no title, so no fork
        return spawnv(path, args, passfds)

    title = FORK_SERVER_TITLE.format(pid=os.getpid())
    _flush_streams()  # or the child writes out the daemon's buffered output again
    keep = sorted({0, 1, 2, *map(int, passfds)})
    pid = os.fork()
    if pid != 0:
        return pid
    code = 1
    try:
        _as_new_interpreter(keep)
        if not _retitled(setproctitle.setproctitle, title):
            # The daemon's command line stays, which `stager stop`, ps and an admin's
            # pkill read as a daemon (and every process the server forks would too): a
            # new interpreter instead, as multiprocessing's, in this process.
            for fd in keep:
                os.set_inheritable(fd, True)
            os.execv(path, args)
        code = _run_command(args[-1])
    except BaseException:  # noqa: BLE001 - said, as the interpreter would, then the exit
        traceback.print_exc()
    finally:
        # Never the daemon's exit handlers (a new interpreter has none of them). Its
        # multiprocessing finalizers, one of which removes the daemon's temp folder that
        # holds the server's socket, run in their maker's process only, and are dropped.
        _flush_streams()
        os._exit(code)


def _retitled(setproctitle: Callable[[str], None], title: str) -> bool:
    """Whether ps now shows ``title`` (cut to the command line's room) for this process,
    instead of the daemon's command line. SPT_NOENV: within that room, leaving
    /proc/PID/environ as it is, where the tests find their processes. setproctitle finds
    the room through the environment's first string, which lies beside it; where the
    daemon began with no environment (`env -i`), or rebuilt it, it silently changes
    nothing."""
    os.environ["SPT_NOENV"] = "1"
    setproctitle(title)
    del os.environ["SPT_NOENV"]
    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            shown = cmdline.read().split(b"\0", 1)[0]
    except OSError:
        return False
    return bool(shown) and title.encode().startswith(shown)


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # None, or closed
            stream.flush()


def _one_thread() -> bool:
    """Whether this process runs one thread, as Linux counts them (Python's and any
    other library's)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False  # no /proc: unknown


def _as_new_interpreter(keep: list[int]) -> None:
    """In the forked child: what an exec of a new interpreter would leave differently
    from the daemon, made so. Descriptors: only ``keep`` (close_fds). Signals: those the
    daemon catches in Python back to their default (an exec's), SIGINT to Python's own
    handler, ignored ones left ignored; no wakeup descriptor. The collector: on, as in a
    new interpreter, with the daemon's objects frozen (a collection would walk
    ~125,000 of them; stager.__main__ had it off while the daemon imported). sys.argv a
    ``-c`` command's; sys.path less the folder the daemon's start put first (its
    script's, or the current folder of `python -m`: PYTHONSAFEPATH's rule). No
    multiprocessing helper started, no finalizer to run. The daemon's modules stay
    imported and its __main__ stays __main__: a child of the server finds the daemon's
    __main__ loaded and does not run it again."""
    signal.set_wakeup_fd(-1)
    for number in signal.valid_signals():
        if callable(signal.getsignal(number)):
            default = signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL
            signal.signal(number, default)
    low = 0
    for fd in keep:
        if low < fd:  # closerange(n, n) closes every descriptor from n: close_range(n, ~0)
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))
    gc.freeze()
    gc.enable()
    sys.argv = ["-c"]
    if not sys.flags.safe_path and sys.path:
        del sys.path[0]
    # As a new interpreter's: the daemon's name its own helpers' pids and descriptors
    # (closed here) and hold the lock ensure_running holds in the daemon.
    multiprocessing.forkserver._forkserver.__init__()
    resource_tracker._resource_tracker.__init__()
    multiprocessing.util._finalizer_registry.clear()


def _run_command(command: str) -> int:
    """Run a ``-c`` command in a namespace of its own: its exit code, as the interpreter's."""
    try:
        exec(compile(command, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


# multiprocessing's temp folder holds the fork server's listening socket. Its own is a
# /tmp/pymp-* that only an exit handler removes: a daemon killed -9 left one in /tmp at
# every kill, forever. A daemon's is ``mp-<pid>`` in its private folder instead, and each
# start removes those of daemons that are gone.
TEMP_PREFIX = "mp-"
# What multiprocessing puts after the folder: /listener-XXXXXXXX (connection.arbitrary_address).
_LISTENER_TAIL = len("/listener-") + 8


def temp_folder_in(folder: Path) -> str | None:
    """Make ``folder/mp-<pid>`` this process's multiprocessing temp folder (removed at a
    normal exit, as multiprocessing's own is), after removing the ``mp-<pid>`` of every
    process there that has ended; its path, or None where multiprocessing keeps its own:
    the temp folder is chosen already; or ``folder`` is not this user's alone, or a
    folder above it is one another user may replace (they could have us remove what
    they point at, or put their files in ours: the daemon refuses such a folder, saying
    why, with the same check, stager.core.prestart.unheld, which must pass before
    anything is made or removed here); or the socket's path would be too long for a
    Unix socket (a folder over 78 bytes, where the daemon's own socket fits up to 95: a
    --runtime-dir that deep keeps multiprocessing's /tmp/pymp-*, which a kill leaves,
    rather than refuse to start; no short name for the folder is safe: the listener's
    path is what every child of the fork server connects to, so a /proc/self/fd/N path
    would name another folder in each of them, a chdir is the whole threaded process's,
    an abstract socket is open to every user, and a short link in /tmp is itself left
    behind)."""
    config = multiprocessing.current_process()._config  # what util.get_temp_dir reads
    if config.get("tempdir") is not None:
        return None
    name = f"{TEMP_PREFIX}{os.getpid()}"
    path = os.path.join(folder, name)
    if len(os.fsencode(path)) + _LISTENER_TAIL > MAX_SOCKET_PATH:
        return None
    try:
        # Checked before anything is made, and again after: what makedirs made above
        # the leaf has the umask's mode.
        if unheld(folder) is not None:
            return None
        os.makedirs(folder, 0o700, exist_ok=True)  # as stager.api.server would next
        if unheld(folder) is not None:
            return None
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # the daemon's checks say why, in a sentence
    try:
        held = os.fstat(fd)
        if held.st_uid != os.geteuid() or held.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        _remove_ended(fd)
        os.mkdir(name, 0o700, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    config["tempdir"] = path
    multiprocessing.util.Finalize(
        None, shutil.rmtree, args=(path,), kwargs={"ignore_errors": True}, exitpriority=-100
    )
    return path


def _remove_ended(folder_fd: int) -> None:
    """Remove the temp folders in ``folder_fd`` of processes that have ended, or that had
    this process's pid (a folder of this process's own is not made yet). Through the
    folder's descriptor, and only folders of this user's own, never what a link names."""
    for entry in os.scandir(folder_fd):
        pid = entry.name.removeprefix(TEMP_PREFIX)
        # As str(pid) writes it: int() takes other scripts' digits, and '²' not at all.
        if pid == entry.name or not (pid.isascii() and pid.isdigit()):
            continue
        if int(pid) != os.getpid() and pid_alive(int(pid)):
            continue
        found = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(found.st_mode) and found.st_uid == os.geteuid():
            shutil.rmtree(entry.name, ignore_errors=True, dir_fd=folder_fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (another user's too); a zombie has ended. No process
    has a pid under 1 (kill(0) and kill(-1) succeed: they name groups of processes) or
    past a C ``pid_t`` (kill raises OverflowError, not OSError)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OverflowError:
        return False
    except OSError as exc:
        return exc.errno == errno.EPERM
    # An exited child its parent has not reaped yet is a zombie: gone for our purposes.
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return line.rsplit(")", 1)[-1].split()[0] != "Z"


def start_child(target: Callable[..., Any], args: tuple[Any, ...], name: str) -> Any:
    """A child of the fork server running ``target(*args)`` (blocking: milliseconds)."""
    process = FORKSERVER.Process(target=target, args=args, name=name)
    process.start()
    return process


def reap(process: Any, grace_s: float) -> None:
    """Join a finished child; kill one that is still running after ``grace_s``."""
    process.join(grace_s)
    if process.is_alive():
        process.kill()
        process.join()


def fork_pool(
    workers: int,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
    context: BaseContext = FORK,
) -> ProcessPoolExecutor:
    """A pool of ``workers`` processes, every one started now (the first task starts
    them all): with fork, before this process runs a thread of its own that a fork
    would copy mid-state (the pool's helper threads start after the forks)."""
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=initializer, initargs=initargs
    )
    pool.submit(int).result()
    return pool


def fork_child(main: Callable[[], int]) -> int:
    """The pid of a forked child that runs ``main`` and exits with its code (1: raised)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = main()
        finally:
            os._exit(code)
    return pid


def thread(
    target: Callable[..., Any], *args: Any, name: str, daemon: bool = True
) -> threading.Thread:
    """``target(*args)`` on a thread of its own, started."""
    started = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    started.start()
    return started


def thread_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix=prefix)


class Threaded:
    """An object whose ``run`` goes on a thread of its own: ``start``, then ``join``;
    what ``run`` raised is kept in ``error``, for the thread that joins it to raise."""

    thread_name = "stager"
    error: BaseException | None = None
    _thread: threading.Thread | None = None

    def run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = thread(self._keep_error, name=self.thread_name)

    def _keep_error(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # noqa: BLE001 - raised by the thread that joins
            self.error = exc

    def join(self) -> None:
        if self._thread is not None:  # started
            self._thread.join()


_PR_SET_PDEATHSIG = 1

# What a staging process is called in ps and top (its "comm"); a spare waiting for its
# job (stager.staging.blocking) is called otherwise, so that nobody takes it for a staging.
STAGE_NAME = "stager-stage"
SPARE_NAME = "stager-spare"
# Processes that became a user (stager.rights): a staging's gateway to its sources, and
# a user process doing a request's checks.
GATE_NAME = "stager-gate"
USER_NAME = "stager-user"
WALKER_NAME = "stager-walker"  # the seal's checks of published trees (stager.staging.blocking)


def name_process(name: str) -> None:
    with contextlib.suppress(OSError):  # not Linux: the name is only for people
        Path("/proc/self/comm").write_text(name)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (thread) dies."""
    prctl = getattr(LIBC, "prctl", None)
    if prctl is not None:  # not Linux: callers keep their own parent checks
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def die_with(pid: int) -> None:
    """SIGKILL this process when process ``pid`` exits, whoever is its parent: a
    staging's parent is the fork server, which outlives the daemon, so it watches the
    daemon itself, through a pidfd, on a thread that only ever waits."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)  # gone already
        return
    # A bare thread: threading.Thread.start waits until the new thread has run (1-6 ms
    # on a busy machine), which every staging would wait before its first step.
    _thread.start_new_thread(_die_when_exited, (fd,))


def _die_when_exited(pidfd: int) -> None:
    select.select([pidfd], [], [])  # readable once the process has exited
    os.kill(os.getpid(), signal.SIGKILL)
