"""Download an HTTP(S) URL into the dataset, resuming with Range requests.

Bytes go to ``<dst>.part`` and are renamed into place only when complete (and
matching ``sha256``), so ``dst`` existing means done. Connection errors, short reads
and 429/5xx replies are retried with backoff, each retry resuming where the last
stopped, up to MAX_ATTEMPTS failures in a row that brought no new bytes.

Replies to ``Range: bytes=N-``: 206 from N appends; 200 (range ignored, or the file
changed, via ``If-Range``) starts over; 416 means the ``.part`` is complete if the
server says the whole is N bytes, else stale (start over).

``Accept-Encoding: identity`` and raw body iteration keep the bytes as stored: Range
offsets count stored bytes, and a ``.tar.gz`` must not be gunzipped on the way.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Annotated, Protocol
from urllib.parse import unquote, urlsplit

import httpx
from pydantic import AfterValidator, Field

from stager.core import downloads
from stager.core.errors import (
    BadRequest,
    FetchFailed,
    NotPublic,
    VerifyFailed,
    from_os_error,
)
from stager.core.redact import redact_url
from stager.fs.credentials import source_reader
from stager.ops.base import CheckContext, OpContext, RelativePath, StepParams
from stager.wire.progress import report_written

MAX_ATTEMPTS = 6  # consecutive failed attempts that brought no new bytes
BACKOFF_S = 0.5  # first retry delay, doubled each time, capped at BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
CHUNK = 1024 * 1024
TIMEOUT = httpx.Timeout(60.0, connect=15.0)
# Gateways and overloaded servers say these for a moment; anything else is final.
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_CONTENT_RANGE = re.compile(r"bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)")


def http_url(value: str) -> str:
    """``value`` if it is an http(s) URL with a host name; else a ValueError naming it."""
    try:
        url = httpx.URL(value)
    except (httpx.InvalidURL, TypeError, UnicodeError) as exc:
        raise ValueError(f"url {value!r} is not a valid URL ({exc})") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"url {value!r} must be an http:// or https:// URL with a host name")
    return value


HttpUrlText = Annotated[str, AfterValidator(http_url)]


class FetchStep(StepParams):
    """Download an HTTP(S) URL into the dataset, resuming with Range requests."""

    url: HttpUrlText
    dst: RelativePath
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")


def without_credentials(step: FetchStep) -> bool:
    """Whether the URL, read by the parser that downloads it, carries none of the
    user's credentials: no user or password, query or path parameters. The daemon sends
    nothing else of the user's (no netrc, no headers)."""
    url = httpx.URL(step.url)
    target = url.raw_path.decode("ascii", "replace")  # the path and the query, as sent
    return not (url.userinfo or "?" in target or ";" in target)


class _Retry(Exception):
    """Internal: this attempt failed in a way the next attempt may fix."""


def check(step: FetchStep, ctx: CheckContext) -> int:
    """No network I/O before staging: validate the name only; size is unknown (0)."""
    _file_name(step)
    if ctx.verify == "sha256" and step.sha256 is None:
        raise BadRequest(
            f"verify 'sha256' needs the digest of {step.url}: give the step that downloads "
            "it (a fetch, or an extract of the URL) its 'sha256' (as published with the "
            "file), or ask for verify 'size'"
        )
    return 0


class Watch(Protocol):
    """Told as the download's file grows, so a reader can follow it (stager.staging.overlap:
    a fetch and the extract of what it fetches, at once)."""

    def writing(self, offset: int) -> None:
        """The ``.part`` file is open to append at ``offset``, the bytes before it kept;
        0: a new file."""

    def wrote(self) -> None:
        """More bytes are in the ``.part`` file, visible to other readers."""


PART_SUFFIX = ".part"


def partial(dst: str) -> str:
    """The name a download's file has until it is complete (``dst``: its name then)."""
    return dst + PART_SUFFIX


def warm_up() -> None:
    """Pay now what a process's first download pays before its first byte (20-70 ms):
    the TLS authorities, the HTTP transport's import, the codec host names are encoded
    with. The fork server calls it before it forks the stagings."""
    httpx.Client(verify=downloads.tls_context()).close()
    "localhost".encode("idna")


def files(step: FetchStep, ctx: OpContext) -> tuple[Path, Path]:
    """The file a download appends to, and the name it has once complete."""
    target = _target(step, ctx)
    return target.with_name(partial(target.name)), target


def run(step: FetchStep, ctx: OpContext, watch: Watch | None = None) -> None:
    part, target = files(step, ctx)
    try:
        if _already_done(step, target, ctx):
            return
        with httpx.Client(
            verify=downloads.tls_context(), follow_redirects=True, timeout=TIMEOUT
        ) as client:
            download = _Download(step, part, ctx, client, watch)
            download.run()
        _verify(step, part, ctx, download.digest_of_part())
        os.replace(part, target)
        ctx.progress.advance(0, 1)
    except OSError as exc:
        raise from_os_error(exc, f"downloading {step.url}") from exc


def _file_name(step: FetchStep) -> str:
    if step.dst not in ("", ".") and not step.dst.endswith("/"):
        return os.path.basename(step.dst)
    name = url_file_name(step.url)
    if name is None:
        raise BadRequest(
            f"cannot name the download of {step.url} from its URL; give 'dst' as a file path"
        )
    return name


def url_file_name(url: str) -> str | None:
    """The file name a URL's path ends with, or None (``https://host/``)."""
    name = os.path.basename(unquote(urlsplit(url).path))
    return None if not name or name in (".", "..") else name


def _target(step: FetchStep, ctx: OpContext) -> Path:
    folder = step.dst if step.dst.endswith("/") or step.dst in ("", ".") else None
    parent = folder or os.path.dirname(step.dst) or "."
    directory = ctx.destination(parent)
    directory.mkdir(parents=True, exist_ok=True)
    return directory / _file_name(step)


def _already_done(step: FetchStep, target: Path, ctx: OpContext) -> bool:
    """A file at ``dst`` was renamed there complete; re-check its hash when one is given."""
    if not target.is_file():
        return False
    if step.sha256 and _sha256(target, ctx) != step.sha256.lower():
        target.unlink()  # replaced by a different file since; download again
        return False
    size = target.stat().st_size
    ctx.progress.add_total(size, 1)
    ctx.progress.advance(size, 1)
    return True


def _verify(step: FetchStep, part: Path, ctx: OpContext, digest: str | None = None) -> None:
    """``digest``: the ``.part`` file's, taken as its bytes arrived (None: read it again)."""
    if not step.sha256:
        return
    got, want = digest or _sha256(part, ctx), step.sha256.lower()
    if got != want:
        part.unlink()
        raise VerifyFailed(
            f"download of {step.url} has sha256 {got} but the step expects {want}; "
            "check the URL and the sha256 in the request"
        )


def _sha256(path: Path, ctx: OpContext) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            ctx.check_cancelled()
    return digest.hexdigest()


class _Download:
    """Retries and resume state for one URL; each attempt appends to the ``.part`` file."""

    def __init__(
        self,
        step: FetchStep,
        part: Path,
        ctx: OpContext,
        client: httpx.Client,
        watch: Watch | None = None,
    ):
        self.url = step.url
        self.part = part
        self.ctx = ctx
        self.client = client
        self.watch = watch
        self.counted = 0  # bytes already reported to progress, so retries never double-count
        self.announced = False
        # Sent as If-Range on resumes within this run: a file that changed
        # between attempts comes back whole (200) instead of being spliced.
        self.validator: str | None = None
        # The sha256 of the .part's first ``hashed`` bytes, taken as they are written, so
        # a checked download is not read a second time (140 GB: minutes) once complete.
        self.digest = hashlib.sha256() if step.sha256 else None
        self.hashed = 0

    def run(self) -> None:
        reason = "no attempt was made"
        failures = 0  # in a row without new bytes: a slow, flaky link still finishes
        while failures < MAX_ATTEMPTS:
            self.ctx.check_cancelled()
            before = self.counted
            try:
                if self._attempt():
                    return
                reason = "the connection closed before the whole file arrived"
            except _Retry as exc:
                reason = str(exc)
            except httpx.TooManyRedirects as exc:
                raise FetchFailed(
                    f"{self.url} redirects too many times ({exc}); check the URL"
                ) from exc
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            failures = 1 if self.counted > before else failures + 1
            if failures < MAX_ATTEMPTS:
                # wait() instead of sleep() so a cancel interrupts the backoff.
                self.ctx.cancel.wait(min(BACKOFF_S * 2 ** (failures - 1), BACKOFF_MAX_S))
        raise FetchFailed(
            f"downloading {self.url} failed after {MAX_ATTEMPTS} attempts in a row without "
            f"progress ({reason}); check the URL and the network, then stage again"
        )

    def _attempt(self) -> bool:
        """One GET; True when the ``.part`` file holds the whole body."""
        offset = self.part.stat().st_size if self.part.exists() else 0
        headers = {"Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
            if self.validator:
                headers["If-Range"] = self.validator
        with self.client.stream("GET", self.url, headers=headers) as response:
            _not_this_node_if_shared(response, self.url)
            if response.status_code == 416:
                return self._unsatisfiable(response, offset)
            self._raise_for_status(response)
            offset, total = self._start(response, offset)
            self._announce(total)
            return self._receive(response, offset, total)

    def _start(self, response: httpx.Response, offset: int) -> tuple[int, int | None]:
        """Where this body starts in the file, and the file's full size if known."""
        validator = response.headers.get("etag", "")
        self.validator = (
            validator if validator and not validator.startswith("W/") else None
        ) or response.headers.get("last-modified")
        if response.status_code == 206:
            start, total = _content_range(response.headers.get("content-range"))
            if start != offset:
                self.part.unlink(missing_ok=True)
                raise _Retry(f"the server answered a range starting at {start}, not {offset}")
            return offset, total
        length = response.headers.get("content-length")
        return 0, int(length) if length and length.isdigit() else None

    def _receive(self, response: httpx.Response, offset: int, total: int | None) -> bool:
        position = offset
        with open(self.part, "ab" if offset else "wb") as out:
            if self.watch is not None:
                self.watch.writing(offset)
            self._hash_up_to(offset)
            # The kept bytes are counted once hashed, which may take minutes: a
            # download's rate is judged from its first counted bytes on (see
            # stager.staging.download_rate), so the hash's silence is not taken for slowness.
            self._advance(position)
            # No chunk_size: httpx would buffer up to it, and a cut connection
            # would lose everything buffered instead of leaving it in the .part.
            for chunk in response.iter_raw():
                out.write(chunk)
                if self.digest is not None:
                    self.digest.update(chunk)
                    self.hashed += len(chunk)
                position += len(chunk)
                if self.watch is not None:
                    out.flush()  # so a reader of the file sees what it is told of
                    self.watch.wrote()
                self._advance(position)
                self.ctx.check_cancelled()
        if total is not None and position > total:
            self.part.unlink()
            raise _Retry(f"received {position} bytes but the server announced {total}")
        return total is None or position == total

    def _hash_up_to(self, offset: int) -> None:
        """Make the digest cover the .part's first ``offset`` bytes, which are kept: read
        from the file when it does not (a resume after a restart, a file started over)."""
        if self.digest is None or self.hashed == offset:
            return
        self.digest, self.hashed = hashlib.sha256(), 0
        with open(self.part, "rb") as kept:
            while self.hashed < offset and (chunk := kept.read(min(CHUNK, offset - self.hashed))):
                self.digest.update(chunk)
                self.hashed += len(chunk)
                self.ctx.check_cancelled()

    def digest_of_part(self) -> str | None:
        """The complete .part's sha256 when the download took it whole, else None."""
        if self.digest is None or not self.part.exists():
            return None
        return self.digest.hexdigest() if self.part.stat().st_size == self.hashed else None

    def _unsatisfiable(self, response: httpx.Response, offset: int) -> bool:
        _, total = _content_range(response.headers.get("content-range"))
        if total is not None and total == offset:
            self._announce(total)
            self._advance(offset)
            return True  # the .part already holds every byte
        self.part.unlink(missing_ok=True)
        raise _Retry(f"the partial download ({offset} bytes) no longer matches the server's file")

    def _raise_for_status(self, response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        message = (
            f"GET {self.url} answered HTTP {response.status_code} {response.reason_phrase}; "
            "check the URL and that the server allows this node to download it"
        )
        if response.status_code in RETRY_STATUS:
            raise _Retry(message)
        raise FetchFailed(message)

    def _announce(self, total: int | None) -> None:
        if self.announced:
            return
        self.announced = True
        self.ctx.progress.add_total(total or 0, 1)

    def _advance(self, position: int) -> None:
        if position > self.counted:
            self.ctx.progress.advance(position - self.counted)
            report_written(self.ctx.progress, position - self.counted)
            self.counted = position


def _not_this_node_if_shared(response: httpx.Response, url: str) -> None:
    """A download every user is to share must not come from this node (see
    stager.core.downloads): its name may have resolved elsewhere when it was asked for."""
    reader = source_reader()
    if reader is None or not reader.public:
        return
    stream = response.extensions.get("network_stream")
    peer = stream.get_extra_info("server_addr") if stream is not None else None
    if peer and downloads.is_this_node(str(peer[0])):
        raise NotPublic(
            f"{redact_url(url)} was served by this node itself ({peer[0]}), so this download "
            "cannot be shared by every user; it is staged again for the asking user alone"
        )


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """``bytes 100-199/1000`` -> (100, 1000); ``bytes */1000`` -> (None, 1000)."""
    match = _CONTENT_RANGE.fullmatch(value.strip()) if value else None
    if not match:
        return None, None
    start, _, total = match.groups()
    return (
        int(start) if start is not None else None,
        int(total) if total and total != "*" else None,
    )
