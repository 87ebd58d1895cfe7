"""Postgres going away while harvesting: the harvester backs off, recovers, and loses nothing."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest

from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from tests.support.harness import Generator, assert_complete_and_ordered, outbox_count, read_topic, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


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


def test_postgres_outage_while_harvesting(database_url, bootstrap_servers, new_topic):
    topic = new_topic("outage")
    parts = urlsplit(database_url)
    proxy = CuttableProxy((parts.hostname, parts.port or 5432))
    proxied = urlunsplit(parts._replace(netloc=f"{parts.username}:{parts.password}@127.0.0.1:{proxy.port}"))
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(dsn=proxied, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                                        leader_topic=leader, leader_group=leader, name="outage-replica",
                                        limits=Limits(heartbeat_timeout=2.0, io_error_backoff=0.2)))
    generator = Generator(topic, pause=0.01)
    harvester.start()
    try:
        generator.start()
        wait_until(lambda: harvester.published > 500, 60, "harvesting under way")
        proxy.cut()
        time.sleep(4)  # marks and purges fail meanwhile; the generator keeps writing directly
        published_during_outage = harvester.published
        proxy.restore()
        wait_until(lambda: harvester.published > published_during_outage + 500, 60, "harvesting to resume")
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 120, "the outbox to drain")
        assert harvester.state.value == "running", "an outage is survived, not fatal"
    finally:
        generator.halt.set()
        harvester.stop()
        harvester.wait(timeout=30)
        proxy.close()
    assert_complete_and_ordered(read_topic(bootstrap_servers, topic, expected=len(stashed)), stashed)
