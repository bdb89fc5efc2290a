"""The daemon's one settings object, built once from flags and ``STAGER_*`` env.

Nothing else in the daemon reads ``os.environ``: the CLI builds ``Settings`` and
passes it down.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


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


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STAGER_", extra="ignore")

    cache_dir: Path = Field(default_factory=default_cache_dir)
    runtime_dir: Path = Field(default_factory=default_runtime_dir)
    socket: Path | None = None  # default: <runtime_dir>/stager.sock
    host: str | None = None  # TCP instead of the Unix socket when set
    port: int = 8765
    token: str | None = None  # bearer token for TCP; generated when not given
    token_file: Path | None = None  # default: <runtime_dir>/token
    no_token: bool = False  # allowed on loopback addresses only
    max_workers: int = Field(default=2, ge=1)  # datasets staged at once
    # Processes one op may use for per-file work (copy, link, extract, seal), capped
    # at the cores (stager.fs.forked.cores); a copy from a network filesystem runs more.
    op_workers: int = Field(default=8, ge=1)
    staging_nice: int = Field(default=10, ge=0, le=19)  # CPU priority of staging processes
    allowed_roots: list[Path] = Field(default_factory=list)  # empty: any readable source
    recipe_dirs: list[Path] = Field(default_factory=list)
    # Modules that add ops to the op table (each defines OPS; see stager.ops.table).
    op_modules: list[str] = Field(default_factory=list)
    capacity_bytes: int = Field(default=0, ge=0)  # cache size limit; 0 means the disk's size
    sweep_interval_s: float = Field(default=30.0, gt=0)  # lease expiry and capacity sweep
    min_free_bytes: int = Field(default=1 << 30, ge=0)  # floor kept free on the cache disk
    progress_flush_s: float = Field(default=1.0, gt=0)
    # How often at most one entry's last use (LRU order) is written to the store: a
    # cache hit then costs no write, and a crash leaves eviction order this stale.
    recency_persist_s: float = Field(default=30.0, ge=0)
    shutdown_timeout_s: float = Field(default=5.0, gt=0)
    # A staging that has not stopped this long after a cancel (or a stop) is ended.
    cancel_grace_s: float = Field(default=3.0, gt=0)
    # A staging whose counters have not moved this long is stuck (a hung source) and
    # fails; 0 turns the check off. Generous: one huge file may be hashed in silence.
    stall_timeout_s: float = Field(default=900.0, ge=0)
    # For the crash-consistency tests only: die right after this durable step
    # (a stager.durable.Durable value, "#N" for its N-th time). Never set it otherwise.
    crash_after: str | None = None
    log_level: str = "info"
    # The node service for every user (stager serve --multi-user, as root): callers are
    # told apart by the kernel, sources read with their rights (docs/multiuser.md).
    multi_user: bool = False
    # Node service: the most bytes of data only its user may read that one user may hold
    # (shared entries count against nobody's); 0: no limit but the cache's.
    user_quota_bytes: int = Field(default=0, ge=0, le=2**62)
    # Node service: the most stagings one user runs at once (0: all slots but one, so
    # that another user always finds one) and queues (past it, 429).
    max_stagings_per_user: int = Field(default=0, ge=0)
    max_queued_per_user: int = Field(default=64, ge=1)
    # Node service: a request's checks run in a process that became its user; one that
    # takes longer than this (a source on a hung filesystem) is ended and the request fails.
    user_process_timeout_s: float = Field(default=60.0, gt=0)
    # Node service: munged's socket, through which a fan-out's manifest is vouched for
    # by the service that packed it (stager.vouch); None: munge's own default.
    munge_socket: Path | None = None

    @field_validator("cache_dir", "runtime_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().absolute()

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
        """Where the daemon keeps what is its alone (pid, log, token): the runtime folder
        itself per user (0700); in the node service, whose socket everyone must reach,
        a folder of its own in it (0700), its log and state never readable by users."""
        return self.runtime_dir / "private" if self.multi_user else self.runtime_dir

    @property
    def token_path(self) -> Path:
        return self.token_file or self.private_dir / "token"

    @property
    def pid_path(self) -> Path:
        return self.private_dir / "stager.pid"

    @property
    def log_path(self) -> Path:
        return self.private_dir / "stager.log"

    @property
    def url(self) -> str:
        """What a client puts in STAGER_URL to reach this daemon."""
        if self.host:
            return f"http://{self.host}:{self.port}"
        return f"unix://{self.socket_path}"

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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
