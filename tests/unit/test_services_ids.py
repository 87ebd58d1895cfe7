"""What `bin/services` draws is valid for the tool that reads it (a fresh machine passes every time)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def services_script():
    loader = importlib.machinery.SourceFileLoader("bin_services", str(ROOT / "bin" / "services"))
    spec = importlib.util.spec_from_loader("bin_services", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_cluster_ids_never_begin_with_a_dash(services_script):
    # urlsafe base64 of a random UUID begins with "-" once in 64 draws: 20,000 draws meet it ~300 times.
    drawn = [services_script.new_cluster_id() for _ in range(20_000)]
    assert all(services_script.valid_cluster_id(cluster_id) for cluster_id in drawn)
    assert not [cluster_id for cluster_id in drawn if cluster_id.startswith("-")]
    assert len(set(drawn)) == len(drawn)


@pytest.mark.parametrize("text", ["-zETt82rQ5SeLsG9YhSQKg", "", "short", "H8eu1XjZTZG78XWdObi2pA==",
                                  "H8eu1XjZTZG78XWdObi2p!"])
def test_ids_kafka_storage_cannot_take_are_invalid(services_script, text):
    assert not services_script.valid_cluster_id(text)


def test_a_saved_id_beginning_with_a_dash_is_replaced_and_said(services_script, tmp_path, capsys):
    saved = tmp_path / "cluster-id"
    saved.write_text("-zETt82rQ5SeLsG9YhSQKg\n")
    cluster_id = services_script.saved_cluster_id(saved, "kafka --brokers 3")
    assert services_script.valid_cluster_id(cluster_id)
    assert saved.read_text() == cluster_id
    assert "replacing the saved cluster id '-zETt82rQ5SeLsG9YhSQKg'" in capsys.readouterr().out
    assert services_script.saved_cluster_id(saved, "kafka --brokers 3") == cluster_id, "a valid id is kept"
