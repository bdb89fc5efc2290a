"""A web server off this node, for tests of what the node service may share: a real
network namespace of its own (``ip netns``), joined to this one by a veth pair, so
that its address is none of this node's (stager.core.downloads never shares a download
from this node itself). Needs root and iproute2; the fixture skips otherwise.

The server (``SERVER``, run inside the namespace) serves files from a folder with
``Last-Modified`` and a strong ``ETag`` (unless told to name no version), answers
``HEAD``, and counts the ``GET``s of each path at ``/__count/<path>``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

SERVER = r"""
import hashlib, os, sys
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

root, port, versioned = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
counts = {}

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _head(self):
        if self.path.startswith("/__count/"):
            body = str(counts.get("/" + self.path[len("/__count/"):], 0)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return body
        path = os.path.join(root, self.path.lstrip("/"))
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        body = open(path, "rb").read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        if versioned:
            st = os.stat(path)
            self.send_header("Last-Modified", formatdate(st.st_mtime, usegmt=True))
            self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest()[:16] + '"')
        self.end_headers()
        return body

    def do_HEAD(self):
        self._head()

    def do_GET(self):
        if not self.path.startswith("/__count/"):
            counts[self.path] = counts.get(self.path, 0) + 1
        body = self._head()
        if body is not None:
            self.wfile.write(body)

ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()
"""


@dataclass
class OffNode:
    """The server's folder (write files there) and base URL."""

    root: Path
    url: str

    def gets(self, path: str) -> int:
        """How many GETs of ``path`` the server has answered."""
        return int(httpx.get(f"{self.url}/__count{path}", timeout=5).text)


@contextmanager
def off_node_server(root: Path, versioned: bool = True, port: int = 8088) -> Iterator[OffNode]:
    tag = f"{os.getpid() % 100000}"
    namespace, outer = f"stg-web{tag}", f"stgw{tag}"
    subnet = f"10.{96 + os.getpid() % 3}.{os.getpid() % 250 + 1}"
    here, there = f"{subnet}.1", f"{subnet}.2"
    steps = [
        ["ip", "netns", "add", namespace],
        ["ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", namespace],
        ["ip", "addr", "add", f"{here}/30", "dev", outer],
        ["ip", "link", "set", outer, "up"],
        ["ip", "-n", namespace, "addr", "add", f"{there}/30", "dev", "eth0"],
        ["ip", "-n", namespace, "link", "set", "eth0", "up"],
        ["ip", "-n", namespace, "link", "set", "lo", "up"],
    ]
    server = None
    try:
        for argv in steps:
            subprocess.run(argv, check=True, capture_output=True)
        server = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{namespace}",
                sys.executable,
                "-c",
                SERVER,
                str(root),
                str(port),
                "1" if versioned else "0",
            ],  # fmt: skip
        )
        url = f"http://{there}:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                httpx.get(f"{url}/__count/x", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.05)
        yield OffNode(root, url)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", outer], capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def can_make_namespaces() -> str | None:
    """Why this machine cannot run an off-node server, or None."""
    if os.geteuid() != 0:
        return "a network namespace needs root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian: iproute2, util-linux)"
    return None
