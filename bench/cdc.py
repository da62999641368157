"""Change data capture throughput (``make bench``, section ``cdc``).

Debezium change events of three tables -- 40% creates, 50% updates, 10% deletes (each delete
followed by its tombstone, as Debezium writes them), ~200-byte rows, JSON keys -- on one topic
per table, read by one exactly-once pipeline through a ``topic_pattern`` and written into
PostgreSQL replica tables by one sink with a ``table`` template (upsert on each table's primary
key, deletes applied). The other side is the same number of plain ~200-byte JSON records into
one table in insert mode, on as many partitions. Both are timed as :mod:`bench.throughput`
times its runs: from the first participant ready to every offset committed and no part of the
pipeline left prepared (every decided part applied); then, off the clock, every table must hold
exactly the keys the changes leave.

The events are generated here in Debezium's schemaless JSON shape (``before``, ``after``,
``op``, ``source``), not captured by a connector: the figure is the pipeline's, not Debezium's.

The peer (:func:`kc_cdc_run`) is what a Debezium user runs today: Debezium's JDBC sink on the
stack's Kafka Connect worker, applying the same events -- copied once, not timed, to topics of
their own with key and value in the JsonConverter's ``{schema, payload}`` envelope, as
Debezium's source writes them with ``schemas.enable=true`` -- into replica tables made like the
pipeline's: upserts by the record key, deletes (``delete.enabled``), its reduction buffer (a key
changed twice within one batch otherwise fails the batch's upsert), and the JDBC peer's batch
settings (:mod:`bench.kc_peers`). It is timed as that module times its runs, from the connector
RUNNING (``records_per_s_from_assigned`` from its group's assignment) to the last change of
every source partition applied -- index lookups of each partition's last surviving key and of
the keys deleted after it -- and then checked row by row (id, name, amount) against what the
changes leave. At least once: what it would apply twice after a crash is not measured here.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg
from confluent_kafka import Consumer, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from bench import kc_peers
from bench import throughput as tp
from harness import Scenario, control_summary, load_stack_env
from twophase.config import load_config
from twophase.kafka import create_topics
from twophase.retry import KAFKA

TABLES = ("customers", "orders", "lines")
PARTITIONS_PER_TOPIC = 2
COLUMNS = "id bigint PRIMARY KEY, name text, amount numeric(12, 2), note text"


def change_topics(prefix: str) -> list[str]:
    """The change topics of ``prefix``, one per table, named as Debezium names them."""
    return [f"{prefix}.public.{t}" for t in TABLES]


def _make_tables(dsn: str, tables: dict[str, str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in tables.values():
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')
            conn.execute(f'CREATE TABLE "{table}" ({COLUMNS})')


def _drop_tables(dsn: str, tables: dict[str, str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in tables.values():
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')


@dataclass
class Changes:
    """The change topics (produced once, read by every run) and what they leave per table."""

    bootstrap: str
    prefix: str
    messages: int
    live: dict[str, set[int]]

    @property
    def topics(self) -> list[str]:
        return change_topics(self.prefix)

    @classmethod
    def create(cls, bootstrap: str, events: int, seed: int = 11) -> Changes:
        prefix = f"benchcdc{uuid.uuid4().hex[:6]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        topics = change_topics(prefix)
        for f in admin.create_topics(
            [NewTopic(t, PARTITIONS_PER_TOPIC, 1) for t in topics]
        ).values():
            f.result()
        rnd = random.Random(seed)
        live: dict[str, set[int]] = {t: set() for t in TABLES}
        ordered: dict[str, list[int]] = {t: [] for t in TABLES}  # live ids, for random picks
        next_id = dict.fromkeys(TABLES, 1)
        # Idempotent: a retried send must not reorder a key's changes, or the topic no longer
        # says what `live` says (a 1M-event run waited for a replica that followed Kafka's order).
        producer = Producer(
            {"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True}
        )
        messages = 0
        for i in range(events):
            table = TABLES[i % len(TABLES)]
            topic = f"{prefix}.public.{table}"
            r = rnd.random()
            ids = ordered[table]
            if not ids or r < 0.4:
                op, key = "c", next_id[table]
                next_id[table] += 1
                ids.append(key)
                live[table].add(key)
            else:
                at = rnd.randrange(len(ids))
                key = ids[at]
                if r < 0.9:
                    op = "u"
                else:
                    op = "d"
                    ids[at] = ids[-1]
                    ids.pop()
                    live[table].discard(key)
            row = {
                "id": key,
                "name": f"{table}-{key}-{rnd.randrange(10_000)}",
                "amount": f"{rnd.randrange(1, 500_000) / 100:.2f}",
                "note": "x" * rnd.randrange(60, 90),
            }
            source = {"connector": "postgresql", "table": table, "lsn": i, "ts_ms": 1_700_000_000}
            event = {
                "before": {"id": key} if op == "d" else None,
                "after": None if op == "d" else row,
                "op": op,
                "source": source,
                "ts_ms": 1_700_000_000_000 + i,
            }
            k = orjson.dumps({"id": key})
            _produce(producer, topic, k, orjson.dumps(event))
            messages += 1
            if op == "d":
                _produce(producer, topic, k, None)  # Debezium's tombstone for compaction
                messages += 1
        if producer.flush(120) > 0:
            raise RuntimeError("change events not delivered")
        return cls(bootstrap, prefix, messages, live)

    def delete(self) -> None:
        AdminClient({"bootstrap.servers": self.bootstrap}).delete_topics(self.topics)


def _produce(p: Producer, topic: str, key: bytes, value: bytes | None) -> None:
    while True:
        try:
            p.produce(topic, key=key, value=value)
            return
        except BufferError:
            p.poll(0.1)


def _committed(c: Consumer, changes: Changes) -> int:
    tps = [TopicPartition(t, p) for t in changes.topics for p in range(PARTITIONS_PER_TOPIC)]
    got = KAFKA.call(lambda: c.committed(tps, timeout=10), "committed offsets")
    return sum(max(tp.offset, 0) for tp in got)


def _replica_ids(dsn: str, tables: dict[str, str]) -> dict[str, set[int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {t: {r[0] for r in conn.execute(f'SELECT id FROM "{n}"')} for t, n in tables.items()}


def cdc_run(changes: Changes, workdir: Path, *, timeout_s: float = 900.0) -> tp.RunResult:
    name = f"bench-cdc-{uuid.uuid4().hex[:6]}"
    tables = {t: f"{name.replace('-', '_')}_{t}" for t in TABLES}
    s = Scenario.on_stack(name, workdir / name, mongo=False, files=False)
    s.extra.update(
        {
            "sources": [
                {
                    "topic_pattern": f"{changes.prefix}\\.public\\..*",
                    "format": "debezium",
                    "key_format": "json",
                }
            ],
            "sinks": [
                {
                    "name": "pg",
                    "type": "postgres",
                    "dsn": s.pg_dsn,
                    "table": "${topic}",
                    "topic_replace": [
                        f"^{changes.prefix}\\.public\\.",
                        f"{name.replace('-', '_')}_",
                    ],
                    "mode": "upsert",
                }
            ],
        }
    )
    create_topics(load_config(s.write()))
    _make_tables(s.pg_dsn, tables)
    probe = Consumer({"bootstrap.servers": changes.bootstrap, "group.id": f"twophase.{name}"})
    started = time.monotonic()
    try:
        # Done as the plain pipeline's runs are (tp.pipeline_run): the offsets at the end and
        # no part left prepared; the replicas are compared after the clock.
        seconds, cpu, rss = tp.timed(
            s,
            "exactly_once",
            tp.PARTICIPANTS,
            lambda: (
                _committed(probe, changes) >= changes.messages and not tp._left_behind(s, {"pg"})
            ),
            timeout_s,
            tp.FAST_POLL_S,
        )
    finally:
        probe.close()
    wall = time.monotonic() - started
    control = control_summary(s)
    replicas = _replica_ids(s.pg_dsn, tables)
    rows = {t: len(ids) for t, ids in replicas.items()}
    _drop_tables(s.pg_dsn, tables)
    if replicas != changes.live:
        wrong = sorted(t for t in tables if replicas.get(t) != changes.live.get(t))
        raise RuntimeError(f"{name}: replica tables {wrong} differ from the changes' live keys")
    n = changes.messages
    return tp.RunResult(
        "exactly_once", ["pg"], n, n / seconds, seconds, wall, rows, control, cpu, rss
    )


def plain_source(bootstrap: str, records: int) -> tp.Source:
    """Plain JSON records on as many partitions as the change topics have together."""
    return tp.Source.create(
        bootstrap, records, "cdcplain", partitions=len(TABLES) * PARTITIONS_PER_TOPIC
    )


# -- the peer: Debezium's JDBC sink on the same change events -------------------------------------

#: A replica row in Kafka Connect's schema, typed as the replica tables are (``COLUMNS``).
ROW_FIELDS: list[dict[str, Any]] = [
    {"field": "id", "type": "int64", "optional": False},
    {"field": "name", "type": "string", "optional": True},
    kc_peers.AMOUNT_FIELD,
    {"field": "note", "type": "string", "optional": True},
]


def _schemas(prefix: str, table: str) -> tuple[bytes, bytes]:
    """The JsonConverter ``schema`` of a change event's key and of its value (Debezium's
    envelope: ``before``, ``after``, ``source``, ``op``, ``ts_ms``), as JSON."""
    name = f"{prefix}.public.{table}"
    row = {"type": "struct", "name": f"{name}.Value", "optional": True, "fields": ROW_FIELDS}
    key = {
        "type": "struct",
        "name": f"{name}.Key",
        "optional": False,
        "fields": [{"field": "id", "type": "int64", "optional": False}],
    }
    source = {
        "type": "struct",
        "name": "io.debezium.connector.postgresql.Source",
        "optional": False,
        "fields": [
            {"field": "connector", "type": "string", "optional": False},
            {"field": "table", "type": "string", "optional": False},
            {"field": "lsn", "type": "int64", "optional": True},
            {"field": "ts_ms", "type": "int64", "optional": False},
        ],
    }
    value = {
        "type": "struct",
        "name": f"{name}.Envelope",
        "optional": False,
        "fields": [
            {**row, "field": "before"},
            {**row, "field": "after"},
            {**source, "field": "source"},
            {"field": "op", "type": "string", "optional": False},
            {"field": "ts_ms", "type": "int64", "optional": True},
        ],
    }
    return orjson.dumps(key), orjson.dumps(value)


@dataclass
class Enveloped:
    """The change events re-produced in the JsonConverter's ``{schema, payload}`` envelope (key
    and value), what the replica must hold at the end, and how to tell a run is done cheaply."""

    source: tp.Source  # records = events + tombstones; partitions = all topics' together
    prefix: str
    #: Per table: id -> (name, amount) of every key the changes leave.
    final: dict[str, dict[int, tuple[str, Decimal]]]
    #: Per table and source partition: the last change of a key that is left (its id and name)
    #: and the ids changed after it (all deleted by the end). Once that row holds that name and
    #: those ids are gone, the connector applied the partition (it applies one in order).
    marks: list[tuple[str, int, str, list[int]]]

    @property
    def topics(self) -> list[str]:
        return change_topics(self.prefix)

    def delete(self) -> None:
        tp.delete_topics(self.source.bootstrap, self.topics)


def enveloped_changes(changes: Changes) -> Enveloped:
    """``changes`` copied, partition for partition and key for key, to topics of their own with
    keys and values in the JsonConverter's envelope (``amount`` as a JSON number): what
    Debezium's PostgreSQL source writes with ``schemas.enable=true`` (not timed)."""
    prefix = f"{changes.prefix}kc"
    admin = AdminClient({"bootstrap.servers": changes.bootstrap})
    for f in admin.create_topics(
        [NewTopic(t, PARTITIONS_PER_TOPIC, 1) for t in change_topics(prefix)]
    ).values():
        f.result()
    heads = {t: _schemas(prefix, t) for t in TABLES}
    final: dict[str, dict[int, tuple[str, Decimal]]] = {t: {} for t in TABLES}
    # Per (table, partition): the ids in the order of their changes, last change last.
    order: dict[tuple[str, int], list[int]] = {}

    def wrap(m: Message) -> tuple[str, bytes | None, bytes | None, int]:
        table = (m.topic() or "").rsplit(".", 1)[1]
        partition = m.partition() or 0
        key_schema, value_schema = heads[table]
        key = orjson.loads(m.key() or b"null")
        raw = m.value()
        value = None
        if raw is not None:  # a tombstone stays one
            event = orjson.loads(raw)
            after = event.get("after")
            if event["op"] == "d":
                final[table].pop(key["id"], None)
            else:
                final[table][key["id"]] = (after["name"], Decimal(after["amount"]))
                # A JSON number, which the JsonConverter reads into the Decimal exactly.
                after["amount"] = float(after["amount"])
            value = b'{"schema":%s,"payload":%s}' % (value_schema, orjson.dumps(event))
            order.setdefault((table, partition), []).append(key["id"])
        framed = b'{"schema":%s,"payload":%s}' % (key_schema, orjson.dumps(key))
        return f"{prefix}.public.{table}", framed, value, partition

    tps = [TopicPartition(t, p, 0) for t in changes.topics for p in range(PARTITIONS_PER_TOPIC)]
    try:
        copied = kc_peers.copy_records(changes.bootstrap, tps, wrap)
        if copied != changes.messages:
            raise RuntimeError(f"copied {copied} of {changes.messages} change events")
    except BaseException:
        tp.delete_topics(changes.bootstrap, change_topics(prefix))
        raise
    marks = []
    for (table, _partition), ids in sorted(order.items()):
        live = final[table]
        last = max((i for i, k in enumerate(ids) if k in live), default=-1)
        after = sorted({k for k in ids[last + 1 :]})
        if last >= 0:
            marks.append((table, ids[last], live[ids[last]][0], after))
    source = tp.Source(changes.bootstrap, change_topics(prefix)[0], changes.messages, len(tps))
    return Enveloped(source, prefix, final, marks)


def kc_cdc_config(env: Enveloped, pg_dsn: str, name: str) -> dict[str, str]:
    """Debezium's JDBC sink over the enveloped change events: Debezium's own events, so it
    applies ``op`` itself -- upserts by the record key, deletes with ``delete.enabled`` -- into
    ``<name>_<table>`` (a ``RegexRouter`` on the topic), its batch settings as the JDBC peer's
    (:mod:`bench.kc_peers`)."""
    prefix = env.prefix.replace(".", "\\.")
    config = kc_peers.jdbc_config(env.source, pg_dsn, "${topic}")  # the topic as routed
    del config["primary.key.fields"]  # the record key's fields
    return config | {
        "topics": ",".join(env.topics),
        "key.converter": "org.apache.kafka.connect.json.JsonConverter",
        "key.converter.schemas.enable": "true",
        "primary.key.mode": "record_key",
        "delete.enabled": "true",
        # A key changed twice in one batch: without the reduction buffer its upsert of the two
        # rows fails ("ON CONFLICT DO UPDATE command cannot affect row a second time"); with
        # it, each batch holds a key's latest state only (the connector's documented setting).
        "use.reduction.buffer": "true",
        "transforms": "route",
        "transforms.route.type": "org.apache.kafka.connect.transforms.RegexRouter",
        "transforms.route.regex": f"{prefix}\\.public\\.(.*)",
        "transforms.route.replacement": f"{name.replace('-', '_')}_$1",
    }


def _replica(
    conn: psycopg.Connection[Any], tables: dict[str, str]
) -> dict[str, dict[int, tuple[str, Decimal]]]:
    return {
        t: {r[0]: (r[1], r[2]) for r in conn.execute(f'SELECT id, name, amount FROM "{n}"')}
        for t, n in tables.items()
    }


def kc_cdc_run(env: Enveloped, workdir: Path, *, timeout_s: float = 900.0) -> tp.RunResult:
    """One run of Debezium's JDBC sink over the enveloped change events into fresh replica
    tables, timed as :mod:`bench.kc_peers` times its runs (from RUNNING); done when every
    partition's mark is applied (index lookups, polled), then checked row by row."""
    del workdir
    pg_dsn = load_stack_env()["TWOPHASE_PG_DSN"]
    name = f"bench-kc-cdc-{uuid.uuid4().hex[:6]}"
    tables = {t: f"{name.replace('-', '_')}_{t}" for t in TABLES}
    _make_tables(pg_dsn, tables)
    n = env.source.records
    probe = psycopg.connect(pg_dsn, autocommit=True)
    rows: dict[str, int] = {}

    def visible() -> int:
        for table, key, name_, gone in env.marks:
            t = tables[table]
            row = probe.execute(f'SELECT name FROM "{t}" WHERE id = %s', (key,)).fetchone()
            if row is None or row[0] != name_:
                return 0
            if gone:
                left = probe.execute(f'SELECT 1 FROM "{t}" WHERE id = ANY(%s) LIMIT 1', (gone,))
                if left.fetchone() is not None:
                    return 0
        replica = _replica(probe, tables)
        rows.update((t, len(r)) for t, r in replica.items())
        return n if replica == env.final else 0

    try:
        seconds, wall, control, cpu = kc_peers._timed(
            name, kc_cdc_config(env, pg_dsn, name), env.source, visible, timeout_s
        )
    finally:
        probe.close()
        _drop_tables(pg_dsn, tables)
    control |= {"connector": kc_peers.JDBC_CLASS, "batch_size": kc_peers.JDBC_BATCH}
    control["exact"] = True  # visible() compared every row with what the changes leave
    return tp.RunResult("kafka_connect", ["pg"], n, n / seconds, seconds, wall, rows, control, cpu)
