from django.apps import AppConfig


class QueueConfig(AppConfig):
    """Message queues over Kafka: add "outbox.queue" to INSTALLED_APPS (beside "outbox")."""

    name = "outbox.queue"
    label = "outbox_queue"
    verbose_name = "Outbox queues"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # OUTBOX keys are checked by the outbox app (an unknown one is outbox.E002); it knows "queues" is ours
        # while this app is installed (conf.APP_KEYS).
        from outbox.queue import checks  # noqa: F401  registers the system checks
