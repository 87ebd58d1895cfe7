"""How long a queue takes to resume after an outage: the broker's or the database's return to the first message
handled after it. Prints figures; asserts nothing.

    manage.py queue_outage_bench --runs 5                        # both backends, a broker restart and a database outage
    manage.py queue_outage_bench --backend markers --fault broker --runs 5 --down 16

Each run starts the real `manage.py outbox_consume` (and, for the markers backend, `outbox_redeliver`) on a fresh
topic pair of the spare broker (`bin/services up --spare`: a broker of its own, so the project's is left alone),
sends a message every 20 ms from this process throughout, and once the consumer handles them steadily:
- `broker`: stops the broker (SIGTERM, as a routine restart does), waits --down seconds, starts it again;
- `database`: the consumer (with --inbox) and the tracker reach Postgres through a proxy, which drops every
  connection and refuses new ones for --down seconds.
Measured from the moment the broker answers again (or the proxy lets connections through) to the first message
a handler finishes after it; the processes must still be running, and every message sent must be handled (or,
on the share backend, dead-lettered: a handler that fails is delivered again at once, so a database outage
spends deliveries; the count is printed).
The bound the product promises (docs/operations.md): the consumers' session timeout (10 s) plus 15 s.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.test import override_settings
from django.utils import timezone

from outbox.queue import api, app_settings
from outbox.queue.clients import STALL_AFTER
from outbox.queue.models import DeadLetter
from outbox.queue.topics import ensure_topics
from project.bench.proxy import proxied_url
from project.settings import queue_names

ROOT = Path(__file__).resolve().parents[4]
SERVICES = ROOT / "bin" / "services"
SPARE = "127.0.0.1:9190"
PID_FILE = ROOT / ".services" / "kafka-spare" / "node-1" / "kafka.pid"
QUEUE = "outage"
#: A message is sent this often (seconds) for the whole run.
SEND_EVERY = 0.02


class Command(BaseCommand):
    help = "Time from a broker's or the database's return to the first queue message handled after it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--backend", action="append", choices=["markers", "share"], dest="backends",
                            help="repeat for several (default both)")
        parser.add_argument("--fault", action="append", choices=["broker", "database"], dest="faults",
                            help="repeat for several (default both)")
        parser.add_argument("--runs", type=int, default=5, help="runs per backend and fault (default 5)")
        parser.add_argument("--down", type=float, default=16.0, help="seconds the broker or database is away")

    def handle(self, *args: Any, backends: list[str] | None, faults: list[str] | None, runs: int, down: float,
               **_: Any) -> None:
        self._services("up", "--spare", "--kafka-only")
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        rows = []
        for backend in backends or ["markers", "share"]:
            for fault in faults or ["broker", "database"]:
                timings = [self._run(backend, fault, down, run) for run in range(runs)]
                rows.append((backend, fault, timings))
        self.stdout.write(f"\n{started} to {time.strftime('%H:%M:%S %Z')}, load {os.getloadavg()[0]:.2f}; "
                          f"away {down:g} s each time; the bound: {STALL_AFTER:g} s\n")
        self.stdout.write("| backend | fault | runs | first handled after the return: p50 | max |\n"
                          "|---|---|---|---|---|")
        for backend, fault, timings in rows:
            self.stdout.write(f"| {backend} | {fault} | {len(timings)} | {statistics.median(timings):.1f} s | "
                              f"{max(timings):.1f} s |")

    def _run(self, backend: str, fault: str, down: float, run: int) -> float:
        prefix = f"outage-{uuid.uuid4().hex[:8]}"
        began = timezone.now()
        database_url = settings.DATABASES["default"]
        dsn = (f"postgres://{database_url['USER']}:{database_url['PASSWORD']}@{database_url['HOST'] or '127.0.0.1'}:"
               f"{database_url['PORT'] or 5432}/{database_url['NAME']}")
        proxy, proxied = proxied_url(dsn)
        override = override_settings(OUTBOX={**settings.OUTBOX, "base_kafka_config": {"bootstrap.servers": SPARE},
                                             "queues": {**queue_names(prefix), "partitions": 4,
                                                        "markers_partitions": 2, "backend": backend}})
        override.enable()
        sender_halt = threading.Event()
        processes: list[subprocess.Popen[bytes]] = []
        try:
            ensure_topics(app_settings.queue_config(), 30)
            with tempfile.TemporaryDirectory() as tmp:
                events = Path(tmp) / "events"
                events.touch()
                env = {**os.environ, "OUTBOX_QUEUE_PREFIX": prefix, "OUTBOX_QUEUE_BACKEND": backend,
                       "KAFKA_BOOTSTRAP_SERVERS": SPARE, "BENCH_EVENTS": str(events), "LOG_LEVEL": "WARNING",
                       "DATABASE_URL": proxied if fault == "database" else dsn}
                args = ["--queue", QUEUE, "--handler", "project.bench.queue_handlers.counted", "--workers", "2",
                        *(["--inbox"] if fault == "database" else [])]
                logs = Path(tmp)
                processes.append(self._spawn("outbox_consume", [*args, "--name", "consumer"], env, logs))
                if backend == "markers":
                    processes.append(self._spawn("outbox_redeliver", ["--name", "tracker"], env, logs))
                sent: list[str] = []
                sender = threading.Thread(target=self._send, args=(sent, sender_halt), daemon=True)
                sender.start()
                self._wait(lambda: len(self._handled(events)) >= 100, 120, "100 messages handled")
                if fault == "broker":
                    self._stop_broker()
                    time.sleep(down)
                    self._services("up", "--spare", "--kafka-only")
                else:
                    proxy.cut()
                    time.sleep(down)
                    proxy.restore()
                back = time.time()
                first = self._wait(lambda: next((t for t in self._handled(events) if t > back), None), 300,
                                   "a message handled after the return")
                sender_halt.set()
                sender.join()
                # A share queue's handler that fails (its database away) is released at once and delivered again
                # at once (docs/queue-backends.md): past max_deliveries it is dead-lettered, not handled.
                self._wait(lambda: len(self._handled(events)) + self._dead_letters(began) >= len(sent), 300,
                           "every message sent handled or dead-lettered")
                dead = self._dead_letters(began)
                ended = [p.args[p.args.index("--name") + 1] for p in processes if p.poll() is not None]
                if ended:
                    last = {name: (logs / f"{name}.log").read_text(errors="replace").strip().splitlines()[-1:]
                            for name in ended}
                    raise CommandError(f"a process ended during the outage: {last}")
        finally:
            sender_halt.set()
            for process in processes:
                process.send_signal(signal.SIGTERM)
            for process in processes:
                process.wait(timeout=60)
            override.disable()
            proxy.close()
            self._services("up", "--spare", "--kafka-only")
        self.stdout.write(f"{backend} {fault} run {run + 1}: first message handled {first - back:.1f} s after the "
                          f"return ({len(sent)} sent, {dead} dead-lettered)")
        return first - back

    @staticmethod
    def _send(sent: list[str], halt: threading.Event) -> None:
        """A message every SEND_EVERY seconds; during the outage send() waits in librdkafka and then goes out."""
        while not halt.is_set():
            try:
                sent.append(api.send(QUEUE, "work"))
            except Exception:  # a send that timed out while the broker was away: not counted
                pass
            halt.wait(SEND_EVERY)

    @staticmethod
    def _dead_letters(since: datetime) -> int:
        return DeadLetter.objects.filter(queue=QUEUE, created__gte=since).count()

    @staticmethod
    def _handled(events: Path) -> list[float]:
        return [float(line) for line in events.read_text().split()]

    @staticmethod
    def _wait(condition: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = condition()
            if found:
                return found
            time.sleep(0.05)
        raise CommandError(f"timed out after {timeout:g} s waiting for {what}")

    def _stop_broker(self) -> None:
        pid = int(PID_FILE.read_text())
        os.kill(pid, signal.SIGTERM)
        self._wait(lambda: not Path(f"/proc/{pid}").exists(), 60, "the spare broker to shut down")

    @staticmethod
    def _spawn(command: str, args: list[str], env: dict[str, str], logs: Path) -> subprocess.Popen[bytes]:
        """`manage.py command --name NAME ...`, its output in logs/NAME.log."""
        with open(logs / f"{args[args.index('--name') + 1]}.log", "w") as log:
            return subprocess.Popen([sys.executable, str(ROOT / "manage.py"), command, *args], cwd=ROOT, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)

    @staticmethod
    def _services(*args: str) -> None:
        result = subprocess.run([sys.executable, str(SERVICES), *args], capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise CommandError(f"bin/services {' '.join(args)} failed: {result.stderr.strip()}")
