# The example project's harvester (and shop), for docker-compose.yml.
# BASE is any image with Python 3.11+ and pip; where python:3.12-slim cannot be pulled,
# `bin/services images` builds one from Debian's archive: --build-arg BASE=outbox-local/python:3.11.
ARG BASE=python:3.12-slim
FROM ${BASE}
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY outbox ./outbox
RUN pip install --no-cache-dir ".[metrics]" "django-environ>=0.11"
COPY manage.py ./
COPY project ./project
COPY templates ./templates
CMD ["sh", "-c", "python manage.py migrate --noinput && exec python manage.py harvest"]
