"""`bin/services` leaves nothing behind that makes the next `up` fail, and touches no server it did not start."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def services(tmp_path, monkeypatch):
    loader = importlib.machinery.SourceFileLoader("bin_services_layouts", str(ROOT / "bin" / "services"))
    spec = importlib.util.spec_from_loader("bin_services_layouts", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    monkeypatch.setattr(module, "STATE", tmp_path)
    return module


class FakeStorageTool:
    """kafka-storage format: writes meta.properties with the id it is given (as the real one does)."""

    def __init__(self) -> None:
        self.formatted: list[tuple[str, str]] = []

    def __call__(self, cmd, **_kwargs):
        cluster_id = cmd[cmd.index("-t") + 1]
        data = Path(cmd[cmd.index("-c") + 1]).parent / "data"
        (data / "meta.properties").write_text(f"node.id=1\ncluster.id={cluster_id}\n")
        self.formatted.append((data.parent.name, cluster_id))
        return SimpleNamespace(communicate=lambda: ("", None), returncode=0)


def layout(services, monkeypatch, secure=False):
    cluster = services.KafkaCluster(3, secure)
    tool = FakeStorageTool()
    monkeypatch.setattr(services.subprocess, "Popen", tool)
    cluster.home.mkdir(parents=True)
    cluster.write_configs(cluster.credentials())
    return cluster, tool


def test_a_node_formatted_for_another_cluster_is_formatted_again_and_said(services, monkeypatch, capsys):
    cluster, tool = layout(services, monkeypatch)
    cluster.cluster_id_file.write_text("H8eu1XjZTZG78XWdObi2pA")
    stale = cluster.nodes[1]
    (stale.data / "meta.properties").write_text("cluster.id=AAAAAAAAAAAAAAAAAAAAAA\n")
    (stale.data / "__cluster_metadata-0").mkdir()
    cluster.format(cluster.nodes, {})
    assert sorted(tool.formatted) == [(f"node-{n}", "H8eu1XjZTZG78XWdObi2pA") for n in (1, 2, 3)]
    assert not (stale.data / "__cluster_metadata-0").exists()
    assert "node 2 was formatted for cluster AAAAAAAAAAAAAAAAAAAAAA, not H8eu1XjZTZG78XWdObi2pA: formatting it " \
           "again" in capsys.readouterr().out


def test_a_lost_cluster_id_file_takes_the_id_the_nodes_agree_on(services, monkeypatch, capsys):
    cluster, tool = layout(services, monkeypatch)
    for node in cluster.nodes[:2]:
        (node.data / "meta.properties").write_text("cluster.id=H8eu1XjZTZG78XWdObi2pA\n")
    cluster.format(cluster.nodes, {})
    assert tool.formatted == [("node-3", "H8eu1XjZTZG78XWdObi2pA")], "the formatted nodes are kept"
    assert cluster.cluster_id_file.read_text() == "H8eu1XjZTZG78XWdObi2pA"
    assert "is missing: taking H8eu1XjZTZG78XWdObi2pA" in capsys.readouterr().out


def test_what_a_failed_format_left_is_cleared_before_formatting(services, monkeypatch):
    cluster, tool = layout(services, monkeypatch)
    junk = cluster.nodes[0].data / "bootstrap.checkpoint"
    junk.write_text("half written")
    cluster.format(cluster.nodes, {})
    assert not junk.exists() and len(tool.formatted) == 3


def test_lost_credentials_of_a_formatted_secure_layout_make_it_anew(services, monkeypatch, capsys):
    cluster, _tool = layout(services, monkeypatch, secure=True)
    (cluster.nodes[0].data / "meta.properties").write_text("cluster.id=H8eu1XjZTZG78XWdObi2pA\n")
    cluster.credentials_file.unlink()
    made = cluster.credentials()
    assert set(made) == {"admin", "outbox"} and cluster.credentials_file.exists()
    assert not (cluster.nodes[0].data / "meta.properties").exists()
    assert "formatting them again" in capsys.readouterr().out


def test_a_postgres_on_another_port_is_not_taken_for_ours(services, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://outbox:outbox@127.0.0.1:55999/outbox")
    ours = services.Postgres()
    ours.data.mkdir(parents=True)
    (ours.data / "postmaster.pid").write_text("1234\n/data\n1700000000\n5432\n/run\n127.0.0.1\n")
    monkeypatch.setattr(services, "reachable", lambda host, port, timeout=1.0: True)
    assert not ours.owns_running_cluster(), "our cluster runs on 5432; 55999 is somebody else's"
    (ours.data / "postmaster.pid").write_text("1234\n/data\n1700000000\n55999\n/run\n127.0.0.1\n")
    assert ours.owns_running_cluster()


def test_kafka_only_touches_no_postgres_and_no_tools(services, monkeypatch):
    touched = []

    def refuse(self, *args):
        raise AssertionError(f"{type(self).__name__} was touched")

    for name in ("Postgres", "Chromium", "Prometheus", "SparkJars"):
        monkeypatch.setattr(getattr(services, name), "up", refuse)
    monkeypatch.setattr(services.KafkaCluster, "up", lambda self: touched.append(self.name))
    monkeypatch.setattr(services.KafkaCluster, "status", lambda self: self.name)
    assert services.main(["up", "--brokers", "3", "--kafka-only"]) == 0
    assert touched == ["kafka-3"]


def test_wheel_postgres_runs_on_its_own_port_unless_told(services, monkeypatch):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    assert services.WheelPostgres(18).port == 5418
    monkeypatch.setenv("DATABASE_URL", "postgres://outbox:outbox@127.0.0.1:55418/outbox")
    assert services.WheelPostgres(18).port == 55418


@pytest.mark.parametrize(("flags", "stopped"), [
    (["--brokers", "3"], ["kafka-3"]),
    (["--secure"], ["kafka-secure"]),
    (["--spare"], ["kafka-spare"]),
    (["--brokers", "3", "--kafka-only"], ["kafka-3"]),
    (["--postgres-only"], ["Postgres"]),
    (["--kafka-only"], ["Kafka"]),
    (["--postgres", "18"], ["WheelPostgres"]),
    (["--postgres", "18", "--brokers", "3"], ["kafka-3", "WheelPostgres"]),
    ([], ["kafka-3", "kafka-secure", "kafka-3-secure", "kafka-spare", "Kafka", "Postgres", "DockerEngine"]),
])
def test_down_stops_just_the_layout_it_names(services, monkeypatch, flags, stopped):
    """`down --brokers 3` (the cluster tests' fixtures run it at the end of a session) stopped the default
    Postgres too, and the session's last step, dropping the test database, found no server."""
    downs = []
    monkeypatch.setattr(services.Postgres, "down", lambda self: downs.append("Postgres"))
    monkeypatch.setattr(services.Kafka, "down", lambda self: downs.append("Kafka"))
    monkeypatch.setattr(services.KafkaCluster, "down", lambda self: downs.append(self.name))
    monkeypatch.setattr(services.DockerEngine, "down", lambda self: downs.append("DockerEngine"))
    monkeypatch.setattr(services.WheelPostgres, "down", lambda self: downs.append("WheelPostgres"))
    monkeypatch.setattr(services, "wheel_postgres_clusters", lambda: [])
    assert services.main(["down", *flags]) == 0
    assert downs == stopped


def test_a_broker_on_another_port_has_its_own_state_and_controller(services, monkeypatch, tmp_path):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9292")
    kafka = services.Kafka()
    assert (kafka.port, kafka.controller_port, kafka.home) == (9292, 9293, tmp_path / "kafka-9292")
    assert kafka.libs.parent == tmp_path / "kafka", "the jars are shared by every port's broker"
    monkeypatch.setenv("KAFKA_CONTROLLER_PORT", "9400")
    assert services.Kafka().controller_port == 9400
    monkeypatch.delenv("KAFKA_CONTROLLER_PORT")
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS")
    assert services.Kafka().home == tmp_path / "kafka"


@pytest.mark.parametrize(("bootstrap", "taken"), [("127.0.0.1:9095", "KAFKA_BOOTSTRAP_SERVERS 9095"),
                                                  ("127.0.0.1:9189", "the controller port 9190")])
def test_a_broker_on_another_port_keeps_off_the_layouts_ports(services, monkeypatch, bootstrap, taken):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", bootstrap)
    monkeypatch.setattr(services, "reachable", lambda *args, **kwargs: False)
    with pytest.raises(services.ServiceError, match=f"{taken} is one of the cluster layouts' ports"):
        services.Kafka().up()


def test_share_groups_are_formatted_on_from_kafka_4_2_and_kafka_version_picks_the_release(services, monkeypatch):
    kafka = services.Kafka()
    assert services.share_groups_in(kafka.version), "the pinned release has share groups"
    assert kafka.format_features() == ["--feature", "share.version=1"]
    monkeypatch.setenv("KAFKA_VERSION", "4.1.1")
    old = services.Kafka()
    assert (old.version, old.format_features(), old.libs.name) == ("4.1.1", [], "libs-4.1.1")
    monkeypatch.setenv("KAFKA_VERSION", "latest")
    monkeypatch.setattr(services, "reachable", lambda *args, **kwargs: False)
    with pytest.raises(services.ServiceError, match=r"KAFKA_VERSION must be a release such as 4\.2\.1"):
        services.Kafka().up()


def test_data_formatted_by_a_newer_kafka_is_refused_and_by_an_older_one_warned_about(services, monkeypatch, capsys):
    monkeypatch.setattr(services, "reachable", lambda *args, **kwargs: False)
    for step in ("ensure_tools", "resolve_jars"):
        monkeypatch.setattr(services.Kafka, step, lambda self: None)
    kafka = services.Kafka()
    kafka.data.mkdir(parents=True)
    (kafka.data / "meta.properties").write_text("cluster.id=x\n")
    (kafka.home / "formatted-by").write_text("9.9.9")
    newer = rf"formatted by Kafka 9\.9\.9, newer than {re.escape(kafka.version)}"
    with pytest.raises(services.ServiceError, match=newer):
        kafka.up()
    (kafka.home / "formatted-by").unlink()  # formatted before the stamp existed (4.1.1): started, with a warning
    monkeypatch.setattr(services.subprocess, "Popen", lambda *args, **kwargs: (_ for _ in ()).throw(
        services.ServiceError("started")))
    with pytest.raises(services.ServiceError, match="started"):
        kafka.up()
    assert "without share groups: the share backend of outbox.queue will not work on it" in capsys.readouterr().out


def test_a_killed_dockerds_network_namespaces_are_cleared_and_a_running_ones_kept(services, tmp_path, monkeypatch):
    """A dockerd killed with its machine leaves its containers' namespaces mounted, their addresses still on the
    bridge: the next engine's containers got the same addresses and their published ports refused connections."""
    roots = tmp_path / "run"
    dead, alive, other = roots / "outbox-docker-dead0000", roots / "outbox-docker-live0000", roots / "unrelated"
    for root in (dead, alive, other):
        (root / "netns").mkdir(parents=True)
        (root / "netns" / "b94eff885648").touch()
    unmounted = []
    monkeypatch.setattr(services, "EXEC_ROOTS", roots)
    monkeypatch.setattr(services, "running_exec_roots", lambda: {str(alive)})
    monkeypatch.setattr(services.subprocess, "run", lambda cmd, **_: unmounted.append(cmd))
    services.clear_dead_engines()
    assert unmounted == [["umount", "--lazy", str(dead / "netns" / "b94eff885648")]]
    assert not dead.exists() and (alive / "netns" / "b94eff885648").exists() and other.exists()


def test_running_exec_roots_finds_this_machines_dockerd_by_its_command_line(services, monkeypatch):
    fake = {"1/cmdline": b"/sbin/init\0", "7/cmdline": b"dockerd\0--host\0unix:///x\0--exec-root\0/run/outbox-docker-ab\0",
            "9/cmdline": b"/usr/bin/python3\0dockerd\0--exec-root\0/run/not-it\0"}

    class Proc:
        def glob(self, _pattern):
            return [SimpleNamespace(read_bytes=lambda body=body: body) for body in fake.values()]

    monkeypatch.setattr(services, "Path", lambda path: Proc() if path == "/proc" else Path(path))
    assert services.running_exec_roots() == {"/run/outbox-docker-ab"}
