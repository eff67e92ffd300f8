"""A TCP proxy in front of the API server that a test can make stall: the network failure of
one client (the Lease holder) while others reach the API server.

Data flow: a client connects to 127.0.0.1:<port>; a thread per direction copies bytes to and
from the upstream (TLS passes through unread, so certificates and tokens work as they are).
`stall()` stops the copying in both directions and keeps every connection open: the client's
requests sit unsent and its calls hang, as behind a partition. `heal()` resumes; data that a
client which has gone since (its process exited) left behind is dropped, not delivered, as a
partition's packets would be. One `StallProxy` per test, closed with `close()`.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml

CHUNK = 65536


@dataclass
class StallProxy:
    upstream: tuple[str, int]
    port: int = 0
    _running: threading.Event = field(default_factory=threading.Event)  # set: copying
    _closed: threading.Event = field(default_factory=threading.Event)
    _server: socket.socket | None = None
    _sockets: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> StallProxy:
        server = socket.create_server(("127.0.0.1", 0))
        self.port = server.getsockname()[1]
        self._server = server
        self._running.set()
        threading.Thread(target=self._accept, name="stallproxy", daemon=True).start()
        return self

    def stall(self) -> None:
        self._running.clear()

    def heal(self) -> None:
        self._running.set()

    def close(self) -> None:
        self._closed.set()
        self._running.set()
        with self._lock:
            for sock in [*self._sockets, *([self._server] if self._server else [])]:
                with contextlib.suppress(OSError):
                    sock.close()

    def _accept(self) -> None:
        assert self._server is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                conn.close()
                continue
            up.settimeout(None)
            with self._lock:
                self._sockets += [conn, up]
            for src, dst in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(src, dst, conn), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, client: socket.socket) -> None:
        """Copy `src` to `dst` while running; while stalled, read nothing. What a client that
        has hung up (its process exited) left unread is dropped, never delivered."""
        try:
            while not self._closed.is_set():
                self._running.wait()
                ready, _, _ = select.select([src], [], [], 0.2)
                if not ready or not self._running.is_set():
                    continue
                if src is client and _hung_up(src):
                    break
                data = src.recv(CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except (OSError, ValueError):  # ValueError: the other direction closed the socket
            pass
        finally:
            for sock in (src, dst, client):
                with contextlib.suppress(OSError):
                    sock.close()

    def kubeconfig_through(self, kubeconfig: Path, out: Path) -> Path:
        """A copy of `kubeconfig` whose server is this proxy (same host name in TLS terms:
        127.0.0.1, which the local API server's certificate names)."""
        config = yaml.safe_load(kubeconfig.read_text())
        for entry in config["clusters"]:
            server = urlsplit(entry["cluster"]["server"])
            entry["cluster"]["server"] = f"{server.scheme}://127.0.0.1:{self.port}"
        out.write_text(yaml.safe_dump(config, sort_keys=False))
        return out


def _hung_up(sock: socket.socket) -> bool:
    """The peer closed its end (POLLRDHUP: set even while its last data waits unread)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP)
    return bool(poller.poll(0))


def upstream_of(kubeconfig: Path) -> tuple[str, int]:
    """The API server's host and port in `kubeconfig` (its first cluster)."""
    server = urlsplit(yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"])
    return server.hostname or "127.0.0.1", server.port or 443
