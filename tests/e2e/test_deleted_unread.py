"""Source records deleted before the pipeline read them -- by the topic's retention while the
pipeline was down, or by an operator's DeleteRecords -- are gone from Kafka: no pipeline can
deliver them. What it must do is say so. A participant resuming from its committed positions
finds them below the partitions' log start; it reads on from there, and names each partition
and range in its log and counts the offsets in ``twophase_source_offsets_deleted_unread``, in
either mode, while every record still in the topic lands once. Offsets a reader never sees for
other reasons -- a transactional producer's commit markers and aborted records -- are not
deletions and are not counted."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from harness import (
    Cluster,
    Scenario,
    end_offsets,
    group_offsets,
    produce,
    produce_into,
    verify,
    wait_until,
)
from tests.e2e.e2e_support import metric, scenario, scrape, start

METRIC = "twophase_source_offsets_deleted_unread_total"
MODES = ["exactly_once", "at_least_once"]


def _twice(
    tmp_path: Path,
    mode: str,
    first: Callable[[Scenario], set[int]],
    between: Callable[[Scenario], set[int]],
) -> tuple[Scenario, Cluster, str]:
    """Run the pipeline over what ``first`` produces until it is in every sink, stop it, let
    ``between`` change the topic, run it again until every record ``between`` says is readable
    is in too; the second participant's /metrics, scraped at the end."""
    s = scenario(tmp_path, "deleted", mongo=False, interval_ms=500, extra={
        "participant": {"mode": mode}})  # fmt: skip
    c = Cluster(s)

    def run() -> int:
        if mode == "exactly_once":
            start(c, "coordinator", "coord-0")
        return start(c, "participant", "p-0")

    def landed(expected: set[int]) -> None:
        # Every sink: each record once, nothing prepared or staged (a transactional topic's
        # end offset is its last commit marker: no committed position reaches it).
        try:
            wait_until(lambda: all(r.ok for r in verify(s, expected).values()), 90, "the sinks")
        except TimeoutError:
            c.print_logs()
            raise

    expected = first(s)
    run()
    try:
        landed(expected)
    finally:
        c.stop_all()
    expected |= between(s)
    port = run()
    try:
        landed(expected)
        text = scrape(port)
    finally:
        c.stop_all()
    return s, c, text


@pytest.mark.parametrize("mode", MODES)
def test_records_deleted_before_they_were_read_are_named_and_counted(
    tmp_path: Path, mode: str
) -> None:
    gone: dict[int, tuple[int, int]] = {}  # partition -> the first offset gone, the log start

    def first(s: Scenario) -> set[int]:
        produce(s.bootstrap, s.topic, 0, 200)
        return set(range(200))

    def between(s: Scenario) -> set[int]:
        committed = group_offsets(s.bootstrap, f"twophase.{s.name}", s.topic, s.partitions)
        # While the pipeline is down: records nobody reads, then deleted (what retention does).
        produce(s.bootstrap, s.topic, 200, 100)
        ends = end_offsets(s.bootstrap, s.topic, s.partitions)
        admin = AdminClient({"bootstrap.servers": s.bootstrap})
        deleted = admin.delete_records([TopicPartition(s.topic, p, ends[p]) for p in ends])
        for future in deleted.values():
            future.result(30)
        gone.update((p, (committed[p], ends[p])) for p in ends)
        produce(s.bootstrap, s.topic, 300, 100)
        return set(range(300, 400))

    s, c, text = _twice(tmp_path, mode, first, between)
    assert sum(end - at for at, end in gone.values()) == 100
    assert metric(text, METRIC, pipeline=s.name) == 100
    log = (c.logs / "p-0.log").read_text()
    for p, (at, end) in gone.items():
        assert metric(text, METRIC, topic=s.topic, partition=str(p)) == end - at
        if end > at:
            line = f"{s.topic}[{p}]: offsets {at} to {end - 1} were deleted"
            assert line in log, log[-3000:]


@pytest.mark.parametrize("mode", MODES)
def test_a_transactional_producers_markers_and_aborted_records_are_not_deletions(
    tmp_path: Path, mode: str
) -> None:
    """Committed positions that end just before a commit marker, and aborted records after
    them: the first record read after the restart is past the sought offset, but nothing was
    deleted."""
    rng = random.Random(3)

    def transactions(s: Scenario, ids: list[tuple[int, int, bool]]) -> None:
        p = Producer({"bootstrap.servers": s.bootstrap, "transactional.id": uuid.uuid4().hex})
        p.init_transactions(30)
        for begin, count, commit in ids:
            p.begin_transaction()
            produce_into(p, s.topic, begin, count, rng)
            if commit:
                p.commit_transaction(30)
            else:
                p.flush(30)
                p.abort_transaction(30)

    def first(s: Scenario) -> set[int]:
        transactions(s, [(0, 50, True), (50, 50, True), (100, 20, True)])
        return set(range(120))

    def between(s: Scenario) -> set[int]:
        transactions(s, [(1000, 40, False), (120, 60, True)])
        return set(range(120, 180))

    _s, _c, text = _twice(tmp_path, mode, first, between)
    assert metric(text, METRIC) == 0
