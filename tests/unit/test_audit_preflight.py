"""The checks the audit makes before Spark starts, and other plain-Python helpers: no JVM."""

from __future__ import annotations

import socket
import time

import pytest

from outbox.pipeline import ids, jars, preflight
from outbox.pipeline.follow import covered


@pytest.mark.parametrize("master", ["local", "local[2]", "local[*]", "local[4,2]", "local-cluster[2, 1, 1024]",
                                    "yarn", "k8s://https://10.0.0.1:6443", None])
def test_masters_spark_knows_pass(master):
    preflight.check_master(master)


@pytest.mark.parametrize(("master", "message"), [
    ("loca[2]", "is not a Spark master URL"),
    ("local[0]", "is not a Spark master URL"),
    ("spark://nohost", "expected spark://HOST:PORT"),
    ("spark://host:99999", "expected spark://HOST:PORT"),
    ("mesos://host:5050", "is not a Spark master URL"),
])
def test_bad_masters_are_one_line(master, message):
    with pytest.raises(preflight.PreflightError, match=message) as raised:
        preflight.check_master(master)
    assert "\n" not in str(raised.value)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_unreachable_master_says_why_at_once():
    port = free_port()
    began = time.monotonic()
    with pytest.raises(preflight.PreflightError) as raised:
        preflight.check_master(f"spark://127.0.0.1:{port}")
    assert time.monotonic() - began < 15
    assert str(raised.value) == (f"the Spark master spark://127.0.0.1:{port} is unreachable: "
                                 f"127.0.0.1:{port}: Connection refused")


def test_a_listening_master_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        preflight.check_master(f"spark://127.0.0.1:{free_port()},127.0.0.1:{port}")  # one standby answers


def test_folders_are_created_and_probed(tmp_path):
    target = tmp_path / "a" / "b"
    preflight.check_writable_folder("--out", str(target))
    assert target.is_dir() and list(target.iterdir()) == []  # the probe file is gone


@pytest.mark.parametrize(("where", "message"), [
    ("under-a-file", "cannot write there: Not a directory"),
    ("a-file", "a file is in the way"),
    ("/proc/outbox-audit", "cannot write there: "),
])
def test_unwritable_folders_are_one_line(tmp_path, where, message):
    plain = tmp_path / "plain"
    plain.write_text("x")
    path = {"under-a-file": str(plain / "x"), "a-file": str(plain)}.get(where, where)
    with pytest.raises(preflight.PreflightError, match=message) as raised:
        preflight.check_writable_folder("--sink", path)
    assert str(raised.value).startswith(f"--sink {path}: ")


def test_the_ledgers_first_line_is_checked(tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("\n 12\nnot checked here\n")
    bad.write_text("\n\nid\n1\n")
    preflight.check_ledger_file(str(good))
    with pytest.raises(preflight.PreflightError, match=r"line 3 is not an outbox id: 'id'"):
        preflight.check_ledger_file(str(bad))
    with pytest.raises(preflight.PreflightError, match="no such file"):
        preflight.check_ledger_file(str(tmp_path / "none.txt"))
    preflight.check_ledger_file("hdfs:///ledgers/ids.txt")  # checked through Hadoop once Spark is up


def test_replaced_folders_must_not_overlap(tmp_path):
    out = str(tmp_path / "out")
    preflight.check_distinct({"--out": out, "--sink": str(tmp_path / "sink"), "--latest": str(tmp_path / "latest")},
                             replaced=("--sink", "--latest"))
    with pytest.raises(preflight.PreflightError, match=r"--latest .* overlaps --out"):
        preflight.check_distinct({"--out": out, "--latest": out + "/latest"}, replaced=("--sink", "--latest"))
    with pytest.raises(preflight.PreflightError, match=r"--sink .* overlaps --latest"):
        preflight.check_distinct({"--sink": "hdfs:///a", "--latest": "hdfs:///a/b"}, replaced=("--sink", "--latest"))


def test_shared_storage_is_noted_on_a_cluster_only():
    paths = {"--ledger": "/data/ids.txt", "--checkpoint": "hdfs:///ckpt", "--sink": None}
    assert preflight.note_shared_storage("local[2]", paths) is None
    note = preflight.note_shared_storage("spark://h:7077", paths)
    assert note is not None and "--ledger /data/ids.txt" in note and "hdfs" not in note.split("must")[0]


@pytest.mark.parametrize(("jar", "message"), [
    ("spark-sql-kafka-0-10_2.13-4.1.0.jar", "is for Spark 4.1 but pyspark is 4.2.1"),
    ("spark-sql-kafka-0-10_2.12-4.2.0.jar", "built for Scala 2.12 but pyspark's Spark uses Scala 2.13"),
])
def test_connector_and_pyspark_must_agree(jar, message):
    with pytest.raises(jars.JarsNotFound, match=message):
        jars.check_versions(["/jars/kafka-clients-3.9.2.jar", f"/jars/{jar}"], "4.2.1", "2.13")


def test_a_connector_of_the_same_minor_version_passes():
    jars.check_versions(["/jars/spark-sql-kafka-0-10_2.13-4.2.0.jar"], "4.2.1", "2.13")
    jars.check_versions(["s3a://libs/spark-sql-kafka.jar"], "4.2.1", "2.13")  # no version in the name: trusted


@pytest.mark.parametrize(("found", "message"), [
    (["/jars/spark-sql-kafka-0-10_2.13-4.2.0.jar"], r"no Delta Lake jar \(delta-spark_\*\.jar\).*bin/services up"),
    (["/jars/delta-spark_4.1_2.13-4.0.0.jar"], "is Delta Lake for Spark 4.1 but pyspark is 4.2.1"),
    (["/jars/delta-spark_4.2_2.12-4.4.0.jar"], "built for Scala 2.12 but pyspark's Spark uses Scala 2.13"),
])
def test_delta_jars_must_be_there_and_agree_with_pyspark(found, message):
    with pytest.raises(jars.JarsNotFound, match=message):
        jars.check_delta(found, "4.2.1", "2.13")


def test_delta_jars_of_the_same_minor_version_pass():
    jars.check_delta(["/jars/spark-sql-kafka-0-10_2.13-4.2.0.jar", "/jars/delta-spark_4.2_2.13-4.4.0.jar"],
                     "4.2.1", "2.13")
    assert not jars.has_delta(["/jars/delta-storage-4.4.0.jar"])


def test_delta_settings_add_its_extension_to_any_given():
    from outbox.pipeline import session

    plain = session.settings("local[2]", {}, [])
    assert "spark.sql.extensions" not in plain and "spark.sql.catalog.spark_catalog" not in plain
    delta = session.settings("local[2]", {"spark.sql.extensions": "com.example.Ext"}, [], delta=True)
    assert delta["spark.sql.extensions"] == f"com.example.Ext,{session.DELTA_EXTENSION}"
    assert delta["spark.sql.catalog.spark_catalog"] == session.DELTA_CATALOG
    given = session.settings(None, {"spark.sql.extensions": session.DELTA_EXTENSION,
                                    "spark.databricks.delta.snapshotPartitions": "16"}, [], delta=True)
    assert given["spark.sql.extensions"] == session.DELTA_EXTENSION
    assert given["spark.databricks.delta.snapshotPartitions"] == "16"


def test_follow_offsets_keep_the_first_start_and_the_last_end():
    first = covered({}, {"t": {"0": 0, "1": 5}}, {"t": {"0": 10, "1": 5}})
    assert first == {"t": {"0": [0, 10], "1": [5, 5]}}
    assert covered(first, {"t": {"0": 10, "1": 5}}, {"t": {"0": 12, "1": 9, "2": 1}}) == {
        "t": {"0": [0, 12], "1": [5, 9], "2": [1, 1]}}


def test_words_give_back_their_ids():
    assert ids.ids_in(0, 0b1011) == [0, 1, 3]
    assert ids.ids_in(2, -(2**63)) == [2 * 64 + 63]  # bit 63 arrives from Spark as a negative long
    assert ids.ids_in(-1, 1) == [-64]
