"""The queue's settings (OUTBOX["queues"]), its system checks, the marker format and input validation."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from datetime import timedelta

import pytest
from django.core import checks
from django.test import override_settings

from outbox.errors import InvalidRecord
from outbox.queue import api, app_settings, markers
from outbox.queue.config import QueueConfig, QueueLimits
from outbox.queue.errors import Retry
from outbox.queue.markers import Kind, Marker


def queue_checks(queues: object) -> list[tuple[str, str]]:
    with override_settings(OUTBOX={"queues": queues}):
        return [(m.id, m.msg) for m in checks.run_checks(tags=["outbox_queue"])]


def test_defaults_derive_from_the_project_and_the_redelivery_timeout():
    with override_settings(OUTBOX={"base_kafka_config": {"bootstrap.servers": "k:1", "sasl.password": "pw"}}):
        config = app_settings.queue_config()
    assert (config.topic, config.markers_topic) == ("project-queue", "project-queue-markers")
    assert config.consumer_group("emails") == "project-queue-emails"
    assert config.tracker_group == "project-queue-tracker"
    assert config.limits.keep_alive_interval == 10.0  # a third of the 30 s timeout
    assert config.base_kafka_config["bootstrap.servers"] == "k:1"
    assert "'pw'" not in repr(config) and "***" in repr(config)


def test_per_queue_limits_start_from_the_shared_ones():
    queues = {"max_deliveries": 2, "redelivery_timeout": timedelta(minutes=1),
              "per_queue": {"reports": {"redelivery_timeout": 600, "max_in_progress": 1}}}
    with override_settings(OUTBOX={"queues": queues}):
        config = app_settings.queue_config()
    assert config.limits_for("emails") == QueueLimits(redelivery_timeout=60.0, max_deliveries=2)
    reports = config.limits_for("reports")
    assert (reports.redelivery_timeout, reports.keep_alive_interval, reports.max_in_progress,
            reports.max_deliveries) == (600, 200.0, 1, 2)


def test_flags_override_settings_and_rederive_the_keep_alive():
    config = QueueConfig(limits=QueueLimits(redelivery_timeout=30.0))
    limits = api.limits_for(config, "q", redelivery_timeout=3.0, max_in_progress=None)
    assert (limits.redelivery_timeout, limits.keep_alive_interval, limits.max_in_progress) == (3.0, 1.0, 10)
    hand_set = QueueConfig(limits=QueueLimits(redelivery_timeout=30.0, keep_alive_interval=2.0))
    assert api.limits_for(hand_set, "q", redelivery_timeout=9.0).keep_alive_interval == 2.0


def test_the_example_project_passes_its_checks():
    assert checks.run_checks(tags=["outbox_queue"]) == []


@pytest.mark.parametrize(("queues", "code", "text"), [
    ([], "outbox_queue.E001", "must be a dict"),
    ({"redelivery_timout": 5}, "outbox_queue.E002",
     "OUTBOX['queues']['redelivery_timout'] is not a known setting (did you mean"),
    ({"per_queue": {"a": {"max_deliverys": 1}}}, "outbox_queue.E002",
     "OUTBOX['queues']['per_queue']['a']['max_deliverys'] is not a known setting (did you mean 'max_deliveries'"),
    ({"redelivery_timeout": 0}, "outbox_queue.E004",
     "OUTBOX['queues']['redelivery_timeout'] must be between 0.1 and 43200"),
    ({"redelivery_timeout": "soon"}, "outbox_queue.E003",
     "OUTBOX['queues']['redelivery_timeout'] must be a number of seconds"),
    ({"keep_alive_interval": 30}, "outbox_queue.E004", "must be above 0 and below redelivery_timeout"),
    ({"max_in_progress": 0}, "outbox_queue.E004", "OUTBOX['queues']['max_in_progress'] must be a positive integer"),
    ({"max_deliveries": 0}, "outbox_queue.E004",
     "OUTBOX['queues']['max_deliveries'] must be a positive integer or None"),
    ({"topic": "no spaces"}, "outbox_queue.E005", "OUTBOX['queues']['topic'] must be a Kafka topic name"),
    ({"topic": "t", "markers_topic": "t"}, "outbox_queue.E005",
     "OUTBOX['queues']['markers_topic'] must differ from topic"),
    ({"partitions": 0}, "outbox_queue.E004", "OUTBOX['queues']['partitions'] must be an integer from 1 to 10000"),
    ({"per_queue": {"a/b": {}}}, "outbox_queue.E006", "OUTBOX['queues']['per_queue']['a/b'] must be 1-200 characters"),
    ({"per_queue": {"a": {"redelivery_timeout": -1}}}, "outbox_queue.E004",
     "OUTBOX['queues']['per_queue']['a']['redelivery_timeout']"),
    ({"status_interval": 0}, "outbox_queue.E004",
     "OUTBOX['queues']['status_interval'] must be a positive number of seconds"),
    ({"history_retention": 0}, "outbox_queue.E004",
     "OUTBOX['queues']['history_retention'] must be a positive number of seconds"),
    ({"dead_letter_retention": "a month"}, "outbox_queue.E004",
     "OUTBOX['queues']['dead_letter_retention'] must be a positive number of seconds or None, got 'a month'"),
    ({"history_interval": -1}, "outbox_queue.E004",
     "OUTBOX['queues']['history_interval'] must be a number of seconds, 0 or more"),
    ({"per_queue": {"a": {"backend": "kip932"}}}, "outbox_queue.E007",
     "OUTBOX['queues']['per_queue']['a']['backend'] must be one of 'markers', 'share', got 'kip932'"),
    ({"backend": "share", "max_deliveries": None}, "outbox_queue.E007",
     "OUTBOX['queues']['max_deliveries'] must be from 1 to 9 with backend 'share'"),
    ({"per_queue": {"a": {"backend": "share", "max_deliveries": 10}}}, "outbox_queue.E007",
     "OUTBOX['queues']['per_queue']['a']['max_deliveries'] must be from 1 to 9 with backend 'share'"),
    ({"backend": "share", "redelivery_timeout": 0.5}, "outbox_queue.E007",
     "OUTBOX['queues']['redelivery_timeout'] must be from 1 to 3600 seconds with backend 'share'"),
    ({"topic": "t" * 240, "per_queue": {"a" * 10: {"backend": "share"}}}, "outbox_queue.E007",
     "would be longer than 249 characters"),
])
def test_a_bad_setting_is_a_check_error_naming_the_key_and_the_limit(queues, code, text):
    found = queue_checks(queues)
    assert any(i == code and text in msg for i, msg in found), found


def test_every_bad_key_is_said_at_once_each_once():
    found = queue_checks({"topic": "no spaces", "status_interval": 0, "max_in_progress": 0})
    assert sorted(msg.split(" must ")[0] for _, msg in found) == [
        "OUTBOX['queues']['max_in_progress']", "OUTBOX['queues']['status_interval']", "OUTBOX['queues']['topic']"]


def test_a_key_in_breach_is_said_beside_an_unknown_one():
    found = queue_checks({"typo": 1, "status_interval": -1})
    assert sorted(code for code, _ in found) == ["outbox_queue.E002", "outbox_queue.E004"], found


def test_a_bad_name_is_said_once_and_the_project_s_is_used_meanwhile():
    assert [code for code, _ in queue_checks({"topic": "bad topic", "markers_topic": "outbox-queue"})] == [
        "outbox_queue.E005"], "no second problem through the name's fallback"
    with override_settings(OUTBOX={"queues": {"topic": "bad topic", "consumer_group_prefix": 5}}):
        config = app_settings.queue_config()
    assert (config.topic, config.consumer_group_prefix) == ("project-queue", "project-queue-")


def test_print_config_shows_every_key_with_its_default_and_no_secret():
    with override_settings(OUTBOX={"base_kafka_config": {"bootstrap.servers": "k:1", "sasl.password": "pw"},
                                   "queues": {"status_interval": 5}}):
        printed = app_settings.queue_config().redacted()
    assert set(printed) == {spec.name for spec in dataclasses.fields(QueueConfig)}
    assert (printed["status_interval"], printed["dead_letter_retention"], printed["topic"]) == (5, 30 * 24 * 3600.0,
                                                                                               "project-queue")
    assert printed["base_kafka_config"]["sasl.password"] == "***"


def test_a_keep_alive_leaving_little_margin_is_a_warning():
    assert queue_checks({"redelivery_timeout": 10, "keep_alive_interval": 8}) == [(
        "outbox_queue.W001", "OUTBOX['queues']['keep_alive_interval'] 8s leaves less than half the redelivery timeout "
                             "(10s) for a keep-alive to reach the tracker; one slow marker means a needless "
                             "redelivery")]


def test_queues_is_an_outbox_setting_the_queue_app_registers():
    from outbox import conf as outbox_conf
    from outbox import settings_problems as outbox_settings_problems

    assert "queues" in outbox_conf.known_keys()
    with override_settings(OUTBOX={"queues": {}}):
        assert outbox_settings_problems.problems() == []


def test_queues_is_unknown_without_the_queue_app():
    """The outbox app knows the key only while outbox.queue is installed (nothing else would read it)."""
    from django.test import modify_settings

    from outbox import conf as outbox_conf

    with modify_settings(INSTALLED_APPS={"remove": ["outbox.queue"]}):
        assert "queues" not in outbox_conf.known_keys()
    assert "queues" in outbox_conf.known_keys()


def test_every_marker_survives_its_wire_format():
    start = Marker(Kind.START, (3, 42), 30.0, key=b"emails/abc", payload=b"\x00\xffbody",
                   headers=((markers.ID_HEADER, b"abc"), ("trace", b"t-1"), (markers.DELIVERIES_HEADER, b"2")),
                   max_deliveries=5)
    for marker in (start, Marker(Kind.KEEPALIVE, (3, 42), 0.25), Marker(Kind.END, (3, 42)),
                   Marker(Kind.RELEASE, (0, 0))):
        assert markers.decode(*markers.encode(marker)) == marker
    assert start.message_id == "abc" and start.deliveries == 2
    no_limit = Marker(Kind.START, (0, 1), 1.0, key=b"q", payload=b"x", headers=())
    decoded = markers.decode(*markers.encode(no_limit))
    assert decoded.max_deliveries is None and decoded.message_id == "p0o1" and decoded.deliveries == 1


@pytest.mark.parametrize("headers", [
    None, [], [("mq-marker", b"stop")], [("mq-marker", b"start")],
    [("mq-marker", b"keepalive"), ("mq-ref", b"1:x"), ("mq-redeliver-after-ms", b"1")],
])
def test_a_record_that_is_not_a_marker_is_refused(headers):
    with pytest.raises(markers.MarkerError):
        markers.decode(b"x", headers)


def test_message_headers_drop_the_reserved_ones_and_count_deliveries():
    headers = markers.message_headers([("a", b"1"), ("mq-deliveries", b"7"), ("mq-id", b"old")], message_id="new",
                                      deliveries=3)
    assert headers == [("a", b"1"), ("mq-id", b"new"), ("mq-deliveries", b"3")]


@pytest.mark.parametrize(("call", "message"), [
    (lambda: api.send("no/slash", "x"), "queue: must be 1-200 characters of a-z A-Z 0-9 . _ -"),
    (lambda: api.send("q", None), "payload: must not be None"),
    (lambda: api.send("q", 3.5), "payload: must be str, bytes, dict, list or None, got float"),
    (lambda: api.send("q", b"\xff"), "payload: bytes must be valid UTF-8"),
    (lambda: api.send_many("q", ["ok", {"x": object()}]), "payloads[1]: is not serialisable as JSON"),
    (lambda: api.send("q", "x", headers=[("mq-id", "mine")]), "headers[0]: name 'mq-id' is reserved"),
    (lambda: api.send("q", "x", headers=[("a", 1)]), "headers[0]: must be a pair of strings"),
    (lambda: api.stash("q", "x" * 900_001), "payload: must be at most 900000 bytes in UTF-8, got 900001"),
])
def test_bad_input_is_one_clear_error_before_any_io(call, message):
    with pytest.raises(InvalidRecord) as caught:
        call()
    assert str(caught.value).startswith(message), str(caught.value)


def test_retry_delay_is_checked():
    assert Retry(delay=2).delay == 2.0
    with pytest.raises(ValueError, match="delay: must be from 0 to 43200 seconds"):
        Retry(delay=-1)


def test_the_queue_engine_imports_no_django():
    code = ("import sys, outbox.queue.markers_consumer, outbox.queue.tracker, outbox.queue.producer, "
            "outbox.queue.tracker_state; "
            "print(sorted(m for m in sys.modules if m == 'django' or m.startswith('django.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_backend_is_chosen_per_queue_and_decides_where_messages_go():
    with override_settings(OUTBOX={"queues": {"topic": "q", "per_queue": {"emails": {"backend": "share"}}}}):
        assert app_settings.problems() == []
        config = app_settings.queue_config()
    assert (config.backend("emails"), config.backend("other")) == ("share", "markers")
    assert config.topic_for("emails") == "q-share-emails" and config.topic_for("other") == "q"
    assert config.share_group("emails") != config.consumer_group("emails"), "Kafka keeps one kind of group per id"


def test_the_share_backend_imports_no_django():
    code = ("import sys, outbox.queue.share_consumer, outbox.queue.share_state, outbox.queue.share_group; "
            "print(sorted(m for m in sys.modules if m == 'django' or m.startswith('django.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_shared_limit_that_breaks_one_queue_is_said_on_the_key_the_user_wrote_naming_the_queue():
    """A queue of per_queue takes the limits set for every queue unless it sets its own: a problem one of those makes
    in that queue is the shared key's (the user never wrote the per-queue one), said once, naming the queue."""
    found = queue_checks({"keep_alive_interval": 20, "per_queue": {"quick": {"redelivery_timeout": 5}}})
    assert found == [("outbox_queue.E004", "OUTBOX['queues']['keep_alive_interval'] must be above 0 and below "
                                           "redelivery_timeout (5s), got 20: a keep-alive must arrive before the "
                                           "deadline it extends (in queue 'quick', which takes it from here)")]
    # Breaking every queue alike: said once, without a queue.
    found = queue_checks({"keep_alive_interval": 40, "per_queue": {"a": {"max_in_progress": 2}}})
    assert [msg for _, msg in found] == ["OUTBOX['queues']['keep_alive_interval'] must be above 0 and below "
                                         "redelivery_timeout (30s), got 40: a keep-alive must arrive before the "
                                         "deadline it extends"]
    # A queue's own key stays its own.
    found = queue_checks({"per_queue": {"a": {"redelivery_timeout": 5, "keep_alive_interval": 6}}})
    assert [msg.split(" must ")[0] for _, msg in found] == ["OUTBOX['queues']['per_queue']['a']['keep_alive_interval']"]


def test_the_share_backend_takes_no_keep_alive_so_an_inherited_one_is_no_problem():
    """Share queues have no keep-alives (the broker's lock is the redelivery timeout): a shared keep_alive_interval
    that a markers queue needs is not an error, nor a warning, in a share queue with a shorter timeout."""
    assert queue_checks({"keep_alive_interval": 12, "per_queue": {"mail": {"backend": "share",
                                                                           "redelivery_timeout": 5}}}) == []
    assert queue_checks({"redelivery_timeout": 10, "keep_alive_interval": 8, "backend": "share"}) == []


def test_a_warning_a_shared_limit_makes_in_one_queue_is_said_on_the_shared_key():
    found = queue_checks({"keep_alive_interval": 4, "per_queue": {"quick": {"redelivery_timeout": 6}}})
    assert found == [("outbox_queue.W001", "OUTBOX['queues']['keep_alive_interval'] 4s leaves less than half the "
                                           "redelivery timeout (6s) for a keep-alive to reach the tracker; one slow "
                                           "marker means a needless redelivery (in queue 'quick', which takes it "
                                           "from here)")]


@pytest.mark.parametrize("queues", [{"redelivery_timeout": "30", "keep_alive_interval": 0},
                                    {"redelivery_timeout": "30"},
                                    {"backend": "share", "keep_alive_interval": "abc"}])
def test_a_malformed_limit_is_an_error_line_never_a_traceback(queues):
    found = queue_checks(queues)
    assert found and all(code.startswith("outbox_queue.E") for code, _ in found), found
