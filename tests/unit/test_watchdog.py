"""The suite's hard deadline (tests/support/watchdog.py): a test stuck in C ends its process, and says where."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STUCK = '''
import ctypes

def test_stuck_in_c():
    # A C call that no signal ends: locking a mutex the thread already holds waits forever (glibc), as a blocked
    # librdkafka call can, and pytest-timeout's SIGALRM handler never gets to run.
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)

def test_quick():
    pass
'''


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "test_stuck.py").write_text(STUCK)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 1\ntimeout_grace = 1\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.support.watchdog", "-p", "no:cacheprovider",
                           *args, str(tmp_path)], capture_output=True, text=True, timeout=50, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return done, time.monotonic() - started


def test_a_test_stuck_in_c_ends_its_process_with_every_threads_stack(tmp_path: Path) -> None:
    done, took = run(tmp_path, "-k", "stuck")
    assert done.returncode == 1
    assert took < 40
    assert "Timeout (0:00:02)!" in done.stderr
    assert "in test_stuck_in_c" in done.stderr


def test_under_xdist_the_stuck_test_fails_and_the_others_still_run(tmp_path: Path) -> None:
    done, _ = run(tmp_path, "-n", "1")
    assert done.returncode == 1
    assert "worker 'gw0' crashed while running" in done.stdout
    assert "1 failed, 1 passed" in done.stdout
