"""Fuzzed settings: any OUTBOX mapping (and OUTBOX["queues"]) either yields coded check errors or a working
configuration, never a traceback; the configuration then prints without secrets. Profiles: tests/conftest.py."""

from __future__ import annotations

from datetime import timedelta

from django.core import checks
from django.test import override_settings
from hypothesis import example, given
from hypothesis import strategies as st

from outbox import conf
from outbox.kafka.redaction import REDACTED
from outbox.queue import app_settings as queue_settings

SCALARS = (st.none() | st.booleans() | st.integers(-10, 10**7) | st.floats(allow_nan=True) | st.text(max_size=20)
           | st.floats(0.001, 100).map(lambda s: timedelta(seconds=s)))
ANYTHING = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=10), inner, max_size=3), max_leaves=6)
KAFKA_NAMES = st.sampled_from(["bootstrap.servers", "compression.type", "linger.ms", "acks", "enable.idempotence",
                               "batch.size", "sasl.password", "security.protocol", "client.id", "no.such.property",
                               "delivery.timeout.ms", "message.max.bytes"])
KAFKA_CONFIG = st.dictionaries(KAFKA_NAMES, st.text("abc0123456789:.,", max_size=12) | st.integers(-1, 10**6)
                               | st.booleans(), max_size=4) | ANYTHING
QUEUE_SETTINGS = st.dictionaries(st.sampled_from(sorted(queue_settings.KNOWN_KEYS)) | st.text(max_size=8),
                                 ANYTHING | st.dictionaries(st.sampled_from(["emails", "bad name"]),
                                                            st.dictionaries(st.sampled_from(
                                                                ["redelivery_timeout", "max_deliveries", "typo"]),
                                                                SCALARS, max_size=2), max_size=2), max_size=4)
SETTING_VALUES = {"base_kafka_config": KAFKA_CONFIG, "producer_kafka_config": KAFKA_CONFIG, "queues": QUEUE_SETTINGS,
                  "database": st.sampled_from(["default", "nope"]) | SCALARS}


@st.composite
def outbox_settings(draw: st.DrawFn) -> object:
    names = st.sampled_from(sorted(conf.known_keys() | {"queues"})) | st.text(max_size=12)
    if draw(st.integers(0, 9)) == 0:
        return draw(ANYTHING)  # not even a dict
    keys = draw(st.lists(names, max_size=6, unique=True))
    return {key: draw(SETTING_VALUES.get(key, ANYTHING)) for key in keys}


@given(outbox=outbox_settings())
# Found by the long profile (3,000 examples): a queue setting named "\n" made a check message of two lines.
@example(outbox={"base_kafka_config": {}, "queues": {"consumer_group_prefix": {}, "\n": {}}})
def test_any_outbox_setting_gives_coded_errors_or_a_working_configuration(outbox):
    with override_settings(OUTBOX=outbox):
        messages = checks.run_checks(tags=["outbox", "outbox_queue"])
        assert all(m.id and m.id.split(".")[0] in {"outbox", "outbox_queue"} for m in messages), messages
        assert all("\n" not in m.msg for m in messages), "each problem is one line"
        if any(m.level >= checks.ERROR and m.id.startswith("outbox.") for m in messages):
            return
        config = conf.harvest_config()
        assert config.validate() == []
        shown = f"{config!r} {config.redacted()}"
        assert "sasl.password': '" not in shown or f"sasl.password': '{REDACTED}'" in shown
        if not any(m.level >= checks.ERROR for m in messages):
            queue_settings.queue_config().redacted()
