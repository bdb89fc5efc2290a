"""A process that has imported what ``python -m stager serve`` imports, and forks a
daemon from that state on each request: ``stager serve`` run in full in each child,
less the interpreter's start and ~800 imports (~0.9 s of CPU of a start's ~1.4).

For tests that start daemons by the hundred and whose claim is what a daemon does,
not how an interpreter starts (the crash-point tests: two daemons per durable step).
Every other test starts ``python -m stager`` itself (tests.daemon.Daemon).

Run as ``python -m tests.daemon_zygote stager serve`` (the words make its cmdline, and its
children's, what the suite's check for daemons left running looks for). It reads one JSON
request a line on stdin, ``{"id", "argv", "env", "cwd", "log"}``, and writes one line for
each start, ``{"id", "pid"}`` or ``{"id", "error"}``, and one for each end of a child,
``{"pid", "returncode"}`` (as subprocess.Popen's: -9 for a kill -9). At the end of its
stdin it kills the children still running and exits.
"""

from __future__ import annotations

import gc

# As stager.__main__: no collections while the daemon's modules import; `stager serve`
# turns the collector on once it has frozen them (stager.api.server), in each child.
gc.disable()
# ruff: noqa: E402

import json
import os
import select
import signal
import sys
import threading

import stager.__main__  # noqa: F401 - the file a daemon's sys.argv[0] names
from stager import cli
from stager.api import app, server  # noqa: F401 - what `stager serve` imports (the app in serve())


def main() -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears it
    children: set[int] = set()
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            reap(children)
        if 0 in ready:
            data = os.read(0, 65536)
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                try:
                    pid = fork_daemon(request)
                except OSError as exc:
                    say({"id": request["id"], "error": str(exc)})
                    continue
                children.add(pid)
                say({"id": request["id"], "pid": pid})
        reap(children)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in list(children):
        os.waitpid(pid, 0)


def reap(children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        say({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def say(message: dict) -> None:
    os.write(1, json.dumps(message).encode() + b"\n")


def fork_daemon(request: dict) -> int:
    # A fork clones the calling thread only: with another thread running, a lock it
    # held would stay held in the child for ever.
    assert threading.active_count() == 1, threading.enumerate()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.fork()
    if pid:
        os.close(log)
        return pid
    try:
        # What a new `python -m stager serve` would start with: default signal
        # handling, the log as stdout and stderr, no descriptor of the zygote's.
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        # Only what differs: the environment's first string stays where the kernel put
        # it, beside the command line, where setproctitle finds the room for the fork
        # server's title (with a cleared one, the server is a new interpreter instead:
        # stager.core.processes._retitled).
        env = request["env"]
        for key in [key for key in os.environ if key not in env]:
            del os.environ[key]
        for key, value in env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        os.chdir(request["cwd"])
        sys.argv = [stager.__main__.__file__, *request["argv"]]
        code = cli.main(request["argv"])
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - anything: said in the log, as an interpreter would
        import traceback

        traceback.print_exc()
        code = 1
    # The interpreter's own exit from here (its atexit handlers: multiprocessing's, which
    # stop the daemon's fork server), as at the end of `python -m stager`.
    raise SystemExit(code)


if __name__ == "__main__":
    main()
