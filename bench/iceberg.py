"""Iceberg throughput (``make bench``, section ``iceberg``).

One side is the exactly-once pipeline with one ``iceberg`` sink (append mode, the table
partitioned by ``bucket(4, id)``, a local warehouse, pyiceberg's SQL catalog in the stack's
PostgreSQL) at ``commit.interval_ms: 1000``, timed from the first participant ready to every
offset committed and every record in the table -- a pyiceberg scan's count, polled every 0.1 s
on the clock (the other pipeline sections, since 2026-11-28, read the parts left behind every
0.02 s and count after the clock; this one was left as measured: its issue is blocked). The
other is pyiceberg's own ``Table.append`` of the same records, already as Arrow (converted by
the sink's own row rules beforehand, outside the clock), in chunks of ``CHUNK`` rows into a
table of the same schema and spec: what writing Iceberg costs without Kafka, JSON, or a
two-phase commit. Beside them: the pipeline's commit latency
(PREPARE written to DECISION written, from the control topic) -- its p99 at the 1 s interval.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
from confluent_kafka import Consumer, TopicPartition
from pyiceberg.catalog.sql import SqlCatalog

from bench import throughput as tp
from harness import Scenario, control_summary, iceberg_catalog, load_stack_env
from twophase.config import load_config
from twophase.kafka import create_topics
from twophase.participants.sdk import Record, SinkContext
from twophase.participants.sinks.iceberg import IcebergSink

#: Rows per direct ``append``: a batch writer's chunk.
CHUNK = 100_000


def _catalog(s: Scenario) -> SqlCatalog:
    return iceberg_catalog(s.pg_dsn, s.table, s.warehouse)


def _scenario(name: str, workdir: Path, source: tp.Source) -> Scenario:
    s = Scenario.on_stack(
        name,
        workdir / name,
        partitions=source.partitions,
        mongo=False,
        files=False,
        iceberg=True,
        extra={
            "sources": [
                {"topic": source.topic, "partitions": source.partitions, "replication_factor": 1}
            ],
            "participant": {"mode": "exactly_once"},
        },
    )
    s.extra["sinks"] = [x for x in s.config()["sinks"] if x["type"] == "iceberg"]
    return s


def pipeline_run(source: tp.Source, workdir: Path, *, timeout_s: float = 900.0) -> tp.RunResult:
    s = _scenario(f"bench-ice-{uuid.uuid4().hex[:6]}", workdir, source)
    create_topics(load_config(s.write()))
    probe = tp.CommittedProbe(source, f"twophase.{s.name}")
    catalog: list[SqlCatalog] = []
    n = source.records

    def rows() -> int:
        if not catalog:
            catalog.append(_catalog(s))
        try:
            return int(catalog[0].load_table(s.iceberg_table).scan().count())
        except Exception:  # noqa: BLE001 - no table yet: the sink makes it at start-up
            return -1

    started = time.monotonic()
    try:
        seconds, cpu, rss = tp.timed(
            s,
            "exactly_once",
            tp.PARTICIPANTS,
            lambda: probe.total() >= n and rows() == n,
            timeout_s,
        )
        got = rows()
    finally:
        probe.close()
        for c in catalog:
            c.engine.dispose()
    wall = time.monotonic() - started
    control = control_summary(s)
    return tp.RunResult(
        "exactly_once",
        ["iceberg"],
        n,
        n / seconds,
        seconds,
        wall,
        {"iceberg": got},
        control,
        cpu,
        rss,
    )


def arrow_of(source: tp.Source, workdir: Path) -> pa.Table:
    """The source's records as the sink's Arrow rows (its own conversion), read once."""
    s = _scenario(f"bench-ice-ref-{uuid.uuid4().hex[:6]}", workdir, source)
    sink = IcebergSink.from_mapping(
        s.extra["sinks"][0], SinkContext(s.name, "bench", "lake", logging.getLogger("bench"))
    )
    assert isinstance(sink, IcebergSink)
    sink.setup()
    maker = sink._maker
    assert maker is not None
    consumer = Consumer(
        {
            "bootstrap.servers": source.bootstrap,
            "group.id": f"bench-ref-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(source.topic, p, 0) for p in range(source.partitions)])
    rows: list[list[Any]] = []
    try:
        while len(rows) < source.records:
            for m in consumer.consume(10_000, 5.0):
                value = m.value()
                if m.error() is None and value is not None:
                    r = Record(source.topic, 0, 0, 0, None, orjson.loads(value))
                    row = maker.row(r)
                    assert not isinstance(row, str), row
                    rows.append(row)
    finally:
        consumer.close()
        sink.close()
    return pa.Table.from_batches(
        [maker.batch(rows[i : i + CHUNK]) for i in range(0, len(rows), CHUNK)]
    )


def direct_run(data: pa.Table, workdir: Path, source: tp.Source) -> float:
    """Records per second of ``Table.append`` of ``data`` in chunks into a fresh table of the
    sink's schema and spec (made by the sink's own setup, outside the clock)."""
    s = _scenario(f"bench-ice-direct-{uuid.uuid4().hex[:6]}", workdir, source)
    sink = IcebergSink.from_mapping(
        s.extra["sinks"][0], SinkContext(s.name, "bench", "lake", logging.getLogger("bench"))
    )
    sink.setup()
    sink.close()
    catalog = _catalog(s)
    try:
        table = catalog.load_table(s.iceberg_table)
        started = time.monotonic()
        for offset in range(0, data.num_rows, CHUNK):
            table.append(data.slice(offset, CHUNK))
        seconds = time.monotonic() - started
        assert catalog.load_table(s.iceberg_table).scan().count() == data.num_rows
    finally:
        catalog.engine.dispose()
    return float(data.num_rows / seconds)


def stack_bootstrap() -> str:
    return load_stack_env()["TWOPHASE_KAFKA_BOOTSTRAP"]
