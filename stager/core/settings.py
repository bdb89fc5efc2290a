"""The daemon's one settings object, built once from flags and ``STAGER_*`` env.

Nothing else in the daemon reads ``os.environ``: the CLI builds ``Settings`` and
passes it down.

Each field declares its flag (its name with dashes, unless ``flag=``), and its
environment variable is ``STAGER_`` plus the flag's name. ``stager serve``'s flags,
the environment read and docs/settings.md's table are derived from the fields
(``cli_flags``, ``env_name``, ``settings_table``), so they cannot drift apart. A
variable's earlier name still works, and ``Settings.renamed`` says which were used.

Lists take commas (a JSON list still works), sizes take units (``10G``, ``500MiB``).
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BeforeValidator,
    ByteSize,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

PREFIX = "STAGER_"


def default_runtime_dir() -> Path:
    """Per-user folder for socket, pid, log, token: ``${XDG_RUNTIME_DIR:-/tmp}/stager-$UID``."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"stager-{os.getuid()}"


# The node service's places (stager serve --multi-user), unless given.
NODE_RUNTIME_DIR = Path("/run/stager")
NODE_CACHE_DIR = Path("/var/cache/stager")


def default_cache_dir() -> Path:
    # Node-local by default: /tmp is local disk on every cluster we target.
    return Path("/tmp") / f"stager-{os.getuid()}" / "cache"


# ---- value types that read the same from a flag and from the environment -------------


def _size(value: Any) -> Any:
    """``10G``, ``500 MiB``, ``1.5T``, ``0`` or a plain count of bytes (pydantic's
    ByteSize: K, M, G, T are powers of 1000; KiB, MiB, GiB, TiB of 1024)."""
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        if text.isdigit():
            return int(text)
        try:
            return int(_BYTE_SIZE.validate_python(text))
        except ValidationError as exc:
            raise ValueError(
                f"{value!r} is not a size; give bytes or a number with a unit, "
                "e.g. 10G, 500M, 1.5TiB"
            ) from exc
    return value


_BYTE_SIZE = TypeAdapter(ByteSize)
# A number of bytes, written with or without a unit; an int for the code that uses it.
Size = Annotated[int, BeforeValidator(_size)]


def _comma_list(value: Any) -> Any:
    """``a,b`` (and ``["a", "b"]``, the JSON form earlier releases asked for) -> a list;
    each item of a list given as flags is split at commas too."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{value!r} is not a JSON list; give items separated by commas"
                ) from exc
        return [item.strip() for item in text.split(",") if item.strip()]
    if isinstance(value, list | tuple):
        return [part for item in value for part in _comma_list(str(item))]
    return value


def CommaList(item: Any) -> Any:  # noqa: N802 - used as a type: CommaList(Path)
    """A list setting: repeat its flag or separate items with commas."""
    return Annotated[list[item], BeforeValidator(_comma_list)]


def format_size(nbytes: int) -> str:
    """``161597160`` -> ``154.1 MiB``: how sizes are printed back to people."""
    return re.sub(r"(?<=\d)(?=[A-Za-z])", " ", ByteSize(nbytes).human_readable())


# The prefetch port's default. It is below 1024 (privileged: only root binds it) so that
# no user can listen there while the node service is down or restarting, and be sent the
# planner's orders and copy credentials (docs/prestaging.md, "Threats on the port").
DEFAULT_PREFETCH_PORT = 866
PRIVILEGED_BELOW = 1024


def setting(
    default: Any = None,
    *,
    factory: Any = None,
    help: str,  # noqa: A002 - argparse's word for it
    flag: str | None = None,
    cli: tuple[str, ...] = ("serve",),
    aliases: tuple[str, ...] = (),
    default_text: str | None = None,
    **constraints: Any,
) -> Any:
    """A settings field with its flag's name and help. ``cli``: the ``stager`` commands
    that take it as a flag (none: it is set in the environment only).
    ``aliases``: other flag spellings accepted (an older or singular form)."""
    extra = {"flag": flag, "cli": cli, "aliases": list(aliases), "default_text": default_text}
    if factory is not None:
        return Field(
            default_factory=factory, description=help, json_schema_extra=extra, **constraints
        )
    return Field(default, description=help, json_schema_extra=extra, **constraints)


# Commands whose flags find a daemon: where it listens and in which mode.
LOCATION = ("serve", "stop", "gc")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore")

    # ---- where it lives and how it is reached ----
    multi_user: bool = setting(
        False,
        cli=LOCATION,
        help="the node service for every user (as root, from systemd or the SLURM prolog): "
        "one Unix socket anyone may connect to (default /run/stager/stager.sock), each "
        "caller known by the kernel, sources read with the caller's rights, data everyone "
        "may read shared, the rest private (docs/multiuser.md); cache default "
        "/var/cache/stager",
    )
    runtime_dir: Path = setting(
        factory=default_runtime_dir,
        cli=LOCATION,
        default_text="${XDG_RUNTIME_DIR:-/tmp}/stager-$UID (node service: /run/stager)",
        help="folder of socket, pid, log, token",
    )
    socket: Path | None = setting(
        cli=LOCATION, default_text="<runtime-dir>/stager.sock", help="Unix socket path"
    )
    cache_dir: Path = setting(
        factory=default_cache_dir,
        default_text="/tmp/stager-$UID/cache (node service: /var/cache/stager)",
        help="node-local cache root (data, partial stagings, state.db): keep it on local disk",
    )
    host: str | None = setting(help="serve TCP on this address instead of the Unix socket")
    port: int = setting(8765, help="TCP port")
    token: str | None = setting(default_text="generated, stored 0600", help="bearer token for TCP")
    token_file: Path | None = setting(
        default_text="<runtime-dir>/token", help="where the TCP token is read or stored"
    )
    no_token: bool = setting(False, help="serve TCP without a token (loopback addresses only)")

    # ---- how much it does at once ----
    max_workers: int = setting(2, ge=1, help="datasets staged at once")
    op_workers: int = setting(
        8,
        ge=1,
        help="worker processes one operation may use for per-file work: copy, link, extract, "
        "seal (capped at the CPU cores; a copy from a network filesystem runs up to 8 at "
        "once whatever the cores, its time being round trips)",
    )
    staging_nice: int = setting(
        10, ge=0, le=19, cli=(), help="CPU priority (nice) of staging processes"
    )

    # ---- what it may read ----
    allowed_roots: CommaList(Path) = setting(
        factory=list,
        aliases=("--allowed-root",),
        default_text="any readable source",
        help="only stage sources under these folders",
    )
    recipe_dirs: CommaList(Path) = setting(
        factory=list,
        cli=("serve", "recipes"),
        aliases=("--recipe-dir",),
        default_text="none",
        help="also read recipe files (*.toml) from these folders (docs/recipes.md)",
    )
    cluster_storage_dirs: CommaList(Path) = setting(
        factory=list,
        aliases=("--cluster-storage-dir",),
        default_text="network filesystems only",
        help="node service: folders that hold the same files on every node, besides "
        "network filesystems (found by their type): a fan-out's vouched copy of a dataset "
        "read from there is shared between users; from anywhere else, it stays its user's",
    )
    trusted_image_dirs: CommaList(Path) = setting(
        factory=list,
        aliases=("--trusted-image-dir",),
        default_text="none",
        help="node service: folders of prebuilt images (stager image build) that requests "
        "may stage with their sha256 pinned; the folders and images must be writable by "
        "root alone (a user's own image file is never mounted in the kernel)",
    )
    image_backing: Literal["loop", "file"] = setting(
        "file",
        help="how the kernel mounts an image: EROFS straight from the file (Linux 6.12+; an "
        "older kernel gets a loop device), or through a read-only loop device; a user's own "
        "image in the node service is mounted from its file wherever the kernel can (a loop "
        "device's size is every user's to read)",
    )
    image_index: bool = setting(
        False,
        help="node service: an image staged from one plain .tar is an index image: the tar "
        "copied whole beside it and its files read from there (issue 31: ready in about "
        "the time of cp); needs Linux 6.12+ with image-backing file, or loop devices",
    )
    op_modules: CommaList(str) = setting(
        factory=list, cli=(), default_text="none", help="Python modules that add ops (OPS)"
    )

    # ---- the cache's size ----
    capacity_bytes: Size = setting(
        0,
        ge=0,
        default_text="0: the disk's size",
        help="cache size limit, e.g. 800G; least recently used datasets are evicted beyond it",
    )
    min_free_bytes: Size = setting(
        1 << 30, ge=0, default_text="1GiB", help="free space to keep on the cache disk, e.g. 10G"
    )
    user_quota_bytes: Size = setting(
        0,
        ge=0,
        le=2**62,
        flag="user-quota",
        default_text="0: no limit",
        help="node service: bytes of data only its user may read that one user may hold, "
        "e.g. 200G; data every user may read is shared and counts against nobody",
    )
    # Inodes (folders, files, links: an archive of empty ones costs names, not bytes),
    # counted as a staging makes them (stager.wire.progress.report_written), as bytes are.
    user_inode_quota: int = setting(
        0,
        ge=0,
        le=2**62,
        default_text="0: no limit",
        help="node service: files, folders and links of data only its user may read that "
        "one user may hold, e.g. 5000000 (an image counts as one)",
    )
    min_free_inodes: int = setting(
        100_000,
        ge=0,
        le=2**62,
        help="free inodes to keep on the cache disk (a disk that reports none, as btrfs "
        "does, has no floor)",
    )

    # ---- timings ----
    # Generous: one huge file may be hashed in silence.
    stall_timeout_s: float = setting(
        900.0,
        ge=0,
        flag="stall-timeout",
        help="seconds: fail a staging whose progress has not moved this long, e.g. on a hung "
        "network filesystem (0: never)",
    )
    min_download_rate: Size = setting(
        10 * 1024,
        ge=0,
        default_text="10KiB",
        help="bytes a second, e.g. 10KiB: fail a download slower than this over "
        "--download-rate-window once its bytes have begun to arrive, as a server trickling "
        "bytes would hold a staging slot for ever (0: no minimum)",
    )
    download_rate_window_s: float = setting(
        60.0,
        gt=0,
        flag="download-rate-window",
        help="seconds over which a download's rate is measured against --min-download-rate",
    )
    cancel_grace_s: float = setting(
        3.0,
        gt=0,
        flag="cancel-grace",
        help="seconds a cancelled staging may take to stop before its process is ended",
    )
    sweep_interval_s: float = setting(
        30.0, gt=0, cli=(), help="seconds between sweeps: lease expiry, capacity"
    )
    progress_flush_s: float = setting(
        1.0, gt=0, cli=(), help="seconds between writes of progress to the state store"
    )
    # How often at most one entry's last use (LRU order) is written to the store: a
    # cache hit then costs no write, and a crash leaves eviction order this stale.
    recency_persist_s: float = setting(
        30.0, ge=0, cli=(), help="seconds: how stale a crash may leave the LRU order"
    )
    shutdown_timeout_s: float = setting(
        5.0, gt=0, cli=(), help="seconds a stop waits for open requests and stagings"
    )

    # ---- the log ----
    log_level: Literal["debug", "info", "warning", "error"] = setting(
        "info", help="the least important log lines written"
    )
    log_format: Literal["text", "json"] = setting(
        "text",
        help="text: a timestamped line each; json: one JSON object a line, for journald's "
        "and log shippers' parsers (docs/logging.md)",
    )

    # ---- connections (stager.api.connections): each holds a file descriptor until it closes ----
    max_connections: int = setting(
        1024,
        ge=1,
        help="connections open at once, every user's together (past it: 503); in the node "
        "service root's are not counted, so the epilog and admins always get in; lowered to "
        "fit the daemon's file descriptors, whose soft limit is raised to the hard one",
    )
    max_connections_per_user: int = setting(
        64, ge=1, help="node service: connections one user may hold at once (past it: 503)"
    )
    connection_reserve: int = setting(
        128,
        ge=0,
        help="node service: the last this many places of --max-connections go only to users "
        "who hold fewer than 4 connections, so that users holding many cannot take them all",
    )
    header_timeout_s: float = setting(
        10.0,
        gt=0,
        flag="header-timeout",
        help="seconds a request's head may take to arrive, from connecting or from its first "
        "byte (and, on the prefetch port, its body after it); past it the connection is "
        "answered 408 and closed",
    )
    keep_alive_timeout_s: float = setting(
        5.0,
        gt=0,
        flag="keep-alive-timeout",
        help="seconds a connection may stay idle between requests before it is closed",
    )
    max_body_bytes: Size = setting(
        1 << 20,
        ge=0,
        default_text="1MiB",
        help="largest request body, e.g. 1M; a larger one is answered 413 without being read",
    )

    # ---- the node service ----
    max_stagings_per_user: int = setting(
        0,
        ge=0,
        default_text="0: all slots but one",
        help="node service: the most stagings one user runs at once, so that another user "
        "always finds a slot",
    )
    max_queued_per_user: int = setting(
        64, ge=1, help="node service: the most stagings one user may queue (past it: 429)"
    )
    user_process_timeout_s: float = setting(
        60.0,
        gt=0,
        cli=(),
        help="node service: seconds a request's checks may take in the process that became "
        "its user (a source on a hung filesystem) before the request fails",
    )
    munge_socket: Path | None = setting(
        cli=(), default_text="munge's own", help="munged's socket (node service, fan-out)"
    )
    # ---- prefetches: pre-staging's node side (stager.prestage.prefetch, docs/prestaging.md) ----
    slurm_user: str = setting(
        "root",
        cli=(),
        help="node service: the user (SlurmUser) whose MUNGE credentials may order "
        "prefetches, besides root; the planner runs as root or this user",
    )
    node_name: str | None = setting(
        cli=(),
        default_text="the host name's first label",
        help="node service: this node's name as Slurm knows it, which a prefetch must name",
    )
    prefetch_credential_ttl_s: int = setting(
        300,
        ge=1,
        le=3600,
        cli=(),
        help="node service: the longest time to live a prefetch's MUNGE credential may have; "
        "the planner gives its credentials this one",
    )
    prefetch_user_budget_bytes: Size = setting(
        256 * 2**30,
        ge=0,
        le=2**62,
        cli=(),
        help="node service: bytes one user may have prefetched for jobs not started yet",
    )
    prefetch_node_budget_bytes: Size = setting(
        1024 * 2**30,
        ge=0,
        le=2**62,
        cli=(),
        help="node service: bytes prefetched for jobs not started yet, all users together",
    )
    prefetch_listen: str | None = setting(
        default_text="off",
        help="node service: also listen on ADDR:PORT (TCP) for the planner's prefetch "
        "orders, and for nothing else (POST /v1/prefetches with a MUNGE credential of root "
        "or SlurmUser; GET /v1/copies, another planned node's copy, with the planner's copy "
        "credential), e.g. 0.0.0.0:866; the port must be below 1024 (only root binds it)",
    )
    prefetch_max_connections_per_address: int = setting(
        32,
        ge=1,
        help="node service: connections one source address may hold at once on the prefetch "
        "port (--prefetch-listen), of its 64 (past it: 503); keep it at least the planner's "
        "32 sends at once. When all 64 are taken, a newcomer takes the place of a connection "
        "whose request is not yet whole, of the address holding the most",
    )
    prefetch_max_running: int = setting(
        1,
        ge=1,
        cli=(),
        help="node service: the most prefetches staging at once, so that a burst of them "
        "leaves the other slots (--max-workers) to running jobs' requests",
    )
    prefetch_expire_s: float = setting(
        6 * 3600.0,
        gt=0,
        cli=(),
        help="node service: seconds a prefetch its job has not used is kept; then it is "
        "dropped and its bytes counted as wasted; the planner: a node silent that long "
        "holds none of its prefetches, and its cancels are dropped (make them the same)",
    )
    prefetch_slot_s: float = setting(
        1800.0,
        gt=0,
        cli=(),
        help="node service: seconds a prefetch may hold a prefetch slot "
        "(STAGER_PREFETCH_MAX_RUNNING) while another user's prefetch waits for one; then "
        "it is ended (counted as wasted) and its job stages at its start; make it the "
        "planner's STAGER_PLAN_HORIZON",
    )
    prefetch_copy_wait_s: float = setting(
        3600.0,
        gt=0,
        le=7 * 86400,  # the copy step's bound, as any transfer's (wire.schemas)
        cli=(),
        help="node service: seconds a copy from another planned node waits for that node's "
        "answer, which comes once it packed its ready tree (one not ready there is answered "
        "at once: the planner orders a copy only once its source said ready)",
    )
    prefetch_copy_send_timeout_s: float = setting(
        60.0,
        gt=0,
        cli=(),
        help="node service: seconds a copy sent to another planned node may go without that "
        "node taking a byte; then it is cut off (a receiver gives up after 60 s of silence)",
    )
    # ---- placement: node features for the data held here (stager.prestage.placement) ----
    slurm_node_features: bool = setting(
        False,
        cli=(),
        help="node service: keep a Slurm node feature (stg_...) on this node for each "
        "declared dataset it holds ready, which job_submit.lua makes jobs declaring it "
        "prefer (docs/prestaging.md; needs scontrol, run as root or SlurmUser)",
    )
    slurm_node_features_max: int = setting(
        16,
        ge=0,
        le=256,
        cli=(),
        help="node service: the most stg_ features kept on this node (the most recently "
        "used datasets)",
    )
    slurm_node_features_per_user: int = setting(
        4,
        ge=1,
        le=256,
        cli=(),
        help="node service: the most stg_ features one user's requests keep on this node",
    )
    slurm_node_features_period_s: float = setting(
        300.0,
        gt=0,
        cli=(),
        help="node service: seconds between checks that Slurm still has this node's stg_ "
        "features (one `scontrol show node` each; a reconfigure or restart drops them)",
    )
    # ---- the planner (stager plan, controller side; docs/prestaging.md) ----
    plan_horizon_s: float = setting(
        1800.0,
        gt=0,
        cli=("plan",),
        flag="plan-horizon",
        help="planner: pre-stage a pending job's data when Slurm plans its start within "
        "this many seconds",
    )
    plan_interval_s: float = setting(
        30.0,
        gt=0,
        cli=("plan",),
        flag="plan-interval",
        help="planner: seconds between its intervals (one squeue call each); make it "
        "slurm.conf's bf_interval (default 30), how often Slurm's plan can change",
    )
    plan_job_targets_max: int = setting(
        256,
        ge=1,
        cli=("plan",),
        flag="plan-job-targets-max",
        help="planner: the most prefetches (planned node x declared dataset) of one job; "
        "the rest (further nodes) are left out, logged once per job, and stage at the "
        "job's start, so that one wide job costs the planner and the nodes a bounded amount",
    )
    plan_orders_per_interval: int = setting(
        1000,
        ge=1,
        cli=("plan",),
        flag="plan-orders-per-interval",
        help="planner: the most orders sent in one interval, shared round-robin between "
        "the users who have orders to send (one user's thousands cannot push another's "
        "out); the rest wait for the next interval",
    )
    plan_node_port: int = setting(
        DEFAULT_PREFETCH_PORT,
        ge=1,
        le=65535,
        cli=("plan",),
        help="planner: the TCP port of the node services' prefetch listener "
        "(their STAGER_PREFETCH_LISTEN), on each node's name as the resolver finds it; "
        "below 1024",
    )
    plan_node_addresses: CommaList(str) = setting(
        factory=list,
        cli=("plan",),
        aliases=("--plan-node-address",),
        default_text="none",
        help="planner: NODE=HOST:PORT for nodes whose Slurm name is not their address "
        "(a name the resolver does not know, another port)",
    )
    plan_state_path: Path = setting(
        Path("/var/lib/stager/plan.json"),
        cli=("plan",),
        flag="plan-state",
        help="planner: the file that keeps its last plan (written after each interval that "
        "changes it), so that a restarted planner cancels the prefetches of jobs that left "
        "while it was down",
    )
    crash_after: str | None = setting(cli=(), help="tests only: die after this durable step")

    _renamed: list[str] = PrivateAttr(default_factory=list)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags (init) win over the environment; nothing else is read.
        return init_settings, _Environment(settings_cls)

    @field_validator("cache_dir", "runtime_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return _absolute_folder(value)

    @field_validator("allowed_roots")
    @classmethod
    def _existing_roots(cls, value: list[Path]) -> list[Path]:
        """A root that is not there confines to nothing: every source would be refused,
        and only at the first request, so it is said at start."""
        roots = [_absolute_folder(root) for root in value]
        for root in roots:
            if not root.is_dir():
                raise ValueError(
                    f"{root} is not a folder here (or this user cannot reach it); name the "
                    "folders that hold the sources, or leave the setting out to allow any"
                )
        return roots

    @field_validator("prefetch_listen")
    @classmethod
    def _listen_address(cls, value: str | None) -> str | None:
        if value is not None:
            privileged(host_port(value)[1], f"STAGER_PREFETCH_LISTEN (--prefetch-listen) {value}")
        return value

    @field_validator("plan_node_port")
    @classmethod
    def _node_port(cls, value: int) -> int:
        return privileged(value, f"STAGER_PLAN_NODE_PORT (--plan-node-port) {value}")

    @field_validator("plan_node_addresses")
    @classmethod
    def _node_addresses(cls, value: list[str]) -> list[str]:
        for item in value:
            node, _, address = item.partition("=")
            try:
                host_port(address)
            except ValueError:
                node = ""
            if not node.strip():
                raise ValueError(f"{item!r} is not NODE=HOST:PORT, e.g. node1=10.0.0.1:866")
            privileged(host_port(address)[1], f"STAGER_PLAN_NODE_ADDRESSES {item}")
        return value

    @model_validator(mode="after")
    def _node_service_places(self) -> Settings:
        """The node service lives where admins look for a system service's files."""
        if self.multi_user:
            if "runtime_dir" not in self.model_fields_set:
                self.runtime_dir = NODE_RUNTIME_DIR
            if "cache_dir" not in self.model_fields_set:
                self.cache_dir = NODE_CACHE_DIR
        return self

    @model_validator(mode="after")
    def _trusted_images_apart(self) -> Settings:
        """A trusted image folder must not overlap the cache: the service writes users'
        data there as files of root's own, which would pass for images an admin put."""
        cache = os.path.realpath(self.cache_dir)
        for folder in self.trusted_image_dirs:
            real = os.path.realpath(folder)
            if os.path.commonpath([real, cache]) in (real, cache):
                raise ValueError(
                    f"trusted image folder {folder} overlaps the cache folder {self.cache_dir}: "
                    "the service writes users' staged files there as root's, which would pass "
                    "for an admin's images; publish prebuilt images in a folder outside the cache"
                )
        return self

    @model_validator(mode="after")
    def _token_rules(self) -> Settings:
        if self.host and self.no_token and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve {self.host} without a token: only loopback addresses "
                "may use --no-token; drop --no-token or bind 127.0.0.1"
            )
        return self

    @property
    def socket_path(self) -> Path:
        return self.socket or self.runtime_dir / "stager.sock"

    def stagings_per_user(self) -> int:
        """The most stagings one user of the node service runs at once."""
        return self.max_stagings_per_user or max(1, self.max_workers - 1)

    @property
    def private_dir(self) -> Path:
        """Where the daemon keeps what is its alone (log, token): the runtime folder itself
        per user (0700); in the node service, whose socket everyone must reach, a 0700
        folder in it. The pid file stays beside the socket, where ``stager stop`` finds it."""
        return self.runtime_dir / "private" if self.multi_user else self.runtime_dir

    @property
    def token_path(self) -> Path:
        return self.token_file or self.private_dir / "token"

    @property
    def pid_path(self) -> Path:
        return self.runtime_dir / "stager.pid"

    @property
    def log_path(self) -> Path:
        return self.private_dir / "stager.log"

    @property
    def url(self) -> str:
        """What a client puts in STAGER_URL to reach this daemon."""
        if self.host:
            return f"http://{self.host}:{self.port}"
        return f"unix://{self.socket_path}"

    def this_node(self) -> str:
        """This node's name, as a prefetch must name it."""
        return self.node_name or socket.gethostname().split(".")[0]

    @property
    def features_path(self) -> Path:
        """The declared datasets whose node features this node keeps (stager.prestage.placement)."""
        return self.cache_dir / "features.json"

    @property
    def prefetch_path(self) -> Path:
        """The prefetches and the credentials already used (stager.prestage.prefetch)."""
        return self.cache_dir / "prefetches.json"

    @property
    def db_path(self) -> Path:
        return self.cache_dir / "state.db"

    @property
    def data_dir(self) -> Path:
        return self.cache_dir / "data"  # published, ready entries

    @property
    def incoming_dir(self) -> Path:
        return self.cache_dir / "incoming"  # what other nodes broadcast here, until adopted

    @property
    def outgoing_dir(self) -> Path:
        return self.cache_dir / "outgoing"  # ready datasets packed to be broadcast

    @property
    def partial_dir(self) -> Path:
        return self.cache_dir / "partial"  # entries being staged; never reported ready


def _absolute_folder(value: Path) -> Path:
    """``value`` with ``~`` expanded; a relative one is refused: it would name another
    folder for the daemon than for the person who typed it."""
    value = value.expanduser()
    if not value.is_absolute():
        raise ValueError(
            f"{value} is a relative path; give an absolute one (e.g. {Path.cwd() / value})"
        )
    return value


def privileged(port: int, setting_text: str) -> int:
    """``port``, if only root may bind it; else a sentence naming the setting and the fix."""
    if port >= PRIVILEGED_BELOW:
        raise ValueError(
            f"{setting_text}: the prefetch port must be below {PRIVILEGED_BELOW} (one only "
            "root may bind), else a user who binds it while the node service is down is "
            "sent the planner's orders and copy credentials; use the same port below 1024 "
            f"on the nodes and the planner, e.g. {DEFAULT_PREFETCH_PORT}"
        )
    return port


def host_port(text: str) -> tuple[str, int]:
    """``ADDR:PORT`` (``[::1]:866`` for IPv6) -> (ADDR, PORT), or a sentence why not."""
    host, _, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"{text!r} is not ADDR:PORT; give an address and a port, e.g. 0.0.0.0:866 or [::]:866"
        )
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---- names: one source for flags, environment variables and the docs' table ---------


def _extra(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def flag_name(name: str) -> str:
    """The flag of field ``name``, without its dashes: ``user-quota``."""
    return _extra(Settings.model_fields[name]).get("flag") or name.replace("_", "-")


def env_name(name: str) -> str:
    """The environment variable of field ``name``: ``STAGER_`` + its flag's name."""
    return PREFIX + flag_name(name).replace("-", "_").upper()


def old_env_names(name: str) -> list[str]:
    """Names the variable had before it followed its flag (still read, with a warning)."""
    old = PREFIX + name.upper()
    return [old] if old != env_name(name) else []


def commands_of(name: str) -> tuple[str, ...]:
    return tuple(_extra(Settings.model_fields[name]).get("cli") or ())


def is_list(name: str) -> bool:
    return get_origin(Settings.model_fields[name].annotation) is list


def is_size(name: str) -> bool:
    return any(
        isinstance(m, BeforeValidator) and m.func is _size
        for m in Settings.model_fields[name].metadata
    )


def choices(name: str) -> list[str] | None:
    annotation = Settings.model_fields[name].annotation
    return list(get_args(annotation)) if get_origin(annotation) is Literal else None


def default_text(name: str) -> str:
    field = Settings.model_fields[name]
    given = _extra(field).get("default_text")
    if given:
        return str(given)
    if field.default is None:
        return "none"
    if is_size(name):
        return format_size(field.default).replace(" ", "")
    if isinstance(field.default, bool):
        return "off" if not field.default else "on"
    return f"{field.default:g}" if isinstance(field.default, float) else str(field.default)


def cli_flags(command: str) -> Iterator[tuple[str, list[str], dict[str, Any]]]:
    """Each flag of ``command`` as (field, option strings, argparse keywords). Values stay
    text: the settings model reads them exactly as it reads the environment."""
    for name, field in Settings.model_fields.items():
        if command not in commands_of(name):
            continue
        options = [f"--{flag_name(name)}", *_extra(field).get("aliases", [])]
        help_text = f"{field.description} (default {default_text(name)}; env {env_name(name)})"
        keywords: dict[str, Any] = {"dest": name, "help": help_text.replace("%", "%%")}
        if field.annotation is bool:
            keywords.update(action="store_true", default=None)
        elif is_list(name):
            keywords.update(action="append", metavar=_metavar(name).rstrip("S"))
        elif choices(name):
            keywords.update(choices=choices(name))
        else:
            keywords.update(metavar="SIZE" if is_size(name) else _metavar(name))
        yield name, options, keywords


def _metavar(name: str) -> str:
    if Settings.model_fields[name].annotation is float:
        return "SECONDS"
    return flag_name(name).upper().replace("-", "_")


def settings_table() -> str:
    """The settings table of docs/settings.md, as Markdown, from the fields."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        flag = f"`--{flag_name(name)}`" if commands_of(name) else "-"
        meaning = (field.description or "").replace("|", "\\|")
        if is_size(name):
            meaning += " (a size: 500M, 10G, 1.5TiB or bytes)"
        elif is_list(name):
            meaning += " (comma-separated)"
        rows.append(f"| {flag} | `{env_name(name)}` | `{default_text(name)}` | {meaning} |")
    return "\n".join(rows) + "\n"


class _Environment(PydanticBaseSettingsSource):
    """``STAGER_<FLAG>`` for each field (its old name too), as text: the field's own
    type reads it, so ``STAGER_X`` and ``--x`` accept the same values."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str] | None = None):
        super().__init__(settings_cls)
        self.environ = os.environ if environ is None else environ

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        for env in [env_name(field_name), *old_env_names(field_name)]:
            if env in self.environ:
                return self.environ[env], env, False
        return None, env_name(field_name), False

    def __call__(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for name, field in self.settings_cls.model_fields.items():
            value, _, _ = self.get_field_value(field, name)
            if value is not None:
                found[name] = value
        return found


def environment_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """Sentences about ``STAGER_*`` variables that are set but read differently than the
    admin may think: an old name (still read), or a near miss of a setting's name."""
    environ = os.environ if environ is None else environ
    names = {env_name(n): n for n in Settings.model_fields}
    old = {o: env_name(n) for n in Settings.model_fields for o in old_env_names(n)}
    warnings = []
    for var in sorted(v for v in environ if v.startswith(PREFIX)):
        if var in old:
            shadowed = " (and is ignored: the new name is set too)" if old[var] in environ else ""
            warnings.append(f"{var} is the old name of {old[var]}{shadowed}; rename it")
        elif var not in names and var not in NOT_SETTINGS:
            close = difflib.get_close_matches(var, list(names), n=1, cutoff=0.8)
            if close:
                warnings.append(f"{var} is not a setting and is ignored; did you mean {close[0]}?")
    return warnings


# STAGER_* variables that other parts read, not the daemon: the client, the trainer and
# the SLURM scripts (never warned about as near misses).
NOT_SETTINGS = frozenset({"STAGER_URL"})


def describe_error(exc: ValidationError, flags: Mapping[str, Any]) -> str:
    """Pydantic's first complaint as one sentence naming the flag or variable at fault."""
    first = exc.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else ""
    message = first["msg"].removeprefix("Value error, ")
    if name not in Settings.model_fields:
        return message
    where = f"--{flag_name(name)}" if name in flags else env_name(name)
    value = first.get("input")
    shown = (
        f" {value!r}" if isinstance(value, str | int | float) and str(value) not in message else ""
    )
    return f"{where}{shown}: {message}"


def main() -> None:
    """``python -m stager.core.settings``: print the settings table (docs/settings.md)."""
    print(settings_table(), end="")


if __name__ == "__main__":
    main()
