"""The done-checks that time ``make bench``'s runs (:mod:`bench.throughput`) on the stack: a
check that never comes true times a run out, and one that comes true early flatters it. The
MongoDB-only pipeline's check reads the sink's own positions instead of counting the collection
(a scan on SecantusDB, polled all through a run); the peers' checks look up each partition's
last record by key before they count; an exactly-once run ends when no part of it is left
prepared or staged in PostgreSQL, the files sink or MongoDB, as the real sinks leave them."""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from bench import throughput as tp
from harness import Scenario
from harness import record as order_value
from twophase.participants.sdk.records import PartId, Record
from twophase.participants.sdk.sink import Sink, SinkContext
from twophase.participants.sinks.files import FileSink
from twophase.participants.sinks.mongodb import MongoSink
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
    rows = [orjson.loads(order_value(i, random.Random(i))) for i in range(n)]
    return [Record(topic, 0, i, 0, None, v, size=200) for i, v in enumerate(rows)]


SINKS = {"pg": PostgresSink, "files": FileSink, "mongo": MongoSink}


def test_an_exactly_once_run_is_not_done_while_a_part_is_prepared_or_staged(
    source: tp.Source, tmp_path: Path
) -> None:
    """A run's end is read without counting rows: the offsets at the end and no part left
    behind (:func:`bench.throughput._left_behind`). A decided part is applied after the
    offsets are committed, so the check must see a prepared part in each sink -- as the sink
    itself leaves it -- and see none only once the part is there for readers."""
    name = "donecheck-" + uuid.uuid4().hex[:6]
    s = tp.scenario(name, tmp_path, source, sinks=set(SINKS), mode="exactly_once")
    s.write()  # what the bench's clean-up reads
    s.prepare_stores()
    configs = {c["name"]: c for c in s.config()["sinks"]}
    batch = _orders(20, source.topic)
    opened: list[Sink] = []
    try:
        for txn, (sink_name, cls) in enumerate(SINKS.items(), start=1):
            ctx = SinkContext(s.name, "w1", sink_name, logging.getLogger("donecheck"))
            sink = cls.from_mapping(dict(configs[sink_name]), ctx)
            opened.append(sink)
            sink.setup()
            part = PartId(s.name, txn, "w1")
            assert not tp._left_behind(s, set(SINKS))
            sink.begin(part)
            list(sink.write(part, batch))
            sink.prepare(part, {(source.topic, 0): len(batch)})
            assert tp._left_behind(s, {sink_name}), f"{sink_name}: a prepared part went unseen"
            assert tp._verify(s, {sink_name}, source.topic) == {sink_name: 0}
            sink.commit(part)
            assert not tp._left_behind(s, set(SINKS)), f"{sink_name}: a committed part seen"
            assert tp._verify(s, {sink_name}, source.topic) == {sink_name: len(batch)}
    finally:
        for sink in opened:
            sink.close()
        tp._cleanup(s, set(SINKS))  # what a bench run leaves: prepared parts, table, database


def test_a_pg_and_files_run_is_timed_to_its_end_and_exact(
    source: tp.Source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Timed out if the end never comes; raises if fewer than every record is there after it.
    # The parts left behind are asked for once the offsets are at the end: at 600 records the
    # parts are applied within milliseconds of the offsets, so a run that never asks would
    # pass the count too -- whether it asks is watched instead.
    asked: list[bool] = []  # each answer (the run ends on the first False)
    real = tp._left_behind

    def left_behind(s: Scenario, sinks: set[str]) -> bool:
        asked.append(real(s, sinks))
        return asked[-1]

    monkeypatch.setattr(tp, "_left_behind", left_behind)
    r = tp.pipeline_run(source, tmp_path, mode="exactly_once", sinks={"pg", "files"}, timeout_s=120)
    assert r.verified == {"pg": RECORDS, "files": RECORDS}, r.asdict()
    assert asked, "the run ended without asking for the parts left behind"
