"""``twophase status`` against a live pipeline: it sees what the coordinator sees, whatever the
latest checkpoint hides, and it answers in bounded time whatever a store does.

* A stalled partition (records waiting, no commit moving its position for
  ``commit.stall_alarm_s``) is unhealthy, with checkpoints written after every cycle -- the old
  status only looked back to the latest checkpoint and said healthy.
* With no commit decision since the latest checkpoint the last commit is still found (the old
  status said "the last commit is Nones old").
* A commit decided and not applied (its participant died before committing) is unhealthy.
* A MongoDB server that accepts connections and answers nothing (SIGSTOP) costs status a
  bounded wait, reported as the sink's error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.e2e.e2e_support import http_get, metric, scenario, scrape, start
from twophase.harness import Cluster, load_stack_env, produce, wait_until

STALL_S = 3


def _status(config: Path, *extra: str, timeout_s: float = 120) -> tuple[int, dict[str, Any], float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "twophase.cli", "status", str(config), "--json", *extra],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    elapsed = time.monotonic() - started
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout), elapsed


def test_status_sees_a_stall_older_than_the_latest_checkpoint(tmp_path: Path) -> None:
    s = scenario(
        tmp_path,
        "stsee",
        partitions=2,
        mongo=False,
        files=False,
        extra={
            # A checkpoint after every cycle: the tail after it almost never holds a decision.
            "commit": {
                "interval_ms": 500,
                "vote_timeout_ms": 10_000,
                "stall_alarm_s": STALL_S,
                "checkpoint_every": 1,
            }
        },
    )
    c = Cluster(s)
    try:
        cport = start(c, "coordinator", "coord-0")
        pport = start(c, "participant", "p-stuck", env={"TWOPHASE_STALL": "reads"})
        wait_until(lambda: http_get(pport, "/readyz")[0] == 200, 60, "the participant's readiness")
        produce(s.bootstrap, s.topic, 0, 300)
        try:
            wait_until(
                lambda: metric(scrape(cport), "twophase_stalled_partitions") == 2,
                60,
                "the coordinator's stall alarm on both partitions",
            )
        except TimeoutError:
            print(scrape(cport))
            raise
        for _ in range(3):  # whichever message the tail ends with
            code, st, _ = _status(s.config_path, "--no-sinks")
            assert code == 1 and not st["healthy"], st
            stalled = [p for p in st["problems"] if "no commit has moved its position" in p]
            assert len(stalled) == 2, st["problems"]
            for p in st["partitions"]:
                assert p["unmoved_s"] is not None and p["unmoved_s"] >= STALL_S, p
            # Cycles commit all along (empty parts): the last commit is recent and known.
            assert st["last_commit_txn"] is not None, st
            assert st["last_commit_age_s"] is not None and st["last_commit_age_s"] < 10, st
            assert not any("None" in p for p in st["problems"]), st["problems"]
            time.sleep(0.3)
    finally:
        c.stop_all()


def test_status_says_unhealthy_when_a_commit_stays_unapplied(tmp_path: Path) -> None:
    s = scenario(tmp_path, "stunap", partitions=1, mongo=False, files=False)
    c = Cluster(s)
    try:
        start(c, "coordinator", "coord-0")
        # Dies (SIGKILL) before committing its first decided part: the commit stays pending.
        start(c, "participant", "p-0", env={"TWOPHASE_CRASH_AT": "before_commit:1"})
        produce(s.bootstrap, s.topic, 0, 50)
        wait_until(lambda: not c.alive("p-0"), 90, "the participant to die before committing")
        time.sleep(3)
        code, st, _ = _status(s.config_path, "--no-sinks", "--max-commit-age", "2")
        assert code == 1, st
        assert st["pending_commits"], st
        late = [p for p in st["problems"] if "not applied by every participant" in p]
        assert len(late) == 1, st["problems"]
    finally:
        c.stop_all()


def test_status_is_bounded_while_mongodb_answers_nothing(tmp_path: Path) -> None:
    s = scenario(tmp_path, "stmstop", partitions=1, files=False)
    pid = int((Path(load_stack_env()["TWOPHASE_STACK_DIR"]) / "run" / "mongo.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        _code, st, elapsed = _status(s.config_path, timeout_s=90)
    finally:
        os.kill(pid, signal.SIGCONT)
    # Kafka answers; the stopped store is reported as the sink's error, within the probe's limit.
    assert elapsed < 45, elapsed
    mongo = next(e for e in st["sinks"] if e["name"] == "mongo")
    assert "error" in mongo, mongo
    pg = next(e for e in st["sinks"] if e["name"] == "pg")
    assert "error" not in pg, pg
