"""What a node stages when it adopts a broadcast copy instead of reading the source.

Three shapes of delivery (``stager.wire.schemas.Adopt``): the prepared tree in parts
(one ``adopt`` step), the request's own source files (``check_delivered``, then the
request's steps reading the copies), or an image's one file (``adopt_image``).

The entry keeps the request's own cache key, so a later request here is a hit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stager.ops.adopt import AdoptStep
from stager.ops.adopt_image import AdoptImageStep
from stager.ops.check_delivered import CheckDeliveredStep
from stager.ops.table import OpTable
from stager.wire.schemas import IMAGE_DELIVERY_NAME, Adopt, SourceFile, delivered_name


def broadcastable_sources(steps: list[Any], table: OpTable) -> list[SourceFile]:
    """The request's source files, when every op reads only its plain-file ``src``
    (nothing downloaded, nothing left as a link to its source); else empty."""
    found: dict[str, SourceFile] = {}
    for step in steps:
        op = table.op_of(step)
        if not op.shareable or op.links_to_source(step):
            return []
        src = getattr(step, "src", None)
        if not isinstance(src, str) or not src.startswith("/"):
            continue  # relative: an earlier step's output, inside the dataset
        try:
            info = os.stat(src)
        except OSError:
            return []
        if not os.path.isfile(src):
            return []
        found[src] = SourceFile(path=src, size=info.st_size)
    return list(found.values())


@dataclass(frozen=True)
class Vouch:
    """A shared adoption's manifest must carry a credential of ``uid`` (the node
    service's) for entry ``key``, decoded through munged at ``socket``."""

    uid: int
    key: str
    socket: Path | None


def steps_for(
    adopt: Adopt,
    folder: Path,
    steps: list[Any],
    table: OpTable,
    vouch: Vouch | None = None,
    own_delivery: bool = False,
) -> list[Any]:
    """The steps that stage ``adopt``'s delivery in ``folder`` instead of the sources.
    ``own_delivery``: a per-user daemon's, so an image may be taken in where it lies."""
    if adopt.sources is not None:
        return _from_sources(adopt, folder, steps, table)
    vouching = {}
    if vouch is not None:
        socket = str(vouch.socket) if vouch.socket is not None else None
        vouching = {"vouch_uid": vouch.uid, "vouch_key": vouch.key, "munge_socket": socket}
    if adopt.image is not None:
        image = AdoptImageStep(
            src=str(folder / IMAGE_DELIVERY_NAME),
            size=adopt.image.size,
            sha256=adopt.image.sha256,
            origin_node=adopt.origin_node,
            credential=adopt.image.credential,
            in_place=own_delivery,
            **vouching,
        )
        return table.validate_steps([{"op": "adopt_image", **image.model_dump()}])
    step = AdoptStep(
        folder=str(folder),
        origin_node=adopt.origin_node,
        data_bytes=adopt.bundle_bytes or 0,
        **vouching,
    )
    return table.validate_steps([{"op": "adopt", **step.model_dump()}])


def _from_sources(adopt: Adopt, folder: Path, steps: list[Any], table: OpTable) -> list[Any]:
    copies = {src: str(folder / delivered_name(src)) for src in adopt.sources or {}}
    check = CheckDeliveredStep(
        files={copies[src]: tuple(entry) for src, entry in (adopt.sources or {}).items()},
        origin_node=adopt.origin_node,
    )
    rewritten = []
    for step in steps:
        fields = step.model_dump(mode="json")
        src = fields.get("src")
        if src in copies:
            fields["src"] = copies[src]
            if table.op_of(step).keeps_source_name and step.keep is None:
                # A kept copy or link carries the release's own name, not the delivery's.
                fields["keep"] = os.path.basename(src.rstrip("/"))
        rewritten.append(fields)
    return table.validate_steps([{"op": "check_delivered", **check.model_dump()}, *rewritten])


def missing_sources(adopt: Adopt, steps: list[Any], table: OpTable) -> list[str]:
    """Sources of the request that the delivery lacks (then it cannot replace them)."""
    if adopt.sources is None:
        return []
    return sorted({s.path for s in broadcastable_sources(steps, table)} - set(adopt.sources))
