"""Hypothesis strategies for the JSON Schemas that pydantic writes into the OpenAPI
document: objects, arrays and tuples, maps, unions (discriminated too), enums and
constants, bounded numbers, strings with lengths and patterns, references.

hypothesis-jsonschema covers far more of JSON Schema, but it draws through
Hypothesis internals that the Hypothesis this project tests with no longer has; the
subset pydantic emits is small enough to cover here, and a schema outside it fails
loudly instead of being drawn wrong.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

Schema = dict[str, Any]


class Unsupported(Exception):
    pass


def from_schema(node: Schema, document: Schema) -> st.SearchStrategy[Any]:
    """Values valid for ``node``; references resolve in ``document``."""
    if "$ref" in node:
        target: Any = document
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return st.deferred(lambda: from_schema(target, document))
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    for key in ("anyOf", "oneOf"):
        if key in node:
            return st.one_of([from_schema(child, document) for child in node[key]])
    if "allOf" in node:
        if len(node["allOf"]) != 1:
            raise Unsupported(f"allOf of {len(node['allOf'])} schemas")
        return from_schema(node["allOf"][0], document)
    kind = node.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**node, "type": k}, document) for k in kind])
    draw = _KINDS.get(kind)
    if draw is None:
        if not node or set(node) <= {"title", "description", "default", "examples"}:
            return st.from_type(object).filter(lambda v: v is None or isinstance(v, str | int))
        raise Unsupported(f"schema {node!r}")
    return draw(node, document)


def _object(node: Schema, document: Schema) -> st.SearchStrategy[Any]:
    properties = node.get("properties", {})
    required = set(node.get("required", []))
    fixed = {k: from_schema(v, document) for k, v in properties.items() if k in required}
    optional = {k: from_schema(v, document) for k, v in properties.items() if k not in required}
    objects = st.fixed_dictionaries(fixed, optional=optional)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and not properties:
        return st.dictionaries(st.text(max_size=12), from_schema(extra, document), max_size=3)
    return objects


def _array(node: Schema, document: Schema) -> st.SearchStrategy[Any]:
    if "prefixItems" in node:
        return st.tuples(*[from_schema(p, document) for p in node["prefixItems"]]).map(list)
    items = from_schema(node.get("items", {}), document)
    low = node.get("minItems", 0)
    return st.lists(items, min_size=low, max_size=node.get("maxItems", low + 3))


def _integer(node: Schema, document: Schema) -> st.SearchStrategy[Any]:
    low = node.get("minimum", node.get("exclusiveMinimum", -(2**63)) + 1)
    if "exclusiveMinimum" in node and "minimum" not in node:
        low = math.floor(node["exclusiveMinimum"]) + 1
    high = node.get("maximum", node.get("exclusiveMaximum", 2**63) - 1)
    if "exclusiveMaximum" in node and "maximum" not in node:
        high = math.ceil(node["exclusiveMaximum"]) - 1
    edges = st.sampled_from(sorted({int(low), int(high), max(int(low), 0)}))
    return st.one_of(edges, st.integers(min_value=int(low), max_value=int(high)))


def _number(node: Schema, document: Schema) -> st.SearchStrategy[Any]:
    return st.floats(
        min_value=node.get("minimum", node.get("exclusiveMinimum")),
        max_value=node.get("maximum", node.get("exclusiveMaximum")),
        exclude_min="exclusiveMinimum" in node,
        exclude_max="exclusiveMaximum" in node,
        allow_nan=False,
        allow_infinity=False,
    )


def _string(node: Schema, document: Schema) -> st.SearchStrategy[Any]:
    low, high = node.get("minLength", 0), node.get("maxLength", 40)
    if "pattern" in node:
        made = st.from_regex(node["pattern"], fullmatch=True)
        return made.filter(lambda s: low <= len(s) <= high)
    return st.text(min_size=low, max_size=min(high, low + 40))


_KINDS = {
    "object": _object,
    "array": _array,
    "integer": _integer,
    "number": _number,
    "string": _string,
    "boolean": lambda node, document: st.booleans(),
    "null": lambda node, document: st.none(),
}
