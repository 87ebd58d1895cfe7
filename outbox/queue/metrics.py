"""Prometheus metrics of the queue, in prometheus-client's default registry (an optional extra).

    pip install 'django-outbox-harvest[metrics]'

Counters and the processing-time histogram are fed by the clients' QueueInstruments hooks, in
whatever process sends or consumes (so a web process that sends messages counts them too, and
django-prometheus or any exporter of the default registry shows them). Gauges are read from a
consumer or tracker when Prometheus scrapes. `outbox_consume` and `outbox_redeliver` serve
them with `--metrics-port`.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from outbox import metrics_endpoint
from outbox.queue.instruments import QueueInstruments

#: Processing time from receive() to ack(): from a no-op handler to a long report.
PROCESSING_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
INSTALL_HINT = "pip install 'django-outbox-harvest[metrics]'"

_lock = threading.Lock()
_instruments: QueueInstruments | None = None


def available() -> bool:
    return importlib.util.find_spec("prometheus_client") is not None


def default_instruments() -> QueueInstruments:
    """The process's Prometheus instruments, or hooks that do nothing when prometheus-client is not installed."""
    global _instruments
    with _lock:
        if _instruments is None:
            _instruments = PrometheusQueueInstruments() if available() else QueueInstruments()
        return _instruments


class PrometheusQueueInstruments(QueueInstruments):
    """Counters and a histogram per queue, registered once per process."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        def counter(name: str, text: str) -> Any:
            return Counter(f"outbox_queue_messages_{name}", text, ["queue"])

        self._sent = counter("sent", "Messages sent to the queue topic and acknowledged by Kafka")
        self._received = counter("received", "Messages handed to the application by a consumer")
        self._acked = counter("acked", "Messages acknowledged")
        self._retried = counter("retried", "Messages handed back for redelivery (Retry)")
        self._abandoned = counter("abandoned", "Messages whose processing failed (redelivered after the timeout)")
        self._redelivered = counter("redelivered", "Messages redelivered by a tracker")
        self._dead_lettered = counter("dead_lettered", "Messages moved to the dead letters by a tracker")
        self._processing = Histogram("outbox_queue_processing_seconds", "Time from receive to ack", ["queue"],
                                     buckets=PROCESSING_BUCKETS)

    def sent(self, queue: str, count: int) -> None:
        self._sent.labels(queue).inc(count)

    def received(self, queue: str) -> None:
        self._received.labels(queue).inc()

    def acked(self, queue: str, seconds: float) -> None:
        self._acked.labels(queue).inc()
        self._processing.labels(queue).observe(seconds)

    def retried(self, queue: str) -> None:
        self._retried.labels(queue).inc()

    def abandoned(self, queue: str) -> None:
        self._abandoned.labels(queue).inc()

    def redelivered(self, queue: str, count: int) -> None:
        self._redelivered.labels(queue).inc(count)

    def dead_lettered(self, queue: str, count: int) -> None:
        self._dead_lettered.labels(queue).inc(count)


def waiting_gauge(queue: str, name: str, waiting: Callable[[], tuple[str, float] | None]) -> Any:
    """How long the process has waited for Kafka (0 while it is not waiting)."""
    from prometheus_client.core import GaugeMetricFamily

    gauge = GaugeMetricFamily("outbox_queue_waiting_seconds",
                              "How long a queue process has been waiting for Kafka (0: not waiting); past the "
                              "group's session timeout and 15 s it is stalled", labels=["queue", "name"])
    found = waiting()
    gauge.add_metric([queue, name], 0.0 if found is None else found[1])
    return gauge


def consumer_gauges(queue: str, name: str, in_progress: Callable[[], int],
                    waiting: Callable[[], tuple[str, float] | None] = lambda: None) -> Any:
    """A collector of a consumer's messages in progress and its wait for Kafka, read at scrape time."""
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector

    class ConsumerCollector(Collector):
        def collect(self) -> Iterator[Any]:
            gauge = GaugeMetricFamily("outbox_queue_consumer_in_progress",
                                      "Messages a consumer holds (received or buffered, not acked)",
                                      labels=["queue", "name"])
            gauge.add_metric([queue, name], in_progress())
            yield gauge
            yield waiting_gauge(queue, name, waiting)

    return ConsumerCollector()


def tracker_gauges(snapshot: Callable[[], Any], name: str = "",
                   waiting: Callable[[], tuple[str, float] | None] = lambda: None) -> Any:
    """A collector of a tracker's view: messages in progress and the oldest one's age, per queue; its wait for
    Kafka (queue label empty)."""
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector

    class TrackerCollector(Collector):
        def collect(self) -> Iterator[Any]:
            view = snapshot()
            tracked = GaugeMetricFamily("outbox_queue_in_progress",
                                        "Messages started and not yet ended, on this tracker's partitions",
                                        labels=["queue"])
            oldest = GaugeMetricFamily("outbox_queue_oldest_in_progress_seconds",
                                       "Age of the oldest message in progress", labels=["queue"])
            now = time.time()
            for queue, stats in view.queues.items():
                tracked.add_metric([queue], stats.in_progress)
                if stats.oldest_started is not None:
                    oldest.add_metric([queue], max(0.0, now - stats.oldest_started))
            yield tracked
            yield oldest
            yield waiting_gauge("", name, waiting)

    return TrackerCollector()


def serve(port: int, address: str, collector: Any) -> int:
    """Serve the default registry plus `collector` on http://address:port/metrics; the port it serves on
    (EndpointFailure when it cannot)."""
    from prometheus_client import REGISTRY

    REGISTRY.register(collector)
    return metrics_endpoint.start(port, address, REGISTRY)
