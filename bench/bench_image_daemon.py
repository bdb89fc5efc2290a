"""Benchmark: image datasets through a real daemon, against what a user would run instead.

    python -m bench.bench_image_daemon [--work-dir /var/tmp/stager-bench-image]
        [--repeat 3] [--small-files 1000000] [--url-rate 50e6]
        [--sections ready,prebuilt,url,evict,hit,trainer]

- **ready**: request to ready (``POST /v1/datasets`` with ``"image": true``, then
  ``GET .../wait``) on a real daemon whose cache is on the work folder's disk, against
  the one-file copy to the same disk a user would make instead, made durable as the
  daemon's image is (``cp`` or ``zcat > file``, then an fsync of the copy): the
  20,000 files of 4-100 KB from a ``.tar`` and a ``.tar.gz``, ``--small-files`` files
  of 512 B from a ``.tar``. The dataset is evicted (DELETE) between runs; runs
  alternate (A B A B ...), medians and the pairwise ratios are printed.
- **prebuilt**: a prebuilt image of the 20,000 (a step ``image``), its sha256 pinned
  and not, against ``cp`` of that image (made durable), alternated the same way.
- **url**: the 20,000 files' ``.tar.gz`` served over HTTP (a local server, throttled
  to ``--url-rate`` bytes/s): an image dataset of its URL, built as it downloads,
  against ``curl -o`` of the archive (made durable), alternated the same way.
- **index**: the same from the plain ``.tar`` inputs on a second daemon with
  ``STAGER_IMAGE_INDEX`` (and file-backed mounts): an index image and its blob
  (:mod:`stager.image.index`), alternated with the ordinary daemon's image and ``cp``;
  and the ``DELETE`` of each (unmount, delete the image and the blob).
- **evict**: ``DELETE`` of a ready ``--small-files``-file image dataset (unmount and
  delete one file), the request's round trip.
- **hit**: the round trip of a request that hits (``POST``, 200 ready), for the image
  dataset and for the same 20,000 files staged as a tree (after the tree's first,
  full check: later hits need no walk); p50 and p99 of ``--hits`` requests each.
- **trainer**: ``stager-train``'s input pipeline (``--pipeline fast``: decode,
  crop, flip, collate by ``--workers`` DataLoader processes) reading the same JPEGs
  (bench/input_pipeline.py's) from a mounted image and from the tree, images/s,
  alternated, median of ``--repeat``.

The load average is printed before and after each section: the machine is shared.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.bench_image import _fsync_path, alternate, row
from bench.datagen import make_archives, make_small_tar, make_tree
from stager.image import mount
from stager.image.build import build_image
from tests.daemon import Daemon, unmount_under


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/var/tmp/stager-bench-image"))
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per candidate")
    parser.add_argument("--small-files", type=int, default=1_000_000)
    parser.add_argument("--hits", type=int, default=200, help="hit requests timed per kind")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader processes")
    parser.add_argument("--sections", default="ready,prebuilt,url,evict,hit,trainer")
    parser.add_argument(
        "--url-rate", type=float, default=50e6, help="the url section's server, bytes/s"
    )
    return parser


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


class Stager:
    """A real daemon with its cache under the work folder."""

    def __init__(self, work: Path, cache: str = "cache", env: dict[str, str] | None = None) -> None:
        shutil.rmtree(work / cache, ignore_errors=True)
        env = {"STAGER_LOG_LEVEL": "warning", **(env or {})}
        self.daemon = Daemon(cache_dir=work / cache, extra_env=env)
        self.daemon.start()

    def ready(self, body: dict) -> tuple[float, dict]:
        with self.daemon.client(timeout=3600) as client:
            start = time.perf_counter()
            response = client.post("/v1/datasets", json=body)
            response.raise_for_status()
            status = client.get(
                f"/v1/datasets/{body['name']}/wait", params={"timeout": 3600}
            ).json()
            elapsed = time.perf_counter() - start
        if status["state"] != "ready":
            raise RuntimeError(f"{body['name']}: {status['error']}")
        return elapsed, status

    def delete(self, name: str) -> float:
        with self.daemon.client(timeout=3600) as client:
            start = time.perf_counter()
            client.delete(f"/v1/datasets/{name}").raise_for_status()
            return time.perf_counter() - start

    def close(self) -> None:
        self.daemon.stop(timeout=120)
        self.daemon.cleanup()


def staged(stager: Stager, body: dict) -> Callable[[], float]:
    def run() -> float:
        elapsed, _ = stager.ready(body)
        stager.delete(body["name"])
        return elapsed

    return run


def copied(argv: list[str], output: Path, to_stdout: bool = False) -> Callable[[], float]:
    def run() -> float:
        output.unlink(missing_ok=True)
        start = time.perf_counter()
        if to_stdout:
            with open(output, "wb") as out:
                subprocess.run(argv, stdout=out, check=True)
        else:
            subprocess.run([*argv, str(output)], check=True)
        _fsync_path(output)
        return time.perf_counter() - start

    return run


def extract(src: Path) -> dict:
    return {"op": "extract", "src": str(src)}


def ready_section(work: Path, stager: Stager, inputs: dict[str, Path], repeat: int) -> None:
    cases = (
        (
            "20k files 4-100 KB, .tar vs cp",
            extract(inputs["tar"]),
            ["cp", str(inputs["tar"])],
            False,
        ),
        (
            "20k files 4-100 KB, .tar.gz vs zcat > file",
            extract(inputs["tar.gz"]),
            ["zcat", str(inputs["tar.gz"])],
            True,
        ),
        (
            f"{inputs['count']} files of 512 B, .tar vs cp",
            extract(inputs["small"]),
            ["cp", str(inputs["small"])],
            False,
        ),
    )
    _timed_cases("Request to ready through the daemon (durable)", work, stager, cases, repeat)


def prebuilt_section(work: Path, stager: Stager, inputs: dict[str, Path], repeat: int) -> None:
    prebuilt = inputs["prebuilt"]
    sha = hashlib.sha256(prebuilt.read_bytes()).hexdigest()
    cases = (
        (
            "prebuilt image of the 20k files, sha256 pinned, vs cp of the image",
            {"op": "image", "src": str(prebuilt), "sha256": sha},
            ["cp", str(prebuilt)],
            False,
        ),
        (
            "the same, no sha256 (a user's own daemon) vs cp of the image",
            {"op": "image", "src": str(prebuilt)},
            ["cp", str(prebuilt)],
            False,
        ),
    )
    _timed_cases("A prebuilt image through the daemon (durable)", work, stager, cases, repeat)


def url_section(
    work: Path, stager: Stager, inputs: dict[str, Path], repeat: int, rate: float
) -> None:
    """The 20k files' .tar.gz served over HTTP at ``rate`` bytes/s: an image dataset of
    its URL (built as it downloads) against ``curl -o`` of it (made durable)."""
    from tests.httpserver import Behaviour, serve_files

    archive = inputs["tar.gz"]
    behaviour = Behaviour(files={"/a.tar.gz": archive.read_bytes()}, bytes_per_s=rate)
    with serve_files(behaviour) as base:
        url = f"{base}/a.tar.gz"
        cases = (
            (
                f"20k files 4-100 KB, .tar.gz over HTTP at {rate / 1e6:.0f} MB/s vs curl -o",
                {"op": "extract", "src": url},
                ["curl", "-sS", url, "-o"],
                False,
            ),
        )
        _timed_cases("An image of a URL through the daemon (durable)", work, stager, cases, repeat)


def _timed_cases(
    title: str,
    work: Path,
    stager: Stager,
    cases: tuple[tuple[str, dict, list[str], bool], ...],
    repeat: int,
) -> None:
    """Each case's request to ready, alternated with its baseline copy (made durable)."""
    print(f"\n## {title}, load {load()}\n")
    print("| case | image dataset | baseline | ratio (median; pairwise range) |")
    print("|---|---:|---:|---:|")
    copy = work / "copy.bin"
    for label, step, baseline, to_stdout in cases:
        body = {"name": "b", "steps": [step], "image": True}
        times = alternate(
            {"image": staged(stager, body), "base": copied(baseline, copy, to_stdout)}, repeat
        )
        print(row(label, times, "image", "base"))
        sys.stdout.flush()
    copy.unlink(missing_ok=True)


def evict_section(stager: Stager, small: Path, count: str, repeat: int) -> None:
    print(f"\n## Eviction of a {count}-file image dataset (DELETE), load {load()}\n")
    times = []
    for _ in range(repeat):
        _, status = stager.ready({"name": "e", "steps": [extract(small)], "image": True})
        with open(Path(status["path"]) / "data" / "class_0000" / "img_0000000.jpg", "rb") as f:
            f.read()  # read once, as a job would have
        times.append(stager.delete("e"))
    print("| | seconds |")
    print("|---|---:|")
    median = statistics.median(times)
    label = f"DELETE, unmount + delete one file (median of {repeat})"
    print(f"| {label} | {median:.3f} ({min(times):.3f}-{max(times):.3f}) |")


def hit_section(stager: Stager, tar: Path, hits: int) -> None:
    print(f"\n## A hit's round trip, 20k files, image vs tree, load {load()}\n")
    print("| dataset | p50 | p99 |")
    print("|---|---:|---:|")
    for label, body in (
        ("image", {"name": "hi", "steps": [extract(tar)], "image": True}),
        ("tree", {"name": "ht", "steps": [extract(tar)]}),
    ):
        stager.ready(body)
        samples = []
        with stager.daemon.client() as client:
            client.post("/v1/datasets", json=body).raise_for_status()  # the tree's full check
            for _ in range(hits):
                start = time.perf_counter()
                response = client.post("/v1/datasets", json=body)
                samples.append((time.perf_counter() - start) * 1000)
                assert response.status_code == 200, response.text
        samples.sort()
        p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
        print(f"| {label} | {statistics.median(samples):.2f} ms | {p99:.2f} ms |")
        stager.delete(body["name"])


def trainer_section(work: Path, repeat: int, workers: int) -> None:
    from bench.input_pipeline import end_to_end, make_jpegs, trainer_pipeline

    print(f"\n## Trainer input pipeline (--pipeline fast, {workers} workers), load {load()}\n")
    root = make_jpegs(work / "jpegs", 3000)
    image = work / "jpegs.erofs"
    if not image.exists():
        build_image(str(root), str(image))
    target = work / "mnt-jpegs"
    target.mkdir(exist_ok=True)
    mount.mount_kernel(str(image), str(target))
    try:

        def rate(at: Path) -> Callable[[], float]:
            return lambda: end_to_end(trainer_pipeline, at, 1536, 64, workers, 224)

        rates = alternate({"image": rate(target), "tree": rate(root)}, repeat)
    finally:
        mount.unmount(str(target))
    img, tree = statistics.median(rates["image"]), statistics.median(rates["tree"])
    print("| read from | images/s (median) | runs |")
    print("|---|---:|---|")
    print(f"| mounted image | {img:.0f} | {', '.join(f'{r:.0f}' for r in rates['image'])} |")
    print(f"| tree | {tree:.0f} | {', '.join(f'{r:.0f}' for r in rates['tree'])} |")
    print(f"\nimage / tree: {img / tree:.3f}")


def index_section(work: Path, stager: Stager, inputs: dict[str, Path], repeat: int) -> None:
    print(f"\n## Index images through the daemon (durable), load {load()}\n")
    print("| case | candidate | baseline | ratio (median; pairwise range) |")
    print("|---|---:|---:|---:|")
    env = {"STAGER_IMAGE_INDEX": "true", "STAGER_IMAGE_BACKING": "file"}
    indexer = Stager(work, "cache-index", env)
    copy = work / "copy.bin"
    try:
        for label, tar in (
            ("20k files 4-100 KB, .tar", inputs["tar"]),
            (f"{inputs['count']} files of 512 B, .tar", inputs["small"]),
        ):
            body = {"name": "b", "steps": [extract(tar)], "image": True}
            evictions: list[float] = []

            def indexed(body: dict = body, evictions: list[float] = evictions) -> float:
                elapsed, _ = indexer.ready(body)
                evictions.append(indexer.delete(body["name"]))  # image and blob
                return elapsed

            times = alternate(
                {
                    "index": indexed,
                    "image": staged(stager, body),
                    "cp": copied(["cp", str(tar)], copy),
                },
                repeat,
            )
            print(row(f"{label}: index image vs cp", times, "index", "cp"))
            print(row(f"{label}: ordinary image vs cp", times, "image", "cp"))
            print(
                f"| {label}: DELETE of the index image and its blob | "
                f"{statistics.median(evictions):.3f} s (median of {len(evictions)}) | | |"
            )
            sys.stdout.flush()
    finally:
        indexer.close()
        copy.unlink(missing_ok=True)


def main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("bench_image_daemon: kernel mounts need root", file=sys.stderr)
        return 2
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# bench_image_daemon, {now}, load {load()}")
    sections = set(args.sections.split(","))
    tree = make_tree(work / "tree")
    archives = make_archives(tree, work)
    small = make_small_tar(work / f"small-{args.small_files}.tar", args.small_files)
    count = f"{args.small_files:,}"
    prebuilt = work / "tree.erofs"
    if not prebuilt.exists():
        build_image(str(tree), str(prebuilt))
    inputs = {**archives, "small": small, "count": count, "prebuilt": prebuilt}
    stager = Stager(work)
    try:
        if "ready" in sections:
            ready_section(work, stager, inputs, args.repeat)
        if "prebuilt" in sections:
            prebuilt_section(work, stager, inputs, args.repeat)
        if "url" in sections:
            url_section(work, stager, inputs, args.repeat, args.url_rate)
        if "index" in sections:
            index_section(work, stager, inputs, args.repeat)
        if "evict" in sections:
            evict_section(stager, small, count, args.repeat)
        if "hit" in sections:
            hit_section(stager, archives["tar"], args.hits)
    finally:
        stager.close()
        unmount_under(work)
    if "trainer" in sections:
        trainer_section(work, args.repeat, args.workers)
    print(f"\nload at the end {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(get_args_parser().parse_args()))
