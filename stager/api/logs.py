"""The daemon's log: what a line looks like, what it never shows, and its file.

Text lines (ISO 8601 timestamp, level, logger) or with ``--log-format json`` one JSON
object a line. A URL's credentials never show: the redacting filter sits on every
handler, whoever's logger writes. It goes to standard error (under systemd, the
journal); ``--detach`` points it at a file ``open_log_file`` makes. docs/logging.md.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from stager.core.redact import RedactingFilter
from stager.core.settings import Settings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(message)s"
KEEP = 3  # earlier logs a detached start keeps: stager.log.1 (the last) .. .3
LOG_MODE = 0o600


class _Timestamps(logging.Formatter):
    """ISO 8601 with milliseconds and the local offset: 2025-01-31T14:02:03.412+01:00."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        from datetime import datetime

        moment = datetime.fromtimestamp(record.created).astimezone()
        return moment.isoformat(timespec="milliseconds")


def json_formatter() -> logging.Formatter:
    from pythonjsonlogger.json import JsonFormatter

    class _Json(JsonFormatter):
        formatTime = _Timestamps.formatTime  # noqa: N815 - the logging module's name

    return _Json(
        JSON_FIELDS,
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
    )


class NoConsoleHints(logging.Filter):
    """Drops uvicorn's hints for a person at a terminal ("Press CTRL+C to quit")."""

    def filter(self, record: logging.LogRecord) -> bool:
        for hint in (" (Press CTRL+C to quit)", " (CTRL+C to force quit)"):
            if isinstance(record.msg, str) and hint in record.msg:
                record.msg = record.msg.replace(hint, "")
        record.__dict__.pop("color_message", None)
        return True


def config(settings: Settings) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for the daemon (and uvicorn's ``log_config``)."""
    text = {"()": _Timestamps, "fmt": TEXT_FORMAT}
    formatter = {"()": json_formatter} if settings.log_format == "json" else text
    level = settings.log_level.upper()
    handler = {
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
        "formatter": "line",
        "filters": ["redact", "no_console_hints"],
    }
    quiet = "WARNING" if level != "DEBUG" else "DEBUG"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {
            "redact": {"()": RedactingFilter},
            "no_console_hints": {"()": NoConsoleHints},
        },
        "formatters": {"line": formatter},
        "handlers": {"stderr": handler},
        "root": {"handlers": ["stderr"], "level": level},
        "loggers": {
            # uvicorn's own loggers carry handlers of their own unless told otherwise.
            "uvicorn": {"handlers": [], "level": level, "propagate": True},
            "uvicorn.error": {"handlers": [], "level": level, "propagate": True},
            "uvicorn.access": {"handlers": [], "level": level, "propagate": True},
            # A request's every connection is not an admin's business below debug.
            "httpx": {"level": quiet},
            "httpcore": {"level": quiet},
        },
    }


def open_log_file(path: Path, keep: int = KEEP) -> int:
    """The daemon's log file as a descriptor to append to, an earlier start's moved to
    ``<path>.1`` (``keep`` of them). The one place a log file is made: 0600 (it names
    users' datasets) as it is made, and again if it was there already."""
    if keep and path.exists() and path.stat().st_size:
        for index in range(keep - 1, 0, -1):
            older = path.with_name(f"{path.name}.{index}")
            if older.exists():
                older.replace(path.with_name(f"{path.name}.{index + 1}"))
        path.replace(path.with_name(f"{path.name}.1"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, LOG_MODE)
    os.fchmod(fd, LOG_MODE)
    return fd


def started(settings: Settings) -> None:
    """The first line of a daemon's run: what an admin reading the log needs first."""
    from stager import __version__
    from stager.core.settings import environment_warnings, format_size

    mode = "node service (every user)" if settings.multi_user else f"uid {os.getuid()}'s daemon"
    limit = format_size(settings.capacity_bytes) if settings.capacity_bytes else "the disk's size"
    log = logging.getLogger("stager")
    log.info(
        "stager %s starting, pid %d, %s, at %s, cache %s (limit %s)",
        __version__,
        os.getpid(),
        mode,
        settings.url,
        settings.cache_dir,
        limit,
    )
    for warning in environment_warnings():
        log.warning(warning)
