"""`FanoutCalls`: the daemon's fan-out endpoints as Python calls.

Probe, export and the incoming room are the fan-out's plumbing, not a user's API,
so they are not methods of the public clients. They travel over a client's own
connection: its transport (injectable, as for every call), its timeouts and its one
translation of errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from client._client import AsyncStagerClient, _model, _plain, _q
from stager.wire.schemas import ExportPublic, ProbeResult, TransferPublic

EXPORT_TIMEOUT_S = 3600.0  # packing a large dataset for a broadcast takes minutes


class FanoutCalls:
    """The fan-out's requests to one node's daemon, through ``client``."""

    def __init__(self, client: AsyncStagerClient) -> None:
        self._call = client._call

    async def probe(self, body: Mapping[str, Any] | BaseModel) -> ProbeResult:
        """This node's cache key for a stage request, and its copy if it has one."""
        return await self._call(
            "POST", "/v1/datasets/probe", _model(ProbeResult), what="probe", json=_plain(body)
        )

    async def export(
        self,
        name: str,
        label: str,
        part: int = 0,
        part_bytes: int | None = None,
        early: bool = False,
        tree: bool = False,
    ) -> ExportPublic:
        """Pack part ``part`` of ready dataset ``name`` for sbcast (part 0 plans them all,
        in parts of about ``part_bytes``; the last comes with the manifest); parts are
        asked for in order. ``early``: of the files it finished while still staging. A
        ready image dataset is one part, its image file, unless ``tree``."""
        body: dict[str, Any] = {"label": label, "part": part}
        if part_bytes is not None:
            body["part_bytes"] = part_bytes
        if early:
            body["early"] = True
        if tree:
            body["tree"] = True
        return await self._call(
            "POST",
            f"/v1/datasets/{_q(name)}/export",
            _model(ExportPublic),
            what=f"the export of {name!r}",
            json=body,
            timeout=EXPORT_TIMEOUT_S,
        )

    async def delete_export(self, export_id: str) -> TransferPublic:
        return await self._call("DELETE", f"/v1/exports/{_q(export_id)}", _model(TransferPublic),
                                what="the export's removal")  # fmt: skip

    async def reserve(self, label: str, nbytes: int) -> TransferPublic:
        """Room for a delivery of ``nbytes`` in the cache, in a folder named by ``label``."""
        body = {"label": label, "bytes": nbytes}
        return await self._call(
            "POST", "/v1/incoming", _model(TransferPublic), what="reserve", json=body
        )

    async def release_incoming(self, label: str) -> TransferPublic:
        return await self._call("DELETE", f"/v1/incoming/{_q(label)}", _model(TransferPublic),
                                what="the reservation's release")  # fmt: skip
