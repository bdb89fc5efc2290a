"""The recipes as text: what ``stager recipes`` and ``stager-client recipes`` print.

On the wire layer (standard library only): the client prints the daemon's
``GET /v1/recipes`` with it, the daemon's own CLI the recipe files it reads, so the
two listings are one.
"""

from __future__ import annotations

from typing import Any


def format_listing(listing: list[dict[str, Any]]) -> str:
    """``stager recipes``: per recipe its params, the files each split needs, and the call."""
    blocks = []
    for recipe in listing:
        lines = [f"{recipe['name']}: {recipe['description']}", f"  file: {recipe['file']}"]
        for param in recipe["params"]:
            choices = "|".join(map(str, param.get("choices") or [])) or param["type"]
            lines.append(f"  param {param['name']} = {param.get('default')!r}  ({choices})")
        for split, info in recipe["splits"].items():
            files = ", ".join(f if f != "." else "the source itself" for f in info["files"])
            calls = "; ".join(_call(u) for u in info["usage"]) or "-"
            lines.append(f"  split {split}: needs {files or '-'} -> {calls}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _call(usage: dict[str, Any]) -> str:
    root = "root" if usage["root"] in ("", ".") else f"root + '/{usage['root']}'"
    args = "".join(f", {k}={v!r}" for k, v in usage["kwargs"].items())
    return f"{usage['class']}({root}{args})"
