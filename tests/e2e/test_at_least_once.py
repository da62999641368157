"""``participant.mode: at_least_once`` on the real stack: no coordinator, nothing lost through a
kill -9, dead letters as in exactly-once mode, and no prepared or staged leftovers once the
killed participant is back.

Duplicates are allowed in this mode (that is what it trades); the test only bounds them by what
one unacknowledged batch per kill can replay.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from confluent_kafka import Consumer, Producer

from harness import (
    Cluster,
    Scenario,
    end_offsets,
    group_offsets,
    produce,
    verify,
    wait_until,
)
from twophase.config import load_config
from twophase.kafka import create_topics

MAX_BATCH = 500


def _scenario(tmp_path: Path) -> Scenario:
    """An at-least-once pipeline into PostgreSQL and files, its stores and topics ready."""
    s = Scenario.on_stack(
        f"alo-{uuid.uuid4().hex[:6]}",
        tmp_path,
        mongo=False,
        extra={"participant": {"mode": "at_least_once", "max_batch_records": MAX_BATCH}},
    )
    s.write()
    s.prepare_stores()
    create_topics(load_config(s.config_path))
    return s


def test_at_least_once_loses_nothing_through_a_kill_and_leaves_nothing_prepared(
    tmp_path: Path,
) -> None:
    s = _scenario(tmp_path)
    n = 20_000
    produce(s.bootstrap, s.topic, 0, n // 2)
    p = Producer({"bootstrap.servers": s.bootstrap})
    p.produce(s.topic, value=b"\xff not json", partition=2)
    p.flush(30)

    def committed() -> int:
        return sum(
            max(o, 0) for o in group_offsets(s.bootstrap, f"twophase.{s.name}", s.topic, 4).values()
        )

    ends = lambda: sum(end_offsets(s.bootstrap, s.topic, 4).values())  # noqa: E731
    c = Cluster(s)
    try:
        c.start("participant", "w-0")
        c.start("participant", "w-1")
        wait_until(lambda: committed() >= 2_000, 120, "the first batches to commit")
        # Killed mid-stream: w-0 may hold a written, prepared or committed-but-unacknowledged
        # batch. Its replacement (same id) must clear what can never be acknowledged.
        produce(s.bootstrap, s.topic, n // 2, n // 2)
        c.kill("w-0")
        c.start("participant", "w-0")
        wait_until(lambda: committed() == ends(), 180, "offsets to reach the end")
    finally:
        c.stop_all()
    reports = verify(s, set(range(n)))
    for sink, r in reports.items():
        assert r.missing == 0, f"{sink} lost records: {r}"
        assert r.orphaned_prepared == 0, f"{sink}: {r}"
        assert r.staging_leftovers == 0, f"{sink}: {r}"
        # One kill replays at most the batches w-0 had not acknowledged: a few batches' worth.
        assert r.duplicated <= 4 * MAX_BATCH, f"{sink}: {r}"
    assert "running at-least-once" in c.log_tail("w-1", 400)
    dlq = Consumer(
        {
            "bootstrap.servers": s.bootstrap,
            "group.id": f"dlq-{s.name}",
            "auto.offset.reset": "earliest",
        }
    )
    dlq.subscribe([f"{s.name}.dlq"])
    reasons = []
    for _ in range(30):
        m = dlq.poll(1)
        if m is not None and m.error() is None:
            reasons.append(dict(m.headers() or [])["twophase.reason"].decode())
            break
    dlq.close()
    assert reasons and reasons[0].startswith("undecodable"), reasons


def test_a_batch_one_sink_committed_before_a_crash_is_rolled_forward_in_the_others(
    tmp_path: Path,
) -> None:
    """Killed between two sinks' commits of one batch: the restart commits the batch in the
    sinks where it is still prepared (it cannot take it back from the one that shows it), so
    the sinks hold the same records -- the batch's replay duplicates it in both alike."""
    s = _scenario(tmp_path)
    n = 5_000
    produce(s.bootstrap, s.topic, 0, n)
    c = Cluster(s)
    try:
        c.start("participant", "w-0", {"TWOPHASE_CRASH_AT": "alo_mid_commit:3"})
        wait_until(lambda: not c.alive("w-0"), 120, "w-0 to die between two commits")
        assert "crash point alo_mid_commit reached" in c.log_tail("w-0", 50)
        c.start("participant", "w-0")
        wait_until(
            lambda: (
                group_offsets(s.bootstrap, f"twophase.{s.name}", s.topic, 4)
                == end_offsets(s.bootstrap, s.topic, 4)
            ),
            120,
            "offsets to reach the end",
        )
        assert c.alive("w-0"), c.log_tail("w-0", 40)
    finally:
        c.stop_all()
    reports = verify(s, set(range(n)))
    for sink, r in reports.items():
        assert r.missing == 0 and r.orphaned_prepared == 0 and r.staging_leftovers == 0, (sink, r)
    assert reports["pg"].rows == reports["files"].rows, reports
    assert reports["pg"].duplicated > 0, reports  # the crashed batch was replayed
