"""``stager image build|mount|unmount``: images without a daemon.

An admin publishes a dataset's image next to it on shared storage once
(``stager image build /data/imagenet/train.tar -o /data/imagenet/train.erofs``); a
node mounts it read-only. Progress goes to stderr: a line redrawn on a terminal, a
line every 10 s in a log.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from stager.core.errors import StagerError
from stager.core.processes import thread
from stager.wire.progress import Progress

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

EPILOG = """\
examples:
  stager image build train.tar.gz -o train.erofs
  stager image build inat/train.tar.gz -o inat.erofs --into . --rename train=2021_train
  stager image build /data/tree -o tree.erofs        # a folder, packed from its listing
  stager image mount train.erofs /mnt/train          # root: the kernel; a user: FUSE
  stager image unmount /mnt/train

The image is EROFS (docs/image-mode.md says why): every file 0444, every folder 0555,
owned by root, names checked as an extraction checks them. It is written as
FILE.partial and renamed when complete: the output names a file in an existing
folder, never the source itself; a folder packed with its output inside leaves the
image's own files out.
"""


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    image = commands.add_parser(
        "image",
        help="build, mount and unmount read-only dataset images (no daemon needed)",
        description="Build a read-only EROFS image of a dataset from a tar stream or a "
        "folder, and mount it read-only.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = image.add_subparsers(dest="image_command", required=True, metavar="ACTION")
    build = actions.add_parser(
        "build",
        help="build an image from a tar (plain, .gz, .bz2, .xz, .zst) or a folder",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    build.add_argument("source", type=Path, help="a tar archive (compressed or not) or a folder")
    build.add_argument("-o", "--output", type=Path, required=True, help="the image file to write")
    build.add_argument(
        "--strip-components",
        dest="strip",
        type=int,
        default=0,
        help="drop this many leading folders from member names, as tar's option does",
    )
    build.add_argument("--into", default="", help="put the members under this folder of the image")
    build.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="rename a path of the image and everything under it (repeatable, in order): "
        "a recipe's rename step, e.g. train=2021_train",
    )
    build.add_argument("--quiet", action="store_true", help="print no progress")
    mount = actions.add_parser(
        "mount",
        help="mount an image read-only (nosuid,nodev): the kernel as root, FUSE as a user",
    )
    mount.add_argument("image", type=Path)
    mount.add_argument("target", type=Path, help="an existing, empty folder")
    mount.add_argument("--fuse", action="store_true", help="use FUSE even as root")
    unmount = actions.add_parser("unmount", help="unmount an image's mount point")
    unmount.add_argument("target", type=Path)


def run(args: argparse.Namespace) -> int:
    try:
        if args.image_command == "build":
            return _build(args)
        if args.image_command == "mount":
            return _mount(args)
        from stager.image.mount import unmount

        unmount(str(args.target))
        return EXIT_OK
    except StagerError as exc:
        print(f"stager: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:  # the output's disk or folder: name the path and the cause
        print(f"stager: {exc.filename or args.image_command}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED


def _build(args: argparse.Namespace) -> int:
    from stager.image.build import BuildOptions, Names, build_image

    source = str(args.source)
    if not os.path.exists(source):
        print(f"stager: source {source} does not exist; check the path", file=sys.stderr)
        return EXIT_USAGE
    wrong = _bad_output(source, str(args.output))
    if wrong is not None:
        print(f"stager: {wrong}", file=sys.stderr)
        return EXIT_USAGE
    renames = []
    for pair in args.rename:
        old, sep, new = pair.partition("=")
        if not sep or not old or not new:
            print(f"stager: --rename {pair!r} is not OLD=NEW", file=sys.stderr)
            return EXIT_USAGE
        renames.append((old.strip("/"), new.strip("/")))
    progress = Progress()
    names = Names(args.strip, args.into.strip("/").removeprefix("."), tuple(renames))
    reporter = _Reporter(progress, str(args.output), quiet=args.quiet)
    reporter.start()
    try:
        built = build_image(source, str(args.output), BuildOptions(names, progress))
    finally:
        reporter.stop()
    print(
        f"{built.path}: {built.size / 1e6:,.1f} MB, {built.files:,} files in "
        f"{built.folders:,} folders, {built.seconds:.1f} s",
        file=sys.stderr,
    )
    return EXIT_OK


def _bad_output(source: str, output: str) -> str | None:
    """What is wrong with ``output`` as the image file to write from ``source``: the image
    is renamed onto it at the end, so it must not be a folder, nor the source itself
    (the archive would be replaced by its image), and its folder must exist."""
    if os.path.isdir(output):
        example = f"{output.rstrip('/')}/NAME.erofs"
        return f"output {output} is a folder; name the image file to write, e.g. {example}"
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        return (
            f"the folder of output {output} ({folder}) does not exist; create it, or "
            "choose another output"
        )
    if os.path.exists(output) and os.path.samefile(source, output):
        return (
            f"output {output} is the source itself: the image would replace it; choose "
            "another file name for the image"
        )
    return None


def _mount(args: argparse.Namespace) -> int:
    from stager.image import mount

    if os.geteuid() == 0 and not args.fuse:
        done = mount.mount_kernel(str(args.image), str(args.target))
    else:
        done = mount.mount_fuse(str(args.image), str(args.target))
    print(f"{args.image} mounted at {done.target} ({done.fstype}, {done.options})")
    return EXIT_OK


class _Reporter:
    """Prints a build's progress from a thread, so the build's loop pays nothing."""

    def __init__(self, progress: Progress, label: str, quiet: bool) -> None:
        self._progress, self._label = progress, label
        self._tty = sys.stderr.isatty()
        self._every = 0.5 if self._tty else 10.0
        self._stopped = threading.Event()
        self._quiet = quiet
        self._thread: Any = None  # stager.core.processes.thread's

    def start(self) -> None:
        if not self._quiet:
            self._thread = thread(self._loop, name="stager-image-progress")

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            if self._tty:
                sys.stderr.write("\n")

    def _loop(self) -> None:
        started = time.monotonic()
        while not self._stopped.wait(self._every):
            now = self._progress.snapshot()
            eta = f", {now.eta_s:.0f} s left" if now.eta_s is not None else ""
            line = (
                f"building {self._label}: {now.bytes_done / 1e6:,.0f} of "
                f"{now.bytes_total / 1e6:,.0f} MB read, {now.files_done:,} entries, "
                f"{now.rate_bytes_per_s / 1e6:,.0f} MB/s{eta} "
                f"({time.monotonic() - started:.0f} s)"
            )
            sys.stderr.write(f"\r{line}\033[K" if self._tty else f"{line}\n")
            sys.stderr.flush()
