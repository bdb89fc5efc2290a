"""One owner of processes, one doorway to threads: a stray start fails here.

Every process and thread the daemon's code starts is started by stager/core/processes.py,
and every blocking call the event loop hands to a thread goes through
stager/staging/blocking.py's ``run_io`` (docs/architecture.md). The scan reads every module of
stager/ and client/ and finds each use of a way to start one; ``OWNERS`` names the one
module allowed each way. And stager/rights/__init__.py's table lists every process the
daemon starts: the modules that ask stager.core.processes for one are its rows, no more.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_import_graph import REPO, modules

# What starts a process, a thread, or hands the loop's call to a thread.
PROCESS, THREAD, LOOP = "process", "thread", "loop-to-thread"
OS_STARTS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen")
MP_STARTS = ("Process", "Pool", "get_context", "ensure_running", "set_start_method")
# The one module allowed each (the client's own, beside the daemon's).
OWNERS = {
    PROCESS: {"stager.core.processes", "client.fanout.slurm", "client.declare"},
    THREAD: {"stager.core.processes"},
    LOOP: {"stager.staging.blocking", "client.fanout.agent", "client.fanout.protocol"},
}
# The functions of stager.core.processes that start a process (a row of rights' table each).
STARTERS = (
    "run",
    "spawn",
    "start_child",
    "fork_pool",
    "fork_child",
    "start_fork_server",
    "Stoppable",
)


def dotted(node: ast.expr) -> str:
    """``a.b.c`` for an attribute chain on a name, else the last attribute."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def starts(source: str) -> list[tuple[str, int, str]]:
    """(kind, line, what) for each way ``source`` starts a process or thread."""
    found = []
    for node in ast.walk(ast.parse(source)):
        kind, what = None, ""
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names]
            module = node.module if isinstance(node, ast.ImportFrom) else None
            every = [module] if module else names
            if any(n.split(".")[0] in ("subprocess", "_thread") for n in every if n):
                kind, what = (THREAD if "_thread" in str(every) else PROCESS), str(every)
            elif module and module.startswith("anyio.to_thread") or "anyio.to_thread" in names:
                kind, what = LOOP, "anyio.to_thread"
            elif module in ("concurrent.futures", "threading", "multiprocessing"):
                for name in names:
                    if name in ("ProcessPoolExecutor", "Process", "Pool", "get_context"):
                        kind, what = PROCESS, f"{module}.{name}"
                    elif name in ("ThreadPoolExecutor", "Thread"):
                        kind, what = THREAD, f"{module}.{name}"
        elif isinstance(node, ast.Attribute):
            chain = dotted(node)
            if chain.startswith("os.") and (
                node.attr in OS_STARTS or node.attr.startswith(("exec", "spawn"))
            ):
                kind, what = PROCESS, chain
            elif node.attr in MP_STARTS or node.attr.startswith("create_subprocess"):
                kind, what = PROCESS, chain
            elif node.attr in ("ProcessPoolExecutor",):
                kind, what = PROCESS, chain
            elif node.attr in ("Thread", "ThreadPoolExecutor", "start_new_thread"):
                kind, what = THREAD, chain
            elif node.attr in ("to_thread", "run_in_executor", "run_in_threadpool"):
                kind, what = LOOP, chain
        if kind is not None:
            found.append((kind, node.lineno, what))
    return found


def strays(packages: tuple[str, ...] = ("stager", "client")) -> list[str]:
    """Each start outside the module ``OWNERS`` allows for it, as ``module:line what``."""
    return sorted(
        f"{name}:{line} {what} ({kind})"
        for package in packages
        for name, path in modules(REPO / package).items()
        for kind, line, what in starts(path.read_text())
        if name not in OWNERS[kind]
    )


def test_every_process_and_thread_is_started_by_its_owner() -> None:
    found = strays()
    assert not found, (
        "start processes and threads through stager.core.processes, and hand the loop's "
        "blocking calls to stager.staging.blocking.run_io (tests/test_owner_rooms.py OWNERS):\n"
        + "\n".join(found)
    )


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("import subprocess\n", PROCESS),
        ("from subprocess import run\n", PROCESS),
        ("import os\nos.fork()\n", PROCESS),
        ("import os\nos.execv('/bin/true', [])\n", PROCESS),
        ("import os\nos.posix_spawn('/bin/true', [], {})\n", PROCESS),
        ("import os\nos.system('true')\n", PROCESS),
        ("import multiprocessing\nmultiprocessing.get_context('fork')\n", PROCESS),
        ("def f(ctx):\n    ctx.Process(target=f).start()\n", PROCESS),
        ("from concurrent.futures import ProcessPoolExecutor\n", PROCESS),
        ("import asyncio\nasyncio.create_subprocess_exec('true')\n", PROCESS),
        ("import threading\nclass T(threading.Thread):\n    pass\n", THREAD),
        ("from threading import Thread\n", THREAD),
        ("import _thread\n", THREAD),
        ("import concurrent.futures as f\nf.ThreadPoolExecutor(2)\n", THREAD),
        ("import anyio.to_thread\n", LOOP),
        ("import asyncio\nasync def f():\n    await asyncio.to_thread(print)\n", LOOP),
        ("def f(loop):\n    loop.run_in_executor(None, print)\n", LOOP),
    ],
)
def test_a_stray_start_is_found(source: str, kind: str) -> None:
    assert kind in {k for k, _, _ in starts(source)}


def test_what_is_no_start_is_not_found() -> None:
    source = (
        "import multiprocessing.connection, threading, os\n"
        "lock = threading.Lock()\nevent = threading.Event()\nos.getpid()\n"
        "def f(ctx):\n    return ctx.Array('q', 4), ctx.Pipe()\n"
    )
    assert starts(source) == []


def askers() -> set[str]:
    """The modules that call one of stager.core.processes' starters."""
    found = set()
    for name, path in modules(REPO / "stager").items():
        tree = ast.parse(path.read_text())
        imported = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "stager.core.processes"
            for alias in node.names
            if alias.name in STARTERS
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Name) and node.func.id in imported)
                or (dotted(node.func).startswith("processes.") and node.func.attr in STARTERS)
            ):
                found.add(name)
    return found


def test_rights_table_lists_every_process_the_daemon_starts() -> None:
    from stager.rights import PROCESSES

    listed = {row.started_by for row in PROCESSES}
    asking = askers()
    assert "stager.rights.pool" in asking and "stager.core.vouch" in asking
    assert listed == asking, (
        f"stager/rights/__init__.py's PROCESSES names {sorted(listed - asking)}, which "
        f"start none; and not {sorted(asking - listed)}, which do"
    )
    assert all(row.rights and row.what for row in PROCESSES)


def test_the_scan_reads_the_owner_rooms() -> None:
    """The owners themselves do start things: the scan sees them (it would pass
    vacuously if it saw nothing)."""
    seen = {
        kind
        for path in (
            REPO / "stager" / "core" / "processes.py",
            REPO / "stager" / "staging" / "blocking.py",
        )
        for kind, _, _ in starts(Path(path).read_text())
    }
    assert seen == {PROCESS, THREAD, LOOP}
