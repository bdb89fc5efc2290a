"""Who may order a prefetch: Slurm's own identity, proven by MUNGE, for exactly this call.

Whoever orders a prefetch chooses the uid a staging runs as, so the order must come
from root or SlurmUser: ``Authorization: Munge <credential>`` whose payload is
``{"what": "stager prefetch", "sha256": <the body's>}``, decoded by this node's munged,
within ``prefetch_credential_ttl_s``, over this body, naming this node. **Used once**
(docs/prestaging.md): an order is an action, so besides munged's replay status
(forgotten at its restart) the service keeps spent credentials (:class:`Seen`) on disk
until they expire, at most ``SEEN_MAX`` (past it calls are refused: forgetting the
oldest would open the replay again).
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stager.core import vouch
from stager.core.errors import BadRequest, Forbidden, StagerError, VerifyFailed
from stager.core.identity import Caller
from stager.core.settings import Settings
from stager.staging.blocking import run_io

WHAT = "stager prefetch"
# A copy order's second credential (docs/prestaging.md, "4-node job"): made by the planner
# over the same body, carried by the target node to the source node's port, decoded only
# there. Its own word, so that neither passes for the other.
COPY = "stager prefetch copy"
COPY_HEADER = "x-stager-copy-credential"
# The target node's service's own credential over the same body, made as it asks the
# source (root's: its staging process's uid): a copy credential alone is not enough, so
# that a user who was sent one (listening on the target's prefetch port while its service
# was down) cannot replay it to the source.
ASKER = "stager prefetch copy asker"
ASKER_HEADER = "x-stager-copy-asker"
SEEN_MAX = 100_000
# munge.h: EMUNGE_CRED_EXPIRED, EMUNGE_CRED_REWOUND, EMUNGE_CRED_REPLAYED.
_EXPIRED, _REWOUND, _REPLAYED = 15, 16, 17


class NotAuthorized(StagerError):
    """401: a prefetch call without a valid credential of root or SlurmUser, or an API
    call whose caller the node service cannot tell (stager.api.deps)."""

    type = "unauthorized"
    status = 401


class PrefetchOrder(BaseModel):
    """The body a credential signs. ``request``: the planner's body of ``POST
    /v1/datasets`` for one declared dataset (stage and copy). A copy is staged on
    ``node`` from what node ``source`` (reached at ``source_address``, HOST:PORT, its
    prefetch port) prefetched for the same job, not from the storage."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["stage", "cancel", "copy"]
    job: int = Field(ge=1, le=2**63)
    uid: int = Field(ge=0, le=2**32 - 2)
    gid: int = Field(ge=0, le=2**32 - 2)
    node: str = Field(min_length=1, max_length=255)
    request: dict | None = None
    source: str | None = Field(default=None, min_length=1, max_length=255)
    source_address: str | None = Field(default=None, min_length=1, max_length=300)

    @model_validator(mode="after")
    def _copy_names_its_source(self) -> PrefetchOrder:
        if (self.action == "copy") != (self.source is not None and self.source_address is not None):
            raise ValueError("a copy, and only a copy, names its source node and its address")
        if self.source == self.node:
            raise ValueError("a copy's source is another node than its target")
        return self


class Seen:
    """Credentials already used (their sha256), each kept until it expires."""

    def __init__(self, entries: dict[str, float] | None = None) -> None:
        self.entries: dict[str, float] = dict(entries or {})

    def claim(self, digest: str, expires: float, now: float) -> None:
        """Take ``digest`` as used now, or refuse it: used before, or too many in flight."""
        self.entries = {d: t for d, t in self.entries.items() if t >= now}
        if digest in self.entries:
            raise NotAuthorized(
                "this prefetch credential was used already; each call needs a fresh one "
                "(munge --string for each)"
            )
        if len(self.entries) >= SEEN_MAX:
            raise NotAuthorized(
                f"{SEEN_MAX} prefetch credentials are still within their time to live on "
                "this node; retry when some have expired"
            )
        self.entries[digest] = expires


def signed_by_slurm(settings: Settings) -> set[int]:
    """Root's and SlurmUser's uids. Blocking (the user database may be LDAP's)."""
    allowed = {0}
    try:
        allowed.add(pwd.getpwnam(settings.slurm_user).pw_uid)
    except KeyError:
        pass  # an unknown SlurmUser adds nobody: root alone
    return allowed


def credential_of(header: str | None) -> str:
    scheme, _, credential = (header or "").partition(" ")
    if scheme.lower() != "munge" or not credential.strip():
        raise NotAuthorized(
            "a prefetch needs 'Authorization: Munge <credential>' made by root or SlurmUser "
            "over the body's sha256; users cannot order prefetches"
        )
    return credential.strip()


async def verify(
    header: str | None, body: bytes, settings: Settings, seen: Seen, what: str = WHAT
) -> PrefetchOrder:
    """The order ``body`` holds, once its credential proves it; else 401 (who signed it)
    or 403 (what it names). Claims the credential in ``seen``, which the caller saves
    before it acts. ``what``: ``WHAT`` (it names this node), or ``COPY``/``ASKER`` (its
    ``source`` is this node)."""
    credential = credential_of(header)
    try:
        decoded = await run_io(
            vouch.decode,
            credential,
            settings.munge_socket,
            "the prefetch's credential",
            "STATUS,UID,ENCODE_TIME,TTL",
        )
    except VerifyFailed as exc:
        raise NotAuthorized(exc.message) from exc
    if decoded.status == _REPLAYED:
        raise NotAuthorized("this prefetch credential was used already; each call needs its own")
    if decoded.status in (_EXPIRED, _REWOUND):
        raise NotAuthorized(f"the prefetch's credential has expired ({decoded.why})")
    if decoded.status != 0:
        raise NotAuthorized(f"the prefetch's credential does not decode here ({decoded.why})")
    maker = decoded.meta.get("UID", "")
    if not maker.isdigit() or int(maker) not in await run_io(signed_by_slurm, settings):
        raise NotAuthorized(
            f"the prefetch's credential was made by uid {maker}, not by root or SlurmUser "
            f"({settings.slurm_user}); users cannot order prefetches"
        )
    encoded, ttl = decoded.meta.get("ENCODE_TIME", ""), decoded.meta.get("TTL", "")
    if not (encoded.isdigit() and ttl.isdigit()):
        raise NotAuthorized("the prefetch's credential tells no time; it cannot be checked")
    if int(ttl) > settings.prefetch_credential_ttl_s:
        raise NotAuthorized(
            f"the prefetch's credential lives {ttl} s, longer than this node accepts "
            f"({settings.prefetch_credential_ttl_s} s, STAGER_PREFETCH_CREDENTIAL_TTL_S)"
        )
    try:
        payload = json.loads(decoded.payload)
    except ValueError:
        payload = None
    digest = hashlib.sha256(body).hexdigest()
    if not isinstance(payload, dict) or payload.get("what") != what:
        raise NotAuthorized(
            f"the credential is not a {what!r} credential (its payload says otherwise)"
        )
    if payload.get("sha256") != digest:
        raise NotAuthorized(
            "the prefetch's body is not the one its credential signed (sha256 differs); "
            "nothing was done"
        )
    seen.claim(
        hashlib.sha256(credential.encode()).hexdigest(), int(encoded) + int(ttl), time.time()
    )
    try:
        order = PrefetchOrder.model_validate_json(body)
    except ValidationError as exc:
        raise BadRequest(f"the prefetch's body is not an order: {exc.errors()[0]['msg']}") from exc
    here = settings.this_node()
    if what in (COPY, ASKER):
        if order.action != "copy" or order.source != here:
            raise Forbidden(
                f"this credential asks for a copy from node {order.source!r}, and this is "
                f"{here!r}; only the copy's source node sends it"
            )
    elif order.node != here:
        raise Forbidden(
            f"this prefetch is for node {order.node!r}, and this is {here!r}; send it to that node"
        )
    return order


def job_user(order: PrefetchOrder) -> Caller:
    """The job's user as Slurm gives a job its identity (the uid, the job's gid, the group
    database's groups); never root, nor a gid not of the user's. Blocking (LDAP)."""
    if order.uid == 0:
        raise Forbidden("a prefetch never stages as root; root's jobs are not pre-staged")
    try:
        user = pwd.getpwuid(order.uid)
    except KeyError as exc:
        raise Forbidden(f"uid {order.uid} is not a user of this node") from exc
    groups = tuple(dict.fromkeys([order.gid, *os.getgrouplist(user.pw_name, user.pw_gid)]))
    if order.gid not in os.getgrouplist(user.pw_name, user.pw_gid):
        raise Forbidden(
            f"gid {order.gid} is not a group of {user.pw_name} (uid {order.uid}) on this node"
        )
    return Caller(uid=order.uid, gid=order.gid, groups=groups)
