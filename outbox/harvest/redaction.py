"""Where `RedactingFilter` lived before the shared Kafka layer: `outbox.kafka.redaction` holds it now. A project's
LOGGING written against this path keeps working (with a DeprecationWarning); point it at the new one."""

from __future__ import annotations

import warnings

from outbox.kafka.redaction import RedactingFilter

__all__ = ["RedactingFilter"]

warnings.warn("outbox.harvest.redaction moved to outbox.kafka.redaction: use outbox.kafka.redaction.RedactingFilter "
              "in LOGGING", DeprecationWarning, stacklevel=2)
