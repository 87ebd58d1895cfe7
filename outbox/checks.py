"""System checks: `manage.py check` fails on a bad OUTBOX setting, with a stable error code."""

from __future__ import annotations

from typing import Any

from django.core import checks

from outbox import conf, settings_problems
from outbox.kafka.problems import Problem
from outbox.kafka.redaction import scrub


@checks.register("outbox")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    hint = "Every OUTBOX setting, its limit and each check code: the documentation's settings reference."
    errors = [checks.Error(describe(p), hint=hint, id=f"outbox.{p.code}") for p in settings_problems.problems()]
    if errors:  # each problem once: what a setting in error also weakens waits until it is fixed
        return errors
    return [checks.Warning(describe(p), hint=hint, id=f"outbox.{p.code}") for p in settings_problems.warnings()]


@checks.register(checks.Tags.database)
def check_shared_group(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """With `check --database`: warn when the status rows show another table harvested in our leader group."""
    alias = conf.database_alias()
    if not databases or alias not in databases or settings_problems.problems():
        return []
    from django.db import DatabaseError
    from django.utils import timezone

    from outbox.models import HarvesterStatus

    config = conf.harvest_config()
    seen_after = timezone.now() - timezone.timedelta(seconds=conf.setting("status_gone_after"))
    try:
        others = list(HarvesterStatus.objects.using(alias).filter(leader_group=config.leader_group,
                                                                  last_seen__gte=seen_after)
                      .exclude(harvested_table=config.table).values_list("name", "harvested_table")[:5])
    except DatabaseError:
        return []  # not migrated yet: nothing to compare
    return [checks.Warning(
        f"OUTBOX['leader_group'] {config.leader_group!r} is also used by replica {name}, which harvests table "
        f"{table!r}: in one group only one of the two tables is ever harvested",
        hint="Give each outbox its own leader_group and leader_topic (leave them unset to derive them from the "
             "database and table).", id="outbox.W002") for name, table in others]


def describe(problem: Problem) -> str:
    """One line naming the setting: OUTBOX['max_in_flight_records'] must be at least 1, got 0 (secret
    values masked, should a message quote one)."""
    where = "OUTBOX" if problem.field == "OUTBOX" else f"OUTBOX[{problem.field!r}]"
    if problem.field.startswith("cloudevents."):  # a key of the nested dict
        where = f"OUTBOX['cloudevents'][{problem.field.split('.', 1)[1]!r}]"
    if problem.field.startswith("outboxes."):  # an entry of OUTBOX['outboxes'], or a key of one
        where = "OUTBOX" + "".join(f"[{part!r}]" for part in problem.field.split(".", 2))
    return scrub(f"{where} {problem.message}", conf.secret_values())
