"""The op table: every staging operation, declared once.

A row names the op and gives its request fields (a ``StepParams`` model), its
``check`` and ``run`` (:mod:`stager.ops.base`) and the request options it honours.
Derived from the rows: the step models and the request schema, step validation,
dispatch in the staging process, the refusal of an option an op cannot carry out,
and ``GET /v1/recipes``'s ops. A module named in ``op_modules`` (``STAGER_OP_MODULES``)
adds ops: it defines ``OPS``, a list of ``Op`` rows.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import posixpath
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field, TypeAdapter, create_model

from stager.archive.growing import GrowingFile, Growth
from stager.core.errors import BadRequest
from stager.core.settings import Settings
from stager.ops import (
    adopt,
    adopt_image,
    check_delivered,
    copy,
    copy_from_node,
    extract,
    fetch,
    image,
    imagenet_devkit,
    imagenet_val,
    rename,
    symlink,
    unpack,
)
from stager.ops.base import CheckContext, ImageStream, OpContext, StepParams
from stager.wire.schemas import VERIFY_LEVELS, DatasetCreate

# An op that writes no file data of its own (a link, a rename) has nothing to verify,
# so any level is fine for it.
NOTHING_TO_VERIFY = frozenset(VERIFY_LEVELS)


@dataclass(frozen=True)
class Grows:
    """An op that writes one file from its first byte to its last (a download), and can
    tell a reader as it grows (stager.staging.overlap)."""

    # The file it appends to, and the name that file has once complete.
    files: Callable[[Any, OpContext], tuple[Path, Path]]
    run: Callable[[Any, OpContext, Growth], None]
    # The name (relative) of the file it appends to, given the name it has once complete.
    partial: Callable[[str], str]


@dataclass(frozen=True)
class Follows:
    """An op that can read its ``src`` while an earlier step still writes it."""

    # The relative src it can read so, or None (an archive whose end must come first).
    src: Callable[[Any], str | None]
    # (read, made): read False when the file turned out to need its end first (run the
    # op once it is complete); made as the op's ``run`` returns it.
    run: Callable[[Any, OpContext, GrowingFile], tuple[bool, int | None]]


@dataclass(frozen=True)
class Op:
    name: str
    params: type[StepParams]
    check: Callable[[Any, CheckContext], int]
    # Returns the bytes the step put in the tree when it knows them exactly, else None
    # (see stager.ops.base).
    run: Callable[[Any, OpContext], int | None]
    # The request's ``verify`` levels this op carries out for the data it writes.
    verify: frozenset[str] = NOTHING_TO_VERIFY
    # An earlier step's output named by a relative ``src`` is used up by this op (an
    # archive once extracted): the staging removes it after the step unless ``keep``.
    consumes_src: bool = False
    # What it writes comes only from files it opens through stager.fs.sources, so the
    # node service may share its result when each is readable by everyone
    # (docs/multiuser.md). Not a download (it may carry the user's credentials), a
    # delivery, or a site's op unless it says.
    shareable: bool = False
    # Every file it writes is created 0444 and it returns the bytes it left: alone in a
    # fresh tree, its tree is sealed by a listing.
    read_only_files: bool = False
    # For the fan-out's adoption: whether this step leaves links to its source (so it
    # never stages from a delivered copy, deleted after adoption), and whether a kept
    # copy of its source carries the source's own name.
    links_to_source: Callable[[Any], bool] = lambda step: False
    keeps_source_name: bool = False
    # Whether this step's source carries none of the user's credentials (a URL without
    # user:password or query): shareable like a world-readable file.
    public_source: Callable[[Any], bool] = lambda step: False
    # Overlap (stager.staging.overlap): a step whose op ``grows`` a file, then one whose
    # op ``follows`` it and names that file as its src, run at once.
    grows: Grows | None = None
    follows: Follows | None = None
    # The steps a step of this op runs as, when a request arrives (raw, as in a request),
    # or None: itself (an extract of a URL runs as a fetch, then an extract).
    expands: Callable[[Any], list[dict[str, Any]] | None] = lambda step: None
    # The daemon's own: built by the daemon from a request (a fan-out's adoption), never
    # given in a request's steps, whose checks it skips (its folder is the service's).
    internal: bool = False
    # Image mode (stager.kinds.imaging): the archive read straight into the image, or None
    # (run as an op); ``moves``: the (old, new) name a step only renames; and whether the
    # step is a prebuilt image file, staged as it is.
    image_stream: Callable[[Any], ImageStream | None] = lambda step: None
    moves: Callable[[Any], tuple[str, str] | None] = lambda step: None
    prebuilt_image: bool = False

    @property
    def summary(self) -> str:
        return inspect.cleandoc(self.params.__doc__ or "").split("\n\n")[0].replace("\n", " ")


def _row(
    name: str,
    module: Any,
    params: type[StepParams],
    verify: Iterable[str] = (),
    shareable: bool = True,
    **options: Any,
) -> Op:
    """A built-in op: its module's ``check`` and ``run``, shareable unless it says."""
    verify = frozenset(verify) or NOTHING_TO_VERIFY
    return Op(name, params, module.check, module.run, verify, shareable=shareable, **options)


EVERY_LEVEL = VERIFY_LEVELS
BUILTIN = (
    _row("copy", copy, copy.CopyStep, verify=EVERY_LEVEL, read_only_files=True),
    _row(
        "symlink",
        symlink,
        symlink.SymlinkStep,
        read_only_files=True,
        links_to_source=lambda step: True,
    ),
    # sha256: every file read back and compared with its member's bytes in the archive.
    _row(
        "extract",
        extract,
        extract.ExtractStep,
        verify=EVERY_LEVEL,
        consumes_src=True,
        read_only_files=True,
        follows=Follows(extract.reads_growing, extract.run_growing),
        expands=extract.as_fetch_then_extract,
        image_stream=extract.as_image_stream,
    ),
    _row("rename", rename, rename.RenameStep, moves=rename.moves),
    # sha256 of a download is checked against the digest its step names.
    _row(
        "fetch",
        fetch,
        fetch.FetchStep,
        verify=EVERY_LEVEL,
        shareable=False,
        public_source=fetch.without_credentials,
        grows=Grows(fetch.files, fetch.run, fetch.partial),
    ),
    _row(
        "unpack",
        unpack,
        unpack.UnpackStep,
        verify=EVERY_LEVEL,
        links_to_source=lambda step: step.mode == "symlink",
        keeps_source_name=True,
        image_stream=unpack.as_image_stream,
    ),
    # A prebuilt image, copied and checked by its sha256, mounted as it is.
    _row("image", image, image.ImageStep, prebuilt_image=True),
    _row("imagenet_devkit", imagenet_devkit, imagenet_devkit.ImagenetDevkitStep),
    _row("imagenet_val", imagenet_val, imagenet_val.ImagenetValStep),
    # A multi-node job's broadcast copies (docs/multinode.md): checked by sha256 always.
    _row("adopt", adopt, adopt.AdoptStep, verify=EVERY_LEVEL, shareable=False, internal=True),
    _row(
        "check_delivered",
        check_delivered,
        check_delivered.CheckDeliveredStep,
        shareable=False,
        internal=True,
    ),
    # A multi-node job's prefetch copied from another planned node before the job starts
    # (docs/prestaging.md): checked against the source service's vouched manifest always.
    _row(
        "copy_from_node",
        copy_from_node,
        copy_from_node.CopyFromNodeStep,
        verify=EVERY_LEVEL,
        shareable=False,
        internal=True,
    ),
    # An image dataset broadcast as one file: copied, checked by its (vouched) sha256.
    _row(
        "adopt_image",
        adopt_image,
        adopt_image.AdoptImageStep,
        shareable=False,
        internal=True,
        prebuilt_image=True,
    ),
)


class OpTable:
    def __init__(self, ops: Iterable[Op]) -> None:
        self._ops: dict[str, Op] = {}
        self._tagged: dict[str, type[StepParams]] = {}
        for op in ops:
            if op.name in self._ops:
                raise ValueError(f"op {op.name!r} is declared twice")
            self._ops[op.name] = op
            # The step model a request uses: the op's fields plus ``op`` naming it.
            self._tagged[op.name] = create_model(
                op.params.__name__,
                __base__=op.params,
                __module__=op.params.__module__,
                op=(Literal[op.name], ...),
            )
        variants = tuple(self._tagged.values())
        self.step_type: Any = Annotated[Union[variants], Field(discriminator="op")]  # noqa: UP007
        self._steps = TypeAdapter(list[self.step_type])

    @property
    def names(self) -> list[str]:
        return list(self._ops)

    @property
    def public_names(self) -> list[str]:
        """The ops a request may name: not the daemon's own (``internal``)."""
        return [name for name, op in self._ops.items() if not op.internal]

    def __getitem__(self, name: str) -> Op:
        return self._ops[name]

    def op_of(self, step: Any) -> Op:
        return self._ops[step.op]

    def validate_steps(self, raw: Any) -> list[Any]:
        """Step models from JSON-like data; raises pydantic's ``ValidationError``."""
        return self._steps.validate_python(raw)

    def validate_steps_json(self, raw: str | bytes) -> list[Any]:
        return self._steps.validate_json(raw)

    def expand(self, steps: Sequence[Any]) -> list[Any]:
        """The steps a request's steps run as: each one that its op ``expands`` replaced
        by what it expands to. Done once, when a request arrives: what is stored, keyed by
        its sources, shared and run is the expansion."""
        expanded: list[Any] = []
        for index, step in enumerate(steps, start=1):
            op = self.op_of(step)
            if op.internal:
                raise BadRequest(
                    f"step {index} ({op.name}) is the daemon's own, built from a request's "
                    "'adopt' (a multi-node fan-out), not a step a request may give; use "
                    "stager-client stage --peers slurm"
                )
            raw = op.expands(step)
            expanded.extend([step] if raw is None else self.validate_steps(raw))
        return expanded

    def dump_steps(self, steps: Sequence[Any]) -> list[dict[str, Any]]:
        return self._steps.dump_python(list(steps), mode="json")

    def request_model(self) -> type[DatasetCreate]:
        """``POST /v1/datasets``'s body with its steps typed by this table."""
        return create_model(
            "DatasetCreate",
            __base__=DatasetCreate,
            __module__=DatasetCreate.__module__,
            __doc__=DatasetCreate.__doc__,
            steps=(list[self.step_type], Field(default_factory=list)),
        )

    def check(self, steps: Sequence[Any], ctx: CheckContext) -> int:
        """Pre-flight every step; returns the bytes the staging is expected to write."""
        total = 0
        for index, step in enumerate(steps, start=1):
            op = self.op_of(step)
            src = getattr(step, "src", None)
            if index == 1 and isinstance(src, str) and not src.startswith("/"):
                raise BadRequest(
                    f"step 1 ({op.name}) has src {src!r}, a relative path, which names a file "
                    "an earlier step writes into the dataset, but no step comes before it; "
                    "give an absolute source path, or put the step that writes it first"
                )
            if ctx.verify not in op.verify:
                honoured = "', '".join(sorted(op.verify))
                raise BadRequest(
                    f"verify {ctx.verify!r} is not carried out by step {index} ({op.name}), "
                    f"which honours '{honoured}'; ask for one of those"
                )
            total += op.check(step, ctx)
        return total

    def shareable(self, steps: Sequence[Any]) -> bool:
        """Whether every step is an op whose result the node service may share: one
        that reads only its sources (each then checked readable by everyone), or one
        whose source carries no credentials."""
        return all(
            self.op_of(step).shareable or self.op_of(step).public_source(step) for step in steps
        )

    def run(self, step: Any, ctx: OpContext) -> int | None:
        return self.op_of(step).run(step, ctx)

    def overlaps(self, step: Any, following: Any, ctx: OpContext) -> bool:
        """Whether ``following`` reads the file ``step`` writes and the two can run at
        once (stager.staging.overlap)."""
        grows, follows = self.op_of(step).grows, self.op_of(following).follows
        if grows is None or follows is None or (src := follows.src(following)) is None:
            return False
        return ctx.destination(src) == grows.files(step, ctx)[1]

    def used_up(self, step: Any, ctx: OpContext) -> str | None:
        """The earlier step's output this step consumed, to remove once it is done."""
        src = getattr(step, "src", "")
        if self.op_of(step).consumes_src and not src.startswith("/") and not step.keep:
            return str(ctx.destination(src))
        return None

    def scratch(self, steps: Sequence[Any]) -> frozenset[str]:
        """What a staging of ``steps`` writes in its tree and removes before it is ready:
        an output a later step uses up, and its names while an op writes it. A fan-out
        never sends them early (stager.fanout.early)."""
        growers = [op.grows for op in self._ops.values() if op.grows is not None]
        names: set[str] = set()
        for step in steps:
            src = getattr(step, "src", "")
            if self.op_of(step).consumes_src and not src.startswith("/") and not step.keep:
                name = posixpath.normpath(src)
                names |= {name, *(grows.partial(name) for grows in growers)}
        return frozenset(names)

    def describe(self) -> list[dict[str, Any]]:
        """What ``GET /v1/recipes`` lists under ``ops``: each op's fields and options."""
        return [
            {
                "name": op.name,
                "summary": op.summary,
                "verify": sorted(op.verify),
                "schema": self._tagged[op.name].model_json_schema(),
            }
            for op in self._ops.values()
            if not op.internal  # built by the daemon, never named in a request
        ]


def for_settings(settings: Settings) -> OpTable:
    return load(tuple(settings.op_modules))


@functools.cache
def load(op_modules: tuple[str, ...] = ()) -> OpTable:
    """The built-in ops plus each module's ``OPS`` (a site's own ops)."""
    extra: list[Op] = []
    for name in op_modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(
                f"op module {name!r} (STAGER_OP_MODULES) cannot be imported: {exc}"
            ) from exc
        extra.extend(getattr(module, "OPS", ()))
    return OpTable([*BUILTIN, *extra])
