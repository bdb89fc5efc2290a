"""Every number a request may carry is bounded where it is declared.

A number with no upper bound reaches code that cannot take it: ``ttl_s`` of
9.07e+307 once became an OverflowError (a 500) deep in the fan-out's books, and an
unbounded ``bytes`` reserved the disk away from everyone. So the live OpenAPI
document is walked: every body, query and path parameter of every operation, every
model reachable from them (the op table's steps included), every integer and number
in them, at any depth (lists, tuples, maps). Each must carry a lower and an upper
bound, which pydantic enforces, and which also refuse NaN and infinity.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stager.api.app import create_app
from stager.core.settings import Settings

NUMBER_TYPES = {"integer", "number"}


def openapi() -> dict[str, Any]:
    return create_app(Settings()).openapi()


def resolve(document: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        path = node["$ref"].removeprefix("#/").split("/")
        node = document
        for part in path:
            node = node[part]
    return node


def numbers(
    document: dict[str, Any], node: Any, where: str, seen: set[str]
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(place, schema) of every number schema under ``node``."""
    if not isinstance(node, dict):
        return
    if "$ref" in node:
        if node["$ref"] in seen:
            return
        seen = seen | {node["$ref"]}
        yield from numbers(document, resolve(document, node), where, seen)
        return
    if node.get("type") in NUMBER_TYPES:
        yield where, node
    for key, child in node.get("properties", {}).items():
        yield from numbers(document, child, f"{where}.{key}", seen)
    for key in ("items", "additionalProperties"):
        yield from numbers(document, node.get(key), f"{where}[]", seen)
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        for index, child in enumerate(node.get(key, [])):
            yield from numbers(document, child, f"{where}<{key}{index}>", seen)
    if "discriminator" in node:
        for ref in node["discriminator"].get("mapping", {}).values():
            yield from numbers(document, {"$ref": ref}, where, seen)


def request_numbers(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            place = f"{method.upper()} {path}"
            for parameter in operation.get("parameters", []):
                name = f"{place} ?{parameter['name']}"
                yield from numbers(document, parameter.get("schema"), name, set())
            body = operation.get("requestBody", {}).get("content", {})
            for media in body.values():
                yield from numbers(document, media.get("schema"), f"{place} body", set())


def unbounded(schema: dict[str, Any]) -> list[str]:
    missing = []
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        missing.append("a lower bound")
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        missing.append("an upper bound")
    return missing


def test_every_number_in_every_request_is_bounded() -> None:
    document = openapi()
    found = list(request_numbers(document))
    assert len(found) > 10, "the walk found too few numbers to be looking at the requests"
    offenders = [
        f"{where} lacks {' and '.join(missing)}"
        for where, schema in found
        if (missing := unbounded(schema))
    ]
    assert not offenders, "unbounded numbers in requests:\n" + "\n".join(sorted(set(offenders)))


def test_the_walk_finds_an_unbounded_number_at_any_depth() -> None:
    document = {
        "paths": {
            "/x": {
                "post": {
                    "parameters": [{"name": "n", "schema": {"type": "integer", "minimum": 0}}],
                    "requestBody": {
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/A"}}
                        }
                    },
                }
            }
        },
        "components": {
            "schemas": {
                "A": {
                    "properties": {
                        "files": {
                            "additionalProperties": {
                                "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}]
                                + [{"type": "number", "exclusiveMinimum": 0}]
                            }
                        },
                        "self": {"$ref": "#/components/schemas/A"},
                    }
                }
            }
        },
    }
    bad = [where for where, schema in request_numbers(document) if unbounded(schema)]
    assert bad == ["POST /x ?n", "POST /x body.files[]<prefixItems1>"]
