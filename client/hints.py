"""The daemon's sentences in the terms of the command the user typed.

The daemon speaks HTTP: its hints name API calls ("GET /v1/datasets lists the
known ones", "DELETE /v1/datasets/x first"), which is right for a script talking
to the API and wrong for a person at ``stager-client``. ``in_user_terms`` rewrites
every API call a sentence names into the ``stager-client`` command that makes it;
``tests/client/test_cli_errors.py`` finds every call the daemon's sentences can
name and fails on one this table does not cover.
"""

from __future__ import annotations

import re

_NAME = r"([^/\s;,)`'\"]+)"

# API call -> the command that makes it; most specific first.
COMMANDS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), command)
    for pattern, command in (
        (rf"DELETE /v1/datasets/{_NAME}/leases(?:/{_NAME})?", r"`stager-client release \1`"),
        (rf"POST /v1/datasets/{_NAME}/leases", r"`stager-client stage \1 --lease HOLDER`"),
        (rf"GET /v1/datasets/{_NAME}/(?:wait|events)\S*", r"`stager-client wait \1`"),
        (rf"DELETE /v1/datasets/{_NAME}", r"`stager-client cancel \1`"),
        (rf"GET /v1/datasets/{_NAME}", r"`stager-client status \1`"),
        (r"GET /v1/datasets\b", "`stager-client ls`"),
        (r"POST /v1/datasets\b", "`stager-client stage`"),
        (r"GET /v1/recipes\b", "`stager-client recipes`"),
        (r"GET /v1/whoami\b", "`stager-client whoami`"),
        (r"POST /v1/gc\b", "`stager gc`"),
    )
)


def in_user_terms(sentence: str) -> str:
    """``sentence`` with each API call it names replaced by its ``stager-client`` command."""
    for pattern, command in COMMANDS:
        sentence = pattern.sub(command, sentence)
    return sentence
