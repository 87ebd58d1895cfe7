"""A TCP proxy to Postgres that can drop every connection and refuse new ones, then come back: a database
restart as its clients meet it, without touching the server other tests use."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit, urlunsplit


class CuttableProxy:
    """A TCP proxy to Postgres that can drop every connection and refuse new ones, then come back."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = threading.Event()
        self.up.set()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self._drop([source, sink])

    def _drop(self, sockets: list[socket.socket]) -> None:
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
            with self._lock:
                if sock in self._sockets:
                    self._sockets.remove(sock)

    def cut(self) -> None:
        self.up.clear()
        with self._lock:
            sockets = list(self._sockets)
        self._drop(sockets)

    def restore(self) -> None:
        self.up.set()

    def close(self) -> None:
        self.cut()
        self.listener.close()
        time.sleep(0.2)  # let the pipe threads see their sockets closed


def proxied_url(database_url: str) -> tuple[CuttableProxy, str]:
    """A proxy to the database of `database_url`, and the same URL through it."""
    parts = urlsplit(database_url)
    proxy = CuttableProxy((parts.hostname or "127.0.0.1", parts.port or 5432))
    return proxy, urlunsplit(parts._replace(netloc=f"{parts.username}:{parts.password}@127.0.0.1:{proxy.port}"))
