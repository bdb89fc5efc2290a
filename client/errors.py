"""The client's exception tree. Every message is one sentence a user can act on.

    StagerError
    ├── BadConfiguration        STAGER_URL / --url / the token file cannot be used
    ├── DaemonUnavailable       no daemon answers at the URL (not started, stopped, wrong URL)
    │   └── ConnectionLost      the daemon went away mid-request (killed or restarting)
    ├── DaemonError             5xx, or an answer that is not the stager API's
    ├── RequestRejected         the daemon refused the request (4xx); its sentence, type, status
    │   ├── Unauthorized        401: missing or wrong token (TCP)
    │   ├── DatasetNotFound     404: no dataset by that name
    │   └── Conflict            409: name taken by another spec, dataset leased, ...
    ├── StagingFailed           the dataset ended without becoming ready; the daemon's sentence
    │   ├── StagingCancelled    someone cancelled it
    │   └── DatasetEvicted      it was ready, then evicted from the node cache
    ├── WaitTimeout             still queued or staging when the caller's timeout passed
    │   └── NeverRequested      no stage request for that name arrived before the timeout
    └── FanoutError             --peers slurm: a node, a step or sbcast failed and nothing
                                was left to try; the sentence names the node and the step

httpx's errors become these in exactly one place, ``client._client._translate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stager.wire.schemas import DatasetPublic


class StagerError(Exception):
    """Base of every error the client raises; ``str(exc)`` is a sentence for humans."""

    type: str = "error"  # machine-readable, like the daemon's error types

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadConfiguration(StagerError):
    type = "bad_configuration"


START_FIX = "start it with `stager serve --detach`, or point --url / STAGER_URL at it"


class DaemonUnavailable(StagerError):
    """Kept as (problem, fix) so a retry loop can say how long it tried in between."""

    type = "daemon_unavailable"

    def __init__(self, problem: str, *, url: str = "", fix: str = START_FIX) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix
        self.url = url

    def after_retries(self, seconds: float) -> DaemonUnavailable:
        problem = f"{self.problem}, and it did not come back after {seconds:.1f} s of retries"
        return type(self)(problem, url=self.url, fix=self.fix)


class ConnectionLost(DaemonUnavailable):
    """The request may have reached the daemon; only idempotent calls retry it."""

    type = "connection_lost"


class DaemonError(StagerError):
    type = "daemon_error"

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class RequestRejected(StagerError):
    """The daemon answered ``{"error": {"type", "message"}}`` with a 4xx status."""

    def __init__(self, message: str, *, type: str, status_code: int) -> None:  # noqa: A002
        super().__init__(message)
        self.type = type
        self.status_code = status_code


class Unauthorized(RequestRejected):
    pass


class DatasetNotFound(RequestRejected):
    # Seconds a wait gave the name's stage request before raising this (0: not a wait's).
    waited: float = 0.0


class Conflict(RequestRejected):
    pass


class StagingFailed(StagerError):
    """``message`` is the daemon's sentence; ``status`` the dataset's final status."""

    def __init__(self, message: str, *, status: DatasetPublic) -> None:
        super().__init__(message)
        self.status = status
        self.name = status.name
        self.type = status.error.type if status.error else str(status.state)


class StagingCancelled(StagingFailed):
    pass


class DatasetEvicted(StagingFailed):
    pass


class WaitTimeout(StagerError):
    """``status`` is the last status seen, with its progress."""

    type = "timeout"

    def __init__(self, message: str, *, status: DatasetPublic) -> None:
        super().__init__(message)
        self.status: DatasetPublic | None = status
        self.name = status.name


class NeverRequested(WaitTimeout):
    """A wait that began before its stage request, which then never came."""

    def __init__(self, message: str, *, name: str) -> None:
        StagerError.__init__(self, message)
        self.status = None
        self.name = name


class FanoutError(StagerError):
    """A multi-node staging (``--peers slurm``) could not make the data ready everywhere."""

    type = "fanout_failed"


__all__ = [
    "BadConfiguration",
    "Conflict",
    "ConnectionLost",
    "DaemonError",
    "DaemonUnavailable",
    "DatasetEvicted",
    "DatasetNotFound",
    "FanoutError",
    "NeverRequested",
    "RequestRejected",
    "StagerError",
    "StagingCancelled",
    "StagingFailed",
    "Unauthorized",
    "WaitTimeout",
]
