"""A URL's secrets never leave the daemon: its user, password, query and path
parameters are replaced by ``***`` wherever a URL is printed.

The daemon needs a private download's credentials to download, and nothing else
does: every text that leaves the daemon for a person goes through
:func:`redact_text`, and ``RedactingFilter`` does it for every log record. Kept: the
scheme, host, port and path up to its first ``;``, which tell one download from
another.
"""

from __future__ import annotations

import logging
import re

MASK = "***"

# A URL in free text: a scheme, then anything up to white space or a character that
# ends a URL in prose (quotes, brackets, a closing parenthesis).
_URL_IN_TEXT = re.compile(r"""\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'"<>()\[\]{}]+""")


def redact_url(url: str) -> str:
    """``url`` without its user, password, query, path parameters and fragment. Works
    on the text itself, so a URL no parser accepts is redacted too: what sits between
    ``://`` and the last ``@`` before the path, and the path from its first ``?``,
    ``;`` or ``#`` on, are masked."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    slash = rest.find("/")
    authority, path = (rest, "") if slash < 0 else (rest[:slash], rest[slash:])
    # A query may also follow the authority directly: http://host?token=x
    for mark in "?#":
        cut = authority.find(mark)
        if cut >= 0:
            authority, path = authority[:cut], authority[cut:] + path
    if "@" in authority:
        authority = f"{MASK}@{authority.rsplit('@', 1)[1]}"
    cut = min((i for i in (path.find(c) for c in "?;#") if i >= 0), default=-1)
    if cut >= 0:
        path = f"{path[:cut]}{path[cut]}{MASK}"
    return f"{scheme}://{authority}{path}"


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted (:func:`redact_url`)."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), text)


class RedactingFilter(logging.Filter):
    """Redacts URLs in a log record's message and arguments before any handler sees
    it. Installed on the handlers of the daemon's log, so that no logger (ours,
    uvicorn's, httpx's) can write a token to it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            record.msg = record.getMessage()
            record.args = None
        if isinstance(record.msg, str):
            record.msg = redact_text(record.msg)
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True
