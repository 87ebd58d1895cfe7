"""A share queue's invariants, checked as the simulated run goes and at its end.

The ledger watches the memory share group (every acquisition, acknowledgement, and record put back
by a lock's end, a member gone, or the broker's delivery limit) and the consumers (each message a
handler is given, what its handling came to, each dead letter and each failed write of them):

- nothing lost: a record is acknowledged (ACCEPT) only once its handler's work committed, REJECTed
  only once its dead letter is written, and archived by the broker (its delivery limit) only once it
  is handled or dead-lettered; at the end every message is handled or dead-lettered;
- a handler is given a delivery only while its lock holds (buffered records whose lock is about to
  end are released unhandled: docs/queue-backends.md), never the same delivery twice, never a
  delivery counted past max_deliveries, and never a message already dead-lettered;
- max_deliveries: a dead letter carries at least max_deliveries deliveries, and exactly that many
  only if its last delivery's handler ran (and failed or asked to retry): dead on arrival is only
  for deliveries past it; a handler that failed on the last allowed delivery is not RELEASEd (it
  would come back once more) unless its dead letter could not be written;
- a dead letter that cannot be written is tried again while the lock holds: its record is RELEASEd
  (spending a delivery) only when the lock is about to end;
- Retry(delay): a record is never held past its lock's end by a consumer that runs (its delayed
  RELEASE comes while the lock holds).

The one loss the backend cannot prevent: every delivery between max_deliveries and the broker's limit
ended with no dead letter possible (its consumer crashed or was paused past the lock, or the dead
letters' table refused the write for the whole lock, each time): Kafka archives the record. Such a
message is counted, not failed, and docs/queue-backends.md says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from outbox.kafka.memory.world import Violation, World
from outbox.queue import handling, markers
from outbox.queue.markers_consumer import Message
from outbox.queue.share_state import LETTER_RETRY, LOCK_MARGIN
from outbox.queue.tracker import DeadLetter

Ref = tuple[int, int]
#: Latitude for a RELEASE given up near the lock's end: the fetch's latency and the acknowledgement's flight.
SLACK = 0.1


@dataclass
class Acquisition:
    member: str
    lock_ends: float
    #: Why it is no longer held, or None while it is.
    ended: str | None = None
    #: Ended with no dead letter possible: its lock ended or its member went (crashed, paused, left) first, or it
    #: was RELEASEd once its dead letter had failed until the lock was about to end.
    unsettled: bool = False


@dataclass
class ShareLedger:
    world: World
    max_deliveries: int
    handled: dict[str, int]
    dead: dict[str, DeadLetter]
    #: message id -> its record's place (the senders fill it in)
    sent: dict[str, Ref] = field(default_factory=dict)
    violation: str | None = None
    acquisitions: dict[tuple[Ref, int], Acquisition] = field(default_factory=dict)
    handed_to: dict[tuple[str, int], str] = field(default_factory=dict)
    #: (message id, deliveries) whose handler failed or asked to retry
    failed: set[tuple[str, int]] = field(default_factory=set)
    #: (message id, deliveries) whose dead letter could not be written
    letters_failed: set[tuple[str, int]] = field(default_factory=set)
    refused: int = 0
    #: (message id, deliveries) whose acknowledgement request failed on the way
    acks_lost: set[tuple[str, int]] = field(default_factory=set)
    #: (message id, deliveries) -> when its handler asked to Retry
    retries: dict[tuple[str, int], float] = field(default_factory=dict)
    #: Whether the named consumer has run, neither paused nor crashed, since the given time (the scenario's).
    steady: Callable[[str, float], bool] = lambda consumer, since: False
    #: Archived by the broker past max_deliveries with no dead letter possible (every delivery past it crashed, ...).
    unseen: set[str] = field(default_factory=set)

    # -- the share group's reports ----------------------------------------------------------------

    def acquired(self, member: str, record: object, deliveries: int, lock_ends: float) -> None:
        self.acquisitions[(_ref(record), deliveries)] = Acquisition(member, lock_ends)
        if self.world.keep_trace:
            self.world.note(f"{member} acquired {_id(record)} (delivery {deliveries}, lock to t={lock_ends:.3f})")

    def put_back(self, record: object, deliveries: int, why: str, *, archived: bool) -> None:
        ref, key = _ref(record), (_id(record), deliveries)
        held = self.acquisitions.get((ref, deliveries))
        asked = self.retries.get(key)
        if why == "its lock ended" and held is not None and held.ended is None and asked is not None \
                and key not in self.acks_lost and asked <= held.lock_ends - LOCK_MARGIN - SLACK \
                and self.steady(held.member, asked):
            self.fail(f"{held.member} held {key[0]} (delivery {deliveries}) past its lock's end after a Retry at "
                      f"t={asked:.3f}: its delayed RELEASE must come while the lock holds")
        self._ended(ref, deliveries, why, unsettled=True)
        if self.world.keep_trace:
            self.world.note(f"{_id(record)} (delivery {deliveries}) {'archived' if archived else 'available'}: {why}")
        if archived:
            self._seen(record, f"archived by the broker (its delivery limit) after {deliveries} deliveries ({why})",
                       _ref(record), deliveries)

    def acknowledged(self, member: str, record: object, deliveries: int, ack: str, *, applied: bool,
                     archived: bool, lost: bool = False) -> None:
        if self.world.keep_trace:
            self.world.note(f"{ack.upper()} of {_id(record)} (delivery {deliveries}) by {member} "
                            f"{'applied' if applied else 'lost on the way' if lost else 'refused'}")
        if not applied:
            self.refused += 1
            if lost:
                self.acks_lost.add((_id(record), deliveries))
            return
        ref, message_id = _ref(record), _id(record)
        key = (message_id, deliveries)
        held = self.acquisitions.get((ref, deliveries))
        lock_left = held.lock_ends - self.world.now if held else 0.0
        gave_up = key in self.letters_failed and lock_left <= LOCK_MARGIN + LETTER_RETRY + SLACK
        self._ended(ref, deliveries, f"{ack.upper()} by {member}", unsettled=ack == "release" and gave_up)
        if ack == "accept" and message_id not in self.handled:
            self.fail(f"{message_id} acknowledged (ACCEPT, delivery {deliveries}) before its handler's work committed")
        elif ack == "reject" and message_id not in self.dead:
            self.fail(f"{message_id} REJECTed (delivery {deliveries}) before its dead letter was written")
        elif ack == "release" and key in self.letters_failed and not gave_up:
            self.fail(f"{message_id} RELEASEd (delivery {deliveries}) {lock_left:.3f}s before its lock's end, once its "
                      f"dead letter failed: a delivery spent while the letter could still be tried again")
        elif ack == "release" and deliveries >= self.max_deliveries and key in self.failed and not gave_up:
            self.fail(f"{message_id} RELEASEd after its handler failed on delivery {deliveries} (max_deliveries "
                      f"{self.max_deliveries}): not dead-lettered, it comes back")
        if archived and ack != "reject":
            self._seen(record, f"archived by the broker (its delivery limit) at its {ack.upper()}", ref, deliveries)

    # -- the consumers' reports -------------------------------------------------------------------

    def handed(self, consumer: str, message: Message) -> None:
        """A worker got the message from receive()."""
        key = (message.id, message.deliveries)
        earlier = self.handed_to.get(key)
        if earlier is not None:
            self.fail(f"delivery {message.deliveries} of {message.id} reached a handler twice ({earlier}, then "
                      f"{consumer})")
        self.handed_to[key] = consumer
        if message.deliveries > self.max_deliveries:
            self.fail(f"{message.id} handed to a handler on delivery {message.deliveries} (max_deliveries "
                      f"{self.max_deliveries})")
        if message.id in self.dead:
            self.fail(f"{message.id} handed to a handler (delivery {message.deliveries}) after it was dead-lettered")
        held = self.acquisitions.get((message.ref, message.deliveries))
        if held is None or held.member != consumer or held.ended is not None:
            why = "never acquired by it" if held is None or held.member != consumer else held.ended
            self.fail(f"{consumer} handed delivery {message.deliveries} of {message.id} to a handler after its lock "
                      f"ended ({why})")

    def outcome(self, message: Message, outcome: handling.Outcome) -> None:
        if outcome in (handling.Outcome.FAILED, handling.Outcome.RETRIED):
            self.failed.add((message.id, message.deliveries))
        if outcome is handling.Outcome.RETRIED:
            self.retries[(message.id, message.deliveries)] = self.world.now

    def letters_not_written(self, letters: list[DeadLetter]) -> None:
        self.letters_failed.update((letter.message_id, letter.deliveries) for letter in letters)

    def dead_lettered(self, letter: DeadLetter) -> None:
        key = (letter.message_id, letter.deliveries)
        if letter.deliveries < self.max_deliveries:
            self.fail(f"{letter.message_id} dead-lettered after {letter.deliveries} deliveries (max_deliveries "
                      f"{self.max_deliveries})")
        elif letter.deliveries == self.max_deliveries and key not in self.failed:
            self.fail(f"{letter.message_id} dead-lettered on its delivery {letter.deliveries} (max_deliveries "
                      f"{self.max_deliveries}) without its handler running")
        self.world.note(f"{letter.message_id} dead-lettered at delivery {letter.deliveries}")

    # -- the account ------------------------------------------------------------------------------

    def _ended(self, ref: Ref, deliveries: int, why: str, *, unsettled: bool = False) -> None:
        held = self.acquisitions.get((ref, deliveries))
        if held is not None and held.ended is None:
            held.ended, held.unsettled = f"{why} at t={self.world.now:.3f}", unsettled

    def _seen(self, record: object, what: str, ref: Ref, deliveries: int) -> None:
        """An archived record is handled or dead-lettered, unless every delivery past max_deliveries ended with no
        dead letter possible (docs/queue-backends.md: the broker's limit must leave room for those)."""
        message_id = _id(record)
        if message_id in self.handled or message_id in self.dead:
            return
        past = [self.acquisitions.get((ref, d)) for d in range(self.max_deliveries + 1, deliveries + 1)]
        if past and all(held is not None and held.unsettled for held in past):
            self.world.note(f"{message_id} lost to the broker's delivery limit: deliveries {self.max_deliveries + 1}"
                            f"-{deliveries} all ended with no dead letter possible")
            self.unseen.add(message_id)
            return
        self.fail(f"{message_id} {what}: neither handled nor dead-lettered, lost")

    def check_settled(self) -> None:
        """Once the faults stopped, every message was handled or dead-lettered."""
        left = [m for m in self.sent if m not in self.handled and m not in self.dead and m not in self.unseen]
        if left:
            self.fail(f"{len(left)} message(s) never handled nor dead-lettered, e.g. {left[:3]}")

    def fail(self, text: str) -> None:
        if self.violation is None:
            self.violation = f"t={self.world.now:.3f}: {text}"
        raise Violation(text)


def _ref(record: object) -> Ref:
    return (record.partition(), record.offset())  # type: ignore[attr-defined]


def _id(record: object) -> str:
    return markers.header_text(record.headers(), markers.ID_HEADER) or "?"  # type: ignore[attr-defined]
