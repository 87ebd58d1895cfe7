"""Benchmarks and load tools for this repository (`manage.py outbox_bench`, `outbox_pump`,
`outbox_audit_bench`): part of the example project, never of the installed package."""
