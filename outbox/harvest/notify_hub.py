"""One LISTEN session per database for every outbox a process harvests there.

A Harvester LISTENs on a session of its own (store.Listener). A process harvesting fifty tenant
schemas would hold fifty idle LISTEN sessions; here it holds one per database: the hub's thread
LISTENs on every channel its engines asked for (`outbox_<oid>`, contract.notify_channel) and hands
each NOTIFY to the engine whose table fired it, by writing to that engine's wake pipe.

    hub = NotifyHub(dsn); hub.start()
    listener = hub.subscribe("outbox_16384")   # store.Listener's interface: fileno(), drain(), close()

A NOTIFY sent while nobody listened is lost, so every listener is woken once whenever its channel
starts being listened to (at subscribe and after each reconnect): its engine then marks, and finds what
was written meanwhile. While the session is down, the hub wakes every listener at each attempt to
connect again (every RETRY_AFTER): the engines look at their tables that often, together, rather than
each polling every `mark_backoff` as an engine whose own Listener lost its session does (so an engine's
listener always has its pipe to select on, and the engine keeps its long safety-net poll).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg import sql

from outbox.harvest.runtime import drain_pipe, readable
from outbox.harvest.store import close_quietly
from outbox.harvest.store import connect as connect_session
from outbox.reasons import first_line

log = logging.getLogger("outbox.harvest.notify_hub")

#: After a failed connection, the hub tries again at most this often (its engines poll meanwhile).
RETRY_AFTER = 5.0
#: TCP keepalives on the LISTEN session, so a session whose server vanished without a word is noticed
#: (and its engines woken) within about idle + interval x count seconds, without a query of ours.
KEEPALIVES = {"keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5", "keepalives_count": "3"}


class ChannelListener:
    """One engine's view of the hub: store.Listener's interface over a wake pipe the hub writes to."""

    def __init__(self, hub: NotifyHub, channel: str) -> None:
        self.hub = hub
        self.channel = channel
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self.closed = False

    def fileno(self) -> int | None:
        """The pipe to select on (None once closed)."""
        return None if self.closed else self._read

    @property
    def connected(self) -> bool:
        """Whether the hub listens on this channel now."""
        return not self.closed and self.hub.listens(self.channel)

    def wake(self) -> None:
        """From the hub's thread: a NOTIFY of this channel arrived (or may have been missed)."""
        try:
            os.write(self._write, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake is pending) or closed (the engine stopped)

    def drain(self) -> int:
        """Consume pending wakes; returns how many arrived."""
        return drain_pipe(self._read)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.hub.unsubscribe(self)
        for fd in (self._read, self._write):
            os.close(fd)


class NotifyHub(threading.Thread):
    """The LISTEN session of one database, shared by every engine of the process harvesting there."""

    def __init__(self, dsn: str, *, name: str = "",
                 connect: Callable[[], psycopg.Connection] | None = None) -> None:
        """`connect` opens the LISTEN session (default: an engine session to `dsn`, with keepalives)."""
        super().__init__(name="outbox-notify-hub", daemon=True)
        self._connect = connect or (lambda: connect_session(dsn, "listen", name=name, **KEEPALIVES))
        self._lock = threading.Lock()
        self._subscribers: dict[str, set[ChannelListener]] = {}
        #: Channels LISTENed on the current session (read by the engines' fileno()).
        self._listening: frozenset[str] = frozenset()
        self._control_read, self._control_write = os.pipe()
        os.set_blocking(self._control_read, False)
        os.set_blocking(self._control_write, False)
        self._stop_event = threading.Event()
        self._conn: psycopg.Connection | None = None
        self._retry_at = 0.0
        self._opened_at = 0.0
        #: Sessions cannot be had (said once, until one LISTENs again).
        self._failing = False
        #: How many NOTIFYs the hub received, and how many sessions it opened (reconnects + 1).
        self.received = 0
        self.sessions = 0

    # -- the engines' side (any thread) ------------------------------------------------------------

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
        self._poke()

    def listens(self, channel: str) -> bool:
        return channel in self._listening

    @property
    def channels(self) -> frozenset[str]:
        """The channels LISTENed on the hub's session now."""
        return self._listening

    def stop(self) -> None:
        self._stop_event.set()
        self._poke()

    def _poke(self) -> None:
        with self._lock:  # never after run() closed it (the number could name another file by then)
            if self._control_write < 0:
                return
            try:
                os.write(self._control_write, b"\0")
            except (BlockingIOError, OSError):
                pass

    # -- the hub's thread ---------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                try:
                    self._turn()
                except Exception:  # never leave the engines without their wakes: start over
                    log.exception("LISTEN session failed (started again in %gs)", RETRY_AFTER)
                    self._drop()
                    self._stop_event.wait(RETRY_AFTER)
        finally:
            self._drop()
            with self._lock:
                fds, self._control_read, self._control_write = (self._control_read, self._control_write), -1, -1
            for fd in fds:
                os.close(fd)

    def _turn(self) -> None:
        conn = self._session()
        readers = [self._control_read] + ([conn.fileno()] if conn is not None else [])
        timeout = None if conn is not None else max(0.0, self._retry_at - time.monotonic())
        ready = readable(readers, timeout)
        if self._control_read in ready:
            drain_pipe(self._control_read)
        if conn is not None and conn.fileno() in ready:
            self._dispatch(conn)
        if self._conn is not None and self._apply():
            # A NOTIFY that came in during LISTEN waits in psycopg's backlog, not on the socket.
            self._dispatch(self._conn)

    def _session(self) -> psycopg.Connection | None:
        """The LISTEN session, connected again (at most every RETRY_AFTER) when it is down."""
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if time.monotonic() < self._retry_at:
            return None
        try:
            self._conn = self._connect()
        except psycopg.Error as error:
            self._failed(error)
            return None
        self._opened_at = time.monotonic()
        self.sessions += 1
        if self._apply():
            self._dispatch(self._conn)
        return self._conn

    def _failed(self, error: psycopg.Error) -> None:
        """No session to be had (or each fails as soon as it is opened: a hot standby refuses LISTEN):
        try again in RETRY_AFTER, and have every engine look at its table meanwhile."""
        if not self._failing:
            log.warning("LISTEN session unavailable: its outboxes are looked at every %gs until it is back: %s",
                        RETRY_AFTER, first_line(error))
        self._failing = True
        self._drop()
        self._retry_at = time.monotonic() + RETRY_AFTER
        with self._lock:
            wanted = frozenset(self._subscribers)
        self._wake(wanted)  # a NOTIFY meanwhile would be lost: each engine marks instead

    def _lost(self, error: psycopg.Error) -> None:
        """The session failed: connect again at once, unless it had only just been opened (then back off,
        rather than open sessions in a loop that never wakes anyone)."""
        if time.monotonic() - self._opened_at < RETRY_AFTER:
            self._failed(error)
            return
        log.warning("LISTEN session lost, its outboxes poll until it is back: %s", first_line(error))
        self._drop()

    def _apply(self) -> bool:
        """LISTEN on channels subscribed since, UNLISTEN those left; wake the listeners of a new channel,
        which may have missed a NOTIFY before it was listened to. True if the session ran a statement."""
        conn = self._conn
        with self._lock:
            wanted = frozenset(self._subscribers)
        new, gone = wanted - self._listening, self._listening - wanted
        if not new and not gone:
            return False
        try:
            for channel in sorted(new):
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            for channel in sorted(gone):
                conn.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))
        except psycopg.Error as error:
            self._lost(error)
            return False
        if self._failing and new:
            log.info("LISTEN session back")
            self._failing = False
        self._wake(new)  # before they count as listened to, so whoever sees them listened to sees the wake too
        self._listening = (self._listening | new) - gone
        return self._conn is not None

    def _dispatch(self, conn: psycopg.Connection) -> None:
        try:
            channels = [notify.channel for notify in conn.notifies(timeout=0)]
        except psycopg.Error as error:
            self._lost(error)
            return
        self.received += len(channels)
        self._wake(set(channels))

    def _wake(self, channels: set[str] | frozenset[str]) -> None:
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



class NotifyHubs:
    """The process's hubs, one per database (by connection string), started when first asked for."""

    def __init__(self, *, name: str = "") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._hubs: dict[str, NotifyHub] = {}

    def hub(self, dsn: str) -> NotifyHub:
        with self._lock:
            hub = self._hubs.get(dsn)
            if hub is None:
                hub = self._hubs[dsn] = NotifyHub(dsn, name=self._name)
                hub.start()
            return hub

    @property
    def hubs(self) -> list[NotifyHub]:
        with self._lock:
            return list(self._hubs.values())

    def close(self) -> None:
        for hub in self.hubs:
            hub.stop()
        for hub in self.hubs:
            hub.join(timeout=10)
