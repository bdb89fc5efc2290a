"""A local HTTP file server for tests: Range support, throttling, dropped connections,
an ETag, and HTTPS with a certificate of a private authority."""

from __future__ import annotations

import re
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Behaviour:
    files: dict[str, bytes] = field(default_factory=dict)
    bytes_per_s: float | None = None  # throttle every response body
    piece: int = 16 * 1024  # bytes written at a time (a trickle: small pieces, often)
    drop_after: int | None = None  # cut the first full response after this many bytes
    hold: threading.Event | None = None  # bodies wait until this is set (a stalled server)
    ignore_ranges: bool = False  # answer every request 200 with the whole body
    etag: str | None = None  # the version every response names (None: none)
    ranges_seen: list[str] = field(default_factory=list)
    requests: int = 0
    sent: int = 0  # body bytes written to clients, all responses together

    def reset(self, files: dict[str, bytes]) -> Behaviour:
        """Serve ``files``, with no faults and no history (one server serves a module)."""
        fresh = Behaviour(files=dict(files))
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))
        return self


def _handler(behaviour: Behaviour) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep test output quiet
            pass

        def do_GET(self) -> None:
            behaviour.requests += 1
            body = behaviour.files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            start = 0
            header = self.headers.get("Range")
            if header:
                behaviour.ranges_seen.append(header)
            if header and behaviour.ignore_ranges:
                header = None
            if header:
                start = int(re.match(r"bytes=(\d+)-", header).group(1))
                if start >= len(body):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(body)}")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(body) - start))
            if behaviour.etag is not None:
                self.send_header("ETag", behaviour.etag)
            self.end_headers()
            if behaviour.hold is not None:
                behaviour.hold.wait(60)
            self._send_body(body[start:], drop=not header and behaviour.drop_after)

        def _send_body(self, data: bytes, drop: int | None) -> None:
            chunk = behaviour.piece
            sent = 0
            while sent < len(data):
                if drop and sent >= drop:
                    behaviour.drop_after = None  # only the first response is cut
                    self.connection.close()
                    return
                piece = data[sent : sent + chunk]
                self.wfile.write(piece)
                sent += len(piece)
                behaviour.sent += len(piece)
                if behaviour.bytes_per_s:
                    time.sleep(len(piece) / behaviour.bytes_per_s)

    return Handler


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """Quiet about a client that went away mid-body (a cancelled or failed
        download: what the tests do on purpose); anything else is printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@contextmanager
def serve_files(behaviour: Behaviour, tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """Serve ``behaviour.files`` on 127.0.0.1 (over TLS with ``tls``: :func:`private_ca`);
    yields the base URL."""
    server = _Server(("127.0.0.1", 0), _handler(behaviour))
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        scheme = "https" if tls is not None else "http"
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def private_ca(folder: Path) -> tuple[Path, ssl.SSLContext]:
    """An authority of the test's own (``ca.pem`` in ``folder``: what SSL_CERT_FILE
    names) and a server's TLS settings with a certificate it signed for 127.0.0.1,
    made by the openssl command, as strict as Python 3.13's checks want them."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=stager test authority",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    openssl("req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (folder / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    )
    signed = ("-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-extfile", "server.ext")
    openssl("x509", "-req", "-in", "server.csr", *signed, "-out", "server.pem", "-days", "2")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(folder / "server.pem", folder / "server.key")
    return folder / "ca.pem", server
