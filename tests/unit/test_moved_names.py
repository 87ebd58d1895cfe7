"""Names a project may have written into its settings keep working after they moved, with a warning that says
where they went."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_the_logging_filter_at_its_old_path() -> None:
    sys.modules.pop("outbox.harvest.redaction", None)
    with pytest.warns(DeprecationWarning, match="outbox.kafka.redaction"):
        old = importlib.import_module("outbox.harvest.redaction")
    from outbox.kafka.redaction import RedactingFilter

    assert old.RedactingFilter is RedactingFilter
