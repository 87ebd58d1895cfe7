"""Where the Kafka connector's jars come from, so that a run needs no network.

PySpark ships Spark but not its Kafka source, nor Delta Lake (`--format delta`). The pom beside this module
(`POM`, shipped in the package) names them and what they need beyond pyspark's own jars; Maven copies them into a
folder (a checkout's `bin/services up` into `.services/spark/jars-<version>/`).
The audit looks, in order, at: the `--jars` flag, `$OUTBOX_SPARK_JARS`, the `OUTBOX["spark_jars"]`
setting (passed in by the management command), then that folder. Each may name a folder (every
`*.jar` in it) or a comma-separated list of jars; a URL (hdfs://, s3a://, https://...) is passed
to Spark unchecked, for clusters.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

SPARK_VERSION = "4.2.0"
ENV_VAR = "OUTBOX_SPARK_JARS"
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_DIR = REPO_ROOT / ".services" / "spark" / f"jars-{SPARK_VERSION}"
CONNECTOR = "spark-sql-kafka-0-10"
CONNECTOR_NAME = re.compile(r"spark-sql-kafka-0-10_(?P<scala>\d+\.\d+)-(?P<spark>\d+\.\d+)\.[^/]*\.jar")
DELTA = "delta-spark_"
# Delta Lake names its builds after the Spark minor version and the Scala version: delta-spark_4.2_2.13-4.4.0.jar
DELTA_NAME = re.compile(r"delta-spark_(?P<spark>\d+\.\d+)_(?P<scala>\d+\.\d+)-(?P<delta>[^/]*)\.jar")
#: The Maven project that names the jars (in the package: an installed project fetches them with it too).
POM = Path(__file__).with_name("pom.xml")
_MAVEN = (f"`mvn -B -q -f {shlex.quote(str(POM))} dependency:copy-dependencies -DoutputDirectory=DIR "
          f"-DincludeScope=runtime`, then pass --jars DIR or set {ENV_VAR}")
#: How to fetch them: in a checkout, `bin/services up` does it; an installed package says what to run.
HOW_TO_FETCH = (f"run `bin/services up` (copies them into {DEFAULT_DIR}) or {_MAVEN}"
                if (REPO_ROOT / "bin" / "services").exists() else f"fetch them with Maven (Java 17): {_MAVEN}")


class JarsNotFound(Exception):
    """A one-line reason why no usable connector jars were found, with how to fetch them."""


def _is_url(item: str) -> bool:
    return "://" in item and not item.startswith("file://")


def expand(spec: str, origin: str) -> list[str]:
    """The jars named by one spec: a folder, or a comma-separated list of jars or URLs."""
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise JarsNotFound(f"{origin} is empty; {HOW_TO_FETCH}")
    jars: list[str] = []
    for item in items:
        if _is_url(item):
            jars.append(item)
            continue
        path = Path(item.removeprefix("file://")).expanduser()
        if path.is_dir():
            found = sorted(str(jar) for jar in path.glob("*.jar"))
            if not found:
                raise JarsNotFound(f"{origin}: no *.jar in {path}; {HOW_TO_FETCH}")
            jars.extend(found)
        elif path.is_file():
            jars.append(str(path))
        else:
            raise JarsNotFound(f"{origin}: {path} does not exist; {HOW_TO_FETCH}")
    if not any(CONNECTOR in Path(jar).name for jar in jars):
        raise JarsNotFound(f"{origin} has no {CONNECTOR} jar; {HOW_TO_FETCH}")
    return jars


def resolve(flag: str | None = None, setting: str | Sequence[str] | None = None,
            environ: dict[str, str] | None = None, default_dir: Path = DEFAULT_DIR) -> list[str]:
    """The jars to hand to Spark (`spark.jars`), from the first source that is given.

    Raises JarsNotFound when the first source given is unusable or none is given and the
    default folder does not exist.
    """
    environ = os.environ if environ is None else environ
    if isinstance(setting, list | tuple):
        setting = ",".join(setting)
    for spec, origin in ((flag, "--jars"), (environ.get(ENV_VAR), f"${ENV_VAR}"),
                         (setting, 'OUTBOX["spark_jars"]')):
        if spec is not None and str(spec).strip():
            return expand(str(spec), origin)
    if default_dir.is_dir():
        return expand(str(default_dir), str(default_dir))
    raise JarsNotFound(f"the Kafka connector's jars were not found; {HOW_TO_FETCH}")


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def has_delta(jars: Sequence[str]) -> bool:
    """Whether `jars` include Delta Lake's Spark connector."""
    return any(DELTA in jar.rsplit("/", 1)[-1] for jar in jars)


def check_delta(jars: Sequence[str], pyspark_version: str, scala_version: str | None) -> None:
    """Delta Lake's jar is among `jars` and built for pyspark's Spark minor and Scala versions, or JarsNotFound."""
    if not has_delta(jars):
        raise JarsNotFound(f"--format delta: no Delta Lake jar ({DELTA}*.jar) among the jars; {HOW_TO_FETCH}")
    for jar in jars:
        name = jar.rsplit("/", 1)[-1]
        found = DELTA_NAME.fullmatch(name)
        if found is None:
            continue
        if found["spark"] != _minor(pyspark_version):
            raise JarsNotFound(f"--format delta: {name} is Delta Lake for Spark {found['spark']} but pyspark is "
                               f"{pyspark_version}: use the delta-spark_{_minor(pyspark_version)} jars "
                               f"({POM} pins them)")
        if scala_version and found["scala"] != scala_version:
            raise JarsNotFound(f"--format delta: {name} is built for Scala {found['scala']} but pyspark's Spark "
                               f"uses Scala {scala_version}")


def check_versions(jars: Sequence[str], pyspark_version: str, scala_version: str | None) -> None:
    """The connector jar is built for pyspark's Spark minor version and Scala version, or JarsNotFound.

    A connector of another Spark minor version fails deep inside Spark (NoSuchMethodError and
    the like) after the JVM started; checked here it is one line. A jar named otherwise (renamed,
    or a URL without a version) is taken on trust.
    """
    for jar in jars:
        name = jar.rsplit("/", 1)[-1]
        found = CONNECTOR_NAME.search(name)
        if found is None:
            continue
        if found["spark"] != _minor(pyspark_version):
            raise JarsNotFound(f"the Kafka connector {name} is for Spark {found['spark']} but pyspark is "
                               f"{pyspark_version}: use the connector jars of Spark {_minor(pyspark_version)} "
                               f"({POM} pins them) or install pyspark {found['spark']}.*")
        if scala_version and found["scala"] != scala_version:
            raise JarsNotFound(f"the Kafka connector {name} is built for Scala {found['scala']} but pyspark's "
                               f"Spark uses Scala {scala_version}: use the _{scala_version} connector jars")


def pyspark_versions() -> tuple[str, str | None]:
    """(pyspark's version, the Scala version of the Spark it ships, when its jars show it)."""
    import pyspark
    from pyspark.version import __version__

    home = Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).parent)
    scala = next((match[1] for jar in (home / "jars").glob("scala-library-*.jar")
                  if (match := re.fullmatch(r"scala-library-(\d+\.\d+)\..*\.jar", jar.name))), None)
    return __version__, scala
