"""The done-checks that time ``make bench``'s runs (:mod:`bench.throughput`) on the stack: a
check that never comes true times a run out, and one that comes true early flatters it. The
MongoDB-only pipeline's check reads the sink's own positions instead of counting the collection
(a scan on SecantusDB, polled all through a run); the peers' checks look up each partition's
last record by key before they count; an exactly-once PostgreSQL / files run ends when no part
of it is left prepared or staged, as the real sinks leave them."""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from psycopg import sql

from bench import throughput as tp
from harness import Scenario
from harness import record as tp_record
from twophase.participants.sdk.records import PartId, Record
from twophase.participants.sdk.sink import SinkContext
from twophase.participants.sinks.files import FileSink
from twophase.participants.sinks.postgres import PostgresSink

pytestmark = [pytest.mark.stack]

RECORDS = 600


@pytest.fixture
def source(kafka_bootstrap: str) -> Iterator[tp.Source]:
    with tp.Source.temporary(kafka_bootstrap, RECORDS, "donecheck") as src:
        yield src


def test_last_ids_are_the_last_record_of_each_partition(source: tp.Source) -> None:
    c = Consumer(
        {
            "bootstrap.servers": source.bootstrap,
            "group.id": f"donecheck-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,
        }
    )
    last: dict[int, int] = {}
    ends: dict[int, int] = {}
    try:
        for p in range(source.partitions):
            ends[p] = c.get_watermark_offsets(TopicPartition(source.topic, p), timeout=10)[1]
        c.assign([TopicPartition(source.topic, p, 0) for p in range(source.partitions)])
        read = 0
        deadline = time.monotonic() + 60
        while read < sum(ends.values()):
            assert time.monotonic() < deadline, f"{read} of {sum(ends.values())} records read"
            for m in c.consume(1000, 1.0):
                value, partition, offset = m.value(), m.partition(), m.offset()
                assert m.error() is None and value is not None and partition is not None
                read += 1
                if offset == ends[partition] - 1:
                    last[partition] = orjson.loads(value)["id"]
    finally:
        c.close()
    assert len(last) == source.partitions  # 600 keyed records leave no partition empty
    assert tp.last_ids(source) == sorted(last.values())


def test_a_mongodb_pipeline_run_is_timed_to_every_document_applied(
    source: tp.Source, tmp_path: Path
) -> None:
    # Timed out unless the sink's positions come to every record (then the count agrees).
    r = tp.pipeline_run(source, tmp_path, mode="exactly_once", sinks={"mongo"}, timeout_s=120)
    assert r.verified == {"mongo": RECORDS}, r.asdict()
    assert r.control["committed"] >= 1, r.asdict()


def _orders(n: int, topic: str) -> list[Record]:
    rows = [orjson.loads(tp_record(i, random.Random(i))) for i in range(n)]
    return [Record(topic, 0, i, 0, None, v, size=200) for i, v in enumerate(rows)]


def test_an_exactly_once_run_is_not_done_while_a_part_is_prepared_or_staged(
    source: tp.Source, tmp_path: Path
) -> None:
    """A run's end is read without counting rows: the offsets at the end and no part left
    behind (:func:`bench.throughput._left_behind`). A decided part is applied after the
    offsets are committed, so the check must see a prepared part in either sink -- as the sinks
    themselves leave it -- and see none once it is committed."""
    s = tp.scenario("donecheck-" + uuid.uuid4().hex[:6], tmp_path, source, sinks={"pg", "files"},
                    mode="exactly_once")  # fmt: skip
    s.prepare_stores()
    made = {c["name"]: c for c in s.config()["sinks"]}
    classes = {"pg": PostgresSink, "files": FileSink}
    batch = _orders(20, source.topic)
    try:
        for name in ("pg", "files"):
            ctx = SinkContext(s.name, "w1", name, logging.getLogger("donecheck"))
            sink = classes[name].from_mapping(dict(made[name]), ctx)
            sink.setup()
            part = PartId(s.name, 7, "w1")
            assert not tp._left_behind(s, {"pg", "files"})
            sink.begin(part)
            list(sink.write(part, batch))
            sink.prepare(part, {(source.topic, 0): len(batch)})
            assert tp._left_behind(s, {name}), f"{name}: a prepared part went unseen"
            assert tp._left_behind(s, {"pg", "files"})
            assert not tp._left_behind(s, {"pg", "files"} - {name})
            sink.commit(part)
            assert not tp._left_behind(s, {"pg", "files"}), f"{name}: a committed part seen"
            sink.close()
    finally:
        with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
            for (gid,) in conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s", (f"%:{s.name}~%",)
            ).fetchall():
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            conn.execute(f"DROP TABLE IF EXISTS {s.table}")


def test_a_pg_and_files_run_is_timed_to_its_end_and_exact(
    source: tp.Source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Timed out if the end never comes; raises if fewer than every record is there after it.
    # The parts left behind are asked for once the offsets are at the end (the run's own
    # end, not a count): at 600 records the parts are applied within milliseconds of the
    # offsets, so without the question the run would pass too -- it is watched instead.
    asked: list[bool] = []
    real = tp._left_behind

    def left_behind(s: Scenario, sinks: set[str]) -> bool:
        asked.append(real(s, sinks))
        return asked[-1]

    monkeypatch.setattr(tp, "_left_behind", left_behind)
    r = tp.pipeline_run(source, tmp_path, mode="exactly_once", sinks={"pg", "files"}, timeout_s=120)
    assert r.verified == {"pg": RECORDS, "files": RECORDS}, r.asdict()
    assert asked and asked[-1] is False, asked
