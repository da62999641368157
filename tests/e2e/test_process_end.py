"""How a run process ends. One that dies in native code (librdkafka, a database driver) leaves
every thread's Python stack in its log, not only a signal number: the one such death seen (a
coordinator's SIGSEGV on its way out, CI) could only be guessed at from its exit status. One
that fails stops its threads before it closes what they use: closing a consumer under another
thread's poll is itself a known way for librdkafka to crash."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from harness import Cluster, produce, wait_until
from tests.e2e.e2e_support import http_get, scenario, start
from twophase.config import load_config
from twophase.errors import FatalError
from twophase.participants.runtime.participant import ParticipantRuntime


@pytest.mark.parametrize("role", ["coordinator", "participant"])
def test_a_native_crash_leaves_every_threads_stack_in_the_log(
    tmp_path: Path, role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)  # the product's doing, not the env's
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
        assert "cli/main.py" in log, log[-3000:]
    finally:
        c.stop_all()


def test_a_participant_that_fails_stops_its_threads_before_it_closes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store refusing a write ends the run on the data thread while the control thread polls
    its reader and the apply thread waits: run() stops and joins both, then closes the reader,
    the consumer and the sinks (it used to close the consumer with both threads still running
    and the reader under the control thread's poll)."""
    s = scenario(tmp_path, "failstop", partitions=1, mongo=False, files=False)
    runtime = ParticipantRuntime(load_config(s.config_path), participant_id="p-0")
    pg = runtime.sinks[0]

    class _Refusing(type(pg)):  # type: ignore[misc]
        def write(self, *_: Any) -> Sequence[Any]:
            raise FatalError("the store refused this write")

        write_raw = write

    pg.__class__ = _Refusing
    produce(s.bootstrap, s.topic, 0, 10)
    with pytest.raises(FatalError, match="refused this write"):
        runtime.run()
    alive = [t.name for t in threading.enumerate() if t.name in ("control", "apply")]
    assert alive == [], alive
    # A reader closed under the control thread's poll kills that thread ("Consumer closed").
    assert "control thread failed" not in caplog.text, caplog.text[-3000:]
    assert runtime._reader is not None
    for consumer in (runtime._reader.consumer, runtime.consumer):
        with pytest.raises(RuntimeError, match="closed"):
            consumer.assignment()
