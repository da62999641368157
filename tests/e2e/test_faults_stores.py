"""PostgreSQL faults under a running pipeline (issue #21, item 4), on the real stack.

* **Sessions terminated while a part is prepared.** ``pg_terminate_backend`` of every session
  of one participant while its part is PREPARED and its decision not yet taken (a second
  participant holds its vote back with the ``on_prepare`` delay point). A prepared transaction
  outlives its session; the participant must finish it by gid from a new session (``COMMIT
  PREPARED``) once the decision comes, by itself.
* **The connection limit exhausted.** The test opens connections as the stack's own user until
  PostgreSQL refuses more (``too many clients already``), ends the participant's sessions once
  so that it has to reconnect into the full server, holds the server full for a while as
  records keep arriving, then lets go. No process exits; the pipeline resumes.

Each ends with every record exactly once in every sink and nothing left prepared or staged
(``harness.verify``), every process still the one the test started, and no traceback logged.

The participant's sessions are told apart by ``application_name``: the PostgreSQL sink sets
``twophase/<pipeline>/<sink>/<participant>``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from confluent_kafka import KafkaException

from harness import Cluster, Scenario, control_decisions, produce, summary_json, wait_until
from tests.e2e.e2e_support import scenario, settle

pytestmark = pytest.mark.stack

#: How long the held participant sits on its PREPARE: the window for the fault, well inside
#: the vote timeout so the held cycle is decided on the votes (a commit), not timed out.
HOLD_S = 20.0
VOTE_TIMEOUT_MS = 40_000
#: How long the server is kept full (the brief: 15-30 s).
FULL_FOR_S = 20.0
#: Records per produced batch while faults run, and the pause between batches.
BATCH, EVERY_S = 200, 0.3
#: What PostgreSQL answers a connection past max_connections (SQLSTATE 53300).
TOO_MANY = "too many clients"


class _Feeder:
    """Produces a batch of records every EVERY_S on a thread of its own: records flow while a
    fault runs. ``produced`` ids are 0..produced-1."""

    def __init__(self, s: Scenario, start: int) -> None:
        self.s = s
        self.produced = start
        self._stop = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="feeder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                produce(self.s.bootstrap, self.s.topic, self.produced, BATCH)
                self.produced += BATCH
                self._stop.wait(EVERY_S)
        except (RuntimeError, KafkaException) as exc:  # reported by stop()
            self._error = exc

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(60)
        if self._error is not None:
            raise self._error
        return self.produced


def _sessions(
    conn: psycopg.Connection[Any], s: Scenario, participant: str | None = None
) -> list[int]:
    """Backend pids of the pipeline's PostgreSQL sessions (of ``participant`` when given): the
    sink names them ``twophase/<pipeline>/<sink>/<participant>``."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"twophase/{s.name}/pg/{participant or '%'}",),
    ).fetchall()
    return [int(r[0]) for r in rows]


def _prepared(conn: psycopg.Connection[Any], s: Scenario, participant: str) -> list[str]:
    rows = conn.execute(
        "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s ORDER BY gid",
        (f"twophase:pg:{s.name}~%~{participant}",),
    ).fetchall()
    return [r[0] for r in rows]


def _txn_of(gid: str) -> int:
    return int(gid.split("~")[1])


def _quiet_logs(c: Cluster, names: list[str]) -> None:
    for name in names:
        assert c.alive(name), f"{name} exited:\n{c.log_tail(name, 80)}"
        text = (c.logs / f"{name}.log").read_text(errors="replace")
        assert "Traceback" not in text, f"{name}:\n{text[-4000:]}"


def _settled_exactly(s: Scenario, c: Cluster, produced: int, names: list[str]) -> None:
    """Wait for the ``produced`` records exactly once in every sink with nothing left prepared
    or staged, and check that the processes ``names`` are alive with clean logs."""
    report = settle(s, c, set(range(produced)), 180, apply_timeout_s=90)
    print(summary_json(report))
    for sink, r in report.items():
        assert r.ok and r.distinct == produced, f"{sink}: {r}"
    _quiet_logs(c, names)


def test_sessions_of_a_participant_terminated_while_its_part_is_prepared(
    tmp_path: Path, pg_dsn: str, kafka_bootstrap: str
) -> None:
    s = scenario(tmp_path, "pgterm", partitions=4, mongo=False, vote_timeout_ms=VOTE_TIMEOUT_MS)
    c = Cluster(s)
    feeder: _Feeder | None = None
    try:
        c.start("coordinator", "coord-0")
        c.start("participant", "p-0")
        # p-1 sits on its 12th PREPARE: by then both own partitions, and the coordinator
        # waits for p-1's vote while p-0's part of that cycle is prepared and undecided.
        c.start("participant", "p-1", {"TWOPHASE_DELAY_AT": f"on_prepare:12:{HOLD_S:g}"})
        feeder = _Feeder(s, 0)
        wait_until(
            lambda: "delay point on_prepare reached" in c.log_tail("p-1", 400),
            120,
            "p-1 to hold a PREPARE",
        )
        held_at = time.monotonic()
        with psycopg.connect(s.pg_dsn, autocommit=True) as admin:
            # p-0's part of the held cycle: prepared, and still prepared a moment later (a
            # decided part is gone within milliseconds).
            def undecided() -> list[str]:
                first = _prepared(admin, s, "p-0")
                time.sleep(1.5)
                return [g for g in _prepared(admin, s, "p-0") if g in first]

            wait_until(lambda: bool(undecided()), HOLD_S / 2, "p-0 to prepare its part")
            gids = undecided()
            assert gids, "p-0's part was decided before the fault"
            gid = gids[-1]
            txn = _txn_of(gid)
            victims = _sessions(admin, s, "p-0")
            # The prepared part's own connection, the admin one, and any idle or open one.
            assert len(victims) >= 2, (victims, _sessions(admin, s))
            for pid in victims:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            wait_until(
                lambda: not set(victims) & set(_sessions(admin, s)),
                10,
                "the terminated sessions to be gone",
            )
            # Still held: the fault hit a prepared, undecided part, which outlives its session.
            assert time.monotonic() - held_at < HOLD_S, "the hold ended before the fault"
            assert gid in _prepared(admin, s, "p-0"), f"{gid} vanished with its session"
            print(f"terminated {len(victims)} sessions of p-0 while {gid} was prepared")
            # The decision comes when p-1 votes; p-0 finishes the gid from a new session.
            wait_until(lambda: gid not in _prepared(admin, s, "p-0"), 120, f"{gid} to be decided")
        produced = feeder.stop()
        feeder = None
        _settled_exactly(s, c, produced, ["coord-0", "p-0", "p-1"])
    finally:
        if feeder is not None:
            with contextlib.suppress(RuntimeError, KafkaException):
                feeder.stop()
        c.stop_all()
    # The held cycle was committed (on the votes, not timed out), and p-0 committed its part by
    # gid: its own connection was gone.
    outcome = {t: (o, r) for _, t, o, r in control_decisions(s)}
    assert outcome[txn][0] == "commit", outcome[txn]
    token = gid.removeprefix("twophase:pg:")
    log = (c.logs / "p-0.log").read_text(errors="replace")
    assert f"part {token} committed by gid" in log, log[-4000:]


def _fill(dsn: str, limit: int) -> tuple[list[psycopg.Connection[Any]], str]:
    """Connections as the stack's user until PostgreSQL refuses one; the refusal."""
    conns: list[psycopg.Connection[Any]] = []
    for _ in range(limit + 10):
        try:
            conns.append(
                psycopg.connect(dsn, autocommit=True, application_name="twophase-test-filler")
            )
        except psycopg.OperationalError as exc:
            return conns, str(exc)
    raise AssertionError(f"PostgreSQL took {len(conns)} connections, more than max_connections")


def test_connection_limit_exhausted_while_records_flow(
    tmp_path: Path, pg_dsn: str, kafka_bootstrap: str
) -> None:
    s = scenario(tmp_path, "pgfull", partitions=4, mongo=False)
    raw = s.config()
    raw["participant"] = {"sweep_interval_ms": 2_000}  # sweeps meet the full server too
    s.config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    c = Cluster(s)
    feeder: _Feeder | None = None
    fillers: list[psycopg.Connection[Any]] = []
    try:
        c.start("coordinator", "coord-0")
        c.start("participant", "p-0")
        first = 2_000
        produce(s.bootstrap, s.topic, 0, first)
        report = settle(s, c, set(range(first)), 120)
        assert all(r.ok for r in report.values()), summary_json(report)
        with psycopg.connect(s.pg_dsn, autocommit=True) as probe:
            row = probe.execute("SHOW max_connections").fetchone()
        assert row is not None
        limit = int(row[0])

        feeder = _Feeder(s, first)
        fillers, refusal = _fill(s.pg_dsn, limit)
        assert TOO_MANY in refusal, refusal
        # One filler ends the participant's sessions and the freed slots are taken again,
        # until the full server holds none of the pipeline's sessions.
        control = fillers[0]
        for _ in range(20):
            ended = _sessions(control, s)
            for pid in ended:
                control.execute("SELECT pg_terminate_backend(%s)", (pid,))
            time.sleep(0.2)
            more, refusal = _fill(s.pg_dsn, limit)
            fillers += more
            assert TOO_MANY in refusal, refusal
            if not ended and not _sessions(control, s):
                break
        else:
            raise AssertionError("the participant kept a session in the full server")
        print(f"server full: {len(fillers)} fillers (max_connections {limit})")
        full_at = time.monotonic()
        while time.monotonic() - full_at < FULL_FOR_S:
            assert c.alive("p-0"), c.log_tail("p-0", 80)
            assert c.alive("coord-0"), c.log_tail("coord-0", 80)
            assert not _sessions(control, s), "a pipeline session got into the full server"
            time.sleep(1)
        log = (c.logs / "p-0.log").read_text(errors="replace")
        assert TOO_MANY in log, "the participant never met the full server"
        for conn in fillers:
            conn.close()
        fillers = []
        produced = feeder.stop()
        feeder = None
        _settled_exactly(s, c, produced, ["coord-0", "p-0"])
    finally:
        for conn in fillers:
            conn.close()
        if feeder is not None:
            with contextlib.suppress(RuntimeError, KafkaException):
                feeder.stop()
        c.stop_all()
