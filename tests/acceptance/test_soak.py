"""A short soak, as an operator runs the long one: `manage.py outbox_bench soak` with an old transaction held.

The figures are benchmarks (docs/benchmarks.md, "Hours under load"): this checks the command runs
end to end, says what it measured every minute, loses nothing, and ends with its verdict line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# An old transaction held on purpose (the server's horizon, which other tests read) and a steady load: alone.
pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_soak_with_an_old_transaction_says_every_minute_and_loses_nothing(database_url, bootstrap_servers):
    """Slow: one minute of steady load, the soak's shortest."""
    env = {**os.environ, "DATABASE_URL": database_url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers}
    result = subprocess.run([sys.executable, str(ROOT / "manage.py"), "outbox_bench", "soak", "--minutes", "1",
                             "--rate", "300", "--keys", "20", "--hold-transaction", "0:1", "--warmup", "5"],
                            capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert "an old transaction from minute 0 for 1" in lines[0] and "after a 5 s warm-up" in lines[0]
    warm = next(line for line in lines if line.strip().startswith("warm-up, 5 s before minute 1"))
    assert re.search(r"1,[45]\d\d records, p50 [\d.]+ ms, p99 [\d.]+ ms", warm), warm  # 300/s for 5 s
    minute = next(line for line in lines if line.strip().startswith("min   1:"))
    for figure in ("records/s", "p50", "p99", "backlog", "table", "dead", "harvester", "mark", "purge", "Postgres",
                   "[old transaction open]"):
        assert figure in minute, figure
    size = re.search(r"table\s+([\d.]+) MiB", minute)
    assert size and float(size.group(1)) > 0, f"the outbox's size is measured: {minute}"
    for when in ("start", "end"):  # the tables with a retention of their own are measured too
        other = next(line for line in lines if line.strip().startswith(f"other tables at the {when}:"))
        assert "outbox_dead_letter" in other and "outbox_harvester_history" in other, other
    written = re.search(r"written ([\d,]+), read back ([\d,]+)", result.stdout)
    assert written and written.group(1) == written.group(2) == "19,500", result.stdout  # 300/s for 65 s
    assert re.fullmatch(r"verdict: (PASS|FAIL)( \(.*\))?", lines[-1]), lines[-1]


def test_a_soak_stopped_by_sigterm_stops_its_writers_and_the_harvesters_it_started(database_url, bootstrap_servers):
    """A soak killed half-way (a timeout, CI, `kill`) leaves no harvester behind and does not write on."""
    env = {**os.environ, "DATABASE_URL": database_url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
           "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(ROOT / "manage.py"), "outbox_bench", "soak", "--minutes", "10", "--rate", "300",
               "--keys", "20", "--warmup", "60"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=ROOT) as soak:
        try:
            assert soak.stdout is not None
            said = []
            for line in soak.stdout:  # printed once the harvester leads, just before the writers start
                said.append(line)
                if line.strip().startswith("other tables at the start:"):
                    break
            else:
                pytest.fail(f"the soak ended before it began: {soak.wait()} {''.join(said)[-2000:]}")
            harvesters = [child for child in psutil.Process(soak.pid).children(recursive=True)
                          if "harvest" in " ".join(child.cmdline())]
            assert harvesters, "the soak runs a harvester of its own"
            time.sleep(3)  # the writers are under way
            began = time.monotonic()
            soak.send_signal(signal.SIGTERM)
            assert soak.wait(timeout=90) == 143
            stopped_in = time.monotonic() - began
            _, alive = psutil.wait_procs(harvesters, timeout=5)
            assert not alive, f"harvesters left running: {[p.pid for p in alive]}"
            assert stopped_in < 60, f"the writers ran on for {stopped_in:.0f} s"  # they had 10 minutes left
        finally:
            if soak.poll() is None:
                soak.kill()
                soak.wait()
