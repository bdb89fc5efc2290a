"""The multi-node test cluster (deploy/slurm/multinode) from Python.

Brings it up and down under its lock, submits batch jobs, runs commands on a node
(inside its namespaces) and reads the bytes that left the shared storage, counted on
the storage side. Used by the multinode tests, ``bench/bench_fanout.py`` and
``make demo-multinode``. Needs root on a Debian machine (up.sh installs packages).
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "deploy" / "slurm" / "multinode"
LOCK = Path("/tmp/stager-multinode.lock")
ROOT = Path("/run/stager-mn")  # lib.sh's MN_ROOT default
PREFIX = "stmn"  # lib.sh's MN_PREFIX: every namespace and link of the cluster


UNFINISHED = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "?"}


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class StorageBytes:
    """Bytes that left the shared storage: file content its server read, and everything
    its link sent (content, protocol, metadata)."""

    content: int
    wire: int

    def __sub__(self, other: StorageBytes) -> StorageBytes:
        return StorageBytes(self.content - other.content, self.wire - other.wire)


@dataclass
class JobResult:
    job_id: str
    state: str
    exit_code: str
    output: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == "0:0"


class Cluster:
    """``with Cluster(nodes=4, rate="200mbit") as cluster: ...`` holds the cluster's lock
    from up to down, so no other run brings it down meanwhile."""

    def __init__(
        self,
        nodes: int = 4,
        rate: str = "200mbit",
        local_size: str = "2g",
        serve_args: str | None = None,
        python: str | None = None,
        node_service: bool = False,
        prestage: bool = False,
        plan_interval: int = 5,
    ) -> None:
        self.settings = {
            "MN_NODES": str(nodes),
            "MN_STORAGE_RATE": rate,
            "MN_LOCAL_SIZE": local_size,
            "MN_PYTHON": python or str(REPO / ".venv" / "bin" / "python"),
            # Each node's node service for every user (stager serve --multi-user, as root)
            # instead of per-user daemons started by the prolog.
            "MN_NODE_SERVICE": "1" if node_service or prestage else "0",
            # Pre-staging: the planner, job_submit.lua, backfill every plan_interval s,
            # node services taking the planner's orders (docs/prestaging.md).
            "MN_PRESTAGE": "1" if prestage else "0",
            "MN_PLAN_INTERVAL": str(plan_interval),
        }
        if serve_args is not None:
            self.settings["MN_SERVE_ARGS"] = serve_args
        self.values: dict[str, str] = {}
        self.namespaces: set[str] = set()  # "mnt:[inode]", "net:[inode]" of the cluster
        self._lock: int | None = None

    # ---- up and down -------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    def _script_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MN_", "SLURM_"))}
        env.update(self.settings, MN_LOCK_HELD="1")
        return env

    def up(self, timeout: float = 600) -> None:
        if os.geteuid() != 0:
            raise ClusterError("the multi-node cluster needs root (namespaces, mounts, slurmd)")
        self._lock = os.open(LOCK, os.O_WRONLY | os.O_CREAT, 0o644)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        result = subprocess.run(
            ["bash", str(SCRIPTS / "up.sh")],
            env=self._script_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            self.down()
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
            raise ClusterError(f"up.sh exited {result.returncode}:\n{tail}")
        self.values = _read_env(ROOT / "cluster.env")
        self.namespaces = _namespace_ids()

    def down(self) -> None:
        try:
            subprocess.run(
                ["bash", str(SCRIPTS / "down.sh"), "--quiet"],
                env=self._script_env(),
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            )
        finally:
            if self._lock is not None:
                os.close(self._lock)  # releases the flock
                self._lock = None

    # ---- what it is ---------------------------------------------------------------

    @property
    def nodes(self) -> list[str]:
        return self.values["MN_NODE_NAMES"].split()

    @property
    def storage_dir(self) -> Path:
        """Where shared data is put (from this machine); nodes see it under ``shared``."""
        return Path(self.values["MN_STORAGE_DIR"])

    def shared(self, path: Path) -> str:
        """The path under which every node reads ``path`` (inside ``storage_dir``)."""
        return str(Path(self.values["MN_SHARED"]) / path.relative_to(self.storage_dir))

    @property
    def jobs_dir(self) -> Path:
        return Path(self.values["MN_JOBS"])

    @property
    def bin_dir(self) -> Path:
        return Path(self.values["MN_BIN_DIR"])

    def env(self) -> dict[str, str]:
        """For slurm commands against this cluster (never the host's own cluster)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STAGER_"))}
        env["SLURM_CONF"] = self.values["SLURM_CONF"]
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    # ---- using it -------------------------------------------------------------------

    def sbatch(
        self,
        script: str,
        nodes: int,
        name: str,
        timeout: float = 300,
        extra: list[str] | None = None,
    ) -> JobResult:
        """Run ``script`` (bash) as a batch job on ``nodes`` nodes and wait for it;
        ``extra``: more sbatch flags. Its working folder is ``jobs_dir``."""
        return self.wait(self.submit(script, nodes, name, extra), name, timeout)

    def submit(
        self,
        script: str,
        nodes: int,
        name: str,
        extra: list[str] | None = None,
        header: str = "",
        runner: list[str] | None = None,
    ) -> str:
        """Submit without waiting; the job's id. ``header``: lines right after the
        shebang (``#SBATCH``, ``#STAGER``: only the comment block at the top counts);
        ``runner``: argv before ``sbatch`` (e.g. setpriv to submit as a user: a job
        root submits with ``--uid`` is root's submission to job_submit.lua)."""
        path = self.jobs_dir / f"{name}.sh"
        path.write_text("#!/bin/bash\n" + header + "set -euo pipefail\n" + script)
        path.chmod(0o644)
        submitted = subprocess.run(
            [
                *(runner or []),
                "sbatch",
                "--parsable",
                f"--nodes={nodes}",
                f"--output={self.jobs_dir / name}.out",
                f"--chdir={self.jobs_dir}",
                *(extra or []),
                str(path),
            ],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        job_id = submitted.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise ClusterError(f"sbatch failed: {submitted.stderr.strip()}")
        return job_id

    def wait(self, job_id: str, name: str, timeout: float = 300) -> JobResult:
        started = time.monotonic()
        # Polled here: sbatch --wait sleeps up to 10 s between its own polls.
        while (state := self._job_state(job_id))[0] in UNFINISHED:
            if time.monotonic() - started > timeout:
                subprocess.run(["scancel", job_id], env=self.env(), check=False)
                raise ClusterError(f"job {job_id} still {state[0]} after {timeout:.0f} s")
            time.sleep(0.2)
        out = self.jobs_dir / f"{name}.out"
        output = out.read_text() if out.exists() else ""
        return JobResult(job_id, state[0], state[1], output, time.monotonic() - started)

    def set_rate(self, rate: str) -> None:
        """Change the storage link's rate (both ends) while the cluster runs."""
        for prefix in (["tc", "-n", self.values["MN_STORAGE_NS"]], ["tc"]):
            dev = "eth0" if "-n" in prefix else f"{PREFIX}-vst"
            subprocess.run(
                [*prefix, "qdisc", "change", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", "256kb", "latency", "200ms"],
                check=True,
            )  # fmt: skip

    def _job_state(self, job_id: str) -> tuple[str, str]:
        shown = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job_id],
            env=self.env(),
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        state = re.search(r"JobState=(\S+)", shown)
        code = re.search(r"ExitCode=(\S+)", shown)
        return (state.group(1) if state else "?", code.group(1) if code else "?")

    def planner(self, action: str) -> str:
        """``start``, ``stop``, ``restart`` or ``status`` the pre-staging planner
        (deploy/slurm/multinode/planner.sh; a cluster brought up with ``prestage``)."""
        return self._script("planner.sh", action)

    def node_service(self, index: int, action: str) -> None:
        """``stop`` or ``start`` node ``index``'s node service (node-service.sh)."""
        self._script("node-service.sh", str(index), action)

    def restart_slurmctld(self) -> None:
        """Restart slurmctld, keeping its state (slurmctld.sh)."""
        self._script("slurmctld.sh", "restart")

    def _script(self, script: str, *args: str) -> str:
        done = subprocess.run(
            ["bash", str(SCRIPTS / script), *args],
            env=self._script_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise ClusterError(f"{script} {' '.join(args)}: {done.stderr.strip() or done.stdout}")
        return done.stdout.strip()

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (the last value of each; values with spaces
        cut at the first space, which the fields read here never have)."""
        shown = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job_id],
            env=self.env(),
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return dict(re.findall(r"(?:^|\s)([A-Za-z:/]+)=(\S*)", shown))

    def node_info(self, node: str) -> dict[str, str]:
        """``scontrol show node``'s fields (as ``job``)."""
        shown = subprocess.run(
            ["scontrol", "show", "node", "--oneliner", node],
            env=self.env(),
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return dict(re.findall(r"(?:^|\s)([A-Za-z:/]+)=(\S*)", shown))

    def node_metrics(self, index: int) -> str:
        """Node ``index``'s node service's Prometheus text (its socket, as root)."""
        sock = Path(self.values["MN_ROOT"]) / "private" / "stager-node" / "stager.sock"
        return self.on_node(index, f"curl -sf --unix-socket {sock} http://stager/metrics")

    def on_node(self, index: int, command: str, check: bool = True) -> str:
        """Run a shell command inside node ``index``'s namespaces (its /tmp, its network)."""
        result = subprocess.run(
            ["bash", str(SCRIPTS / "on-node.sh"), str(index), "bash", "-c", command],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and result.returncode != 0:
            raise ClusterError(
                f"on node {index}: `{command}` exited {result.returncode}: {result.stderr.strip()}"
            )
        return result.stdout

    def storage(self, settle_s: float = 1.0, timeout: float = 30.0) -> StorageBytes:
        """The bytes that have left the storage so far, once they stop changing: the
        server logs a file's bytes when the client closes it, and a FUSE client
        (sshfs) closes a file a moment after the job's own close, so a count taken at
        once can miss a job's last files and charge them to the next one."""
        last = self._storage_now()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(settle_s)
            now = self._storage_now()
            if now.content == last.content:
                return now
            last = now
        return last

    def _storage_now(self) -> StorageBytes:
        out = subprocess.run(
            ["bash", str(SCRIPTS / "storage-bytes.sh")],
            env=self.env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        values = dict(item.split("=") for item in out.split())
        return StorageBytes(int(values["content_bytes"]), int(values["wire_bytes"]))


def fresh_copy(source: Path, tag: str) -> Path:
    """The same data under a new path, as hard links: a new cache key, so a job on it
    starts from empty caches. (Not a new mtime: nodes may keep a file's old attributes
    for a while, as NFS clients do, and would see other sources than their peers.)"""
    copy = source.with_name(f"{tag}-{source.name}")
    if source.is_dir():
        subprocess.run(["cp", "-al", str(source), str(copy)], check=True)
    else:
        os.link(source, copy)
    return copy


def _read_env(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        if re.match(r"^[A-Z_]+=", line):
            key, _, raw = line.partition("=")
            values[key] = " ".join(shlex.split(raw))
    return values


def _namespace_ids() -> set[str]:
    """The cluster's namespaces as /proc/PID/ns links name them."""
    ids = set()
    for kind, folder in (("mnt", ROOT / "ns"), ("net", Path("/run/netns"))):
        for path in folder.glob("*"):
            if kind == "mnt" or path.name.startswith(PREFIX):
                ids.add(f"{kind}:[{os.stat(path).st_ino}]")
    return ids


def leftovers(namespaces: set[str] = frozenset()) -> list[str]:
    """What a taken-down cluster must not leave: namespaces, links, mounts, folders,
    and processes inside any of them (``namespaces``: recorded while it was up)."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"netns {n.split()[0]}" for n in netns.splitlines() if n.startswith(PREFIX)]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(": ")[1].split("@")[0]
        if name.startswith(PREFIX):
            found.append(f"link {name}")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point.startswith(str(ROOT)) or "stager-mn" in point:
            found.append(f"mount {point}")
    for folder in (ROOT, Path("/var/tmp/stager-mn-storage")):
        if folder.exists():
            found.append(f"folder {folder}")
    found += [f"process {p}" for p in _processes_in(namespaces, str(ROOT))]
    return found


def _processes_in(namespaces: set[str], marker: str) -> list[str]:
    """Processes inside one of ``namespaces``, or whose command line names ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            inside = {os.readlink(f"/proc/{pid}/ns/{kind}") for kind in ("mnt", "net")}
        except OSError:
            continue
        if (inside & namespaces or marker in cmdline) and int(pid) != os.getpid():
            found.append(f"{pid} {cmdline.strip()[:120]}")
    return found
