"""Everything wrong with OUTBOX = {...}, each problem with its check code, gathered from the parts that own each
setting: conf (the Django side's keys and the engine's HarvestConfig), cloudevents, many (several outboxes), the
tracing switch. manage.py check (checks.py) and manage.py harvest report them. conf itself only reads settings,
so the parts it gathers from may read them through it."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from outbox import conf
from outbox.cloudevents import settings_problems as cloudevent_problems
from outbox.harvest.kafka import client_config_problems
from outbox.kafka.keys import NO_BOOTSTRAP
from outbox.kafka.problems import Problem, unknown_keys
from outbox.many import problems as outboxes_problems
from outbox.tracing import switch

#: What each check code of OUTBOX means (docs/reference/settings.md is written from it).
CHECK_CODES: dict[str, str] = {
    "outbox.E001": "`OUTBOX` is not a dict",
    "outbox.E002": "an unknown key (with a \"did you mean\")",
    "outbox.E003": "a value of the wrong type",
    "outbox.E004": "a value below its minimum (or above its maximum)",
    "outbox.E005": "the harvester has no database to connect to (`dsn`)",
    "outbox.E006": "a bad `table` name",
    "outbox.E007": "a bad topic name (`leader_topic`, `dead_letter_topic`)",
    "outbox.E008": "a bad `leader_group` or `name` (empty, or with a control character that would forge a log line)",
    "outbox.E009": "`base_kafka_config` or `producer_kafka_config` not a mapping of librdkafka properties",
    "outbox.E010": "`base_kafka_config` without `bootstrap.servers` once merged (an empty value)",
    "outbox.E011": "`database` not an entry of `DATABASES`",
    "outbox.E012": "`database` not a PostgreSQL entry of `DATABASES`",
    "outbox.E013": "librdkafka refuses a property in `base_kafka_config` or `producer_kafka_config` (checked by "
        "librdkafka itself)",
    "outbox.E014": "a producer setting that would break per-key order: `enable.idempotence` off, `acks` not `all`, "
        "or librdkafka's `delivery.timeout.ms`, `message.timeout.ms` or `enable.gapless.guarantee` set while "
        "`max_in_flight_per_key > 1`",
    "outbox.E015": "`tracing` not `True` or `False`",
    "outbox.E016": "a bad `cloudevents` dict: an unknown key, an empty `source`, `types` not a map of topic names to "
        "non-empty types (or `types` without `source`), a `content_type` that is not a media type",
    "outbox.E017": "`shards` not a whole number from 1 to 256",
    "outbox.E018": "a bad `outboxes` dict: not a dict of names to dicts, a bad name, an unknown or bad key of an entry",
    "outbox.W001": "a delivery timeout too long for safe fail-over (`heartbeat_timeout` plus the delivery timeout must "
        "stay under the session timeout)",
    "outbox.W002": "`check --database default`: another table's replicas use the same leader group",
    "outbox.W003": "`table` differs from the model's table, which `stash()` and the admin use",
    "outbox.W004": "a retired setting (`rescan_interval`): it does nothing any more",
    "outbox.W005": "`tracing` set to `True` but `opentelemetry-api` is not installed: nothing is traced",
    "outbox.W006": "no `bootstrap.servers` in `base_kafka_config` and no `KAFKA_BOOTSTRAP_SERVERS`: Kafka is looked "
        "for at `localhost:9092`",
    "outbox.W007": "`heartbeat_timeout` under 2 s: the leader group's session timeout (3 x it) is under the 6 s "
        "Kafka's brokers accept by default (`group.min.session.timeout.ms`)",
}


def settings_problems() -> list[Problem]:
    """Problems with OUTBOX itself and its Django-side keys (the engine's are HarvestConfig's)."""
    read_once = conf.current()
    if read_once.problems and read_once.problems[0].code == "E001":
        return list(read_once.problems)
    raw = read_once.raw
    found = [*unknown_keys(raw, conf.known_keys()), *read_once.problems,
             *(Problem("E016", field, message) for field, message in cloudevent_problems(raw.get("cloudevents"))),
             *outboxes_problems(raw.get("outboxes"))]
    database = raw.get("database", conf.OutboxKeys.database)  # not a string: said by read_once.problems
    if isinstance(database, str) and (why := conf.alias_problem(database)) is not None:
        found.append(Problem("E012" if database in settings.DATABASES else "E011", "database", why))
    return found


def problems(**overrides: Any) -> list[Problem]:
    """Everything wrong with the outbox settings (with command-line overrides), for `manage.py check`."""
    found = settings_problems()
    if any(p.code in {"E001", "E011", "E012"} for p in found):
        return found
    alias = overrides.get("database")
    if alias is not None and (problem := conf.alias_problem(alias)) is not None:
        return [*found, Problem("E011", "database", problem)]
    config, given, _ = conf.build(**overrides)
    return found + (config.validate(given_limits=given) or client_config_problems(config))


def warnings() -> list[Problem]:
    """Settings that work but weaken a guarantee, for `manage.py check`."""
    if settings_problems():
        return []
    config, given, source = conf.build()
    if config.validate(given_limits=given):
        return []
    from outbox.models import OutboxRecord

    raw, model_table = conf.raw_settings(), OutboxRecord._meta.db_table
    rules = [
        *((key in raw, Problem("W004", key, f"no longer does anything ({why}); remove it"))
          for key, why in conf.RETIRED_KEYS.items()),
        (raw.get("tracing") is True and not switch.otel_installed(),
         Problem("W005", "tracing", "is True but opentelemetry-api is not installed, so nothing is traced: install "
                                    "django-outbox-harvest[otel]")),
        (source is None, NO_BOOTSTRAP),
        (config.table != model_table,
         Problem("W003", "table", f"the harvester harvests {config.table!r}, while stash() and the admin use the "
                                  f"model's table {model_table!r}")),
    ]
    return config.warnings() + [problem for broken, problem in rules if broken]
