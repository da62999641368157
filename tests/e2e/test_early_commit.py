"""A burst is committed when the input goes quiet, not at the next interval (DRAINED hints); a
few records now and then keep the interval. On the real stack: processes, Kafka, PostgreSQL and
files, every count read from the sinks and the control topic themselves."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import psycopg

from harness import (
    Cluster,
    Scenario,
    control_decisions,
    produce,
    read_from,
    record,
    source_producer,
    verify,
    wait_until,
)
from tests.e2e.e2e_support import read_topic, scenario

#: Far longer than the test waits for the burst: a commit of it before this came early.
INTERVAL_MS = 60_000
BURST = 30_000


def _scenario(tmp_path: Path, prefix: str) -> Scenario:
    """PostgreSQL and files, a 60 s interval, early cycles at their defaults."""
    commit = {
        "interval_ms": INTERVAL_MS,
        "vote_timeout_ms": 20_000,
        "early_idle_ms": 100,
        "early_min_records": 10_000,
    }
    return scenario(tmp_path, prefix, mongo=False, extra={"commit": commit})


def _rows(dsn: str, table: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(row[0]) if row else 0


def test_a_burst_commits_when_the_input_goes_quiet_and_a_trickle_waits_for_the_interval(
    tmp_path: Path,
) -> None:
    s = _scenario(tmp_path, "early")
    c = Cluster(s)
    c.start("coordinator", "coord-0")
    c.start("participant", "p-0")
    c.start("participant", "p-1")
    try:
        # The first cycle starts as the coordinator takes the lead; the participants join it.
        wait_until(lambda: bool(control_decisions_live(c)), 90, "the first cycle to commit")
        produce(s.bootstrap, s.topic, 0, BURST)
        produced = time.monotonic()
        wait_until(lambda: _rows(s.pg_dsn, s.table) == BURST, 30, "the burst to be committed")
        took = time.monotonic() - produced
        # Well before the 60 s interval: the cycle started when both inputs went quiet.
        assert took < 20, took

        # A trickle below early_min_records: nothing starts a cycle before the interval.
        produce(s.bootstrap, s.topic, BURST, 10)
        time.sleep(5)
        assert _rows(s.pg_dsn, s.table) == BURST
    finally:
        c.stop_all()
    for sink, report in verify(s, set(range(BURST))).items():
        assert report.ok, f"{sink}: {report}"
    # The first cycle, then the burst's: nothing else committed, nothing aborted since.
    decisions = control_decisions(s)
    first = next(i for i, d in enumerate(decisions) if d[2] == "commit")
    assert [d[2] for d in decisions[first:]] == ["commit", "commit"], decisions
    control = read_topic(s.bootstrap, f"twophase.control.{s.name}")
    assert any(b'"type":7' in (m.value() or b"") for m in control), "no DRAINED message"


def control_decisions_live(c: Cluster) -> bool:
    """The coordinator's log says a cycle committed (the control topic cannot be read to its
    end while the coordinator holds a transaction open on it)."""
    return "committed (" in c.log_tail("coord-0", 400)


def test_partitions_that_got_nothing_since_an_assignment_do_not_hold_an_early_cycle_back(
    tmp_path: Path,
) -> None:
    """Participants restarted over partitions that hold records (so librdkafka knows no position
    until a record is consumed), then a burst into one partition only: the three that got
    nothing are read to their end too, and the burst commits when the input goes quiet."""
    s = _scenario(tmp_path, "early-skew")
    produce(s.bootstrap, s.topic, 0, BURST)  # every partition holds records before they start
    c = Cluster(s)
    c.start("coordinator", "coord-0")
    c.start("participant", "p-0")
    c.start("participant", "p-1")
    try:
        wait_until(lambda: _rows(s.pg_dsn, s.table) == BURST, 90, "the first records committed")
        names = ("p-0", "p-1")
        since = {n: (c.logs / f"{n}.log").stat().st_size for n in names}
        for name in names:  # new processes, new assignments: no position known
            c.kill(name, signal.SIGTERM)
        for name in names:
            c.start("participant", name)

        def settled() -> bool:
            return all(
                "assigned 2 partitions" in read_from(c.logs / f"{n}.log", since[n]) for n in names
            )

        wait_until(settled, 60, "both restarted participants assigned two partitions")
        time.sleep(3)
        p = source_producer(s.bootstrap)
        rng = random.Random(3)
        for i in range(BURST, 2 * BURST):
            p.produce(s.topic, partition=0, key=str(i).encode(), value=record(i, rng))
            if i % 5000 == 0:
                p.poll(0)
        assert p.flush(60) == 0
        produced = time.monotonic()
        wait_until(lambda: _rows(s.pg_dsn, s.table) == 2 * BURST, 30, "the skewed burst")
        assert time.monotonic() - produced < 20
    finally:
        c.stop_all()
    for sink, report in verify(s, set(range(2 * BURST))).items():
        assert report.ok, f"{sink}: {report}"
