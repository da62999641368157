"""PostgreSQL faults under a running pipeline (issue #21, item 4), on the real stack.

* **Sessions terminated while a part is prepared.** ``pg_terminate_backend`` of every session
  of one participant while its part is PREPARED and its decision not yet taken (a second
  participant holds its vote back with the ``on_prepare`` delay point). A prepared transaction
  outlives its session; the participant must finish it by gid from a new session (``COMMIT
  PREPARED``) once the decision comes, by itself.
* **A prepare that fails with a fetched batch in hand.** The participant's part's session is
  terminated while it holds records it fetched (``after_consume`` delay point); the PREPARE
  that comes meanwhile fails and rewinds to the committed positions, and the batch in hand,
  fetched before that seek, must be dropped, not written into the next part as well.
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
import random
import signal
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from confluent_kafka import KafkaError, KafkaException

from harness import (
    Cluster,
    Scenario,
    control_decisions,
    produce,
    produce_into,
    read_from,
    source_producer,
    summary_json,
    wait_until,
)
from harness.store_faults import TOO_MANY, fill_connections, pg_prepared, pg_sessions, terminate
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


class _Feeder:
    """Produces a batch of records every EVERY_S on a thread of its own, through one producer:
    records flow while a fault runs, with no gap of a cycle (a producer made per batch took up
    to a second to start on a loaded machine, and a participant's part of the held cycle came
    out empty -- nothing prepared to fault). ``produced`` ids are 0..produced-1."""

    def __init__(self, s: Scenario, start: int) -> None:
        self.s = s
        self.produced = start
        self._stop = threading.Event()
        self._error: Exception | None = None
        self._failed: list[str] = []
        self._producer = source_producer(s.bootstrap)
        self._thread = threading.Thread(target=self._run, name="feeder", daemon=True)
        self._thread.start()

    def _delivered(self, err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            self._failed.append(err.str())

    def _run(self) -> None:
        rng = random.Random(7 + self.produced)
        try:
            while not self._stop.is_set():
                produce_into(
                    self._producer, self.s.topic, self.produced, BATCH, rng, self._delivered
                )
                self.produced += BATCH
                self._producer.poll(0)
                self._stop.wait(EVERY_S)
        except (RuntimeError, KafkaException) as exc:  # reported by stop()
            self._error = exc

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(60)
        if self._error is not None:
            raise self._error
        if self._producer.flush(60) > 0 or self._failed:
            raise RuntimeError(f"records not delivered: {self._failed[:3]}")
        return self.produced


def _sessions(
    conn: psycopg.Connection[Any], s: Scenario, participant: str | None = None
) -> list[int]:
    return pg_sessions(conn, s.name, participant)


def _prepared(conn: psycopg.Connection[Any], s: Scenario, participant: str) -> list[str]:
    return pg_prepared(conn, s.name, participant)


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
            terminate(admin, victims)
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
        fillers, refusal = fill_connections(s.pg_dsn, limit)
        assert TOO_MANY in refusal, refusal
        # One filler ends the participant's sessions and the freed slots are taken again,
        # until the full server holds none of the pipeline's sessions.
        control = fillers[0]
        for _ in range(20):
            ended = _sessions(control, s)
            terminate(control, ended)
            time.sleep(0.2)
            more, refusal = fill_connections(s.pg_dsn, limit)
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


#: How long p-0 holds a batch it fetched (the ``after_consume`` delay point): over a commit
#: interval, so the next PREPARE is queued meanwhile and runs with the batch in hand.
IN_HAND_S = 5.0
IN_HAND_INTERVAL_MS = 2_000


def _reached(path: Path, offset: int, text: str) -> bool:
    """Whether ``text`` is in the log past ``offset``."""
    return text in read_from(path, offset)


def _held_in_an_open_part(c: Cluster, s: Scenario, name: str, attempts: int = 6) -> list[int]:
    """Start ``name`` until it holds a fetched batch while its open part has a PostgreSQL
    transaction (a session ``idle in transaction``); that session's pids. The batch right after
    a cut opens the next part, which has no transaction yet: then the participant is stopped
    and started again, which re-arms the delay point."""
    path = c.logs / f"{name}.log"
    for attempt in range(attempts):
        seen = path.stat().st_size if path.exists() else 0  # the log is appended to
        nth = 12 + 7 * attempt  # another moment each time
        c.start("participant", name, {"TWOPHASE_DELAY_AT": f"after_consume:{nth}:{IN_HAND_S:g}"})
        wait_until(
            partial(_reached, path, seen, "delay point after_consume reached"),
            120,
            f"{name} to hold a fetched batch",
        )
        with psycopg.connect(s.pg_dsn, autocommit=True) as admin:
            pids = pg_sessions(admin, s.name, name, state="idle in transaction")
        if pids:
            return pids
        print(f"attempt {attempt}: the held batch opens a part; starting {name} again")
        c.kill(name, signal.SIGTERM)
    raise AssertionError(f"{name} never held a batch inside an open part in {attempts} tries")


def test_a_prepare_that_fails_with_a_batch_in_hand_drops_the_batch(
    tmp_path: Path, pg_dsn: str, kafka_bootstrap: str
) -> None:
    """The class a chaos run found (a PostgreSQL crash-restart; four records twice in one part,
    in both sinks): a participant had fetched records when a PREPARE queued meanwhile failed
    (its PostgreSQL session was gone) and rewound the consumer to the committed positions. The
    records in hand were fetched before that seek and are fetched again after it; written as
    well, they were in the next part twice. Here p-0 holds a fetched batch while its part's
    session is terminated; the PREPARE that comes meanwhile fails, and the batch must be
    dropped (and read again) -- every record once in every sink."""
    s = scenario(tmp_path, "inhand", partitions=2, mongo=False, interval_ms=IN_HAND_INTERVAL_MS)
    c = Cluster(s)
    feeder: _Feeder | None = None
    try:
        c.start("coordinator", "coord-0")
        feeder = _Feeder(s, 0)
        victims = _held_in_an_open_part(c, s, "p-0")
        with psycopg.connect(s.pg_dsn, autocommit=True) as admin:
            terminate(admin, victims)
        wait_until(
            lambda: "rewinding to committed positions: prepare of" in c.log_tail("p-0", 400),
            60,
            "the PREPARE p-0 got meanwhile to fail and rewind",
        )
        produced = feeder.stop()
        feeder = None
        # With the batch written as well, it is here twice (100 records, in both sinks).
        _settled_exactly(s, c, produced, ["coord-0", "p-0"])
        log = (c.logs / "p-0.log").read_text(errors="replace")
        assert "records fetched before a rewind dropped" in log, log[-4000:]
    finally:
        if feeder is not None:
            with contextlib.suppress(RuntimeError, KafkaException):
                feeder.stop()
        c.stop_all()
