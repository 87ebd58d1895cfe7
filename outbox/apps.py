from django.apps import AppConfig


class OutboxConfig(AppConfig):
    name = "outbox"
    verbose_name = "Outbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from outbox import checks, conf  # noqa: F401  registers the system checks
        from outbox.kafka.redaction import remember_secrets

        # Log lines and one-line errors mask these wherever they turn up (outbox.kafka.redaction): in every process
        # of the project, web servers and shells too, not only those that build a harvester.
        remember_secrets(*conf.secret_settings())
