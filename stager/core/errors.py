"""The daemon's exception tree.

Every error carries a machine-readable ``type``, an HTTP status for when it
reaches the API, and one sentence that names the input at fault and the fix.

    StagerError
    ├── BadRequest (400)
    │   ├── SourceNotFound          source path does not exist
    │   ├── SourceUnreadable (403)  the asking user may not read the source
    │   ├── UnsafePath              destination or link escapes where it may live
    │   ├── SpecialSource           a source is a FIFO, socket or device (never read)
    │   ├── UnknownFormat           archive format not recognised
    │   ├── UnknownRecipe           recipe name not known
    │   └── MissingExtra (422)      a step needs an optional package (torch, scipy)
    ├── Forbidden (403)             another user's datasets or leases (root excepted)
    │   └── UntrustedImage          a prebuilt image outside the admin's trusted folders,
    │                               or without the sha256 that pins it
    ├── NotFound (404)              no dataset by that name
    ├── Conflict (409)              name taken by another spec, entry leased, ...
    ├── InsufficientSpace (422)     free space below what the request needs
    │   └── QuotaExceeded           a user's own data past their --user-quota
    ├── TooManyRequests (429)       a user's queue on the node service is full
    ├── ImageUnavailable (422)      an image this daemon cannot mount, and no tree allowed
    ├── RecipeFileError (500)       a recipe file on this node is malformed (the admin's fix)
    ├── UserProcessUnanswered (503) the process acting as a user gave no answer
    │   ├── UserProcessTimeout (504)  past STAGER_USER_PROCESS_TIMEOUT_S (a hung source?)
    │   └── UserProcessFailed         it ended, or broke the protocol, first (its user may kill it)
    └── StagingError (raised while staging; stored on the dataset, not an HTTP reply)
        ├── CorruptArchive          truncated or malformed archive
        ├── UnsafeArchiveMember     member would land outside its destination
        ├── VerifyFailed            staged bytes differ from the source
        ├── FetchFailed             HTTP source could not be downloaded
        ├── StagingIOError          an OS error (ENOSPC, EIO, ...) mid-staging
        ├── StagingProcessDied      the staging process crashed or hit a bug
        ├── StagingStalled          no progress for --stall-timeout seconds
        ├── NotPublic               a shared staging met a source not everyone may read
        │                           (staged again for the asking user alone)
        └── Cancelled               the dataset was cancelled
"""

from __future__ import annotations

from stager.core.redact import redact_text


def error_content(type_: str, message: str) -> dict[str, dict[str, str]]:
    """The body of every error the daemon answers, the API's and the prefetch port's
    alike (stager.wire.schemas.ErrorResponse), with a URL's secrets masked."""
    return {"error": {"type": type_, "message": redact_text(message)}}


class StagerError(Exception):
    type: str = "error"
    status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict[str, str]:
        return {"type": self.type, "message": self.message}


class BadRequest(StagerError):
    type = "bad_request"
    status = 400


class SourceNotFound(BadRequest):
    type = "source_not_found"


class SourceUnreadable(BadRequest):
    type = "source_unreadable"
    status = 403


class UnsafePath(BadRequest):
    type = "unsafe_path"


class SpecialSource(BadRequest):
    type = "special_file"


class UnknownFormat(BadRequest):
    type = "unknown_format"


class UnknownRecipe(BadRequest):
    type = "unknown_recipe"


class MissingExtra(BadRequest):
    """Defined here, not in its op, so a staging process can report it by class name."""

    type = "missing_dependency"
    status = 422


class RecipeFileError(StagerError):
    type = "invalid_recipe_file"
    status = 500


class Forbidden(StagerError):
    type = "forbidden"
    status = 403


class UntrustedImage(Forbidden):
    type = "untrusted_image"


class ImageUnavailable(StagerError):
    type = "image_unavailable"
    status = 422


class NotFound(StagerError):
    type = "not_found"
    status = 404


class Conflict(StagerError):
    type = "conflict"
    status = 409


class InsufficientSpace(StagerError):
    type = "insufficient_space"
    status = 422


class QuotaExceeded(InsufficientSpace):
    type = "quota_exceeded"


class StagingError(StagerError):
    type = "staging_error"
    status = 422


class CorruptArchive(StagingError):
    type = "corrupt_archive"


class UnsafeArchiveMember(StagingError):
    type = "unsafe_member"


class VerifyFailed(StagingError):
    type = "verify_failed"


class FetchFailed(StagingError):
    type = "fetch_failed"


class StagingIOError(StagingError):
    type = "io_error"


class StagingProcessDied(StagingError):
    type = "internal_error"


class UserProcessUnanswered(StagerError):
    status = 503


class UserProcessTimeout(UserProcessUnanswered):
    type = "timeout"
    status = 504


class UserProcessFailed(UserProcessUnanswered):
    type = "user_process_failed"


class StagingStalled(StagingError):
    type = "stalled"


class NotPublic(StagingError):
    type = "not_public"


class Cancelled(StagingError):
    type = "cancelled"


def from_os_error(exc: OSError, doing: str) -> StagingIOError:
    """The one place an OSError met while staging becomes a user-facing sentence."""
    import errno

    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno == errno.ENOSPC:
        return StagingIOError(
            f"the node-local disk filled up while {doing}{where}; free space, evict "
            "datasets or use a larger --cache-dir, then stage again"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return StagingIOError(f"permission denied while {doing}{where}; check the permissions")
    return StagingIOError(f"I/O error while {doing}{where}: {exc.strerror or exc}")


class TooManyRequests(StagerError):
    type = "too_many_requests"
    status = 429
