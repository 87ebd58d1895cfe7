"""Helpers shared by the integration, acceptance, spark and browser tests (no tests here)."""
