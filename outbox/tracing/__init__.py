"""Trace context through the outbox with OpenTelemetry (docs/tracing.md).

Nothing in this package imports `opentelemetry` at import time except the modules that only run
once tracing is on (`publish.py`, `consume.py`, `propagation.py`'s helpers): with the setting off,
or without opentelemetry-api installed, the outbox never imports it.
"""
