"""Image mode in the staging process: a request's steps made into one read-only image.

The image holds the tree the steps would have left (docs/image-mode.md), with as
little of that tree on the disk as the steps allow (:func:`plan`):

- A step whose op reads an archive into the dataset (the op table's ``image_stream``)
  is *streamed*: each member goes into the image under the name it would have had,
  with no file made on the way; archives inside a plain tar (``nested``) are read in
  place.
- A step that only renames moves the image's names instead.
- Any other step runs as an op into the attempt's tree, which is packed into the
  image first, then each streamed archive in step order.

A streamed step stays one only while no later op touches its folder (the val sort
reads the val images), and renames stay names only when no op runs after them. A
request with no streamed step is staged as a tree and packed from a walk of it.

The image is built as ``image.erofs.partial`` in the attempt's folder and renamed to
``image.erofs`` when complete and synced (``Durable.IMAGE_BUILT``); the daemon
publishes and mounts it (:meth:`stager.kinds.image.Image.publish`). A resumed staging
runs the steps its marker has not counted and builds again unless the image is there.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stager.archive.growing import GrowingFile
from stager.core.durable import Durable
from stager.core.errors import BadRequest, StagingError
from stager.fs.sources import open_source
from stager.image.build import (
    BuildOptions,
    Built,
    Input,
    Names,
    TarInput,
    TreeInput,
    build_from,
)
from stager.image.index import build_indexed
from stager.image.published import BLOB_SUFFIX, SUFFIXES, format_of, image_of
from stager.ops import adopt_image, table
from stager.ops.adopt_image import AdoptImageStep
from stager.ops.base import ImageStream, OpContext
from stager.ops.image import ImageStep, copy_verified
from stager.staging import overlap
from stager.staging.publish import Attempt, write_atomically
from stager.staging.worker import Steps
from stager.wire.progress import ProgressSink, WorkerCounters, report_written

IMAGE_NAME = "image.erofs"
BUILT_NAME = "image.json"  # what the build counted, written before the image's rename


@dataclass(frozen=True)
class ImageJob:
    """How a staging's image is made: ``top_owner`` the uid of a private copy's user
    (the image's top folder theirs, 0500; the file 0400) or None (root's, 0555; 0444);
    ``trusted`` the folders prebuilt images must lie in (the node service), None: any."""

    top_owner: int | None = None
    trusted: tuple[str, ...] | None = None
    index: bool = False  # one plain tar and nothing else: an index image and its blob
    # One plain tar and nothing else, not as an index image: the tar copied into the
    # image whole, the metadata after it (stager.image.index, embedded): cp's speed.
    embed: bool = False
    # The image's format (stager.image.build's writers): EROFS, or squashfs for a
    # user's own daemon's FUSE mount.
    format: str = "erofs"

    # The image kind's part of a staging job (stager.staging.worker.KindStaging).

    def published(self, final: Path, attempt: Attempt) -> ImageMade | None:
        """An image published before the daemon died (the staging has nothing to do)."""
        published = image_of(final.parent, final.name)
        if published is None or self.built(attempt):
            return None
        return ImageMade(str(published), size=published.stat().st_size)

    def built(self, attempt: Attempt) -> bool:
        """Built, its tree dropped: published next."""
        return attempt_image(attempt, self.format).exists()

    def stage(self, staging: Steps) -> ImageMade:
        return ImageStaging(staging, self).run()


@dataclass(frozen=True)
class ImageMade:
    """The outcome of an image staging: the image at ``path`` (in the attempt's folder,
    or already published) and what is known of it."""

    path: str
    format: str = "erofs"
    size: int = 0
    files: int = 0
    folders: int = 0
    data_bytes: int = 0
    sha256: str = ""  # of a prebuilt image (checked); "" for one built here

    def to_dict(self) -> dict[str, Any]:
        return {"image": asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageMade:
        return cls(**data["image"])


def attempt_image(attempt: Attempt, fmt: str = "erofs") -> Path:
    """Where an attempt builds its image: ``image.erofs`` (``image.sqfs``)."""
    return attempt.root / f"image{SUFFIXES[fmt]}"


# ---- the plan ------------------------------------------------------------------------


TREE, STREAM, NAME = "tree", "stream", "name"


@dataclass
class Plan:
    """What each step is in image mode (``TREE``: run as an op; ``STREAM``: read into the
    image; ``NAME``: a rename of the image's names), with the streams and moves."""

    kinds: list[str]
    streams: dict[int, ImageStream] = field(default_factory=dict)
    moves: dict[int, tuple[str, str]] = field(default_factory=dict)

    def names_after(self, index: int) -> tuple[tuple[str, str], ...]:
        return tuple(move for i, move in sorted(self.moves.items()) if i > index)


def plan(ops: table.OpTable, steps: list[Any], sniff: Callable[[str], str | None]) -> Plan:
    """Which steps stream, which rename names, which run as ops (see the module's
    docstring). ``sniff`` says the format of an absolute source ("zip", "tar", "gz"...)."""
    kinds, streams, moves = [], {}, {}
    for index, step in enumerate(steps, start=1):
        op = ops.op_of(step)
        stream = op.image_stream(step)
        if (move := op.moves(step)) is not None:
            kinds.append(NAME)
            moves[index] = move
        elif stream is not None and _streamable(stream, sniff):
            kinds.append(STREAM)
            streams[index] = stream
        else:
            kinds.append(TREE)
    result = Plan(kinds, streams, moves)
    while _demote(result, steps):
        pass
    return result


def _streamable(stream: ImageStream, sniff: Callable[[str], str | None]) -> bool:
    if not stream.src.startswith("/"):
        return not stream.nested  # an earlier step's file: looked at when it is there
    fmt = sniff(stream.src) if stream.format == "auto" else stream.format
    if fmt in (None, "zip"):
        return False
    return fmt == "tar" or not stream.nested  # nested archives are read from a plain tar


def _demote(plan: Plan, steps: list[Any]) -> bool:
    """One step made an op where the rules say it must be; True if one was."""
    last_op = max((i for i, k in enumerate(plan.kinds, 1) if k == TREE), default=0)
    for index, kind in enumerate(plan.kinds, start=1):
        if kind == NAME and index < last_op:
            plan.kinds[index - 1] = TREE  # an op after it reads the tree renamed
            del plan.moves[index]
            return True
        if kind == STREAM:
            stream = plan.streams[index]
            later = [steps[j - 1] for j, k in enumerate(plan.kinds, 1) if j > index and k == TREE]
            earlier = [
                plan.streams[j].dst if k == STREAM else plan.moves[j][1]
                for j, k in enumerate(plan.kinds, 1)
                if j < index and k in (STREAM, NAME)
            ]
            relative_src = not stream.src.startswith("/")
            if any(_overlaps(stream.dst, path) for s in later for path in _touched(s)) or (
                relative_src and any(_overlaps(stream.src, path) for path in earlier)
            ):
                plan.kinds[index - 1] = TREE
                del plan.streams[index]
                return True
    return False


def _touched(step: Any) -> list[str]:
    """The dataset's paths an op reads or writes: its ``dst`` and a relative ``src``
    (no ``dst``: the whole dataset)."""
    paths = []
    for name in ("dst", "src"):
        value = getattr(step, name, None)
        if isinstance(value, str) and not value.startswith("/") and "://" not in value:
            paths.append(value)
    return paths if hasattr(step, "dst") else ["."]


def _norm(path: str) -> str:
    path = posixpath.normpath(path or ".")
    return "" if path == "." else path.strip("/")


def _overlaps(a: str, b: str) -> bool:
    a, b = _norm(a), _norm(b)
    return not a or not b or a == b or a.startswith(b + "/") or b.startswith(a + "/")


# ---- the staging -----------------------------------------------------------------------


class ImageStaging:
    """One image staging, in the staging process (its kind's ``stage``)."""

    def __init__(self, staging: Steps, job: ImageJob) -> None:
        self.staging = staging
        self.ops, self.steps, self.attempt = staging.ops, staging.steps, staging.attempt
        self.ctx, self.progress, self.crash = staging.ctx, staging.progress, staging.crash
        self.job, self.run_steps = job, staging.run

    def run(self) -> ImageMade:
        made = attempt_image(self.attempt, self.job.format)
        if made.exists():
            return _made_before(self.attempt, made)  # built before a crash: published next
        if len(self.steps) == 1 and isinstance(self.steps[0], AdoptImageStep):
            return self._adopted(self.steps[0], made)
        if len(self.steps) == 1 and self.ops.op_of(self.steps[0]).prebuilt_image:
            return self._prebuilt(self.steps[0], made)
        the_plan = plan(self.ops, self.steps, _sniffer(self.ctx))
        if self._downloads_its_archive(the_plan):
            return self._build_while_downloading(the_plan, made)
        read_from: dict[int, str] = {}

        def at_turn(index: int) -> None:
            if the_plan.kinds[index - 1] == STREAM:
                read_from[index] = self._take_input(index, the_plan.streams[index])

        self.run_steps(lambda index: the_plan.kinds[index - 1] == TREE, at_turn)
        inputs: list[Input] = []
        if any(self.attempt.tree.iterdir()):
            names = Names(renames=the_plan.names_after(0))
            inputs.append(TreeInput(str(self.attempt.tree), names, owned=True))
        opened: list[int] = []
        try:
            for index, stream in sorted(the_plan.streams.items()):
                inputs.append(self._stream_input(index, stream, read_from, the_plan, opened))
            indexed = self._indexable(inputs)
            built = self._build(inputs, made, the_plan, self.progress, indexed=indexed)
        finally:
            for fd in opened:
                os.close(fd)
        return self._built(built, made)

    # -- inputs --

    def _take_input(self, index: int, stream: ImageStream) -> str:
        """Where a streamed step's archive is read from; an earlier step's output that it
        uses up is moved out of the tree first (so it is not packed), at its turn."""
        if stream.src.startswith("/"):
            return stream.src
        inside = self.ctx.destination(stream.src)
        if stream.keep:
            return str(inside)
        aside = self.staging.put_aside(index, inside)
        if not aside.exists():
            raise StagingError(
                f"{stream.src!r} is not in the dataset; a relative src names a file an "
                "earlier step wrote (a fetch), so put that step first"
            )
        return str(aside)

    def _stream_input(
        self,
        index: int,
        stream: ImageStream,
        read_from: dict[int, str],
        the_plan: Plan,
        opened: list[int],
    ) -> TarInput:
        if stream.before is not None:
            self.progress.start_step(index)
            stream.before(self.ctx)
        if stream.src.startswith("/"):  # a source: opened as whoever reads sources here
            fd = open_source(stream.src, self.ctx.allowed_roots)
        else:  # an earlier step's output, in the attempt's folder (the service's own)
            fd = os.open(read_from[index], os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        opened.append(fd)
        names = Names(stream.strip, _norm(stream.dst), the_plan.names_after(index))
        return TarInput(stream.src, names, fd, stream.nested, stream.format)

    # -- an archive built from as it downloads --

    def _downloads_its_archive(self, the_plan: Plan) -> bool:
        """Whether the request is a download and the streamed extract of what it
        downloads (an extract of a URL; renames after it are names), neither done yet:
        then the image is built from the download as it arrives."""
        kinds = the_plan.kinds
        if len(kinds) < 2 or kinds[:2] != [TREE, STREAM] or set(kinds[2:]) - {NAME}:
            return False
        fetch, extract = self.steps[0], self.steps[1]
        return (
            self.attempt.steps_done() == 0
            and not the_plan.streams[2].keep
            and self.ops.overlaps(fetch, extract, self.ctx)
        )

    def _build_while_downloading(self, the_plan: Plan, made: Path) -> ImageMade:
        """The download runs as its op does alone while the image is built from its file
        as it grows (:func:`stager.staging.overlap.follow_download`; again from the first
        byte if the download starts over). The image takes its final name only once the
        download is complete and checked."""
        stream = the_plan.streams[2]
        names = Names(stream.strip, _norm(stream.dst), the_plan.names_after(2))
        self.progress.start_step(1)

        def build(ctx: OpContext, reader: GrowingFile) -> tuple[bool, Built]:
            source = TarInput(
                stream.src, names, reader.fileno(), format=stream.format, growing=reader
            )
            return True, self._build([source], made, the_plan, ctx.progress, steps=False)

        _, built = overlap.follow_download(
            self.ops, self.steps[0], self.ctx, lambda: self.progress.start_step(2), build
        )
        assert built is not None
        result = self._built(built, made)
        write_atomically(self.attempt.marker, str(len(self.steps)))
        return result

    # -- the build --

    def _indexable(self, inputs: list[Input]) -> bool:
        """Whether the image is an index image, its blob apart or embedded: asked for,
        and its one input a plain tar read in one piece (no tree beside it, no archives
        inside it)."""
        if not (self.job.index or self.job.embed) or len(inputs) != 1:
            return False
        source = inputs[0]
        if not isinstance(source, TarInput) or source.nested or source.fd is None:
            return False
        from stager.archive.formats import sniff  # as _sniffer does

        return sniff(os.pread(source.fd, 512, 0)) == "tar"

    def _build(
        self,
        inputs: list[Input],
        made: Path,
        the_plan: Plan,
        counts: ProgressSink,
        indexed: bool = False,
        steps: bool = True,
    ) -> Built:
        """Build the image as ``made`` + ``.building``; ``counts`` takes the bytes and
        files read; ``steps``: the progress shows each input's step as it is read."""
        streamed = sorted(the_plan.streams)
        private = self.job.top_owner is not None
        sink = _StepProgress(self.progress, inputs, streamed, len(self.steps), counts, steps)
        options = BuildOptions(
            progress=sink,
            check=self.ctx.check_cancelled,
            mode=0o400 if private else 0o444,
            top_owner=self.job.top_owner,
            format=self.job.format,
        )
        if indexed:  # a blob apart is written as image.erofs.blob, before the image
            source = inputs[0]
            assert isinstance(source, TarInput)
            options.names = source.names
            blob = str(made) + BLOB_SUFFIX if self.job.index else None
            building = str(made) + ".building"
            built = build_indexed(source.path, blob, building, options, source.fd).image
            if blob is not None:
                built.size += os.path.getsize(blob)
        else:
            built = build_from(inputs, str(made) + ".building", options)
        return built

    def _built(self, built: Built, made: Path) -> ImageMade:
        self.progress.start_step(len(self.steps))
        self.progress.flush()
        result = ImageMade(
            str(made), self.job.format, built.size, built.files, built.folders, built.data_bytes
        )
        self._named(Path(str(made) + ".building"), result)
        self._drop_tree()
        return result

    def _named(self, path: Path, result: ImageMade) -> None:
        """The image complete at ``path`` takes its name (``IMAGE_BUILT``), what is known
        of it written beside it first (a resumed staging reads it: ``_made_before``)."""
        write_atomically(self.attempt.root / BUILT_NAME, json.dumps(result.to_dict()))
        os.rename(path, result.path)
        self.crash.reached(Durable.IMAGE_BUILT)

    def _prebuilt(self, step: ImageStep, made: Path) -> ImageMade:
        if self.job.top_owner is not None:
            raise StagingError(
                f"image {step.src} may be read only by some users, and a prebuilt image "
                "cannot be mounted for one user alone (its top folder is what it is); make "
                "it readable by every user (it is then shared), or stage its source"
            )
        self.progress.start_step(1)
        copy = made.with_name(IMAGE_NAME + ".copied")
        return self._copied(copy, made, copy_verified(step, self.ctx, copy, self.job.trusted))

    def _adopted(self, step: AdoptImageStep, made: Path) -> ImageMade:
        """Another node's image, sent whole: taken in and checked (stager.ops.adopt_image),
        a private copy's too (built for the same user's key; its hash the service's word)."""
        self.progress.start_step(1)
        mode = 0o400 if self.job.top_owner is not None else 0o444
        copy = made.with_name(IMAGE_NAME + ".copied")
        return self._copied(copy, made, adopt_image.take_delivery(step, self.ctx, copy, mode))

    def _copied(self, copy: Path, made: Path, copied: Any) -> ImageMade:
        """An image copied whole and checked (``copied``: its format, size and sha256)
        takes its name; every step is then done."""
        result = ImageMade(str(made), copied.format, copied.size, sha256=copied.sha256)
        self._named(copy, result)
        write_atomically(self.attempt.marker, str(len(self.steps)))
        self.progress.flush()
        return result

    def _drop_tree(self) -> None:
        """The tree the image was packed from, out of the way in one rename: deleted with
        the attempt's folder once the image is published."""
        if self.attempt.tree.is_dir():
            os.rename(self.attempt.tree, self.attempt.root / "packed-tree")


def _made_before(attempt: Attempt, made: Path) -> ImageMade:
    try:
        return ImageMade.from_dict(json.loads((attempt.root / BUILT_NAME).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return ImageMade(str(made), format_of(made), size=made.stat().st_size)


def _sniffer(ctx: OpContext) -> Callable[[str], str | None]:
    from stager.archive.formats import sniff

    def look(src: str) -> str | None:
        try:
            fd = open_source(src, ctx.allowed_roots)
        except (OSError, StagingError, BadRequest):
            return None  # the op's own run says why, when it runs as one
        try:
            return sniff(os.pread(fd, 512, 0))
        finally:
            os.close(fd)

    return look


class _StepProgress:
    """The build's progress, told as the step whose archive (or tree) is being read."""

    def __init__(
        self,
        progress: WorkerCounters,
        inputs: list[Input],
        streamed: list[int],
        steps: int,
        counts: ProgressSink,
        show_steps: bool = True,
    ) -> None:
        self._progress, self._counts, self._show_steps = progress, counts, show_steps
        # The side tree (if any) counts as the last step; streams as their own.
        self._order = ([steps] if len(inputs) > len(streamed) else []) + streamed
        self._at = -1
        self._label = None

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        self._counts.add_total(nbytes, files)

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        self._counts.advance(nbytes, files)

    def wrote(self, nbytes: int, inodes: int = 0) -> None:
        report_written(self._counts, nbytes, inodes)

    def starting(self, label: str) -> None:
        """The build opens its next input."""
        self._at += 1
        if self._show_steps and self._at < len(self._order):
            self._progress.start_step(self._order[self._at])
