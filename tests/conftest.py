"""Fixtures shared by every test: real services (see tests/support/services.py) and handles on them."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import environ
import pytest
from hypothesis import HealthCheck, settings

from tests.support.kafka_cluster import Cluster
from tests.support.services import Services, resolve

# Property-based tests (test_fuzz_*.py). "ci", the default: the same examples every run (derandomized),
# few enough to keep the suite fast. "long" (OUTBOX_FUZZ_PROFILE=long): thousands of random examples, for
# a nightly run; `--hypothesis-show-statistics` prints how many ran.
settings.register_profile("ci", derandomize=True, max_examples=100, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("long", max_examples=int(os.environ.get("OUTBOX_FUZZ_EXAMPLES", "5000")), deadline=None,
                          print_blob=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.load_profile(os.environ.get("OUTBOX_FUZZ_PROFILE", "ci"))

# The JVMs tests start in subprocesses (the audit's Spark driver, a standalone master and worker) live for seconds:
# the JIT's first tier alone starts them sooner for the same work (a small audit with Delta tables, 32.9 s against
# 38.2 s, median of three; the in-process SparkSession's tests took the same time either way). Every subprocess
# inherits it; users' own runs keep the JVM's default.
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1")
os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", "-XX:TieredStopAtLevel=1")
# And Spark's defaults for tiny frames (tests/support/spark-conf/spark-defaults.conf says which, and what they save).
os.environ.setdefault("SPARK_CONF_DIR", str(Path(__file__).parent / "support" / "spark-conf"))

#: Fixtures kept beside the helpers they go with.
pytest_plugins = ["tests.support.statement_stats", "tests.support.tenants", "tests.support.fresh_project",
                  "tests.support.watchdog"]

#: Each folder's tests carry its marker, so `-m` selects by what a test needs (README, "Tests").
FOLDER_MARKERS = {"integration": "integration", "acceptance": "integration", "spark": "spark",
                  "browser": "browser", "docker": "docker"}


#: Tests sharing a layout of bin/services that only they use run on one pytest-xdist worker, one after another: the
#: layout is started once, and two tests that stop, kill or restart its brokers never do it to each other (the spare
#: broker's, the three-node cluster's, the secure cluster's). Those that build the wheel in the checkout (its build/
#: directory is the checkout's) take their turns too, and so do those that use the one in-process SparkSession (the
#: `spark` fixture: a JVM a worker would otherwise start again; a Spark test that starts the audit in a process of
#: its own runs anywhere). A test needing two of these groups at once must be marked `serial` (it then runs alone,
#: after the rest).
GROUPED_FIXTURES = {"secure_cluster": "secure", "kafka_cluster": "cluster", "spare_broker": "spare",
                    "wheel_venv": "wheel", "spark": "spark"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group marks added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.parent.name
        if folder in FOLDER_MARKERS and item.get_closest_marker(FOLDER_MARKERS[folder]) is None:
            item.add_marker(FOLDER_MARKERS[folder])
        # Into the JUnit report, where bin/slowest sums the slow tests' share of the time (at most 10%).
        item.user_properties.append(("marks", "slow" if item.get_closest_marker("slow") is not None else ""))
        if item.get_closest_marker("serial") is not None:
            continue  # alone, after the rest: no group
        groups = {mark.args[0] for mark in item.iter_markers("xdist_group")}
        groups |= {group for fixture, group in GROUPED_FIXTURES.items() if fixture in getattr(item, "fixturenames", ())}
        if len(groups) > 1:
            raise pytest.UsageError(f"{item.nodeid} needs the xdist groups {sorted(groups)} at once: mark it serial")
        if groups and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(groups.pop()))


@pytest.fixture(autouse=True)
def _outbox_log_level() -> Iterator[None]:
    """A simulation quiets the outbox loggers for its thousands of runs (tests/sim/replay.quiet); the next test,
    which may read the logs (caplog), hears them again whatever order the tests ran in."""
    logger = logging.getLogger("outbox")
    level = logger.level
    yield
    logger.setLevel(level)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("simulation")
    group.addoption("--sim-seeds", type=int, default=2000,
                    help="simulated runs of the harvester to check (default 2000); the queue's: half as many")
    group.addoption("--sim-seed", type=int, default=None, help="check this one seed, printing its trace")


@pytest.fixture
def sim_seeds(request: pytest.FixtureRequest) -> list[int]:
    from tests.sim import scenario

    return _seeds(request, scenario.run, request.config.getoption("--sim-seeds"))


@pytest.fixture
def queue_sim_seeds(request: pytest.FixtureRequest) -> list[int]:
    """The queue's simulator: half of --sim-seeds (1,000 by default), or --sim-seed's one, with its trace."""
    from tests.sim import queue_scenario

    return _seeds(request, queue_scenario.run, max(1, request.config.getoption("--sim-seeds") // 2))


@pytest.fixture
def shard_sim_seeds(request: pytest.FixtureRequest) -> list[int]:
    """The sharded runs (tests/sim/shard_scenario.py): a fifth of --sim-seeds (400 by default), or --sim-seed's."""
    from tests.sim import shard_scenario

    return _seeds(request, shard_scenario.run, max(1, request.config.getoption("--sim-seeds") // 5))


@pytest.fixture
def share_sim_seeds(request: pytest.FixtureRequest) -> list[int]:
    """The share backend's runs (tests/sim/share_scenario.py): a fifth of --sim-seeds (400 by default), or
    --sim-seed's."""
    from tests.sim import share_scenario

    return _seeds(request, share_scenario.run, max(1, request.config.getoption("--sim-seeds") // 5))


@pytest.fixture
def many_sim_seeds(request: pytest.FixtureRequest) -> list[int]:
    """Processes harvesting many outboxes (tests/sim/many_scenario.py): a twentieth of --sim-seeds (100 by default),
    or --sim-seed's."""
    from tests.sim import many_scenario

    return _seeds(request, many_scenario.run, max(1, request.config.getoption("--sim-seeds") // 20))


def _seeds(request: pytest.FixtureRequest, run: Any, count: int) -> list[int]:
    """--sim-seed's one seed (its run printed with its trace first), else seeds 1 to `count`."""
    seed = request.config.getoption("--sim-seed")
    if seed is None:
        return list(range(1, count + 1))
    from tests.sim import replay

    replay.quiet()
    result = run(seed, trace=True)
    print(result.summary, result.violation or "ok", *result.trace, sep="\n")
    return [seed]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist the controller resolves the services once, before its workers start, and hands them on
    through DATABASE_URL and KAFKA_BOOTSTRAP_SERVERS (the environment wins in every worker): two workers would
    otherwise each start their own containers, or race to start bin/services. Each worker then makes its own
    test database (pytest-django's `_gw0`, `_gw1` suffixes). A run of the unit tests alone needs no services (and
    `make test` starts them beside it: resolving here would start them twice at once)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput") \
            and not _unit_tests_only(config):
        stack = contextlib.ExitStack()
        found = resolve(stack)
        os.environ["DATABASE_URL"], os.environ["KAFKA_BOOTSTRAP_SERVERS"] = found.database_url, found.bootstrap_servers
        config.stash[_CONTROLLER_SERVICES] = stack


def _unit_tests_only(config: pytest.Config) -> bool:
    unit = Path(__file__).resolve().parent / "unit"
    paths = [Path(config.invocation_params.dir, arg.split("::")[0]).resolve() for arg in config.args]
    return bool(paths) and all(path == unit or unit in path.parents for path in paths)


def pytest_unconfigure(config: pytest.Config) -> None:
    stack = config.stash.get(_CONTROLLER_SERVICES, None)
    if stack is not None:
        stack.close()


_CONTROLLER_SERVICES = pytest.StashKey[contextlib.ExitStack]()


@pytest.fixture(scope="session")
def services(request: pytest.FixtureRequest) -> Iterator[Services]:
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def say(line: str) -> None:
        """Shown at once, not with a failing test's captured output: it is about the whole run."""
        with capture.global_and_fixture_disabled():
            print(f"\n{line}", file=sys.stderr, flush=True)

    with contextlib.ExitStack() as stack:
        found = resolve(stack, say=say)
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = found.bootstrap_servers
        yield found


@pytest.fixture(scope="session")
def django_db_modify_db_settings(services: Services, django_db_modify_db_settings_parallel_suffix: None) -> None:
    """Point Django (and OUTBOX) at the resolved services before the test database is created; under
    pytest-xdist each worker's test database has its own suffix (pytest-django's `_gw0`, `_gw1`)."""
    from django.conf import settings

    parsed = environ.Env.db_url_config(services.database_url)
    for key in ("NAME", "USER", "PASSWORD", "HOST", "PORT"):
        settings.DATABASES["default"][key] = parsed[key]
    settings.OUTBOX["base_kafka_config"]["bootstrap.servers"] = services.bootstrap_servers


@pytest.fixture
def database_url(services: Services, django_db_setup: None) -> str:
    """A URL for the test database, for code that opens its own connections (the engine, subprocesses)."""
    from django.conf import settings

    return services.database_url_for(settings.DATABASES["default"]["NAME"])


@pytest.fixture
def bootstrap_servers(services: Services) -> str:
    return services.bootstrap_servers


@pytest.fixture
def new_topic(bootstrap_servers: str) -> Callable[..., str]:
    """Create a fresh topic with a unique name; returns the name."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap_servers})

    def create(prefix: str = "test", partitions: int = 4, config: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        futures = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1,
                                                config=config or {})])
        futures[name].result(timeout=30)
        return name

    return create


@pytest.fixture
def small_topic(new_topic: Callable[..., str]) -> str:
    """A one-partition topic whose broker refuses batches over SMALL_TOPIC_BYTES (max.message.bytes)."""
    from tests.support.harness import SMALL_TOPIC_BYTES

    return new_topic("poison", partitions=1, config={"max.message.bytes": str(SMALL_TOPIC_BYTES)})


#: The broker layouts this session started, by fixture name: each is stopped once the last test that takes it is
#: done (its xdist group runs its tests one after another on one worker), not left idle on the machine's two cores
#: for the rest of the run, and started again should a later test take it after all.
_LAYOUTS: dict[str, Cluster] = {}


def _layout(name: str, cluster: Cluster) -> Iterator[Cluster]:
    cluster.start()
    if cluster.started_here:
        _LAYOUTS[name] = cluster
    yield cluster
    if cluster.started_here:
        cluster.down()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    for name, cluster in _LAYOUTS.items():
        if name in getattr(item, "fixturenames", ()) and cluster.stopped_early:
            cluster.stopped_early = False
            cluster.up()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    for name, cluster in _LAYOUTS.items():
        if (name in getattr(item, "fixturenames", ()) and nextitem is not None
                and name not in getattr(nextitem, "fixturenames", ()) and not cluster.stopped_early):
            cluster.down()
            cluster.stopped_early = True
    return result


@pytest.fixture(scope="session")
def kafka_cluster(services: Services) -> Iterator[Cluster]:
    """`bin/services up --brokers 3`: three nodes, replication factor 3 (stopped when its tests are done, if
    started here)."""
    yield from _layout("kafka_cluster", Cluster(3))


@pytest.fixture(scope="session")
def spare_broker(services: Services) -> Iterator[Cluster]:
    """`bin/services up --spare`: a single broker of its own, for tests that stop and restart it (stopped when its
    tests are done, if started here)."""
    yield from _layout("spare_broker", Cluster(1, spare=True))


@pytest.fixture(scope="session")
def secure_cluster(services: Services) -> Iterator[Cluster]:
    """`bin/services up --brokers 3 --secure`: the same behind SASL_SSL (stopped when its tests are done, if
    started here)."""
    yield from _layout("secure_cluster", Cluster(3, secure=True))
