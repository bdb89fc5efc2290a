"""Serving lifecycle: runtime folder, token, uvicorn on a Unix socket or TCP,
``--detach`` for job prologues, and ``stop``.
"""

from __future__ import annotations

import asyncio
import functools
import gc as collector
import logging
import os
import secrets
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import httpx
import uvicorn

from stager.api import connections, logs, prefetch_port, startup
from stager.api.startup import ServeError
from stager.core import prestart, processes
from stager.core.processes import pid_alive
from stager.core.settings import Settings
from stager.prestage.prefetch import listener

log = logging.getLogger("stager.api.server")


def check_mode(settings: Settings) -> None:
    """The node service's rules: root, its Unix socket only (and the planner's port)."""
    if not settings.multi_user:
        if settings.prefetch_listen:
            raise ServeError(
                "--prefetch-listen (STAGER_PREFETCH_LISTEN) is for the node service only "
                "(stager serve --multi-user, as root): a daemon of one user's takes no "
                "prefetches; leave it out"
            )
        return
    if os.geteuid() != 0:
        raise ServeError(
            "stager serve --multi-user must run as root: it reads each user's sources with "
            "that user's rights and keeps the node's cache as its own; start it from systemd "
            "or the SLURM prolog, or leave out --multi-user to run a daemon of your own"
        )
    if settings.host:
        raise ServeError(
            "stager serve --multi-user serves its Unix socket only: the kernel tells its "
            "callers apart there, which TCP cannot; leave out --host"
        )


def prepare_runtime_dir(settings: Settings) -> None:
    folder = settings.runtime_dir
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise startup.unusable_folder("runtime_dir", folder, exc) from exc
    if folder.stat().st_uid != os.getuid():
        raise ServeError(f"{folder} belongs to another user; set STAGER_RUNTIME_DIR to your own")
    startup.require_held("runtime_dir", folder)
    # Per user: only this user may reach the socket, which is the whole access control
    # for it. The node service: everyone may connect, and the kernel says who did; what
    # is the service's alone (pid, log) sits in a folder nobody else may enter.
    os.chmod(folder, 0o755 if settings.multi_user else 0o700)
    if settings.private_dir != folder:
        settings.private_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(settings.private_dir, 0o700)


def resolve_token(settings: Settings) -> str | None:
    """TCP always uses a token unless --no-token on loopback; generate one when not given."""
    if not settings.host or settings.no_token:
        return None
    if settings.token:
        return settings.token
    path = settings.token_path
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token


def read_pid(settings: Settings) -> int | None:
    try:
        pid = int(settings.pid_path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def serve(settings: Settings) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT."""
    # Stagings run in processes of their own, but the daemon's own threads (pre-flight
    # walks, fingerprints, background deletes, the state store) still hold the GIL
    # between syscalls; a shorter switch interval lets the event loop in sooner, which
    # keeps status replies in milliseconds while they work.
    sys.setswitchinterval(0.0005)
    check_mode(settings)
    prepare_runtime_dir(settings)
    startup.check_cache(settings)
    startup.check_address(settings)
    try:
        orders = listener.bind(settings) if settings.prefetch_listen else None
    except listener.ListenError as exc:
        raise ServeError(str(exc)) from exc
    token = resolve_token(settings)
    config_args: dict[str, object] = {}
    if settings.host:
        config_args.update(host=settings.host, port=settings.port)
    else:
        sock = settings.socket_path
        if sock.exists():
            if (refusal := prestart.already_serving(sock)) is not None:
                raise ServeError(refusal)  # one that started since `stager serve` looked
            sock.unlink()  # stale socket of a daemon that died
        config_args.update(uds=str(sock))
    # The app, its routes and FastAPI load here, in the daemon alone: `stager stop`, `gc`
    # and `serve --detach` import this module and need none of them (0.3-0.5 s each).
    from stager.api.app import create_app

    app = create_app(settings, token=token)
    caps, notes = connections.caps_for(settings, prestart.raise_descriptor_limit())
    gate = connections.Gate(caps, settings.header_timeout_s)
    config = uvicorn.Config(
        app,
        http=functools.partial(connections.PeerHTTPProtocol, gate=gate),  # type: ignore[arg-type]
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]
        backlog=gate.caps.backlog,
        log_level=settings.log_level,
        log_config=logs.config(settings),
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s),
        access_log=settings.log_level == "debug",
        **config_args,
    )
    settings.pid_path.write_text(f"{os.getpid()}\n")
    logs.started(settings)  # after uvicorn.Config: it set the log up
    for note in notes:  # caps lowered to fit the file descriptors
        log.warning("%s", note)
    # uvicorn shuts down gracefully on SIGTERM and then re-raises the signal to the
    # previous handler; make that handler a clean exit so the status is 0, as job
    # prologues and systemd expect from a graceful stop.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    # What is loaded by now (modules, the app, its schemas) lives as long as the process:
    # out of the collector's sight, full collections do not walk it while the daemon
    # serves, and the interpreter does not at exit, which took 0.6-1.2 s of a stop on a
    # busy machine (0.3 s now).
    collector.freeze()
    collector.enable()  # off since `python -m stager` began (stager.__main__)
    try:
        server = _Server(config, on_exit=app.state.engine.request_stop, gate=gate)
        if orders is not None:
            server.orders = (_orders_server(app.state.prefetches, settings), orders)
        server.run()
    finally:
        if read_pid(settings) in (os.getpid(), None):
            settings.pid_path.unlink(missing_ok=True)
            if not settings.host and not prestart.socket_answers(settings.socket_path):
                settings.socket_path.unlink(missing_ok=True)  # no stale socket after a stop


def _orders_server(prefetches: object, settings: Settings) -> uvicorn.Server:
    """The planner's port as a uvicorn server, which the daemon's own server starts on
    its loop once the app is up; its connections bounded with places of their own, by
    source address (a TCP connection names no user)."""
    gate = prefetch_port.Places(
        listener.MAX_CONNECTIONS,
        settings.prefetch_max_connections_per_address,
        settings.header_timeout_s,
    )
    config = uvicorn.Config(
        listener.Orders(prefetches),
        http=functools.partial(prefetch_port.OrdersProtocol, gate=gate),  # type: ignore[arg-type]
        lifespan="off",  # the app's lifespan starts and stops the Prefetches
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s),
        access_log=settings.log_level == "debug",
        log_config=None,  # the daemon's own server set the log up
        server_header=False,
        date_header=False,
    )
    config.load()
    orders = uvicorn.Server(config)
    orders.lifespan = config.lifespan_class(config)
    return orders


class _Server(uvicorn.Server):
    """uvicorn's server, telling the engine the moment a stop signal arrives, and
    logging accepts that fail for want of descriptors once per burst."""

    def __init__(
        self, config: uvicorn.Config, on_exit: Callable[[], None], gate: connections.Gate
    ) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._gate = gate
        # The planner's port: up once the app is, down first.
        self.orders: tuple[uvicorn.Server, socket.socket] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        connections.quiet_accept_errors(asyncio.get_running_loop(), self._gate.log)
        await super().startup(sockets)
        if self.started and self.orders is not None:
            orders, sock = self.orders
            await orders.startup(sockets=[sock])
            log.info("taking the planner's prefetch orders on %s:%s", *sock.getsockname()[:2])

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.orders is not None and self.orders[0].started:
            orders, sock = self.orders
            await orders.shutdown(sockets=[sock])
        await super().shutdown(sockets)
        self._gate.log.flush()  # the count of a burst still going

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._on_exit()


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def health_client(settings: Settings, timeout: float = 2.0) -> httpx.Client:
    # Plain HTTP, on a Unix socket or http://: no CA bundle to load (~15-30 ms of CPU a
    # client, taken from the daemon starting beside it: `detach` makes one a poll).
    if settings.host:
        return httpx.Client(base_url=settings.url, timeout=timeout, verify=False)
    transport = httpx.HTTPTransport(uds=str(settings.socket_path), verify=False)
    return httpx.Client(transport=transport, base_url="http://stager", timeout=timeout)


def is_healthy(settings: Settings) -> bool:
    try:
        with health_client(settings) as client:
            return client.get("/readyz").status_code == 200
    except httpx.TransportError:
        return False


def detach(settings: Settings, serve_argv: list[str], wait_s: float = 30.0) -> int:
    """Start ``stager serve`` in the background and return once it answers."""
    prepare_runtime_dir(settings)
    pid = read_pid(settings)
    if pid is not None and is_healthy(settings):
        print(f"stager already running (pid {pid}) at {settings.url}")
        return pid
    check_mode(settings)  # what the daemon would refuse, said here and not in its log
    startup.check_cache(settings)
    log = logs.open_log_file(settings.log_path)
    try:
        process = processes.spawn(
            # -P: `-m` would put the current folder first on sys.path, and a folder
            # named stager there (a clone's parent) would be imported for the daemon.
            [sys.executable, "-P", "-m", "stager", "serve", *serve_argv],
            stdout=log,
            stderr=processes.STDOUT,
            start_new_session=True,  # survive the prologue's shell and its signals
        )
    finally:
        os.close(log)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            last = _last_line(settings.log_path).removeprefix("stager: ")
            raise ServeError(
                f"the daemon exited with code {process.returncode} while starting: {last} "
                f"(its log: {settings.log_path})"
            )
        if is_healthy(settings):
            print(f"stager started (pid {process.pid}) at {settings.url}; log: {settings.log_path}")
            return process.pid
        time.sleep(0.05)
    process.terminate()
    raise ServeError(f"the daemon did not answer within {wait_s:.0f}s; see {settings.log_path}")


def stop(settings: Settings, timeout: float = 15.0) -> bool:
    """SIGTERM the daemon of this runtime folder and wait for it; False if none ran."""
    pid = read_pid(settings)
    if pid is None:
        _remove_stale_socket(settings)
        return False
    _check_signallable(settings, pid)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.05)
    if pid_alive(pid):
        raise ServeError(f"daemon pid {pid} did not stop within {timeout:.0f}s; kill it by hand")
    settings.pid_path.unlink(missing_ok=True)
    _remove_stale_socket(settings)
    return True


def _check_signallable(settings: Settings, pid: int) -> None:
    """That the pid file is the folder owner's, the caller's (or the caller is root),
    and ``pid`` that user's ``stager serve`` listening here: whoever can write the
    folder names the pid, and root may have been told of the folder by another user."""
    from stager.core import daemons

    path, caller = settings.pid_path, os.getuid()
    try:
        record, folder = os.lstat(path), os.stat(path.parent)
    except OSError as exc:
        raise ServeError(f"cannot check the pid file {path}: {exc}") from exc
    owner = record.st_uid
    why = None
    if not stat.S_ISREG(record.st_mode) or owner != folder.st_uid:
        why = f"it is not a file of {path.parent}'s owner (uid {folder.st_uid})"
    elif caller not in (0, owner):
        why = f"it is uid {owner}'s, not yours"
    else:
        found = daemons.daemon(pid)
        if found is None or found.uid != owner:
            why = f"pid {pid} is not a stager daemon of uid {owner}"
        elif not settings.host and settings.socket_path not in found.sockets:
            why = f"pid {pid} does not listen on {settings.socket_path}"
    if why is not None:
        raise ServeError(
            f"not signalling pid {pid}, named by {path}: {why}; stop that daemon by its "
            "owner's own `stager stop`, or remove the stale pid file"
        )


def _remove_stale_socket(settings: Settings) -> None:
    """A socket nobody answers on (a daemon killed before it could remove it) goes."""
    if not settings.host and settings.socket_path.is_socket():
        if not prestart.socket_answers(settings.socket_path):
            settings.socket_path.unlink(missing_ok=True)


def gc(settings: Settings, evict_all: bool = False) -> dict[str, object]:
    """Run the daemon's garbage collection; its answer (``GcResult``'s JSON)."""
    token = resolve_token(settings) if settings.host else None
    try:
        with health_client(settings, timeout=120) as client:
            headers = {"authorization": f"Bearer {token}"} if token else {}
            response = client.post("/v1/gc", json={"all": evict_all}, headers=headers)
    except httpx.TransportError as exc:
        raise ServeError(
            f"no daemon answers at {settings.url} ({exc}); start it with `stager serve --detach`"
        ) from exc
    if response.status_code != 200:
        raise ServeError(response.json().get("error", {}).get("message", response.text))
    return response.json()


def _last_line(path: Path) -> str:
    try:
        return (path.read_text(errors="replace").splitlines() or [""])[-1]
    except OSError:
        return ""
