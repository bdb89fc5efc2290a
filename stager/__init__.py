"""stager: per-node dataset staging and caching daemon.

Kept import-light on purpose: the client imports ``stager.wire.schemas`` for the wire
models and must not pull in FastAPI, uvicorn or the engine.
"""

import sys

__version__ = "0.1.0"

# httpx imports its command-line client (click, rich, pygments: ~50 ms of CPU) whenever
# those are installed, as they are with stager (rich is ours, click uvicorn's); nothing
# here runs httpx's command line. Marked absent, it is skipped (httpx falls back to a
# stub): every daemon start imports httpx (its fork server, a fork of it, has it then).
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
