"""A run process that dies in native code (librdkafka, a database driver) leaves every thread's
Python stack in its log, not only a signal number: the one such death seen (a coordinator's
SIGSEGV on its way out, CI) could only be guessed at from its exit status."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from harness import Cluster, wait_until
from tests.e2e.e2e_support import http_get, scenario, start


@pytest.mark.parametrize("role", ["coordinator", "participant"])
def test_a_native_crash_leaves_every_threads_stack_in_the_log(tmp_path: Path, role: str) -> None:
    s = scenario(tmp_path, f"segv-{role[:5]}", partitions=1, mongo=False, files=False)
    c = Cluster(s)
    name = f"{role}-0"
    try:
        port = start(c, role, name)
        wait_until(lambda: http_get(port, "/healthz")[0] == 200, 60, f"{role} serving /healthz")
        # SIGSEGV from outside is handled exactly as a fault inside native code is.
        c.procs[name].send_signal(signal.SIGSEGV)
        try:
            code = c.procs[name].wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{role} still running after SIGSEGV:\n{c.log_tail(name)}")
        log = c.log_tail(name, 400)
        assert code == -signal.SIGSEGV, (code, log[-2000:])
        assert "Fatal Python error: Segmentation fault" in log, log[-2000:]
        # Every thread, the main one with the run loop's frame.
        assert log.count("most recent call first") >= 2, log[-3000:]
        assert "twophase/cli/main.py" in log or "cli/main.py" in log, log[-3000:]
    finally:
        c.stop_all()
