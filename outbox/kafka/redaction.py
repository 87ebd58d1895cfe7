"""What is secret, decided in one place, and the masking of everything that prints or logs configuration.

`is_secret(name)` is the one decision: every `--print-config`, every config object's repr, the
checks' messages, the commands' one-line errors and the log filter ask it, so a secret-bearing
setting is masked everywhere or nowhere. It covers

- every property librdkafka itself marks sensitive (`_RK_SENSITIVE` in its src/rdkafka_conf.c, as
  of librdkafka 2.15-2.16: it never logs these either);
- every libpq connection parameter that holds a secret (`password`, `sslpassword`; a `passfile`'s
  contents are never read here, only its path is shown);
- by name, any other setting whose name contains password, passphrase, secret, token, credential,
  jaas or private, or ends in `.pem` or `key`: a property a future librdkafka adds, or a Java-style
  one pasted by mistake, is masked before anyone knows it exists.

Masking a harmless value costs a line of `***`; missing a secret costs a rotation. So this errs on
the side of masking. `scrub(text)` is the second line of defence: it replaces the secret values
themselves wherever they turn up (a client's error message, a traceback), whatever carried them.
Nothing here imports Django.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox.reasons import first_line

REDACTED = "***"

#: librdkafka's sensitive properties (`_RK_SENSITIVE`), from src/rdkafka_conf.c of the version
#: confluent-kafka bundles (2.16; the list is unchanged since 2.15). `ssl_key` is its internal name
#: for a key handed over in memory.
LIBRDKAFKA_SENSITIVE = frozenset({
    "ssl.key.location", "ssl.key.password", "ssl.key.pem", "ssl_key", "ssl.ca.pem", "ssl.keystore.password",
    "sasl.username", "sasl.password", "sasl.oauthbearer.config", "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.assertion.private.key.file", "sasl.oauthbearer.assertion.private.key.passphrase",
    "sasl.oauthbearer.assertion.private.key.pem",
})
#: libpq connection parameters whose values are secrets.
LIBPQ_SECRETS = frozenset({"password", "sslpassword"})
#: Any other name that looks like it holds a secret (Django's HIDDEN_SETTINGS does the same).
SECRET_NAME = re.compile(r"pass(?:word|wd|phrase)|secret|token|credential|jaas|private|(?:\.pem|key)$",
                         re.IGNORECASE)
#: Secret values shorter than this are not scrubbed from free text: they would mask ordinary words
#: (a development database whose password is its name would blank the name from every log line).
#: They are still masked wherever their setting is printed by name.
MIN_SCRUBBED_LENGTH = 8
#: Keys whose value is a whole connection string.
DSN_KEYS = frozenset({"dsn", "database_url"})


def is_secret(name: object) -> bool:
    """Whether a setting, Kafka property or connection parameter called `name` holds a secret."""
    if not isinstance(name, str):
        return False
    lowered = name.strip().lower()
    return lowered in LIBRDKAFKA_SENSITIVE or lowered in LIBPQ_SECRETS or bool(SECRET_NAME.search(lowered))


def redact_mapping(config: Any) -> Any:
    """A copy of a settings mapping (nested mappings and lists too) with every secret value masked;
    a `dsn` entry is masked as a connection string. Anything that is not a mapping is returned as is."""
    if not isinstance(config, Mapping):
        return config
    redacted: dict[Any, Any] = {}
    for key, value in config.items():
        if is_secret(key):
            redacted[key] = REDACTED
        elif isinstance(key, str) and key.lower() in DSN_KEYS:
            redacted[key] = redact_dsn(value)
        elif isinstance(value, Mapping):
            redacted[key] = redact_mapping(value)
        elif isinstance(value, list | tuple):
            redacted[key] = [redact_mapping(item) for item in value]
        else:
            redacted[key] = value
    return redacted


def redact_dsn(dsn: Any) -> str:
    """A libpq connection string or URL with its secret parameters masked.

    Parsed by libpq's own rules (psycopg), so every way of writing a password (URL user info, a
    query parameter, a quoted key=value) is found; one that carries a secret is shown as key=value
    pairs. A string libpq cannot parse is masked whole: there is no telling where a secret in it ends.
    """
    if not isinstance(dsn, str):
        return REDACTED
    try:
        params = conninfo_to_dict(dsn)
    except Exception:  # psycopg.ProgrammingError and friends: not a connection string
        return REDACTED
    if not any(is_secret(key) for key in params):
        return dsn
    return make_conninfo(**{key: (REDACTED if is_secret(key) else value) for key, value in params.items()})


def dsn_problem(dsn: str) -> str | None:
    """Why libpq cannot parse `dsn`, in words that quote none of its values (a quoted token could be
    part of a password; a parameter name is kept), or None when it parses."""
    try:
        conninfo_to_dict(dsn)
    except Exception as error:
        reason = re.sub(r'"([^"]*)"', lambda m: m[0] if m[1] in _libpq_keywords() or m[1] == "=" else '"..."',
                        first_line(error))
        return f"is not a libpq connection string or URL ({reason})"
    return None


@functools.cache
def _libpq_keywords() -> frozenset[str]:
    return frozenset(option.keyword.decode() for option in pq.Conninfo.get_defaults())


def secret_values(*configs: Any) -> set[str]:
    """The values of every secret setting in `configs`: mappings (nested ones and lists too) and
    connection strings (given as such, or under a `dsn` key), for scrub()."""
    found: set[str] = set()
    for config in configs:
        if isinstance(config, str):
            found.update(_dsn_secrets(config))
        else:
            _collect(config, found)
    return {value for value in found if value and value != REDACTED}


def _collect(value: Any, found: set[str], *, secret: bool = False) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and key.lower() in DSN_KEYS and isinstance(item, str) and not secret:
                found.update(_dsn_secrets(item))
            else:
                _collect(item, found, secret=secret or is_secret(key))
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            _collect(item, found, secret=secret)
    elif secret and value is not None and not callable(value):
        found.add(str(value))


def _dsn_secrets(dsn: str) -> set[str]:
    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        return set()
    return {str(value) for key, value in params.items() if is_secret(key) and value}


def scrub(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with every known secret value (`secrets`, else those remembered) replaced by ***."""
    values = sorted(_remembered if secrets is None else secrets, key=len, reverse=True)
    for value in values:
        if len(value) >= MIN_SCRUBBED_LENGTH and value in text:
            text = text.replace(value, REDACTED)
    return text


_remembered: set[str] = set()
_remember_lock = threading.Lock()


def remember_secrets(*configs: Any) -> None:
    """Have scrub() and RedactingFilter mask these configurations' secret values from now on."""
    values = secret_values(*configs)
    if values - _remembered:
        with _remember_lock:
            _remembered.update(values)


class RedactingFilter(logging.Filter):
    """A logging filter that masks remembered secret values in a record's message and traceback.

    The commands put it on the handler they install; a project with its own LOGGING adds it to its
    handlers: `"filters": {"outbox_redact": {"()": "outbox.kafka.redaction.RedactingFilter"}}`.
    """

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if not _remembered:
            return True
        message = record.getMessage()
        cleaned = scrub(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        return True
