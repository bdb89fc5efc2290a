"""A request's body is bounded (``max_body_bytes``; a 400 MB JSON body once took the
daemon to 1.45 GB): a ``Content-Length`` over it is answered 413 before the app runs;
a chunked body is counted as it streams, and the read past it raises. A 413 closes
the connection, so the rest is not read only to be discarded. Not FastAPI's
``max_body_size``: it answers in plain text, replacing the app's answer.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stager.api.errors import error_response


class BodyTooLarge(HTTPException):
    def __init__(self) -> None:
        super().__init__(status_code=413)


def too_large(limit: int, length: int | None = None) -> JSONResponse:
    size = f"{length} bytes" if length is not None else f"more than {limit} bytes"
    return error_response(
        413,
        "body_too_large",
        f"the request body is {size}, over the daemon's limit of {limit} bytes "
        "(--max-body-bytes); send a smaller request",
        headers={"connection": "close"},
    )


class BodyLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        # The server has checked that it is one number (h11 refuses anything else).
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await too_large(limit, int(declared))(scope, receive, send)
            return
        received = 0

        async def receive_counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge
            return message

        await self.app(scope, receive_counted, send)


def install(app: FastAPI, max_body_bytes: int) -> None:
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return too_large(max_body_bytes)
