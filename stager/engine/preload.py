"""What the fork server holds before it forks anything: imported by the fork server
alone, as its preload (stager.core.processes sets it), and by nothing else.

Every staging process and user process is forked from that server, so each starts
with all of this done: every kind's module imported (a job carries its kind's part,
which unpickling would otherwise import again in each staging process, 10-20 ms),
every op imported and its table built (a pydantic model per op, ~10 ms), a download's
TLS settings and HTTP transport (20-70 ms before a first byte otherwise), whether
``tar`` is GNU tar (a ``tar --version``, ~2 ms), what multiprocessing needs to unpickle
a staging's arguments (3-10 ms), and every module a process that became a user runs
(which may not be able to read the interpreter's files, so must import nothing).
Importing this module does that work; that is its only purpose. It stands on the
engine's job floor, above the kinds: it holds whatever a job takes into a staging
process (tests/stager/test_fork_imports.py).
"""

from __future__ import annotations

import gc

# No collections while the server imports (~10% of its start): nothing it makes here
# is garbage, and it is all frozen at the end. Hence the imports below it.
gc.disable()
# ruff: noqa: E402

try:
    # What a staging process needs to unpickle its arguments (the shared counters, the
    # cancel event).
    import multiprocessing.heap  # noqa: F401
    import multiprocessing.popen_forkserver  # noqa: F401
    import multiprocessing.sharedctypes  # noqa: F401
    import multiprocessing.synchronize  # noqa: F401
    from importlib import import_module

    from stager.archive import split_tar
    from stager.core import downloads
    from stager.kinds import table as kinds  # noqa: F401 - each kind's job part (unpickled)
    from stager.ops import fetch, table
    from stager.rights import agent, pool  # noqa: F401 - a user process's
    from stager.staging import worker  # noqa: F401 - worker: a staging process's entry points

    for module in pool.USER_SIDE_MODULES:  # what a user process runs: never imported as one
        import_module(module)
    table.load(())  # the key every job without site ops asks for
    fetch.warm_up()
    downloads.warm_up()
    split_tar.gnu_tar()
finally:
    # All of the above lives as long as the server: out of the collector's sight (as
    # Python's gc docs advise before fork()), the children's full collections do not
    # walk it nor dirty its pages, and the server's own exit does not walk it (~0.07 s
    # of CPU at every daemon's end). On also when an import failed: the fork server
    # passes over a preload's ImportError and forks on, and every process it forked
    # would run with the collector off.
    gc.freeze()
    gc.enable()
