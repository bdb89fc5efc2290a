"""The ``copy_from_node`` op: stage a job's dataset from another planned node of the job
instead of from the storage (docs/prestaging.md, "The target node", holds the story).

What answers on the source's prefetch port (``GET /v1/copies``) is not trusted: the
head must carry a credential of this service's uid for the cache key computed here
and a manifest sha256, checked before a byte of the body is read; the tar (held in an
unnamed file, at most ``limit_bytes``) goes through the hardened extraction, and the
tree must match the manifest path by path.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import threading
from typing import Any

from pydantic import Field

from stager.archive.extractor import extract_archive
from stager.archive.job import Archive, translate
from stager.core import processes, vouch
from stager.core.errors import VerifyFailed
from stager.core.settings import host_port
from stager.fs import manifest as manifests
from stager.fs.fastcopy import write_all
from stager.ops.base import CheckContext, OpContext, StepParams
from stager.wire import manifest_format
from stager.wire.schemas import MAX_BYTES, TRANSFER_TTL_MAX_S

COPY_ROUTE = "/v1/copies"
CHUNK = 1 << 20
CONNECT_TIMEOUT_S = 10.0
# Once the answer began: a source that sends nothing this long is gone.
READ_TIMEOUT_S = 60.0
MANIFEST_LIMIT = 1 << 30
# The source sends only with this service's own credential beside the planner's
# (stager.prestage.prefetch.authority.ASKER; the same words, not imported: an op does not
# depend on the prefetch service).
ASKER, ASKER_HEADER = "stager prefetch copy asker", "x-stager-copy-asker"
ASKER_TTL_S = 60
# The answer's headers: what the source node sends.
KEY, TAR_BYTES, MANIFEST_BYTES = "x-stager-key", "x-stager-tar-bytes", "x-stager-manifest-bytes"
MANIFEST_SHA256, MANIFEST_CREDENTIAL = "x-stager-manifest-sha256", "x-stager-manifest-credential"


class CopyFromNodeStep(StepParams):
    """Receive the ready tree another planned node of the job prefetched, and check it."""

    address: str = Field(min_length=1, max_length=300)  # HOST:PORT, the source's prefetch port
    origin_node: str = Field(min_length=1, max_length=255)  # for messages
    authorization: str = Field(min_length=1, max_length=4096)  # "Munge <the planner's COPY>"
    order: str = Field(min_length=1, max_length=64 * 1024)  # the body that credential signs
    vouch_uid: int = Field(ge=0, le=2**32 - 1)  # this service's: whose manifest credential
    vouch_key: str = Field(min_length=1, max_length=64)  # this node's cache key
    # The request's shared key, when this node keeps the copy as the user's own (sources
    # not cluster-wide) and the source node shares its staging: the same spec and sources.
    shared_key: str = Field(default="", max_length=64)
    munge_socket: str | None = Field(default=None, max_length=4096)
    limit_bytes: int = Field(ge=1, le=MAX_BYTES)  # the most the tar and manifest may take
    # how long the source may take to pack it (a week at most, as any transfer)
    wait_s: float = Field(gt=0, le=TRANSFER_TTL_MAX_S, allow_inf_nan=False)


def check(step: CopyFromNodeStep, ctx: CheckContext) -> int:
    return 0  # the request's own estimate stands (stager.fanout.room)


def run(step: CopyFromNodeStep, ctx: OpContext) -> None:
    answer, connection = _ask(step, ctx)
    try:
        head = _head(step, answer)
        # Before a file is opened: only what the source's service vouched for counts
        # (the manifest's own bytes are held to this sha256 once they arrive).
        vouch.check(
            head["credential"], step.vouch_uid, head["key"], head["sha256"], step.munge_socket
        )
        tree = ctx.destination(".")
        tree.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(ctx.root), os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            _receive(step, answer, fd, head["tar"], ctx)
            manifest = _read_exactly(step, answer, head["manifest"], ctx)
        except (TimeoutError, ConnectionError, http.client.HTTPException) as exc:
            os.close(fd)
            raise VerifyFailed(
                f"the copy from {step.origin_node} broke off ({exc}); this node's job "
                "stages from the source at its start"
            ) from exc
        except BaseException:
            os.close(fd)
            raise
    finally:
        connection.close()
    with os.fdopen(fd, "rb", buffering=0) as raw:
        if manifest_format.digest(manifest) != head["sha256"]:
            raise VerifyFailed(
                f"the manifest from {step.origin_node} is not the one its answer names; "
                "this node's job stages from the source at its start"
            )
        expected = manifests.read(manifest, f"the manifest from {step.origin_node}")
        label = f"the copy from {step.origin_node}"
        ctx.progress.add_total(head["tar"], 0)
        with translate(label):
            extract_archive(ctx, Archive(raw.fileno(), 0, head["tar"], "tar", label), str(tree))
    ctx.check_cancelled()
    manifests.prune(tree, expected)
    manifests.verify(tree, expected, step.origin_node)


def _ask(step: CopyFromNodeStep, ctx: OpContext) -> tuple[http.client.HTTPResponse, Any]:
    """The source node's answer, once it has one (it packs the ready tree first; one
    not ready is answered at once); a cancel of this staging closes the connection
    meanwhile."""
    host, port = host_port(step.address)
    connection = http.client.HTTPConnection(host, port, CONNECT_TIMEOUT_S)
    done = threading.Event()

    def closer() -> None:  # a socket blocked in recv wakes only when shut down
        while not done.wait(0.2):
            if ctx.cancel.is_set() and connection.sock is not None:
                connection.sock.shutdown(2)
                return

    asker = asker_credential(step.order.encode(), step.munge_socket)
    try:
        connection.connect()
        sock = connection.sock
        assert sock is not None
        sock.settimeout(step.wait_s + 60)
        processes.thread(closer, name="copy-cancel")
        headers = {
            "authorization": step.authorization,
            ASKER_HEADER: f"Munge {asker}",
            "content-type": "application/json",
        }
        connection.request("GET", COPY_ROUTE, body=step.order.encode(), headers=headers)
        answer = connection.getresponse()
        sock.settimeout(READ_TIMEOUT_S)  # (the connection lets go of it: "close")
    except (OSError, http.client.HTTPException) as exc:
        connection.close()
        ctx.check_cancelled()
        raise VerifyFailed(
            f"could not get the copy from {step.origin_node} ({step.address}): {exc}; "
            "this node's job stages from the source at its start"
        ) from exc
    finally:
        done.set()
    return answer, connection


def asker_credential(order: bytes, munge_socket: str | None) -> str:
    """This process's credential over ``order`` (root's: the node service's staging
    process), which the source requires beside the planner's copy credential."""
    payload = json.dumps({"what": ASKER, "sha256": hashlib.sha256(order).hexdigest()})
    made = vouch.encode(payload, munge_socket, ASKER_TTL_S)
    if made is None:
        raise VerifyFailed(
            "munged made no credential for this node's copy request; this node's job "
            "stages from the source at its start"
        )
    return made


def _head(step: CopyFromNodeStep, answer: http.client.HTTPResponse) -> dict[str, Any]:
    if answer.status != 200:
        why = answer.read(4096).decode(errors="replace")
        raise VerifyFailed(
            f"{step.origin_node} did not send the copy ({answer.status}: {why}); this "
            "node's job stages from the source at its start"
        )
    try:
        head = {
            "key": answer.headers[KEY],
            "tar": int(answer.headers[TAR_BYTES]),
            "manifest": int(answer.headers[MANIFEST_BYTES]),
            "sha256": answer.headers[MANIFEST_SHA256],
            "credential": answer.headers[MANIFEST_CREDENTIAL],
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise VerifyFailed(f"{step.origin_node}'s copy came without its sizes ({exc})") from exc
    if head["key"] not in (step.vouch_key, step.shared_key or step.vouch_key):
        raise VerifyFailed(
            f"{step.origin_node} holds {head['key']}, and this node computes {step.vouch_key} "
            "for the request: the sources look different from here; this node's job stages "
            "from the source at its start"
        )
    size = head["tar"] + head["manifest"]
    if min(head["tar"], head["manifest"]) < 0 or size > step.limit_bytes:
        raise VerifyFailed(
            f"{step.origin_node}'s copy says {size} bytes, more than this dataset may take "
            f"({step.limit_bytes}); not received"
        )
    if head["manifest"] > MANIFEST_LIMIT:
        raise VerifyFailed(f"{step.origin_node}'s manifest is over {MANIFEST_LIMIT} bytes")
    return head


def _receive(
    step: CopyFromNodeStep, answer: http.client.HTTPResponse, fd: int, size: int, ctx: OpContext
) -> None:
    left = size
    while left:
        ctx.check_cancelled()
        data = answer.read(min(CHUNK, left))
        if not data:
            raise VerifyFailed(
                f"the copy from {step.origin_node} ended {left} bytes short; this node's job "
                "stages from the source at its start"
            )
        write_all(fd, data)
        left -= len(data)


def _read_exactly(
    step: CopyFromNodeStep, answer: http.client.HTTPResponse, size: int, ctx: OpContext
) -> bytes:
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size:
        ctx.check_cancelled()
        got = answer.readinto(view[done : done + CHUNK])
        if not got:
            raise VerifyFailed(f"the manifest from {step.origin_node} ended short")
        done += got
    return bytes(data)
