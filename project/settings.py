"""Settings for the example project; everything that differs between machines comes from the environment.

Defaults match `bin/services up` (Postgres on 127.0.0.1:5432, Kafka on 127.0.0.1:9092).
"""

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env(
    DEBUG=(bool, False),
    DATABASE_URL=(str, "postgres://outbox:outbox@127.0.0.1:5432/outbox"),
    KAFKA_BOOTSTRAP_SERVERS=(str, "127.0.0.1:9092"),
    ALLOWED_HOSTS=(list, ["127.0.0.1", "localhost"]),
    SECRET_KEY=(str, "example-project-not-secret"),
    LOG_LEVEL=(str, "INFO"),
)
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

SECRET_KEY = env("SECRET_KEY")
DEBUG = env("DEBUG")
ALLOWED_HOSTS = env("ALLOWED_HOSTS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "outbox",
    "outbox.queue",
    "project.shop",
    "project.bench",
]

MIDDLEWARE = [
    "project.tracing.RequestSpanMiddleware",  # a span per request when OpenTelemetry is installed (docs/tracing.md)
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"

DATABASES = {"default": env.db_url("DATABASE_URL")}
DATABASES["default"]["TEST"] = {"NAME": env("TEST_DATABASE_NAME", default="outbox_test")}


def queue_names(prefix: str) -> dict[str, str]:
    return {"topic": prefix, "markers_topic": f"{prefix}-markers", "consumer_group_prefix": f"{prefix}-",
            "tracker_group": f"{prefix}-tracker"}


# Kafka security from the environment, for clusters behind TLS and SASL (`bin/services up --secure` writes
# these variables to .services/<layout>/client.env). Only those set are passed on.
KAFKA_SECURITY_ENVIRONMENT = {
    "KAFKA_SECURITY_PROTOCOL": "security.protocol",  # e.g. SASL_SSL
    "KAFKA_SASL_MECHANISM": "sasl.mechanism",  # e.g. SCRAM-SHA-512, PLAIN
    "KAFKA_SASL_USERNAME": "sasl.username",
    "KAFKA_SASL_PASSWORD": "sasl.password",
    "KAFKA_SSL_CA_LOCATION": "ssl.ca.location",  # the CA that signed the brokers' certificates (a PEM file)
}

OUTBOX = {
    "base_kafka_config": {
        "bootstrap.servers": env("KAFKA_BOOTSTRAP_SERVERS"),
        **{key: env(name) for name, key in KAFKA_SECURITY_ENVIRONMENT.items() if env(name, default="")},
    },
    # librdkafka producer settings as "key=value,key=value", e.g. "compression.type=lz4,linger.ms=1"
    "producer_kafka_config": env.dict("OUTBOX_PRODUCER_KAFKA_CONFIG", default={}),
    "leader_topic": env("OUTBOX_LEADER_TOPIC", default="example-outbox-leader"),
    "leader_group": env("OUTBOX_LEADER_GROUP", default="example-outbox-leader"),
    # The dashboard and harvest_health say who holds the database's horizon back this long (seconds).
    "horizon_warn_after": env.float("OUTBOX_HORIZON_WARN_AFTER", default=60.0),
    # outbox.queue: the topic pair and the consumer groups all start with this prefix.
    # OUTBOX_QUEUE_BACKEND=share: every queue on Kafka's share groups (Kafka 4.2+; docs/queue-backends.md).
    "queues": {**queue_names(env("OUTBOX_QUEUE_PREFIX", default="example-queue")),
               "backend": env("OUTBOX_QUEUE_BACKEND", default="markers")},
    # OpenTelemetry trace context and spans when opentelemetry-api is installed (docs/tracing.md).
    "tracing": env.bool("OUTBOX_TRACING", default=True),
}

# An OpenTelemetry SDK for this example's processes: "console" or "discard" (project/otel.py); unset: none.
if env("OUTBOX_EXAMPLE_OTEL", default=""):
    from project import otel

    otel.configure(env("OUTBOX_EXAMPLE_OTEL"))

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / ".artifacts" / "static"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    # Masks the secret values of OUTBOX and DATABASES should any line quote one (docs/kafka.md, "What is secret").
    "filters": {"outbox_redact": {"()": "outbox.kafka.redaction.RedactingFilter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["outbox_redact"]}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {"outbox": {"level": env("LOG_LEVEL"), "propagate": True}},
}
