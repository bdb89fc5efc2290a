"""Finding the daemon: STAGER_URL, socket and token rules, agreeing with the daemon's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from client import BadConfiguration, discover
from stager.core.settings import Settings


def test_default_socket_matches_the_daemons_default(monkeypatch) -> None:
    for var in ("STAGER_URL", "STAGER_SOCKET", "STAGER_RUNTIME_DIR"):
        monkeypatch.delenv(var, raising=False)
    for xdg in ("/run/user/1234", None):
        env = {"XDG_RUNTIME_DIR": xdg} if xdg else {}
        if xdg:
            monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
        else:
            monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        endpoint = discover(env=env)
        assert endpoint.uds == str(Settings().socket_path)
        assert endpoint.url == Settings().url


def test_runtime_dir_and_socket_variables(tmp_path: Path) -> None:
    assert discover(env={"STAGER_RUNTIME_DIR": "/r"}).uds == "/r/stager.sock"
    assert discover(env={"STAGER_RUNTIME_DIR": "/r", "STAGER_SOCKET": "/s.sock"}).uds == "/s.sock"
    url = discover(env={"STAGER_URL": "unix:///u.sock", "STAGER_SOCKET": "/s.sock"})
    assert url.uds == "/u.sock"
    assert discover("/bare.sock", env={}).url == "unix:///bare.sock"


def test_tcp_token_order(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-runtime-dir\n")
    (tmp_path / "other").write_text("from-token-file\n")
    base = {"STAGER_URL": "http://127.0.0.1:8765", "STAGER_RUNTIME_DIR": str(tmp_path)}
    assert discover(env=base).token == "from-runtime-dir"
    assert discover(env={**base, "STAGER_TOKEN_FILE": str(tmp_path / "other")}).token == (
        "from-token-file"
    )
    assert discover(env={**base, "STAGER_TOKEN": "t"}).token == "t"
    assert discover(token="explicit", env=base).headers() == {"authorization": "Bearer explicit"}
    no_file = {"STAGER_URL": "http://h:1", "STAGER_RUNTIME_DIR": str(tmp_path / "none")}
    assert discover(env=no_file).token is None  # a --no-token daemon
    assert discover(env={**base, "STAGER_URL": "unix:///s"}).token is None  # never on a socket


def test_unusable_settings_say_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(BadConfiguration, match="'ftp://x' is not understood; use unix://"):
        discover("ftp://x", env={})
    with pytest.raises(BadConfiguration, match="absolute socket path"):
        discover("unix://relative.sock", env={})
    missing = {"STAGER_URL": "http://h:1", "STAGER_TOKEN_FILE": str(tmp_path / "nope")}
    with pytest.raises(BadConfiguration, match="STAGER_TOKEN_FILE"):
        discover(env=missing)


@pytest.mark.skipif(os.getuid() == 0, reason="root reads any file")
def test_unreadable_token_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("t")
    (tmp_path / "token").chmod(0)
    with pytest.raises(BadConfiguration, match="cannot be read"):
        discover(env={"STAGER_URL": "http://h:1", "STAGER_RUNTIME_DIR": str(tmp_path)})


def test_the_node_service_is_found_when_the_user_has_no_daemon(tmp_path: Path) -> None:
    from client._discovery import default_socket
    from stager.core.settings import NODE_RUNTIME_DIR

    node = tmp_path / "node.sock"
    own_dir = tmp_path / "own"
    env = {"XDG_RUNTIME_DIR": str(own_dir)}
    own = own_dir / f"stager-{os.getuid()}" / "stager.sock"
    assert default_socket(env, node) == own  # no node service here: the user's own
    node.touch()
    assert default_socket(env, node) == node  # a node service and no daemon of one's own
    own.parent.mkdir(parents=True)
    own.touch()
    assert default_socket(env, node) == own  # one's own daemon wins
    assert default_socket({"STAGER_RUNTIME_DIR": str(tmp_path / "x")}, node) != node
    assert NODE_RUNTIME_DIR / "stager.sock" == default_socket.__defaults__[0]  # as the daemon


def test_clients_of_a_tcp_daemon_read_the_tls_authorities_once_a_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transport that verifies reads the authorities (20-50 ms); the clients a process
    makes share one context, and a Unix socket's make none."""
    import ssl

    from client import _discovery

    made = []
    original = ssl.create_default_context

    def counted(*args: object, **kwargs: object) -> ssl.SSLContext:
        made.append(kwargs.get("cafile"))
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl, "create_default_context", counted)
    _discovery.tls_context.cache_clear()
    try:
        tcp = discover("http://127.0.0.1:1", token="t", env={})
        for transport in (tcp.transport(), tcp.async_transport(), tcp.transport()):
            assert transport._pool._ssl_context is _discovery.tls_context()
        discover(env={"STAGER_SOCKET": "/s.sock"}).transport()
        assert len(made) == 1
    finally:
        _discovery.tls_context.cache_clear()
