# The example project's harvester, for docker-compose.yml.
FROM python:3.12-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY outbox ./outbox
RUN pip install --no-cache-dir ".[metrics]" "django-environ>=0.11"
COPY manage.py ./
COPY project ./project
COPY templates ./templates
CMD ["sh", "-c", "python manage.py migrate --noinput && exec python manage.py harvest"]
