"""/v1/whoami: who the daemon takes the caller to be."""

from __future__ import annotations

from fastapi import APIRouter

from stager.api.deps import CallerDep, SettingsDep
from stager.wire.schemas import WhoAmI

router = APIRouter(prefix="/v1", tags=["identity"])


@router.get("/whoami", response_model=WhoAmI)
async def whoami(caller: CallerDep, settings: SettingsDep) -> WhoAmI:
    """The caller as the kernel names it (node service), or the daemon's own user."""
    return WhoAmI(
        uid=caller.uid,
        gid=caller.gid,
        pid=caller.pid,
        user=caller.user_name,
        root=caller.is_root,
        mode="multi-user" if settings.multi_user else "per-user",
    )
