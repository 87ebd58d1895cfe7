"""A new user's project, as the acceptance tests build it: the wheel in a virtualenv of its own, a database
of its own, a user's shell environment (fixtures registered in tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import uuid
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done


@pytest.fixture
def fresh_database(services):
    """A database of its own on the tests' server, as a new project would have."""
    name = f"fresh_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(services.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield name, services.database_url_for(name)
    services.drop_database(name)


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip wheel --no-deps -w dist .` builds (the README's command), installed with no
    dependencies into a new virtualenv; the dependencies come from this interpreter's site-packages (a
    .pth file), so nothing is fetched, and the package itself only from the wheel. Built once a worker: the tests
    that take it make their projects beside it and install nothing into it (their xdist group keeps them on one
    worker)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, ROOT)
    [wheel] = dist.glob("django_outbox_harvest-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(ours)))
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel)
    return python


def user_env() -> dict[str, str]:
    """The environment of a user's shell: none of the tests' settings module or paths."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"DJANGO_SETTINGS_MODULE", "PYTHONPATH", "DATABASE_URL", "OUTBOX_LEADER_TOPIC",
                        "OUTBOX_LEADER_GROUP"}}
    return {**env, "PYTHONUNBUFFERED": "1"}
