"""Bearer-token check for TCP serving (the Unix socket relies on its 0700 folder)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from stager.api.errors import error_response

OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # probes carry no secrets


class BearerTokenMiddleware:
    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope.get("headers", [])).get(b"authorization", b"")
        if (
            scope["type"] != "http"
            or scope["path"] in OPEN_PATHS
            or hmac.compare_digest(given, self._expected)
        ):
            await self.app(scope, receive, send)
            return
        refusal = error_response(
            401,
            "unauthorized",
            "missing or wrong bearer token; set STAGER_TOKEN or use the daemon's token file",
            headers={"www-authenticate": "Bearer"},
        )
        await refusal(scope, receive, send)
