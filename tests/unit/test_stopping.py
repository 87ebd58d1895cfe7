"""The long-running commands' signals (outbox/stopping.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap


def test_sigusr1_prints_every_threads_stack_and_stops_nothing():
    """A command that seems stuck says where each of its threads waits, and goes on."""
    script = textwrap.dedent("""
        import os, signal, threading
        from outbox.stopping import on_stop_signals

        stopped = []
        parked = threading.Event()
        worker = threading.Thread(target=parked.wait, name="parked-worker", daemon=True)
        worker.start()
        with on_stop_signals(lambda: stopped.append(True)):
            os.kill(os.getpid(), signal.SIGUSR1)
        print("stopped" if stopped else "running", flush=True)
        parked.set()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "running", "SIGUSR1 is no request to stop"
    assert "Current thread 0x" in done.stderr and "in wait" in done.stderr, "the main thread and the worker"


def test_sigusr1_is_left_as_it_was_after_the_block():
    from outbox.stopping import on_stop_signals

    before = signal.getsignal(signal.SIGUSR1)
    with on_stop_signals(lambda: None):
        pass
    assert signal.getsignal(signal.SIGUSR1) == before
