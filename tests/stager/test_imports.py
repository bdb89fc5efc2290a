"""DESIGN: the daemon never imports torch; the ImageNet ops import torch/scipy lazily."""

from __future__ import annotations

import pkgutil

import stager.ops
from tests.imports import among, loaded_modules

DAEMON = ["stager.app", "stager.engine", "stager.ops", "stager.recipes", "stager.cli"]
# Ops are imported on first use, so importing `stager.ops` alone would not catch a
# top-level `import torch` in one of them: import every op module too.
OPS = [f"stager.ops.{m.name}" for m in pkgutil.iter_modules(stager.ops.__path__)]
HEAVY = ("torch", "torchvision", "scipy")


def test_importing_the_daemon_and_its_ops_loads_neither_torch_nor_scipy() -> None:
    loaded = loaded_modules(*DAEMON, *OPS)
    assert "stager.ops.imagenet_devkit" in loaded  # the ops that use torch were imported
    assert among(loaded, HEAVY) == []
