"""The done-checks that time ``make bench``'s runs (:mod:`bench.throughput`) on the stack: a
check that never comes true times a run out, and one that comes true early flatters it. The
MongoDB-only pipeline's check reads the sink's own positions instead of counting the collection
(a scan on SecantusDB, polled all through a run); the peers' checks look up each partition's
last record by key before they count."""

from __future__ import annotations

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
    c = Consumer({"bootstrap.servers": source.bootstrap, "group.id": "donecheck-reader"})
    last: dict[int, int] = {}
    try:
        for p in range(source.partitions):
            c.assign([TopicPartition(source.topic, p, 0)])
            _, high = c.get_watermark_offsets(TopicPartition(source.topic, p), timeout=10)
            seen = 0
            while seen < high:
                for m in c.consume(1000, 1.0):
                    value = m.value()
                    assert m.error() is None and value is not None
                    last[p] = orjson.loads(value)["id"]
                    seen += 1
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
