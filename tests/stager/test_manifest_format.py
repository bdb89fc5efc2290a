"""The manifest's wire format (stager/wire/manifest_format.py) and the daemon's reading of it
(stager/fs/manifest.py): a manifest survives its bytes unchanged, and bytes that are
not one, whatever is wrong with them, are refused with a sentence naming them, never
another exception: an adopting node then stages from the source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stager.core.errors import VerifyFailed
from stager.fs import manifest
from stager.wire.manifest_format import VERSION, Manifest, NotAManifest, digest, file_digest
from tests.trees import write_tree

SAMPLE = Manifest(
    files={"a/b.jpg": (3, "ab" * 32), "c.txt": (0, "cd" * 32)},
    dirs={"a"},
    links={"a/l.jpg": "b.jpg"},
)


def test_a_manifest_survives_its_bytes_and_they_are_canonical(tmp_path: Path) -> None:
    data = SAMPLE.to_bytes()
    assert Manifest.from_bytes(data, "m") == SAMPLE
    shuffled = Manifest(dict(reversed(SAMPLE.files.items())), set(SAMPLE.dirs), SAMPLE.links)
    assert digest(shuffled.to_bytes()) == digest(data)  # the same tree, the same digest
    write_tree(tmp_path / "tree")
    built = manifest.build(tmp_path / "tree")
    assert manifest.read(built.to_bytes(), "m") == built
    name, (size, sha) = next(iter(built.files.items()))
    assert file_digest(tmp_path / "tree" / name) == (size, sha)


def broken_documents() -> list[Any]:
    """A valid document with each of its parts missing or of the wrong kind."""
    good = json.loads(SAMPLE.to_bytes())
    found: list[Any] = [None, [], "manifest", 7, {**good, "version": VERSION + 1}]
    for key in ("version", "files", "dirs", "links"):
        found.append({k: v for k, v in good.items() if k != key})
        for wrong in (None, 5, "x"):
            found.append({**good, key: wrong})
    for entry in ([3], [3, "ab", "cd"], "ab", None, ["three", "ab"]):
        found.append({**good, "files": {"a/b.jpg": entry}})
    return found


@pytest.mark.parametrize("document", broken_documents(), ids=repr)
def test_a_document_that_is_not_a_manifest_is_refused_by_name(document: Any) -> None:
    data = json.dumps(document).encode()
    with pytest.raises(NotAManifest, match=r"manifest /in/m\.json is not a stager manifest"):
        Manifest.from_bytes(data, "/in/m.json")
    with pytest.raises(VerifyFailed, match="cannot be checked, so this node stages from"):
        manifest.read(data, "/in/m.json")


def test_every_truncation_of_a_manifest_is_refused() -> None:
    data = SAMPLE.to_bytes()
    for end in range(len(data)):
        with pytest.raises(VerifyFailed, match="is not a stager manifest"):
            manifest.read(data[:end], "m")
    with pytest.raises(VerifyFailed, match="is not a stager manifest"):
        manifest.read(b"\xff\xfe" + data, "m")
