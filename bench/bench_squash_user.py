"""Benchmark: a per-user daemon's squashfs image datasets, against ``cp``, side by side.

    python -m bench.bench_squash_user [--work-dir /var/tmp/stager-bench-squash]
        [--user nobody] [--repeat 3] [--small-files 200000]

A daemon started as ``--user`` as a login would (``runuser -u USER --``), where no FUSE
reader of EROFS is (Debian 12): ``"image": true`` is the squashfs kind
(stager.kinds.squash), built by stager's own writer (stager.image.squashfs: data
stored as it is, a plain tar embedded whole) and mounted by squashfuse_ll as the user.
/dev/fuse is made 0666 for the run, as Debian's udev leaves it, and given its mode back.

- **ready**: request to ready (``POST`` then ``GET .../wait``) against ``cp`` of the
  archive to the same disk, made durable (an fsync), and against ``tar2sqfs`` (lz4,
  the writer the kind ran before its own) run alone as the user (fsynced too),
  alternated A B C A B C: the 20,000 files of 4-100 KB (bench.datagen)
  and ``--small-files`` files of 512 B, each a ``.tar``; medians and pairwise ratios.
- **steps**: the order of one 20,000-file request's steps, each one's start after the
  ``POST``: the daemon's processes traced by ``strace -f -p`` (only the calls that mark
  a step are printed, but an attached strace stops every call of every traced process:
  the times are upper bounds).
- **evict**: ``DELETE`` of the ready ``--small-files`` image (unmount, delete a file).
- **tools**: the writers that read a tar as it is, as root, against ``cp``, each
  output fsynced, alternated: ``tar2sqfs`` with the kind's options and ``sqfstar``
  (squashfs-tools 4.5.1) with its fastest (no duplicate search, no fragments, data
  stored as it is), on both tars; wall and CPU time.
- **writer**: the 20,000 files' image by ``tar2sqfs`` from the tar, against
  ``tar -x`` then ``mksquashfs``, as root (the images the read section mounts).
- **train**: ``stager-train``'s own input pipeline (bench.read_roots: the trainer's
  dataset, sampler and DataLoader, its default workers) reading ``--jpegs`` generated
  JPEGs (bench.jpegs), staged from one ``.tar`` by the same daemon as a tree and as a
  squashfs image (stager's writer: uncompressed), and from one ``tar2sqfs`` wrote with
  lz4, mounted by the user; run as the user (a FUSE mount is its user's alone), the
  three alternated, ``--repeat`` runs each: medians and each one's ratio to the tree.
- **read**: every file of the 20,000 read through squashfuse_ll as the user
  (``tar -cf - . | cat``, warm: twice, the second timed), the lz4 image tar2sqfs
  wrote against one mksquashfs wrote uncompressed (``-noI -noD -noF -noX``).

The load average is printed with each section: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_image import alternate, row
from bench.bench_image_daemon import Stager, copied, extract, load
from bench.datagen import make_archives, make_small_tar, make_tree
from bench.jpegs import make_jpegs
from bench.timing import spread
from stager.image import mount
from tests.daemon import Daemon, unmount_under
from tests.mounts import debian_fuse_mode
from tests.users import usable_by_everyone


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/var/tmp/stager-bench-squash"))
    parser.add_argument("--user", default="nobody", help="the daemon's user")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per candidate")
    parser.add_argument("--small-files", type=int, default=200_000)
    parser.add_argument("--jpegs", type=int, default=3000, help="JPEGs of the train section")
    parser.add_argument("--sections", default="ready,steps,evict,train,tools,writer,read")
    return parser


class UserStager(Stager):
    """Stager's bench daemon, started as ``user`` through runuser."""

    def __init__(self, work: Path, user: str) -> None:
        shutil.rmtree(work / "cache", ignore_errors=True)
        wrapper = ["runuser", "-u", user, "--"]
        env = {"STAGER_LOG_LEVEL": "warning"}
        self.daemon = Daemon(cache_dir=work / "cache", extra_env=env, wrapper=wrapper)
        entry = pwd.getpwnam(user)
        os.chown(self.daemon.runtime_dir, entry.pw_uid, entry.pw_gid)
        self.daemon.start()


def ready_section(work: Path, stager: Stager, inputs: dict[str, Path], repeat: int) -> None:
    """Request to ready against cp, and against the kind's tar2sqfs run alone as the
    user (what the daemon adds is the difference)."""
    print(f"\n## Request to ready, per-user squashfs vs cp (durable), load {load()}\n")
    print("| case | stager | tar2sqfs alone | cp | stager / cp | tar2sqfs / cp |")
    print("|---|---:|---:|---:|---:|---:|")
    user = pwd.getpwuid(os.stat(stager.daemon.runtime_dir).st_uid).pw_name
    alone = work / "alone.sqfs"
    jobs = str(os.cpu_count() or 1)
    for label, tar in (("20k files 4-100 KB", inputs["tar"]), (inputs["count"], inputs["small"])):
        body = {"name": "r", "steps": [extract(tar)], "image": True}

        def staged(body: dict = body) -> float:
            elapsed, _ = stager.ready(body)
            stager.delete("r")
            return elapsed

        def tar2sqfs(tar: Path = tar) -> float:
            alone.unlink(missing_ok=True)
            return _timed(f"tar2sqfs -q -f -s -c lz4 -j {jobs} {alone} < {tar} && sync {alone}",
                          user)  # fmt: skip

        candidates = {"stager": staged, "tar2sqfs": tar2sqfs,
                      "cp": copied(["cp", str(tar)], work / "copy.tar")}  # fmt: skip
        times = alternate(candidates, repeat)
        medians = " | ".join(
            f"{statistics.median(times[name]):.2f} s ({spread(times[name])})" for name in candidates
        )
        print(f"| {label} files, .tar | {medians} | {_ratio(times['stager'], times['cp'])} | "
              f"{_ratio(times['tar2sqfs'], times['cp'])} |")  # fmt: skip
    (work / "copy.tar").unlink(missing_ok=True)
    alone.unlink(missing_ok=True)


# Calls that mark a step of a request (the strace filter) and how each is named.
STEP_CALLS = "execve,rename,fsync,mount,exit_group,accept4"
STEPS = (
    (r"accept4\(.* = \d", "the POST accepted"),
    (r"rename\(.*/steps-done", "the steps recorded done (no tree: the tar is read as it is)"),
    (r"fsync\(", "an fsync started"),
    (r"rename\(.*image\.sqfs\.building\.partial", "the image built, fsynced, renamed"),
    (r"rename\(.*/data/", "published (renamed into data/)"),
    (r"execve\(\"[^\"]*squashfuse_ll", "squashfuse_ll started"),
    (r"mount\(.*= 0", "mounted (fusermount3)"),
    (r"rename\(.*discarded-", "the attempt discarded: ready"),
)


def steps_section(work: Path, stager: Stager, tar: Path) -> None:
    """One request's steps, timed by an strace of the daemon's processes."""
    print(f"\n## Where a 20k-file request's time goes (strace), load {load()}\n")
    body = {"name": "s", "steps": [extract(tar)], "image": True}
    stager.ready(body)  # the staging processes started, the tar in the page cache
    stager.delete("s")
    user = pwd.getpwuid(os.stat(stager.daemon.runtime_dir).st_uid).pw_name
    found = subprocess.run(["pgrep", "-u", user], capture_output=True, text=True).stdout.split()
    log = work / "steps.strace"
    argv = ["strace", "-f", "-ttt", "-e", f"trace={STEP_CALLS}", "-o", str(log),
            *[f"-p{pid}" for pid in found]]  # fmt: skip
    tracer = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    start = time.time()
    elapsed, _ = stager.ready(body)
    tracer.terminate()
    tracer.wait()
    stager.delete("s")
    tools: dict[str, str] = {}
    print(f"traced request: {elapsed:.2f} s to ready\n")
    print("| at (s) | step |")
    print("|---:|---|")
    for line in log.read_text().splitlines():
        parts = line.split(None, 2)
        if len(parts) < 3 or "resumed>" in line or float(parts[1]) < start:
            continue
        if "execve(" in line:
            tools[parts[0]] = os.path.basename(line.split('"')[1])
        for pattern, name in STEPS:
            if re.search(pattern, line):
                if name is None:
                    name = f"{tools[parts[0]]} exited" if parts[0] in tools else None
                if name is not None:
                    print(f"| {float(parts[1]) - start:.3f} | {name} |")
                break


def evict_section(stager: Stager, small: Path, count: str, repeat: int) -> None:
    print(f"\n## Eviction of a {count}-file squashfs dataset (DELETE), load {load()}\n")
    times = []
    for _ in range(repeat):
        stager.ready({"name": "e", "steps": [extract(small)], "image": True})
        times.append(stager.delete("e"))
        assert not mount.mounts_under(str(stager.daemon.cache_dir)), "DELETE left a mount"
    print(f"DELETE: median {statistics.median(times):.3f} s ({min(times):.3f}-{max(times):.3f})")


def jpeg_tar(work: Path, count: int) -> Path:
    """A plain tar of ``count`` generated JPEGs, ``train/class_XX/*.jpg`` at its top."""
    tar = work / f"jpegs-{count}.tar"
    if not tar.exists():
        root = make_jpegs(work / f"jpegs-{count}", count)
        partial = tar.with_name(tar.name + ".partial")
        subprocess.run(["tar", "-cf", str(partial), "-C", str(root), "train"], check=True)
        os.rename(partial, tar)
    return tar


def train_section(work: Path, stager: Stager, jpegs: Path, user: str, repeat: int) -> None:
    """The trainer's input pipeline over the same JPEGs as a tree, as the daemon's
    squashfs image (uncompressed) and as one tar2sqfs wrote with lz4, mounted by the
    user."""
    print(f"\n## stager-train's input pipeline, tree vs per-user squashfs, load {load()}\n")
    roots = {}
    for name, image in (("tree", False), ("image", True)):
        _, status = stager.ready({"name": f"t-{name}", "steps": [extract(jpegs)], "image": image})
        roots[name] = status["path"]
    assert mount.mounted_at(roots["image"]) is not None, "the image dataset is not mounted"
    assert mount.mounted_at(roots["tree"]) is None, "the tree dataset is a mount"
    lz4 = work / "t-lz4.sqfs"
    with open(jpegs, "rb") as tar:
        subprocess.run(["tar2sqfs", "-q", "-f", "-s", "-c", "lz4", str(lz4)], stdin=tar, check=True)
    roots["lz4"] = str(user_mount(lz4, work / "m-t-lz4", user))
    try:
        argv = ["runuser", "-u", user, "--", "env", f"HOME={stager.daemon.runtime_dir}",
                sys.executable, "-m", "bench.read_roots", *roots.values(),
                "--repeats", str(repeat)]  # fmt: skip
        done = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True)
    finally:
        user_unmount(work / "m-t-lz4", user)
    said = json.loads(done.stdout.strip().splitlines()[-1])
    rates = {name: said["rates"][root] for name, root in roots.items()}
    tree = statistics.median(rates["tree"])
    print(f"{said['workers']} loader worker(s) (the trainer's default here), median of "
          f"{repeat} alternated runs, load {load()}\n")  # fmt: skip
    print("| root | img/s | / tree (pairs) | runs |")
    print("|---|---:|---:|---|")
    labels = {"tree": "tree", "image": "squashfs uncompressed (the daemon's, stager's writer)",
              "lz4": "squashfs lz4 (tar2sqfs, the kind's writer before)"}  # fmt: skip
    for name, label in labels.items():
        runs = rates[name]
        pairs = [x / t for x, t in zip(runs, rates["tree"], strict=True)]
        print(f"| {label} | {statistics.median(runs):.0f} | "
              f"{statistics.median(runs) / tree:.2f}x ({min(pairs):.2f}-{max(pairs):.2f}) | "
              f"{', '.join(f'{x:.0f}' for x in runs)} |")  # fmt: skip
    for name in ("tree", "image"):
        stager.delete(f"t-{name}")


def user_mount(image: Path, target: Path, user: str) -> Path:
    """``image`` mounted at ``target`` by ``squashfuse_ll -o ro`` as ``user``."""
    entry = pwd.getpwnam(user)
    target.mkdir(exist_ok=True)
    os.chown(target, entry.pw_uid, entry.pw_gid)
    os.chmod(image, 0o644)
    _timed(["squashfuse_ll", "-o", "ro", str(image), str(target)], user)
    return target


def user_unmount(target: Path, user: str) -> None:
    subprocess.run(["runuser", "-u", user, "--", "fusermount3", "-u", str(target)])


def _timed(argv: list[str] | str, user: str | None = None) -> float:
    command = ["sh", "-c", argv] if isinstance(argv, str) else argv
    if user is not None:
        command = ["runuser", "-u", user, "--", *command]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def writer_section(work: Path, tar: Path, repeat: int) -> dict[str, Path]:
    print(f"\n## Writer, 20k files 4-100 KB, as root, load {load()}\n")
    lz4, none, tree = work / "w-lz4.sqfs", work / "w-none.sqfs", work / "w-tree"
    jobs = str(os.cpu_count() or 1)

    def tar2sqfs() -> float:
        return _timed(f"tar2sqfs -q -f -s -c lz4 -j {jobs} {lz4} < {tar}")

    def mksquashfs() -> float:
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir()
        return _timed(
            f"tar -xf {tar} -C {tree} && mksquashfs {tree} {none} -noappend -quiet "
            f"-no-progress -noI -noD -noF -noX -processors {jobs}"
        )

    times = alternate({"tar2sqfs": tar2sqfs, "mksquashfs": mksquashfs}, repeat)
    print("| case | tar2sqfs (lz4) | tar -x + mksquashfs (none) | ratio |")
    print("|---|---:|---:|---:|")
    print(row("tar to image", times, "tar2sqfs", "mksquashfs"))
    shutil.rmtree(tree, ignore_errors=True)
    return {"lz4": lz4, "none": none}


def tools_section(work: Path, tars: dict[str, Path], repeat: int) -> None:
    """The writers a tar could be read by, as root, each output fsynced, against cp."""
    print(f"\n## Writers from a .tar against cp, each fsynced (sync FILE), load {load()}\n")
    out = work / "tool.out"
    jobs = str(os.cpu_count() or 1)
    commands = {
        "cp": "cp {tar} {out}",
        "tar2sqfs": f"tar2sqfs -q -f -s -c lz4 -j {jobs} {{out}} < {{tar}}",  # the kind's
        "sqfstar": "sqfstar -quiet -no-progress -no-duplicates -no-fragments -noD -comp lz4 "
        f"-no-xattrs -exit-on-error -processors {jobs} -force {{out}} < {{tar}}",
    }
    print("| input | tool | wall, median (spread) | / cp (pairs) | CPU s (user+sys), median |")
    print("|---|---|---:|---:|---:|")
    for label, tar in tars.items():
        cpu: dict[str, list[float]] = {name: [] for name in commands}

        def run(name: str, tar: Path = tar, cpu: dict[str, list[float]] = cpu) -> float:
            out.unlink(missing_ok=True)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            took = _timed(commands[name].format(tar=tar, out=out) + f" && sync {out}")
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            return took

        times = alternate({name: lambda name=name: run(name) for name in commands}, repeat)
        for name in commands:
            print(f"| {label} | {name} | {statistics.median(times[name]):.2f} s "
                  f"({spread(times[name])}) | {_ratio(times[name], times['cp'])} | "
                  f"{statistics.median(cpu[name]):.2f} |")  # fmt: skip
    out.unlink(missing_ok=True)


def _ratio(a: list[float], b: list[float]) -> str:
    pairs = sorted(x / y for x, y in zip(a, b, strict=True))
    return f"{statistics.median(a) / statistics.median(b):.2f}x ({pairs[0]:.2f}-{pairs[-1]:.2f})"


def read_section(work: Path, images: dict[str, Path], user: str, repeat: int) -> None:
    print(f"\n## Reads through squashfuse_ll as {user}, 20k files, warm, load {load()}\n")
    targets = {name: user_mount(image, work / f"m-{name}", user) for name, image in images.items()}
    try:

        def reader(target: Path) -> Any:
            def run() -> float:
                _timed(f"tar -cf - -C {target} . | cat", user)  # warmed
                return _timed(f"tar -cf - -C {target} . | cat", user)

            return run

        times = alternate({name: reader(t) for name, t in targets.items()}, repeat)
        print("| case | lz4 (tar2sqfs) | none (mksquashfs) | ratio |")
        print("|---|---:|---:|---:|")
        print(row("read every file", times, "lz4", "none"))
    finally:
        for target in targets.values():
            user_unmount(target, user)


def main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("bench_squash_user: needs root (runuser, /dev/fuse's mode)", file=sys.stderr)
        return 2
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# bench_squash_user, {now}, load {load()}")
    sections = set(args.sections.split(","))
    tree = make_tree(work / "tree")
    archives = make_archives(tree, work)
    small = make_small_tar(work / f"small-{args.small_files}.tar", args.small_files)
    inputs = {**archives, "small": small, "count": f"{args.small_files:,}"}
    if "train" in sections:
        inputs["jpegs"] = jpeg_tar(work, args.jpegs)
    entry = pwd.getpwnam(args.user)
    for path in (work, *inputs.values()):
        if isinstance(path, Path):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    with usable_by_everyone(), debian_fuse_mode():
        stager = UserStager(work, args.user)
        try:
            if "ready" in sections:
                ready_section(work, stager, inputs, args.repeat)
            if "steps" in sections:
                steps_section(work, stager, inputs["tar"])
            if "evict" in sections:
                evict_section(stager, small, inputs["count"], args.repeat)
            if "train" in sections:
                train_section(work, stager, inputs["jpegs"], args.user, args.repeat)
        finally:
            stager.close()
            left = mount.mounts_under(str(work))
            unmount_under(work)
        print(f"\nFUSE mounts left after the daemon's stop: {len(left)}")
        if "tools" in sections:
            tars = {"20k files 4-100 KB": archives["tar"], f"{inputs['count']} x 512 B": small}
            tools_section(work, tars, args.repeat)
        if {"writer", "read"} & sections:
            images = writer_section(work, archives["tar"], args.repeat)
            if "read" in sections:
                read_section(work, images, args.user, args.repeat)
    print(f"\nload at the end {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(get_args_parser().parse_args()))
