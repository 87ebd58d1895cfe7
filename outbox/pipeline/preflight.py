"""Checks made before Spark does any work, so that a bad argument costs a second, not an audit.

Each failure is a `PreflightError` with one line naming the option, the value and the cause; the
command line turns it into exit status 2. Local paths are checked here, before the JVM starts:
the folder is created (as the audit would) and a probe file written and removed. Paths with a
scheme (hdfs://, s3a://, ...) can only be checked through Hadoop, so `check_remote_paths` does
that once the session is up and before the first job. A `spark://` master is checked by
connecting to it; after the session starts, `wait_for_executors` makes sure something will run
the work instead of letting Spark wait forever for resources.
"""

from __future__ import annotations

import re
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from outbox.reasons import first_line

LOCAL_MASTER = re.compile(r"local(\[(\*|[1-9]\d*)(,\s*[1-9]\d*)?\])?|local-cluster\[\d+,\s*\d+,\s*\d+\]")
MASTER_FORMS = "local, local[N], local[*], spark://HOST:PORT, yarn or k8s://URL"
CONNECT_TIMEOUT = 5.0


class PreflightError(Exception):
    """A one-line reason why the audit cannot start (exit status 2)."""


def is_local_master(master: str | None) -> bool:
    return master is not None and LOCAL_MASTER.fullmatch(master) is not None


def _endpoints(master: str) -> list[tuple[str, int]]:
    """HOST:PORT pairs of a spark:// URL (several for standby masters: spark://h1:7077,h2:7077)."""
    found = []
    for part in master.removeprefix("spark://").split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise PreflightError(f"--master {master}: expected spark://HOST:PORT, got {part.strip()!r}")
        found.append((host.strip("[]"), int(port)))
    return found


def check_master(master: str | None, timeout: float = CONNECT_TIMEOUT) -> None:
    """A master URL Spark accepts; for spark://, one of its masters accepts connections."""
    if master is None or is_local_master(master) or master == "yarn":
        return
    if master.startswith("k8s://") and len(master) > len("k8s://"):
        return
    if not master.startswith("spark://"):
        raise PreflightError(f"--master {master!r} is not a Spark master URL ({MASTER_FORMS})")
    reasons = []
    for host, port in _endpoints(master):
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return
        except TimeoutError:
            reasons.append(f"{host}:{port}: no answer within {timeout:g}s")
        except OSError as error:
            reasons.append(f"{host}:{port}: {error.strerror or error}")
    raise PreflightError(f"the Spark master {master} is unreachable: {'; '.join(reasons)}")


def has_scheme(path: str) -> bool:
    """A Hadoop URL (hdfs://, s3a://, ...) rather than a local path (file:// counts as local)."""
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> Path:
    return Path(path.removeprefix("file://")).expanduser()


def check_writable_folder(flag: str, path: str) -> None:
    """`path` is (or can be created as) a folder this process can write in; it is created."""
    folder = _local(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not folder.is_dir():
            raise PreflightError(f"{flag} {path}: not a folder")
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".outbox-audit-probe-"):
            pass
    except PreflightError:
        raise
    except FileExistsError:
        raise PreflightError(f"{flag} {path}: a file is in the way (not a folder)") from None
    except OSError as error:
        raise PreflightError(f"{flag} {path}: cannot write there: {error.strerror or error}") from None


def check_ledger_file(path: str) -> None:
    """The ledger is a readable file whose first line is an id (Spark checks the rest)."""
    if has_scheme(path):
        return
    local = _local(path)
    if not local.is_file():
        raise PreflightError(f"--ledger: no such file: {path}")
    try:
        with local.open("rb") as ledger:
            for number, line in enumerate(ledger, start=1):
                text = line.strip()
                if text:
                    try:
                        int(text)
                    except ValueError:
                        raise PreflightError(f"--ledger {path}: line {number} is not an outbox id: "
                                             f"{text[:40].decode(errors='replace')!r}") from None
                    return
    except OSError as error:
        raise PreflightError(f"--ledger {path}: cannot read it: {error.strerror or error}") from None


def _inside(inner: str, outer: str) -> bool:
    if has_scheme(inner) != has_scheme(outer):
        return False
    if has_scheme(inner):
        return inner.rstrip("/") == outer.rstrip("/") or inner.startswith(outer.rstrip("/") + "/")
    a, b = _local(inner).resolve(), _local(outer).resolve()
    return a == b or b in a.parents


def check_distinct(paths: Mapping[str, str | None], replaced: tuple[str, ...]) -> None:
    """Folders that an audit replaces as a whole (`replaced` flags) overlap no other folder it uses."""
    given = {flag: path for flag, path in paths.items() if path}
    for flag in replaced:
        if flag not in given:
            continue
        for other, other_path in given.items():
            if other != flag and (_inside(given[flag], other_path) or _inside(other_path, given[flag])):
                raise PreflightError(f"{flag} {given[flag]} overlaps {other} {other_path}: {flag} is replaced "
                                     f"as a whole on every run, so it needs a folder of its own")


def check_remote_paths(spark: Any, folders: Mapping[str, str | None], files: Mapping[str, str | None]) -> None:
    """Through Hadoop, once the session is up: Hadoop-URL folders writable, Hadoop-URL files there."""
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    for flag, path in folders.items():
        if not path or not has_scheme(path):
            continue
        try:
            folder = jvm.org.apache.hadoop.fs.Path(path)
            fs = folder.getFileSystem(conf)
            fs.mkdirs(folder)
            probe = jvm.org.apache.hadoop.fs.Path(f"{path.rstrip('/')}/.outbox-audit-probe-{uuid.uuid4().hex[:8]}")
            fs.create(probe, True).close()
            fs.delete(probe, False)
        except Exception as error:  # py4j wraps Hadoop's IOExceptions
            raise PreflightError(f"{flag} {path}: cannot write there: {_java_reason(error)}") from None
    for flag, path in files.items():
        if not path or not has_scheme(path):
            continue
        try:
            file = jvm.org.apache.hadoop.fs.Path(path)
            exists = file.getFileSystem(conf).isFile(file)
        except Exception as error:
            raise PreflightError(f"{flag} {path}: cannot read it: {_java_reason(error)}") from None
        if not exists:
            raise PreflightError(f"{flag}: no such file: {path}")


def _java_reason(error: Exception) -> str:
    java = getattr(error, "java_exception", None)
    text = str(java.toString() if java is not None else error).strip()
    return first_line(text) if text else type(error).__name__


def wait_for_executors(spark: Any, timeout: float) -> tuple[int, int]:
    """Wait until at least one executor has registered; returns (executors, Spark's default parallelism).

    The parallelism is the cores the executors offer, but never below 2 (Spark's own floor).

    On a cluster master Spark otherwise waits forever for resources ("Initial job has not
    accepted any resources") when no worker is running or none has enough free cores or memory.
    """
    context = spark.sparkContext
    deadline = time.monotonic() + timeout
    seen, steady_since = 0, time.monotonic()
    while True:
        executors = context._jsc.sc().getExecutorMemoryStatus().size() - 1  # minus the driver
        if executors != seen:
            seen, steady_since = executors, time.monotonic()
        if seen > 0 and (time.monotonic() - steady_since >= 1.0 or time.monotonic() >= deadline):
            return seen, int(context.defaultParallelism)  # the others had a second to register too
        if time.monotonic() >= deadline:
            raise PreflightError(f"no executor registered with the Spark master {context.master} within "
                                 f"{timeout:g}s: are its workers running, with free cores and enough memory "
                                 f"for spark.executor.memory ({context.getConf().get('spark.executor.memory', '1g')})?")
        time.sleep(0.2)


def note_shared_storage(master: str | None, paths: Mapping[str, str | None]) -> str | None:
    """A note for a cluster master given local paths that executors read or write (None: nothing to say)."""
    if master is None or is_local_master(master):
        return None
    local = [f"{flag} {path}" for flag, path in paths.items() if path and not has_scheme(path)]
    if not local:
        return None
    return (f"note: on {master}, executors read or write {', '.join(local)}: with workers on other hosts these "
            f"must be on storage every host sees (a shared mount, hdfs://, s3a://)")
