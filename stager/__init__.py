"""stager: per-node dataset staging and caching daemon.

Kept import-light on purpose: the client imports ``stager.wire.schemas`` for the wire
models and must not pull in FastAPI, uvicorn or the engine.
"""

__version__ = "0.1.0"
