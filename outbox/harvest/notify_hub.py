"""One LISTEN session per database for every engine a process runs there (process_services.py).

The hub's thread LISTENs on every channel its engines asked for (`outbox_<oid>`, contract.notify_channel) and
hands each NOTIFY to the engine whose table fired it, through that engine's wake pipe. An engine asks for its
listener when it first leads (a standby holds no LISTEN session).

    hubs = NotifyHubs()                                   # the process's, one hub per database
    listener = hubs.subscribe(dsn, "outbox_16384")        # fileno(), drain(), connected, close()

A NOTIFY sent while nobody listened is lost, so every listener is woken whenever its channel starts being listened
to (at subscribe and after each reconnect): its engine then marks and finds what was written meanwhile. While the
session is down, the hub wakes every listener at each attempt to connect again (every RETRY_AFTER), rather than
have each engine poll every `mark_backoff`, which fifty engines would do five thousand times a second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import psycopg
from psycopg import sql

from outbox.harvest.pipes import WakePipe, readable
from outbox.harvest.process_services import ProcessServices
from outbox.harvest.store import close_quietly
from outbox.harvest.store import connect as connect_session
from outbox.logs import SaidOnce
from outbox.reasons import first_line

log = logging.getLogger("outbox.harvest.notify_hub")

#: Seconds between attempts to connect after a failure (its engines poll meanwhile).
RETRY_AFTER = 5.0
#: TCP keepalives, so a session whose server vanished without a word is noticed within about idle + interval x
#: count seconds, without a query of ours.
KEEPALIVES = {"keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5", "keepalives_count": "3"}


class ChannelListener(WakePipe):
    """One engine's view of the hub: a wake pipe the hub writes to, under its lock, at each NOTIFY of the channel
    (or one that may have been missed) (connector.ListenerLike)."""

    def __init__(self, hub: NotifyHub, channel: str) -> None:
        super().__init__()
        self.hub = hub
        self.channel = channel
        self.closed = False

    def fileno(self) -> int | None:  # type: ignore[override]
        """The pipe to select on (None once closed)."""
        return None if self.closed else super().fileno()

    @property
    def connected(self) -> bool:
        """Whether the hub listens on this channel now."""
        return not self.closed and self.channel in self.hub.channels

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.hub.unsubscribe(self)  # no wake reaches the pipe from here on
        super().close()


class NotifyHub(threading.Thread):
    """The LISTEN session of one database, shared by every engine of the process harvesting there."""

    def __init__(self, dsn: str, *, name: str = "",
                 connect: Callable[[], psycopg.Connection] | None = None,
                 on_empty: Callable[[NotifyHub], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`connect` opens the LISTEN session (default: to `dsn`, with keepalives); `on_empty` is told when the last
        listener left; `clock` times the retries."""
        super().__init__(name="outbox-notify-hub", daemon=True)
        self.dsn = dsn
        self._clock = clock
        self._connect = connect or (lambda: connect_session(dsn, "listen", name=name, **KEEPALIVES))
        self._on_empty = on_empty
        self._lock = threading.Lock()
        self._subscribers: dict[str, set[ChannelListener]] = {}
        #: Channels LISTENed on the current session (read by the engines' `connected`).
        self._listening: frozenset[str] = frozenset()
        self._control = WakePipe()
        self._stop_event = threading.Event()
        self._conn: psycopg.Connection | None = None
        self._retry_at = 0.0
        self._opened_at = 0.0
        #: No session can be had (said once, until one LISTENs again).
        self._outage = SaidOnce(log, "LISTEN session unavailable: its outboxes are looked at every %gs until it is "
                              "back: %s", "LISTEN session back")
        #: How many NOTIFYs the hub received.
        self.received = 0

    def subscribe(self, channel: str) -> ChannelListener:
        listener = ChannelListener(self, channel)
        with self._lock:
            self._subscribers.setdefault(channel, set()).add(listener)
        self._poke()
        return listener

    def unsubscribe(self, listener: ChannelListener) -> None:
        with self._lock:
            found = self._subscribers.get(listener.channel)
            if found is not None:
                found.discard(listener)
                if not found:
                    del self._subscribers[listener.channel]
            empty = not self._subscribers
        self._poke()
        if empty and self._on_empty is not None:
            self._on_empty(self)

    @property
    def empty(self) -> bool:
        """Whether no listener is subscribed."""
        with self._lock:
            return not self._subscribers

    @property
    def channels(self) -> frozenset[str]:
        """The channels LISTENed on the hub's session now."""
        return self._listening

    def stop(self) -> None:
        self._stop_event.set()
        self._poke()

    def _poke(self) -> None:
        with self._lock:  # never after run() closed it (the number could name another file by then)
            self._control.wake()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                try:
                    self.step(wait=True)
                except Exception:  # never leave the engines without their wakes: start over
                    log.exception("LISTEN session failed (started again in %gs)", RETRY_AFTER)
                    self._drop()
                    self._stop_event.wait(RETRY_AFTER)
        finally:
            self.end()

    def step(self, *, wait: bool = False) -> None:
        """One turn (session, LISTENs, NOTIFYs handed on). With `wait` (the thread's), it first waits until its
        session or a subscriber has something, or the next retry is due."""
        conn = self._session()
        control = self._control.fileno()
        readers = [control] + ([conn.fileno()] if conn is not None else [])
        timeout = 0.0 if not wait else None if conn is not None else max(0.0, self._retry_at - self._clock())
        ready = readable(readers, timeout)
        if control in ready:
            self._control.drain()
        if conn is not None and conn.fileno() in ready:
            self._dispatch(conn)
        if self._conn is not None:
            self._apply()

    def _session(self) -> psycopg.Connection | None:
        """The LISTEN session, connected again (at most every RETRY_AFTER) when it is down."""
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if self._clock() < self._retry_at:
            return None
        try:
            self._conn = self._connect()
        except psycopg.Error as error:
            self._failed(error)
            return None
        self._opened_at = self._clock()
        self._apply()
        return self._conn

    def _failed(self, error: psycopg.Error) -> None:
        """No session to be had (or each fails at once: a hot standby refuses LISTEN): try again in RETRY_AFTER, and
        have every engine look at its table meanwhile."""
        self._outage.failed(RETRY_AFTER, first_line(error))
        self._drop()
        self._retry_at = self._clock() + RETRY_AFTER
        self._wake(self._subscribers)  # every listener: a NOTIFY meanwhile would be lost, each engine marks instead

    def _lost(self, error: psycopg.Error) -> None:
        """The session failed: connect again at once, unless it had only just been opened (then back off)."""
        if self._clock() - self._opened_at < RETRY_AFTER:
            self._failed(error)
            return
        log.warning("LISTEN session lost, its outboxes poll until it is back: %s", first_line(error))
        self._drop()

    def _apply(self) -> None:
        """LISTEN on channels subscribed since, UNLISTEN those left; wake the listeners of a new channel (they may
        have missed a NOTIFY)."""
        conn = self._conn
        with self._lock:
            wanted = frozenset(self._subscribers)
        new, gone = wanted - self._listening, self._listening - wanted
        if not new and not gone:
            return
        try:
            for channel in sorted(new):
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            for channel in sorted(gone):
                conn.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))
        except psycopg.Error as error:
            self._lost(error)
            return
        if new:
            self._outage.ended()
        self._wake(new)  # before they count as listened to, so whoever sees them listened to sees the wake too
        self._listening = (self._listening | new) - gone
        self._dispatch(conn)  # a NOTIFY that came in during LISTEN waits in psycopg's backlog, not on the socket

    def _dispatch(self, conn: psycopg.Connection) -> None:
        try:
            channels = [notify.channel for notify in conn.notifies(timeout=0)]
        except psycopg.Error as error:
            self._lost(error)
            return
        self.received += len(channels)
        self._wake(set(channels))

    def _wake(self, channels: Iterable[str]) -> None:
        # Under the lock: a listener closes its pipe only once unsubscribed, so no write reaches a closed
        # (or reused) descriptor. The writes do not block.
        with self._lock:
            for channel in channels:
                for listener in self._subscribers.get(channel, ()):
                    listener.wake()

    def _drop(self) -> None:
        """The session is gone: nothing is listened to until the next one (each engine polls meanwhile)."""
        self._listening = frozenset()
        conn, self._conn = self._conn, None
        close_quietly(conn)

    def end(self) -> None:
        """The session and the hub's wake pipe closed: the thread's last act, or its owner's for a stepped hub."""
        self._drop()
        with self._lock:
            self._control.close()


class NotifyHubs(ProcessServices[NotifyHub]):
    """The process's hubs, one per database (by connection string)."""

    def __init__(self, *, name: str = "", connect: Callable[[str], psycopg.Connection] | None = None,
                 threads: bool = True) -> None:
        """`connect(dsn)` opens a hub's LISTEN session (default: NotifyHub's)."""
        super().__init__(threads=threads)
        self._name = name
        self._connect = connect

    def subscribe(self, dsn: str, channel: str) -> ChannelListener:
        """A listener of `channel` on the hub of `dsn`'s database."""
        listener = self.use(dsn, lambda: self._hub(dsn), lambda hub: hub.subscribe(channel))
        assert listener is not None  # a hub can always be made
        return listener

    def _hub(self, dsn: str) -> NotifyHub:
        connect = self._connect
        return NotifyHub(dsn, name=self._name, on_empty=self.retire,
                         connect=None if connect is None else lambda: connect(dsn))
