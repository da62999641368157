"""Kafka Connect sinks as peers of the PostgreSQL-only and MongoDB-only pipelines (issue #20).

Two connectors on the stack's Kafka Connect worker (``stack/connect.sh``: Apache Kafka's
connect-runtime of the broker's version, the plugins of ``stack/connect/*/pom.xml``):

* **Debezium's JDBC sink** (``io.debezium.connector.jdbc.JdbcSinkConnector``, 3.6) into the
  stack's PostgreSQL, upserting by ``id`` (``insert.mode=upsert``, ``primary.key.mode=
  record_value``, ``primary.key.fields=id``) into a table made beforehand like the pipeline's
  (same columns and types) plus the primary key an upsert needs. It needs a schema with every
  value, so it reads the same records re-produced on a topic of their own, each value wrapped
  unchanged in the JsonConverter's ``{"schema": ..., "payload": <the original JSON>}`` envelope
  (``value.converter.schemas.enable=true``), partition for partition and key for key. The schema
  types the columns as the pipeline's table does: ``amount`` Connect ``Decimal`` (scale 2; the
  JsonConverter reads the JSON number into it exactly), ``ts`` Debezium's ``ZonedTimestamp``
  (the ISO-8601 string as it is, bound as ``timestamptz``).
* **MongoDB's sink** (``com.mongodb.kafka.connect.MongoSinkConnector``, 2.0) into the stack's
  MongoDB server, reading the source topic itself (schemaless JSON), upserting by ``id``: its
  documented business-key settings, ``document.id.strategy=PartialValueStrategy`` projecting
  ``id`` and ``writemodel.strategy=ReplaceOneBusinessKeyStrategy`` (a ``replaceOne`` with upsert
  whose filter is ``{id: ...}``), on a collection made beforehand with a unique index on ``id``,
  as MongoDB's docs make one for a business key: without it every replace scans the collection.
  (``ReplaceOneDefaultStrategy``, filtering on the ``_id`` PartialValueStrategy makes,
  ``{id: ...}``, was tried: far slower on the stack's server, 2,007 of 5,000 documents in over
  six minutes against 20-60 s for the business key.)

Settings chosen for speed, each from the connector's own documentation:

* ``tasks.max`` = the source topic's partitions: one consumer per partition, as the pipeline's
  participants share them.
* JDBC ``batch.size`` = ``consumer.override.max.poll.records`` = :data:`JDBC_BATCH` (default
  500 and 500). Debezium's "JDBC sink connector batch support" post (2023-12-20) introduced
  ``batch.size`` and says a batch is bounded by the consumer's ``max.poll.records``, to be raised
  with it per connector through ``consumer.override.max.poll.records`` (the worker's
  ``connector.client.config.override.policy`` is ``All``, Kafka's default since 3.0). A poll is
  also bounded by ``max.partition.fetch.bytes`` (1 MiB per partition per fetch, ~1,600 of these
  enveloped ~650-byte records), so ``consumer.override.max.partition.fetch.bytes`` is raised to
  hold a whole batch -- else the batch asked for never forms. The size was picked by measuring
  (100,000 records, 4 tasks, the shared 2-core machine, 2026-11-26, records/s from RUNNING).
  At load average ~10: defaults 6,333; 10,000 without UNNEST 6,705; 10,000 with UNNEST 9,364;
  2,000 with UNNEST 12,463. At load ~2-6, two rounds, with UNNEST: 1,000: 18,904 / 12,693;
  2,000: 15,250 / 14,965; 5,000: 12,735 / 12,973; 10,000: 12,416 / 10,507; 2,000 without
  UNNEST: 10,276 / 11,284. 2,000 was the steadiest: larger batches put a task's 25,000 records
  into fewer, longer statements that overlap less with the other tasks' work.
* JDBC ``dialect.postgres.unnest.insert.enabled=true``: the connector's own description of it
  (3.6): one ``INSERT ... SELECT FROM UNNEST(?::type[], ...)`` per batch instead of a JDBC batch
  of single-row statements, "5-10x" for high throughput; it covers upsert mode (measured above:
  1.3-1.5x here). ``schema.evolution=none``: the table exists, made like the pipeline's.
* MongoDB ``max.batch.size`` = ``consumer.override.max.poll.records`` = :data:`MONGO_BATCH`
  (one bulk write per poll; the default 0 means "the whole poll" and the poll is 500 records)
  and ``bulk.write.ordered=false``: the docs' "Bulk Write Operations": unordered bulk writes are
  executed in parallel by the server, and the order does not matter here (every ``id`` once).

A run is timed as :mod:`bench.iceberg_kc` times Iceberg's connector: from the connector and all
its tasks ``RUNNING`` to every record visible in the target, polled every 0.1 s: the last record
of each source partition looked up by its ``id`` (both tables are keyed on it), then, once all
are in, ``count(*)`` of the table or the collection's document count. (Until 2026-11-27 the
count itself was polled from the start: a scan of the growing target on the server the
connector writes to, ten times a second -- the figures measured that way, the batch sizes
above among them, were the connector's under that load.) The run's ``control`` also says how long the
tasks' consumer group took to be stable with every partition assigned (``assigned_s``) and the
rate from then on (``records_per_s_from_assigned``), and whether the connector delivered exactly
the records (``exact``: rows == distinct ids == the source's count). ``cpu_s`` holds the worker
JVM's CPU seconds from the connector's creation to done. Each run has its own connector,
consumer group (``connect-<connector>``) and table or collection; all are deleted afterwards.

:func:`section` is the ``make bench`` section: the pipeline and the connector alternately on
the same records, ``--runs`` times each. ``python -m bench.kc_peers --records N --runs R`` runs
it alone on the local stack.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import urllib.error
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from pymongo import ASCENDING, MongoClient

from bench import iceberg_kc
from bench import throughput as tp
from harness import load_stack_env
from harness.debezium import rest

__all__ = [
    "JDBC_CLASS",
    "MONGO_CLASS",
    "enveloped",
    "jdbc_config",
    "kc_jdbc_run",
    "kc_mongo_run",
    "mongo_config",
    "section",
]

JDBC_CLASS = "io.debezium.connector.jdbc.JdbcSinkConnector"
MONGO_CLASS = "com.mongodb.kafka.connect.MongoSinkConnector"
#: Records per JDBC batch and per consumer poll (Debezium's default is 500): measured best of
#: 500-10,000 (see the module docstring).
JDBC_BATCH = 2_000
#: Records per MongoDB bulk write and per consumer poll; 1,000 is the bulk size
#: bench.throughput's insert_many baseline writes with.
MONGO_BATCH = 1_000
#: Bytes per partition per fetch: a whole batch of the largest (enveloped, ~650-byte) records
#: with room to spare; the consumer's default of 1 MiB holds ~1,600.
FETCH_BYTES = 4 * 1024 * 1024
#: A new connector's tasks are RUNNING within seconds; the margin is for a 2-core machine that
#: also runs the broker, the databases and the worker's JVM (as bench.iceberg_kc).
RUNNING_TIMEOUT_S = iceberg_kc.RUNNING_TIMEOUT_S
#: A deleted connector's tasks close their consumers within a second or two.
DELETE_TIMEOUT_S = 60.0
#: How often the task states are checked while the clock runs: a FAILED task ends the run.
STATUS_EVERY_S = 2.0

COLUMNS_DDL = (
    "id bigint NOT NULL, customer text, amount numeric(12,2), currency text, "
    "ts timestamptz, note text"
)
#: ``amount numeric(12,2)`` in Kafka Connect's schema: a Connect ``Decimal`` of scale 2, which the
#: JsonConverter reads exactly from a JSON number.
AMOUNT_FIELD: dict[str, Any] = {
    "field": "amount",
    "type": "bytes",
    "optional": True,
    "name": "org.apache.kafka.connect.data.Decimal",
    "version": 1,
    "parameters": {"scale": "2", "connect.decimal.precision": "12"},
}
#: The JsonConverter schema of bench.throughput's records, typed as the pipeline's table.
VALUE_SCHEMA: dict[str, Any] = {
    "type": "struct",
    "name": "bench.orders.Value",
    "optional": False,
    "fields": [
        {"field": "id", "type": "int64", "optional": False},
        {"field": "customer", "type": "string", "optional": True},
        AMOUNT_FIELD,
        {"field": "currency", "type": "string", "optional": True},
        {
            "field": "ts",
            "type": "string",
            "optional": True,
            "name": "io.debezium.time.ZonedTimestamp",
            "version": 1,
        },
        {"field": "note", "type": "string", "optional": True},
    ],
}

log = logging.getLogger(__name__)


# -- input ------------------------------------------------------------------------------------


def enveloped(source: tp.Source) -> tp.Source:
    """The source's records on a new topic of as many partitions, each value wrapped as it is in
    the JsonConverter's ``{schema, payload}`` envelope, on the same partition with the same key
    (not timed; the caller deletes the topic)."""
    topic = f"{source.topic.rsplit('.', 1)[0]}-envelope.orders"
    admin = AdminClient({"bootstrap.servers": source.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=source.partitions, replication_factor=1)])[
        topic
    ].result()
    head = b'{"schema":' + json.dumps(VALUE_SCHEMA, separators=(",", ":")).encode() + b',"payload":'

    def wrap(m: Message) -> tuple[str, bytes | None, bytes, int]:
        return topic, m.key(), head + (m.value() or b"null") + b"}", m.partition() or 0

    try:
        tps = [TopicPartition(source.topic, p, 0) for p in range(source.partitions)]
        copied = copy_records(source.bootstrap, tps, wrap)
        if copied != source.records:
            raise RuntimeError(f"{topic}: copied {copied} of {source.records} records")
    except BaseException:
        tp.delete_topics(source.bootstrap, [topic])
        raise
    return tp.Source(source.bootstrap, topic, source.records, source.partitions)


def copy_records(
    bootstrap: str,
    tps: list[TopicPartition],
    rewrite: Callable[[Message], tuple[str, bytes | None, bytes | None, int]],
) -> int:
    """Every record of ``tps``, read to its end, produced again as ``rewrite`` makes it --
    ``(topic, key, value, partition)`` -- in order per partition (idempotent producer);
    how many (not timed: the peers' inputs are made this way)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-copy-{uuid.uuid4().hex[:6]}",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    producer = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True}
    )
    consumer.assign(tps)
    copied = eof = 0
    try:
        while eof < len(tps):
            for m in consumer.consume(10_000, 1.0):
                err = m.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"copying {m.topic()}: {err}")
                    eof += 1
                    continue
                topic, key, value, partition = rewrite(m)
                while True:
                    try:
                        producer.produce(topic, value, key, partition=partition)
                        break
                    except BufferError:
                        producer.poll(0.1)
                copied += 1
            producer.poll(0)
        if producer.flush(120) > 0:
            raise RuntimeError("copied records not delivered")
    finally:
        consumer.close()
    return copied


# -- connector settings -----------------------------------------------------------------------


def jdbc_config(source: tp.Source, pg_dsn: str, table: str) -> dict[str, str]:
    """Debezium's JDBC sink: the enveloped ``source`` upserted by ``id`` into ``table``."""
    url, user, password = tp.jdbc(pg_dsn)
    return {
        "connector.class": JDBC_CLASS,
        "topics": source.topic,
        "tasks.max": str(source.partitions),
        # Keys are never read (the primary key is the value's id): no parsing for them.
        "key.converter": "org.apache.kafka.connect.storage.StringConverter",
        "value.converter": "org.apache.kafka.connect.json.JsonConverter",
        "value.converter.schemas.enable": "true",
        "connection.url": url,
        "connection.username": user,
        "connection.password": password,
        # One connection per task is all a task uses; the default pool keeps 5 per task open.
        "connection.pool.min_size": "1",
        "insert.mode": "upsert",
        "primary.key.mode": "record_value",
        "primary.key.fields": "id",
        "table.name.format": table,
        "schema.evolution": "none",
        "use.time.zone": "UTC",
        "dialect.postgres.unnest.insert.enabled": "true",
        "batch.size": str(JDBC_BATCH),
        "consumer.override.max.poll.records": str(JDBC_BATCH),
        "consumer.override.max.partition.fetch.bytes": str(FETCH_BYTES),
    }


def mongo_config(source: tp.Source, mongo_uri: str, database: str) -> dict[str, str]:
    """MongoDB's sink: the plain JSON ``source`` upserted by ``id`` into ``database.orders``."""
    return {
        "connector.class": MONGO_CLASS,
        "topics": source.topic,
        "tasks.max": str(source.partitions),
        "key.converter": "org.apache.kafka.connect.storage.StringConverter",
        "value.converter": "org.apache.kafka.connect.json.JsonConverter",
        "value.converter.schemas.enable": "false",
        "connection.uri": mongo_uri,
        "database": database,
        "collection": "orders",
        "document.id.strategy": (
            "com.mongodb.kafka.connect.sink.processor.id.strategy.PartialValueStrategy"
        ),
        "document.id.strategy.partial.value.projection.type": "AllowList",
        "document.id.strategy.partial.value.projection.list": "id",
        "writemodel.strategy": (
            "com.mongodb.kafka.connect.sink.writemodel.strategy.ReplaceOneBusinessKeyStrategy"
        ),
        "max.batch.size": str(MONGO_BATCH),
        "bulk.write.ordered": "false",
        "consumer.override.max.poll.records": str(MONGO_BATCH),
    }


# -- runs -------------------------------------------------------------------------------------


def kc_jdbc_run(source: tp.Source, workdir: Path, *, timeout_s: float = 900.0) -> tp.RunResult:
    """One run of Debezium's JDBC sink over the enveloped ``source`` (see :func:`enveloped`)
    into a fresh table; ``workdir`` is unused (the connector writes no files)."""
    del workdir
    pg_dsn = load_stack_env()["TWOPHASE_PG_DSN"]
    name = f"bench-kc-jdbc-{uuid.uuid4().hex[:6]}"
    table = f"{name.replace('-', '_')}_orders"
    last = tp.last_ids(source)  # before the table: nothing to clean up if it fails
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} ({COLUMNS_DDL}, PRIMARY KEY (id))")

    def rows() -> int:
        return tp.pg_rows_once_last_in(pg_dsn, table, last)

    try:
        seconds, wall, control, cpu = _timed(
            name, jdbc_config(source, pg_dsn, table), source, rows, timeout_s
        )
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            got = conn.execute(f"SELECT count(*), count(DISTINCT id) FROM {table}").fetchone()
        count, distinct = (int(got[0]), int(got[1])) if got else (0, 0)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")
    return _result(
        "pg",
        source,
        seconds,
        wall,
        count,
        distinct,
        control | {"connector": JDBC_CLASS, "batch_size": JDBC_BATCH},
        cpu,
    )


def kc_mongo_run(source: tp.Source, workdir: Path, *, timeout_s: float = 900.0) -> tp.RunResult:
    """One run of MongoDB's sink over ``source`` (plain JSON) into a fresh collection;
    ``workdir`` is unused."""
    del workdir
    mongo_uri = load_stack_env()["TWOPHASE_MONGO_URI"]
    name = f"bench-kc-mongo-{uuid.uuid4().hex[:6]}"
    database = name.replace("-", "_")
    last = tp.last_ids(source)  # before the collection: nothing to clean up if it fails
    client: MongoClient[dict[str, Any]] = MongoClient(mongo_uri)
    try:
        orders = client[database]["orders"]
        orders.create_index([("id", ASCENDING)], unique=True)

        def docs() -> int:
            # Counted only once each partition's last record is in (found by the id index):
            # a count is a scan of the collection on SecantusDB.
            if len(list(orders.find({"id": {"$in": last}}, {"_id": 1}))) < len(last):
                return 0
            return orders.estimated_document_count()

        try:
            seconds, wall, control, cpu = _timed(
                name, mongo_config(source, mongo_uri, database), source, docs, timeout_s
            )
            count = orders.count_documents({})
            distinct = len(orders.distinct("id"))
        finally:
            client.drop_database(database)
    finally:
        client.close()
    return _result(
        "mongo",
        source,
        seconds,
        wall,
        count,
        distinct,
        control | {"connector": MONGO_CLASS, "batch_size": MONGO_BATCH},
        cpu,
    )


def _result(
    sink: str,
    source: tp.Source,
    seconds: float,
    wall: float,
    count: int,
    distinct: int,
    control: dict[str, Any],
    cpu: dict[str, float],
) -> tp.RunResult:
    n = source.records
    control["distinct_ids"] = distinct
    control["exact"] = count == n and distinct == n
    return tp.RunResult(
        "kafka_connect", [sink], n, n / seconds, seconds, wall, {sink: count}, control, cpu
    )


def _timed(
    name: str,
    config: dict[str, str],
    source: tp.Source,
    visible: Callable[[], int],
    timeout_s: float,
) -> tuple[float, float, dict[str, Any], dict[str, float]]:
    """Create connector ``name``, wait for it and its tasks ``RUNNING``, then until
    ``visible()`` counts every record; delete it. The seconds from RUNNING to done, the wall
    seconds from creation, the run's ``control`` and the worker's CPU seconds."""
    url = iceberg_kc.connect_url()
    classes = {p["class"] for p in rest("GET", f"{url}/connector-plugins")}
    if config["connector.class"] not in classes:
        raise RuntimeError(f"the worker at {url} has no {config['connector.class']}: {classes}")
    admin = AdminClient({"bootstrap.servers": source.bootstrap})
    group = f"connect-{name}"
    n = source.records
    worker = iceberg_kc._worker_pid()
    started = time.monotonic()
    cpu0 = tp._cpu_s(worker)
    try:
        rest("PUT", f"{url}/connectors/{name}/config", config)
        iceberg_kc._wait_running(url, name)
        t_running = time.monotonic()
        next_status = t_running + STATUS_EVERY_S
        assigned_s: float | None = None
        while (got := visible()) < n:
            if assigned_s is None and iceberg_kc._assigned(admin, group, source.partitions):
                assigned_s = time.monotonic() - t_running
            now = time.monotonic()
            if now > t_running + timeout_s:
                raise TimeoutError(
                    f"{name}: not every record visible in {timeout_s}s ({got} counted)"
                )
            if now >= next_status:
                iceberg_kc._check_tasks(url, name)
                next_status = now + STATUS_EVERY_S
            time.sleep(tp.POLL_S)
        seconds = time.monotonic() - t_running
        cpu = {"connect_worker": round(tp._cpu_s(worker) - cpu0, 2)}
    finally:
        _delete(url, admin, name, group)
    control: dict[str, Any] = {
        "tasks": source.partitions,
        # RUNNING to every source partition held by a task: the consumer-group join that the
        # pipeline's clock (from a participant ready) leaves out.
        "assigned_s": None if assigned_s is None else round(assigned_s, 2),
        "records_per_s_from_assigned": (
            None if assigned_s is None else round(n / (seconds - assigned_s))
        ),
    }
    return seconds, time.monotonic() - started, control, cpu


def _delete(url: str, admin: AdminClient, name: str, group: str) -> None:
    """Delete the connector, wait until its tasks have left their consumer group (the next run
    must not share the worker with them), then delete the group."""
    try:
        rest("DELETE", f"{url}/connectors/{name}")
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
    deadline = time.monotonic() + DELETE_TIMEOUT_S
    while time.monotonic() < deadline:
        if name not in rest("GET", f"{url}/connectors") and not iceberg_kc._members(admin, group):
            break
        time.sleep(0.2)
    else:
        log.warning("connector %s: tasks still in %s after %ss", name, group, DELETE_TIMEOUT_S)
        return
    delete_group(admin, group)


def delete_group(admin: AdminClient, group: str) -> None:
    """Delete a peer run's consumer group. A run that ended before its tasks joined (or before
    a first checkpoint committed offsets) has none; any other group left behind is only
    clutter, never in the way of a run (each has its own)."""
    for future in admin.delete_consumer_groups([group], request_timeout=10).values():
        try:
            future.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.GROUP_ID_NOT_FOUND:
                log.warning("consumer group %s not deleted: %s", group, exc)


# -- the bench section ------------------------------------------------------------------------


def section(args: argparse.Namespace, env: dict[str, str], work: Path) -> dict[str, Any]:
    """``make bench``'s Kafka Connect peers: the PostgreSQL-only pipeline vs Debezium's JDBC
    sink on ``args.records`` records, the MongoDB-only pipeline vs MongoDB's sink on
    ``args.mongo_records``, the two sides of each alternating ``args.runs`` times."""
    # bench.run imports this module to add the section: import it when the section runs.
    from bench.run import alternate, say

    bootstrap = env["TWOPHASE_KAFKA_BOOTSTRAP"]
    details: dict[str, list[dict[str, Any]]] = {
        "pg_pipeline": [],
        "kc_jdbc": [],
        "mongo_pipeline": [],
        "kc_mongo": [],
    }

    def side(key: str, run: Callable[[], tp.RunResult]) -> Callable[[], float]:
        return checked_side(details, key, run, "kafka_connect")

    def versus(
        sink: str, source: tp.Source, peer: str, run_peer: Callable[[], tp.RunResult]
    ) -> dict[str, list[float]]:
        """The ``sink``-only exactly-once pipeline and a peer, alternating."""
        pipeline = f"{sink}_pipeline"

        def run_pipeline() -> tp.RunResult:
            return tp.pipeline_run(source, work, mode="exactly_once", sinks={sink})

        return alternate(
            args.runs, {pipeline: side(pipeline, run_pipeline), peer: side(peer, run_peer)}
        )

    say(f"kc_peers: producing {args.records:,} records and their enveloped copy")
    source = tp.Source.create(bootstrap, args.records, "kcjdbc")
    try:
        framed = enveloped(source)
    except BaseException:
        tp.delete_topics(bootstrap, [source.topic])
        raise
    try:
        pg = versus("pg", source, "kc_jdbc", lambda: kc_jdbc_run(framed, work))
    finally:
        tp.delete_topics(bootstrap, [source.topic, framed.topic])

    say(f"kc_peers: producing {args.mongo_records:,} records")
    msource = tp.Source.create(bootstrap, args.mongo_records, "kcmongo")
    try:
        mongo = versus("mongo", msource, "kc_mongo", lambda: kc_mongo_run(msource, work))
    finally:
        tp.delete_topics(bootstrap, [msource.topic])

    med = {k: float(statistics.median(v)) for k, v in (pg | mongo).items()}
    return {
        **versus_fields("kc_jdbc", "eo_over_kc_jdbc", med, "pg_pipeline", details),
        "kc_jdbc_pg_pipeline_records_per_s": round(med["pg_pipeline"]),
        **versus_fields("kc_mongo", "mongo_over_kc_mongo", med, "mongo_pipeline", details),
        "kc_mongo_pipeline_records_per_s": round(med["mongo_pipeline"]),
        "_runs": details,
    }


def checked_side(
    details: dict[str, list[dict[str, Any]]],
    key: str,
    run: Callable[[], tp.RunResult],
    peer_mode: str,
) -> Callable[[], float]:
    """One side of an alternation: ``run()``'s rate, its result kept in ``details[key]``; a
    peer's run (``mode`` ``peer_mode``) that did not deliver exactly stops the section."""

    def go() -> float:
        r = run()
        details[key].append(r.asdict())
        if r.mode == peer_mode and not r.control["exact"]:
            raise RuntimeError(f"{key}: the peer did not deliver exactly: {r.asdict()}")
        return r.records_per_s

    return go


def versus_fields(
    peer: str,
    ratio: str,
    med: dict[str, float],
    side: str,
    details: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """A peer's median rate and the ``side`` pipeline's ratio over it, by both timings. The
    connector's rate from its consumer group stable and every partition assigned: the
    pipeline's clock starts at a participant ready, past its own group join, so this is the
    figure to set beside it; the headline ratio (from RUNNING) is timed as bench.iceberg_kc's."""
    rate, pipeline = med[peer], med[side]
    assigned = _median_from_assigned(details[peer])
    return {
        f"peer_{peer}_records_per_s": round(rate),
        ratio: round(pipeline / rate, 3),
        f"peer_{peer}_records_per_s_from_assigned": None if assigned is None else round(assigned),
        f"{ratio}_from_assigned": None if assigned is None else round(pipeline / assigned, 3),
    }


def _median_from_assigned(runs: list[dict[str, Any]]) -> float | None:
    rates = [
        float(r["control"]["records_per_s_from_assigned"])
        for r in runs
        if r["control"].get("records_per_s_from_assigned")
    ]
    return float(statistics.median(rates)) if rates else None


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--records", type=int, default=100_000, help="records (JDBC comparison)")
    ap.add_argument("--mongo-records", type=int, default=50_000, help="records (MongoDB)")


def main(argv: list[str] | None = None) -> int:
    return tp.section_main(argv, "python -m bench.kc_peers", __doc__, section, _arguments)


if __name__ == "__main__":
    sys.exit(main())
