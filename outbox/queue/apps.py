from django.apps import AppConfig


class QueueConfig(AppConfig):
    """Message queues over Kafka: add "outbox.queue" to INSTALLED_APPS (beside "outbox")."""

    name = "outbox.queue"
    label = "outbox_queue"
    verbose_name = "Outbox queues"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from outbox import conf
        from outbox.queue import checks  # noqa: F401  registers the system checks

        # OUTBOX keys are checked by the outbox app (an unknown one is outbox.E002): "queues" is ours.
        conf.EXTRA_KEYS.add("queues")
