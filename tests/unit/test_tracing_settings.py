"""OUTBOX["tracing"] and OUTBOX["cloudevents"]: bad values are one check error each; per-call CloudEvents
arguments are refused naming the field; the switch follows the settings."""

from __future__ import annotations

import sys

import pytest
from django.core import checks
from django.test import override_settings

from outbox import cloudevents
from outbox.errors import InvalidRecord
from outbox.harvest import contract
from outbox.tracing import switch
from outbox.validation import clean


@pytest.mark.parametrize(("outbox", "code", "text"), [
    ({"tracing": "yes"}, "outbox.E015", "OUTBOX['tracing'] must be True or False, got 'yes'"),
    ({"cloudevents": "on"}, "outbox.E016", "OUTBOX['cloudevents'] must be a dict"),
    ({"cloudevents": {"source": ""}}, "outbox.E016", "OUTBOX['cloudevents']['source'] must be a non-empty str"),
    ({"cloudevents": {"types": {"orders": "x"}}}, "outbox.E016",
     "OUTBOX['cloudevents']['source'] is required when cloudevents.types names topics"),
    ({"cloudevents": {"source": "/s", "types": {"orders": ""}}}, "outbox.E016",
     "OUTBOX['cloudevents']['types'] must map topic names to non-empty event types"),
    ({"cloudevents": {"source": "/s", "content_type": "json"}}, "outbox.E016",
     "OUTBOX['cloudevents']['content_type'] must be a media type"),
    ({"cloudevents": {"source": "/s", "sorce": "/t"}}, "outbox.E016",
     "OUTBOX['cloudevents']['sorce'] is not a known key"),
])
def test_each_bad_tracing_setting_is_one_clear_check_error(outbox, code, text):
    with override_settings(OUTBOX=outbox):
        messages = checks.run_checks(tags=["outbox"])
    assert [m.id for m in messages] == [code], [m.msg for m in messages]
    assert messages[0].msg.startswith(text), messages[0].msg


def test_good_tracing_settings_pass():
    with override_settings(OUTBOX={"tracing": False, "cloudevents": {"source": "/shop", "types": {"orders": "o"},
                                                                      "content_type": "application/json"}}):
        assert checks.run_checks(tags=["outbox"]) == []


def test_tracing_true_without_opentelemetry_is_a_warning(monkeypatch):
    monkeypatch.setattr(switch, "otel_installed", lambda: False)
    with override_settings(OUTBOX={"tracing": True}):
        messages = checks.run_checks(tags=["outbox"])
    assert [m.id for m in messages] == ["outbox.W005"]


def test_the_switch_follows_the_setting():
    with override_settings(OUTBOX={"tracing": False}):
        assert switch.tracing_on() is False
    assert switch.tracing_on() is True  # the default, with opentelemetry-api installed (the dev extra)


def test_the_switch_is_off_when_opentelemetry_does_not_import_whatever_the_setting(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.propagate", None)  # `import` raises ImportError
    with override_settings(OUTBOX={"tracing": True}):
        assert switch.tracing_on() is False
    switch.reset()


def row(topic: str = "orders", value: str | None = "{}"):
    return clean(topic, "k", value, {"app": "1"}, max_value_bytes=1000, max_header_bytes=1000)


def test_cloudevent_headers_per_call_and_from_settings():
    record = row()
    cloudevents.add_headers(record, {"type": "t.placed", "source": "/shop", "subject": "s"})
    assert list(zip(record.header_keys, record.header_values, strict=True)) == [
        ("app", "1"), ("ce_specversion", "1.0"), ("ce_type", "t.placed"), ("ce_source", "/shop"),
        ("ce_subject", "s"), ("content-type", "application/json")]
    with override_settings(OUTBOX={"cloudevents": {"source": "/shop", "types": {"orders": "o.v1"}}}):
        automatic, other, refused = row(), row("payments"), row()
        cloudevents.add_headers(automatic, None)
        cloudevents.add_headers(other, None)
        cloudevents.add_headers(refused, False)
    assert dict(zip(automatic.header_keys, automatic.header_values, strict=True))["ce_type"] == "o.v1"
    assert other.header_keys == ["app"] and refused.header_keys == ["app"]


def test_the_callers_cloudevent_headers_win():
    record = clean("orders", "k", "{}", {"ce_source": "/theirs"}, max_value_bytes=1000, max_header_bytes=1000)
    cloudevents.add_headers(record, {"type": "t", "source": "/ours"})
    assert record.header_keys.count("ce_source") == 1
    assert dict(zip(record.header_keys, record.header_values, strict=True))["ce_source"] == "/theirs"


@pytest.mark.parametrize(("spec", "field"), [
    ({"type": "t"}, "cloudevent.source"),
    ({"source": "/s"}, "cloudevent.type"),
    ({"type": "t", "source": "/s", "id": ""}, "cloudevent.id"),
    ({"type": "t", "source": "/s", "kind": "x"}, "cloudevent"),
    ("yes", "cloudevent"),
    (True, "cloudevent.type"),
])
def test_a_bad_cloudevent_argument_names_its_field(spec, field):
    with pytest.raises(InvalidRecord) as raised:
        cloudevents.add_headers(row(), spec)
    assert raised.value.field == field


@pytest.mark.parametrize(("spec", "field", "message"), [
    ({"type": "", "source": "/s"}, "cloudevent.type", "must be a non-empty str, got ''"),
    ({"type": "t", "source": ""}, "cloudevent.source", "must be a non-empty str, got ''"),
    ({"type": "t", "source": "/s", "content_type": ""}, "cloudevent.content_type",
     "must be a media type such as 'application/json', got ''"),
    ({"type": "t", "source": "/s", "content_type": "json"}, "cloudevent.content_type",
     "must be a media type such as 'application/json', got 'json'"),
])
def test_an_empty_cloudevent_field_given_per_call_is_refused_not_taken_from_the_settings(spec, field, message):
    """A field the call gives is the call's: empty, it is refused with what it was (as the setting's own is), even
    where the settings have one to fall back on."""
    settings = {"cloudevents": {"source": "/shop", "types": {"orders": "placed"}, "content_type": "application/json"}}
    with override_settings(OUTBOX=settings), pytest.raises(InvalidRecord) as raised:
        cloudevents.add_headers(row(), spec)
    assert (raised.value.field, str(raised.value)) == (field, f"{field}: {message}")


def test_the_harvester_adds_only_what_a_cloudevent_lacks():
    assert contract.cloudevent_headers(7, "2026-01-01T00:00:00.000000Z", ["ce_specversion"]) == [
        ("ce_id", "7"), ("ce_time", "2026-01-01T00:00:00.000000Z")]
    assert contract.cloudevent_headers(7, "t", ["ce_specversion", "ce_id", "ce_time"]) == []
