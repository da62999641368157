"""The Kafka Connect peers of ``make bench`` (:mod:`bench.kc_peers`), once each on a few
thousand records: Debezium's JDBC sink into PostgreSQL and MongoDB's sink into the stack's
MongoDB server, on the stack's Kafka Connect worker, must each deliver exactly the source's
records (rows == distinct ids == records) -- a connector that cannot start its tasks (a plugin
packaging fault in ``stack/connect/*/pom.xml``), refuses the envelope or loses records fails here.

Marked ``connect`` like ``tests/smoke/test_connect.py``: run with the worker up
(``TWOPHASE_STACK_CONNECT=1 make stack-up``, or ``bash stack/connect.sh up``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import cdc, kc_peers
from bench import throughput as tp

pytestmark = [pytest.mark.stack, pytest.mark.connect]

RECORDS = 2_000
#: Fewer for MongoDB: the stack's server (SecantusDB, a test server) upserted 40-400 documents/s
#: through the connector on the shared 2-core machine.
MONGO_RECORDS = 1_000
#: From the tasks RUNNING to done: a JDBC run takes ~5 s here, a MongoDB run 3-30 s.
RUN_TIMEOUT_S = 60.0


def _source(kafka_bootstrap: str, records: int) -> Iterator[tp.Source]:
    with tp.Source.temporary(kafka_bootstrap, records, "kcpeers") as src:
        yield src


@pytest.fixture
def source(connect_url: str, kafka_bootstrap: str) -> Iterator[tp.Source]:
    del connect_url  # only its check that the worker answers
    yield from _source(kafka_bootstrap, RECORDS)


@pytest.fixture
def mongo_source(connect_url: str, kafka_bootstrap: str) -> Iterator[tp.Source]:
    del connect_url
    yield from _source(kafka_bootstrap, MONGO_RECORDS)


def _exact(r: tp.RunResult, sink: str, records: int) -> None:
    assert r.verified == {sink: records}, r.asdict()
    assert r.control["distinct_ids"] == records, r.asdict()
    assert r.control["exact"] is True, r.asdict()
    assert r.control["tasks"] == tp.PARTITIONS
    assert r.records_per_s > 0 and r.cpu_s["connect_worker"] > 0, r.asdict()


def test_debezium_jdbc_sink_upserts_exactly_the_records(source: tp.Source, tmp_path: Path) -> None:
    framed = kc_peers.enveloped(source)
    try:
        r = kc_peers.kc_jdbc_run(framed, tmp_path, timeout_s=RUN_TIMEOUT_S)
    finally:
        tp.delete_topics(source.bootstrap, [framed.topic])
    _exact(r, "pg", RECORDS)


def test_mongodb_sink_upserts_exactly_the_records(mongo_source: tp.Source, tmp_path: Path) -> None:
    r = kc_peers.kc_mongo_run(mongo_source, tmp_path, timeout_s=RUN_TIMEOUT_S)
    _exact(r, "mongo", MONGO_RECORDS)


#: Change events for the CDC peer: ~3,300 with the deletes' tombstones, three tables.
CDC_EVENTS = 3_000


def test_debezium_jdbc_sink_applies_the_change_events(
    connect_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The CDC section's peer: creates, updates and deletes of three tables, applied by the
    connector into replica tables that must then hold exactly what the changes leave (the run
    compares every row), with a key changed twice in one batch (the reduction buffer's case)."""
    del connect_url
    changes = cdc.Changes.create(kafka_bootstrap, CDC_EVENTS)
    framed = cdc.enveloped_changes(changes)
    try:
        r = cdc.kc_cdc_run(framed, tmp_path, timeout_s=RUN_TIMEOUT_S)
    finally:
        framed.delete()
        changes.delete()
    assert r.control["exact"] is True, r.asdict()
    assert r.verified == {t: len(ids) for t, ids in changes.live.items()}, r.asdict()
    assert r.records == changes.messages and r.cpu_s["connect_worker"] > 0, r.asdict()
