"""Django's admin autodiscovery imports `<app>.admin`: the console registers the outbox's pages there."""

from outbox.console import admin  # noqa: F401  (registers the ModelAdmins)
