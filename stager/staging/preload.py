"""What the fork server holds before it forks anything: imported by the fork server
alone, as its preload, and by nothing else.

Every staging and user process is forked from that server, so each starts with every
op imported and its table built (~10 ms), a download's TLS settings and transport
(20-70 ms), whether ``tar`` is GNU tar (~2 ms), what multiprocessing needs to unpickle
a staging's arguments (3-10 ms), and every module a process that became a user runs
(it may not be able to read the interpreter's files). Importing this module does that.
"""

from __future__ import annotations

# What a staging process needs to unpickle its arguments (the shared counters, the
# cancel event).
import multiprocessing.heap  # noqa: F401
import multiprocessing.popen_forkserver  # noqa: F401
import multiprocessing.sharedctypes  # noqa: F401
import multiprocessing.synchronize  # noqa: F401
from importlib import import_module

from stager.archive import split_tar
from stager.core import downloads
from stager.ops import fetch, table
from stager.rights import agent, pool  # noqa: F401 - a user process's
from stager.staging import worker  # noqa: F401 - worker: a staging process's entry points

for module in pool.USER_SIDE_MODULES:  # what a user process runs: never imported as one
    import_module(module)
table.load(())  # the key every job without site ops asks for
fetch.warm_up()
downloads.warm_up()
split_tar.gnu_tar()
