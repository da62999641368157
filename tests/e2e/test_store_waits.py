"""A store that stops answering during a participant's start-up recovery is waited for.

The repro of issue #14: MongoDB stops answering right after the participant's MongoDB sink is
set up; recovery (abort stale parts, list in-doubt parts) used to give up after its 60 s budget
and the process died with a traceback and status 1. The rule now: a store call the process
cannot go on without waits until the store answers (or the process is stopped); only calls
whose failure the participant survives are bounded, by ``participant.sink_retry_s``.

The test sets that budget to 2 s and stops the stack's own SecantusDB server (SIGSTOP) for
much longer, right where recovery begins: the participant must outlive the stop, then deliver
everything exactly once.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import yaml

from harness import Cluster, load_stack_env, produce, wait_until
from tests.e2e.e2e_support import http_get, scenario, settle, start

#: participant.sink_retry_s in the test: the old code's give-up budget, made small.
BUDGET_S = 2.0
#: How long the store is stopped: several budgets, and several driver time-outs.
STOP_S = 15.0


def _mongo_pid() -> int:
    run = Path(load_stack_env()["TWOPHASE_STACK_DIR"]) / "run" / "mongo.pid"
    return int(run.read_text().strip())


def _wait_for_line(path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise TimeoutError(f"no line {text!r} in {path} within {timeout_s}s")


def test_participant_waits_out_a_store_that_stops_answering_during_recovery(
    tmp_path: Path,
) -> None:
    s = scenario(tmp_path, "storewait", partitions=2, files=False)
    raw = s.config()
    # Sweeps every second: several of them run into the stopped store in the second phase.
    raw["participant"] = {"sweep_interval_ms": 1_000, "sink_retry_s": BUDGET_S}
    for sink in raw["sinks"]:
        if sink["type"] == "mongodb":
            # Each attempt against the stopped server ends quickly: many attempts, many budgets.
            sink.update(server_selection_timeout_s=1, socket_timeout_s=1, connect_timeout_s=1)
    s.config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    c = Cluster(s)
    mongo = _mongo_pid()
    stopped = False
    try:
        start(c, "coordinator", "coord-0")
        pport = start(
            c,
            "participant",
            "p-0",
            # Holds the participant between set-up and recovery long enough to stop the store.
            env={"TWOPHASE_DELAY_AT": "before_recovery:1:1"},
        )
        log = c.logs / "p-0.log"
        _wait_for_line(log, "delay point before_recovery reached", 90)
        os.kill(mongo, signal.SIGSTOP)
        stopped = True
        stopped_at = time.monotonic()
        while time.monotonic() - stopped_at < STOP_S:
            assert c.alive("p-0"), c.log_tail("p-0", 60)
            time.sleep(0.5)
        os.kill(mongo, signal.SIGCONT)
        stopped = False
        text = log.read_text(errors="replace")
        # It did wait on the stopped store, for longer than the budget, and never gave up.
        assert re.search(r"mongo failed \(try \d+\), retrying", text), c.log_tail("p-0", 60)
        assert "gave up" not in text, c.log_tail("p-0", 60)
        n = 200
        produce(s.bootstrap, s.topic, 0, n)
        wait_until(lambda: http_get(pport, "/readyz")[0] == 200, 90, "the participant's readiness")
        reports = settle(s, c, set(range(n)), 120)
        assert all(r.ok for r in reports.values()), reports

        # Second phase, while running: records arrive and the store stops again. Writes,
        # prepares, sweeps and the apply worker all meet it; the ones the participant
        # survives give up after the budget (abort votes, re-reads, skipped sweeps), the
        # others wait. Nothing ends the process, and everything arrives once.
        produce(s.bootstrap, s.topic, n, n)
        os.kill(mongo, signal.SIGSTOP)
        stopped = True
        stopped_at = time.monotonic()
        while time.monotonic() - stopped_at < STOP_S:
            assert c.alive("p-0"), c.log_tail("p-0", 60)
            time.sleep(0.5)
        os.kill(mongo, signal.SIGCONT)
        stopped = False
        reports = settle(s, c, set(range(2 * n)), 180)
        assert all(r.ok for r in reports.values()), reports
        assert c.alive("p-0"), c.log_tail("p-0", 60)
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, text[-3000:]
        assert "sweep: cannot list in-doubt parts" in text, text[-3000:]
    finally:
        if stopped:
            os.kill(mongo, signal.SIGCONT)
        c.stop_all()
