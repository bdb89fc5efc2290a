"""One node service vouching to another for a fan-out's manifest, with MUNGE.

A copy broadcast from another node may become an entry every user shares only if its
manifest comes from the source node's service, not from the job that carried it (a
user's, which could forge parts and a manifest that match). So the packing service
asks munged for a credential over the entry's key and the manifest's sha256
(:func:`vouch`); the job carries it; the receiving service decodes it with its own
munged (:func:`check`). Only a credential made by the service's own uid over this key
and manifest counts.

A credential decoded twice (a resumed adoption) is reported as replayed: it still
vouches, since its payload binds the key and the manifest.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from stager.core.errors import VerifyFailed
from stager.core.processes import NotRun, run

TTL_S = 900  # from the last part packed to the adoption checking it
WHAT = "stager fan-out manifest"
# An image dataset's file, sent whole (docs/multinode.md): the same credential over the
# image's sha256, under another name, so that one never passes for the other.
IMAGE = "stager fan-out image"
# unmunge's STATUS values that still vouch for the payload (munge.h: EMUNGE_SUCCESS,
# EMUNGE_CRED_REPLAYED).
VOUCHING = {0, 17}


@functools.cache
def available() -> bool:
    """Whether this node can vouch (and check): munge's commands are installed. Looked
    up once per daemon: it is asked on the event loop for every part exported."""
    return shutil.which("munge") is not None and shutil.which("unmunge") is not None


def _socket_args(socket: Path | str | None) -> list[str]:
    return ["--socket", str(socket)] if socket is not None else []


def vouch(
    key: str, manifest_sha256: str, socket: Path | str | None, what: str = WHAT
) -> str | None:
    """A credential of this process's uid for the manifest (``what``: or the image) of
    entry ``key``; None when munged cannot make one (the receivers then keep their
    copies private, and refuse an image)."""
    payload = json.dumps({"what": what, "key": key, "manifest_sha256": manifest_sha256})
    return encode(payload, socket, TTL_S)


def encode(payload: str, socket: Path | str | None, ttl_s: int) -> str | None:
    """A credential of this process's uid over ``payload``, valid ``ttl_s`` seconds; None
    when munged cannot make one."""
    try:
        done = run(["munge", *_socket_args(socket), "--ttl", str(ttl_s), "--string", payload], 30)
    except NotRun:
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


@dataclass(frozen=True)
class Decoded:
    """What munged says of a credential: its STATUS (munge.h's number, -1 when unknown),
    the metadata asked for, and the payload as text."""

    status: int
    meta: dict[str, str]
    payload: str
    why: str  # unmunge's sentence when status is not 0


def decode(
    credential: str, socket: Path | str | None, what: str, keys: str = "STATUS,UID"
) -> Decoded:
    """Decode ``credential`` with this node's munged; ``what`` names it in errors."""
    try:
        done = run(["unmunge", *_socket_args(socket), "--numeric", "--keys", keys], 30, credential)
    except NotRun as exc:
        raise VerifyFailed(f"cannot check {what} with unmunge ({exc})") from exc
    meta_text, _, payload_text = done.stdout.partition("\n\n")
    meta = dict(
        (name.strip(), value.strip())
        for name, _, value in (line.partition(":") for line in meta_text.splitlines())
    )
    status = meta.get("STATUS", "")
    code = int(status) if status.isdigit() else -1
    why = done.stderr.strip() or f"status {status or 'unknown'}"
    return Decoded(status=code, meta=meta, payload=payload_text, why=why)


def check(
    credential: object,
    uid: int,
    key: str,
    manifest_sha256: str,
    socket: Path | str | None,
    what: str = WHAT,
) -> None:
    """Raise unless ``credential`` is munged's, made by ``uid``, for the manifest (or
    ``what`` else) of ``key`` whose sha256 is ``manifest_sha256``."""
    if not isinstance(credential, str) or not credential.strip():
        raise VerifyFailed(
            "the broadcast copy's manifest came without the source node's credential, so it "
            "cannot be shared with every user; this node stages from the source"
        )
    decoded = decode(credential, socket, "the manifest's credential")
    status, maker, payload_text = decoded.status, decoded.meta.get("UID", ""), decoded.payload
    if status not in VOUCHING:
        raise VerifyFailed(f"the manifest's credential does not decode here ({decoded.why})")
    if maker != str(uid):
        raise VerifyFailed(
            f"the manifest's credential was made by uid {maker}, not by the node service "
            f"(uid {uid}): a job's own, so the copy is not trusted"
        )
    try:
        payload = json.loads(payload_text)
    except ValueError as exc:
        raise VerifyFailed("the manifest's credential holds no stager payload") from exc
    if not isinstance(payload, dict) or payload.get("what") != what:
        raise VerifyFailed("the manifest's credential vouches for something else")
    if (payload.get("key"), payload.get("manifest_sha256")) != (key, manifest_sha256):
        raise VerifyFailed(
            f"the manifest's credential vouches for {payload.get('key')} with manifest "
            f"{payload.get('manifest_sha256')}, not for {key} with manifest {manifest_sha256}"
        )
