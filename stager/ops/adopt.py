"""The ``adopt`` op: stage a prepared dataset another node broadcast as a bundle.

A multi-node job (``stager-client stage --peers slurm``, docs/multinode.md) stages a
dataset on one node and sbcasts it to the others as a plain tar with a manifest
(every path, size and sha256). The manifest must match the sha256 the job gave (it
reached this node along another path than the broadcast); the bundle is extracted
by ``extract``, the hardened path every archive takes; then the tree is compared
with the manifest, path by path. Anything missing, extra or different fails the
staging, which never publishes: no delivered byte is trusted before it matched.
(``check_delivered`` is the same promise for source files broadcast as they are.)
"""

from __future__ import annotations

from pydantic import Field

from stager.errors import VerifyFailed
from stager.fanout import manifest as manifests
from stager.ops import extract
from stager.ops.base import AbsoluteSource, CheckContext, OpContext, StepParams, require_source

SHA256 = r"^[0-9a-f]{64}$"


class AdoptStep(StepParams):
    """Extract a bundle another node broadcast, then check the tree against its manifest."""

    bundle: AbsoluteSource
    manifest: AbsoluteSource
    manifest_sha256: str = Field(pattern=SHA256)
    origin_node: str = Field(min_length=1, max_length=200)  # for messages


def _manifest(step: AdoptStep) -> manifests.Manifest:
    path = require_source(step.manifest, "delivered manifest")
    data = path.read_bytes()
    if manifests.digest(data) != step.manifest_sha256:
        raise VerifyFailed(
            f"the manifest broadcast from {step.origin_node} ({step.manifest}) is damaged "
            "(its sha256 differs from the one the job sent); this node stages from the source"
        )
    return manifests.Manifest.from_bytes(data, step.manifest)


def check(step: AdoptStep, ctx: CheckContext) -> int:
    require_source(step.bundle, "delivered bundle")
    return _manifest(step).total_bytes


def run(step: AdoptStep, ctx: OpContext) -> None:
    expected = _manifest(step)
    bundle = extract.ExtractStep(src=step.bundle, format="tar")
    extract.run(bundle, ctx)
    ctx.check_cancelled()
    manifests.verify(ctx.destination("."), expected, step.origin_node)
