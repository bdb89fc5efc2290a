"""Client of the stager daemon: the Python API and the ``stager-client`` command.

    from client import StagerClient
    status = StagerClient().wait("inat", timeout=3600)   # raises StagingFailed / WaitTimeout
    print(status.path)

Importing this package loads httpx and pydantic only (the wire models come from
``stager.wire.schemas``, which depends on pydantic alone); never FastAPI, uvicorn or torch.
"""

from __future__ import annotations

# Before httpx: the stager package (stager/__init__.py) marks httpx's command-line client
# (click, rich's syntax, pygments) absent, which httpx would otherwise import with itself:
# each stager-client process 0.44 -> 0.40 s of CPU (means of 30, `ls` with no daemon).
import stager.wire.schemas  # noqa: F401  # isort: skip
from client._client import (
    DEFAULT_AWAIT_REQUEST_S,
    DEFAULT_RETRY_FOR_S,
    DEFAULT_TIMEOUT_S,
    AsyncStagerClient,
    Backoff,
    StagerClient,
    stage_body,
)
from client._discovery import Endpoint, discover
from client.errors import (
    BadConfiguration,
    Conflict,
    ConnectionLost,
    DaemonError,
    DaemonUnavailable,
    DatasetEvicted,
    DatasetNotFound,
    NeverRequested,
    RequestRejected,
    StagerError,
    StagingCancelled,
    StagingFailed,
    Unauthorized,
    WaitTimeout,
)
from stager.wire.schemas import (
    DatasetCreate,
    DatasetPublic,
    DatasetsPublic,
    ErrorInfo,
    LeaseCreate,
    LeasePublic,
    ProgressPublic,
    State,
)

__all__ = [
    "DEFAULT_AWAIT_REQUEST_S",
    "DEFAULT_RETRY_FOR_S",
    "DEFAULT_TIMEOUT_S",
    "AsyncStagerClient",
    "Backoff",
    "BadConfiguration",
    "Conflict",
    "ConnectionLost",
    "DaemonError",
    "DaemonUnavailable",
    "DatasetCreate",
    "DatasetEvicted",
    "DatasetNotFound",
    "DatasetPublic",
    "DatasetsPublic",
    "Endpoint",
    "ErrorInfo",
    "LeaseCreate",
    "LeasePublic",
    "NeverRequested",
    "ProgressPublic",
    "RequestRejected",
    "StagerClient",
    "StagerError",
    "StagingCancelled",
    "StagingFailed",
    "State",
    "Unauthorized",
    "WaitTimeout",
    "discover",
    "stage_body",
]
