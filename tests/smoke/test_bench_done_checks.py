"""The done-checks that time ``make bench``'s runs (:mod:`bench.throughput`) on the stack: a
check that never comes true times a run out, and one that comes true early flatters it. The
MongoDB-only pipeline's check reads the sink's own positions instead of counting the collection
(a scan on SecantusDB, polled all through a run); the peers' checks look up each partition's
last record by key before they count."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from bench import throughput as tp

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
