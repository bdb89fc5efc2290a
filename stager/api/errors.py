"""Every error leaves the API as ``{"error": {"type", "message"}}`` with one sentence.

Validation errors from pydantic are turned into a sentence naming the field at
fault; unknown routes and methods keep their status but get the same shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from stager.core.errors import StagerError, error_content
from stager.wire.suggest import did_you_mean

log = logging.getLogger("stager.api")


def error_response(
    status: int, type_: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The one way an error leaves the API; a URL's secrets never do (stager.core.redact)."""
    return JSONResponse(status_code=status, content=error_content(type_, message), headers=headers)


def describe_validation_error(
    exc: RequestValidationError, op_names: list[str], content_type: str = "application/json"
) -> tuple[int, str, str]:
    """The first problem, as (status, type, sentence)."""
    first = exc.errors()[0]
    if first.get("loc") == ("body",) and "json" not in content_type:
        # FastAPI parses bodies as JSON only when the client says so (CSRF protection).
        return (
            400,
            "malformed_json",
            ("the request body must be a JSON object sent with 'Content-Type: application/json'"),
        )
    kind = first.get("type", "")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    field = ".".join(loc) or "request body"
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return (
            400,
            "malformed_json",
            f"the request body is not valid JSON ({detail}); send a JSON object",
        )
    if kind == "union_tag_invalid":
        tag = str(first.get("ctx", {}).get("tag", "?"))
        hint = did_you_mean(tag, op_names)
        return (
            422,
            "unknown_op",
            f"{field}: unknown op {tag!r}; {hint}use one of {', '.join(op_names)}",
        )
    if kind == "union_tag_not_found":
        return 422, "invalid_request", f"{field}: each step needs an 'op' ({', '.join(op_names)})"
    if kind == "string_pattern_mismatch" and loc == ["name"]:
        return (
            422,
            "invalid_name",
            (
                f"name {first.get('input')!r} must be 1-128 lowercase letters, digits, "
                "'.', '_' or '-', "
                "starting with a letter or digit"
            ),
        )
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return 422, "invalid_request", f"{field}: {message}"


def install(app: FastAPI, op_names: list[str]) -> None:
    """``op_names``: the ops a request may name (never the daemon's internal ones)."""

    @app.exception_handler(StagerError)
    async def _stager_error(request: Request, exc: StagerError) -> JSONResponse:
        return error_response(exc.status, exc.type, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        return error_response(*describe_validation_error(exc, op_names, content_type))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}; see /docs for the API"
        return error_response(exc.status_code, "http_error", message)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            500, "internal_error", f"internal error: {exc!r}; see the daemon log for the traceback"
        )
