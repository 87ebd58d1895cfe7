"""CloudEvents in Kafka's binary mode: the ce_ headers stash() adds (per call, or by topic from settings).

stash() writes ce_specversion, ce_type, ce_source (and ce_subject, content-type, a given ce_id);
the harvester adds ce_id (the outbox id) and ce_time (the create time) when publishing a record
that has ce_specversion but not those (contract.cloudevent_headers), because neither is known
before the row is inserted. A plain-SQL writer gets the same by writing the first set itself.

    OUTBOX = {"cloudevents": {"source": "/shop", "types": {"orders": "com.example.shop.order"}}}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from outbox import conf
from outbox.errors import InvalidRecord
from outbox.harvest import contract
from outbox.harvest.contract import Record

SETTING_KEYS = frozenset({"source", "types", "content_type"})
CALL_KEYS = frozenset({"type", "source", "id", "subject", "content_type"})
DEFAULT_CONTENT_TYPE = "application/json"



def configured() -> Mapping[str, Any]:
    """OUTBOX["cloudevents"] as read once ({}: not configured, or not a dict: check says so)."""
    return conf.current().cloudevents


def add_headers(record: Record, spec: Any, prefix: str = "") -> None:
    """Add the ce_ headers `spec` asks for to a cleaned record; headers the caller set win.

    `spec`: None (as the settings say for this topic), False (never), True (the settings' source and
    this topic's type, which must exist), or a mapping with type, source, id, subject, content_type.
    """
    if spec is False:
        return
    settings = configured()
    types = settings.get("types") or {}
    if spec is None:
        if record.topic not in types:
            return
        spec = {}
    elif spec is True:
        spec = {}
    elif not isinstance(spec, Mapping):
        raise InvalidRecord(f"{prefix}cloudevent", f"must be None, True, False or a mapping, got "
                                                   f"{type(spec).__name__}")
    unknown = set(spec) - CALL_KEYS
    if unknown:
        raise InvalidRecord(f"{prefix}cloudevent", f"unknown field(s) {sorted(map(str, unknown))}; "
                                                   f"allowed: {', '.join(sorted(CALL_KEYS))}")
    # A field given (not None) is the call's, and must be valid itself: an empty one is not "use the settings'".
    event_type = spec["type"] if spec.get("type") is not None else types.get(record.topic)
    source = spec["source"] if spec.get("source") is not None else settings.get("source")
    for name, text in (("type", event_type), ("source", source)):
        if not isinstance(text, str) or not text:
            hint = "" if spec.get(name) is not None else \
                f" (or set OUTBOX['cloudevents'][{'types' if name == 'type' else 'source'!r}])"
            raise InvalidRecord(f"{prefix}cloudevent.{name}", f"must be a non-empty str{hint}, got {text!r}")
    extra = [(contract.CE_SPECVERSION, "1.0"), (contract.CE_TYPE, event_type), (contract.CE_SOURCE, source)]
    for field, header in (("id", contract.CE_ID), ("subject", contract.CE_SUBJECT)):
        text = spec.get(field)
        if text is not None:
            if not isinstance(text, str) or not text:
                raise InvalidRecord(f"{prefix}cloudevent.{field}", f"must be a non-empty str, got {text!r}")
            extra.append((header, text))
    content_type = spec["content_type"] if spec.get("content_type") is not None else \
        settings.get("content_type") or DEFAULT_CONTENT_TYPE
    if not isinstance(content_type, str) or "/" not in content_type:
        raise InvalidRecord(f"{prefix}cloudevent.content_type", f"must be a media type such as 'application/json', "
                                                                f"got {content_type!r}")
    if record.value is not None:
        extra.append((contract.CONTENT_TYPE, content_type))
    taken = {name.lower() for name in record.header_keys}
    for name, text in extra:
        if name not in taken:
            record.header_keys.append(name)
            record.header_values.append(text)


def settings_problems(value: Any) -> list[tuple[str, str]]:
    """(field, message) for each problem with OUTBOX["cloudevents"]."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        return [("cloudevents", f"must be a dict with source, types and content_type, got {type(value).__name__}")]
    source, types, content_type = value.get("source"), value.get("types", {}), value.get("content_type")
    mapped = isinstance(types, Mapping) and all(isinstance(k, str) and isinstance(v, str) and v
                                                for k, v in types.items())
    rules = [
        *((True, key, f"is not a known key (known: {', '.join(sorted(SETTING_KEYS))})")
          for key in sorted(set(value) - SETTING_KEYS, key=str)),
        (source is not None and (not isinstance(source, str) or not source), "source",
         f"must be a non-empty str (a URI reference), got {source!r}"),
        (not mapped, "types", f"must map topic names to non-empty event types, got {types!r}"),
        (mapped and bool(types) and source is None, "source", "is required when cloudevents.types names topics"),
        (content_type is not None and (not isinstance(content_type, str) or "/" not in content_type), "content_type",
         f"must be a media type such as 'application/json', got {content_type!r}"),
    ]
    return [(f"cloudevents.{key}", why) for broken, key, why in rules if broken]
