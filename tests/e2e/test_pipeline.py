"""End to end on the real stack: coordinator and participant processes writing all three sinks.

Every check reads the sinks and Kafka directly (harness.verify); nothing trusts the
product's own bookkeeping.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from harness import (
    Cluster,
    Scenario,
    control_summary,
    end_offsets,
    produce,
    summary_json,
    wait_until,
)
from tests.e2e.e2e_support import settle
from twophase.config import load_config
from twophase.kafka import create_topics


def _scenario(tmp_path: Path, prefix: str, **kw: object) -> Scenario:
    s = Scenario.on_stack(f"{prefix}-{uuid.uuid4().hex[:6]}", tmp_path, **kw)  # type: ignore[arg-type]
    s.write()
    s.prepare_stores()
    create_topics(load_config(s.config_path))
    return s


def _leader(cluster: Cluster, names: list[str]) -> str:
    """The coordinator that took the lead (only one does while both live)."""

    def find() -> str | None:
        return next((n for n in names if "is now the leader" in cluster.log_tail(n, 500)), None)

    wait_until(lambda: find() is not None, 60, "a coordinator to lead")
    return find() or ""


@pytest.mark.slow
def test_100k_records_exactly_once_through_kills(tmp_path: Path) -> None:
    # SecantusDB (the test MongoDB) applies ~1-2k docs/s: give votes room beyond the default.
    s = _scenario(tmp_path, "e2e", interval_ms=1000, vote_timeout_ms=15_000, iceberg=True)
    n = 100_000
    produce(s.bootstrap, s.topic, 0, n)
    c = Cluster(s)
    c.start("coordinator", "coord-0")
    c.start("coordinator", "coord-1")
    # p-0 dies by SIGKILL right after its 4th vote: its part is prepared and not yet decided.
    c.start("participant", "p-0", {"TWOPHASE_CRASH_AT": "after_vote:4"})
    c.start("participant", "p-1")
    try:
        wait_until(lambda: not c.alive("p-0"), 120, "p-0 to hit its crash point")
        c.start("participant", "p-0")
        # Kill the leading coordinator mid-run; the standby takes over after the session timeout.
        leader = _leader(c, ["coord-0", "coord-1"])
        time.sleep(3)
        c.kill(leader)
        c.start("coordinator", leader)
        report = settle(s, c, set(range(n)), 600, apply_timeout_s=120)
    finally:
        c.stop_all()
    summary = control_summary(s)
    print(summary_json(report), summary)
    for sink, r in report.items():
        assert r.ok, f"{sink}: {r}"
        assert r.distinct == n
    assert summary["committed"] > 0


def test_deposed_coordinator_cannot_write_a_decision(tmp_path: Path) -> None:
    import threading

    from twophase.coordinator.runtime import CoordinatorRuntime
    from twophase.errors import FencedError

    s = _scenario(tmp_path, "fence", mongo=False, files=False, interval_ms=200)
    cfg = load_config(s.config_path)
    c = Cluster(s)
    c.start("participant", "p-0")
    zombie = CoordinatorRuntime(cfg, instance="zombie")
    failure: list[BaseException] = []

    def run() -> None:
        try:
            zombie.run()
        except FencedError as exc:  # anything else fails the assertion below
            failure.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        wait_until(lambda: zombie.machine.committed >= 2, 60, "the first coordinator to commit")
        # A new leader's first act: init_transactions with the pipeline's transactional.id.
        usurper = Producer(
            {"bootstrap.servers": s.bootstrap, "transactional.id": cfg.transactional_id}
        )
        usurper.init_transactions(30)
        fenced_at = end_offsets(s.bootstrap, cfg.control_topic, 1)[0]
        t.join(60)
        assert not t.is_alive(), "the deposed coordinator kept running"
        assert failure and isinstance(failure[0], FencedError), failure
        assert zombie.metrics.fenced.labels(s.name)._value.get() >= 1
        # Nothing it tried after the fence reached the log (read_committed).
        reader = Consumer(
            {
                "bootstrap.servers": s.bootstrap,
                "group.id": f"probe-{s.name}",
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
            }
        )
        reader.assign([TopicPartition(cfg.control_topic, 0, fenced_at)])
        late = []
        while True:
            m = reader.poll(5)
            if m is None or m.error():
                break
            if b"coordinator:zombie" in (m.value() or b""):
                late.append(m.offset())
        reader.close()
        assert late == []
    finally:
        c.stop_all()
        zombie.stop()


def test_a_fenced_coordinator_process_stays_up_and_the_pipeline_goes_on(tmp_path: Path) -> None:
    """A leader cut off long enough to be replaced finds itself fenced when it comes back (the
    chaos run's Kafka partition of the leader). The process does not exit: it gives up the
    control partition, starts again as a standby, and -- the only coordinator here -- leads again;
    the records sent meanwhile land exactly once."""
    s = _scenario(tmp_path, "fencedproc", mongo=False, files=False, interval_ms=200)
    cfg = load_config(s.config_path)
    n = 4_000
    produce(s.bootstrap, s.topic, 0, n)
    c = Cluster(s)
    c.start("coordinator", "coord-0")
    c.start("participant", "p-0")
    try:
        wait_until(lambda: "is now the leader" in c.log_tail("coord-0", 500), 60, "coord-0 to lead")
        # From its log: the control log grows every 200 ms, a reader to its end may never end.
        wait_until(
            lambda: c.log_tail("coord-0", 500).count(" committed (") >= 2, 60, "the first commits"
        )
        # A newer leader's first act: init_transactions with the pipeline's transactional.id.
        Producer(
            {"bootstrap.servers": s.bootstrap, "transactional.id": cfg.transactional_id}
        ).init_transactions(30)
        wait_until(
            lambda: "starting again as a standby" in c.log_tail("coord-0", 500),
            60,
            "coord-0 to notice the fence",
        )
        assert c.alive("coord-0"), c.log_tail("coord-0")
        produce(s.bootstrap, s.topic, n, n)
        report = settle(s, c, set(range(2 * n)), 300, apply_timeout_s=120)
        assert c.alive("coord-0"), c.log_tail("coord-0")
        tail = c.log_tail("coord-0", 2000)
    finally:
        c.stop_all()
    assert tail.count("is now the leader") >= 2, tail
    for sink, r in report.items():
        assert r.ok, f"{sink}: {r}"
        assert r.distinct == 2 * n


def test_rebalance_mid_cycle_is_decided_on_the_votes_and_data_lands_once(tmp_path: Path) -> None:
    s = _scenario(tmp_path, "rebal", interval_ms=500, vote_timeout_ms=20_000, mongo=False)
    n = 20_000
    produce(s.bootstrap, s.topic, 0, n)
    c = Cluster(s)
    c.start("coordinator", "coord-0")
    # p-0 holds its 3rd PREPARE for 8 s before acting on it; p-2 joins during that hold.
    c.start("participant", "p-0", {"TWOPHASE_DELAY_AT": "on_prepare:3:8"})
    c.start("participant", "p-1")
    try:
        wait_until(
            lambda: "delay point on_prepare reached" in c.log_tail("p-0", 200), 90, "p-0 to hold"
        )
        c.start("participant", "p-2")
        produce(s.bootstrap, s.topic, n, n)
        report = settle(s, c, set(range(2 * n)), 300, apply_timeout_s=120)
    finally:
        c.stop_all()
    summary = control_summary(s)
    print(summary)
    # The cycle spanning the rebalances is decided on its votes -- aborted on their generations,
    # or committed when the late joiners' re-votes make one generation cover everything --
    # never left to the 20 s vote timeout.
    assert not any("vote timeout" in r for r in summary["abort_reasons"]), summary
    for sink, r in report.items():
        assert r.ok, f"{sink}: {r}"


@pytest.mark.parametrize("only_pg", [False, True], ids=["all-sinks", "pg-reads-raw-json"])
def test_poison_records_go_to_the_dead_letter_topic(tmp_path: Path, only_pg: bool) -> None:
    """With PostgreSQL alone, the sink reads the JSON itself (compiled encoder) and the
    runtime dead-letters what it found undecodable: same topic, same reasons."""
    extra = {"mongo": False, "files": False} if only_pg else {}
    s = _scenario(tmp_path, "poison", interval_ms=500, **extra)
    n = 2_000
    produce(s.bootstrap, s.topic, 0, n)
    p = Producer({"bootstrap.servers": s.bootstrap})
    poison = {
        b"\xff\xfe not json": "undecodable",
        b"[1, 2, 3]": "undecodable",
        b'{"id": "not-a-number", "customer": "x"}': "rejected by sink pg",
    }
    for value in poison:
        p.produce(s.topic, value=value, partition=1)
    p.flush(30)
    produce(s.bootstrap, s.topic, n, n)
    c = Cluster(s)
    c.start("coordinator", "coord-0")
    c.start("participant", "p-0")
    try:
        report = settle(s, c, set(range(2 * n)), 300, apply_timeout_s=120)
    finally:
        c.stop_all()
    for sink, r in report.items():
        assert r.ok, f"{sink}: {r}"
    assert set(report) == ({"pg"} if only_pg else {"pg", "mongo", "files"})
    reads_raw = "every sink reads the JSON values itself" in c.log_tail("p-0", 2000)
    assert reads_raw == only_pg
    dlq = Consumer(
        {
            "bootstrap.servers": s.bootstrap,
            "group.id": f"dlq-{s.name}",
            "auto.offset.reset": "earliest",
        }
    )
    dlq.subscribe([f"{s.name}.dlq"])
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < len(poison) and time.monotonic() < deadline:
        m = dlq.poll(1)
        if m is None or m.error():
            continue
        h = dict(m.headers() or [])
        got[m.value()] = h
    dlq.close()
    assert set(got) >= {b"\xff\xfe not json", b"[1, 2, 3]"}
    assert len(got) == len(poison), got.keys()
    for value, headers in got.items():
        reason = headers["twophase.reason"].decode()
        assert headers["twophase.source.topic"] == s.topic.encode()
        assert headers["twophase.source.partition"] == b"1"
        assert int(headers["twophase.source.offset"]) >= 0
        if value in poison:
            assert reason.startswith(poison[value]), reason
