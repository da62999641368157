"""Change data capture throughput (``make bench``, section ``cdc``).

Debezium change events of three tables -- 40% creates, 50% updates, 10% deletes (each delete
followed by its tombstone, as Debezium writes them), ~200-byte rows, JSON keys -- on one topic
per table, read by one exactly-once pipeline through a ``topic_pattern`` and written into
PostgreSQL replica tables by one sink with a ``table`` template (upsert on each table's primary
key, deletes applied). The other side is the same number of plain ~200-byte JSON records into
one table in insert mode, on as many partitions. Both are timed as :mod:`bench.throughput`
times its runs: from the first participant ready to every offset committed and the replica
complete -- here, every table holding exactly the keys the changes leave, checked row by row.

The events are generated here in Debezium's schemaless JSON shape (``before``, ``after``,
``op``, ``source``), not captured by a connector: the figure is the pipeline's, not Debezium's.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import orjson
import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from bench import throughput as tp
from harness import Scenario, control_summary
from twophase.config import load_config
from twophase.kafka import create_topics
from twophase.retry import KAFKA

TABLES = ("customers", "orders", "lines")
PARTITIONS_PER_TOPIC = 2
COLUMNS = "id bigint PRIMARY KEY, name text, amount numeric(12, 2), note text"


@dataclass
class Changes:
    """The change topics (produced once, read by every run) and what they leave per table."""

    bootstrap: str
    prefix: str
    messages: int
    live: dict[str, set[int]]

    @property
    def topics(self) -> list[str]:
        return [f"{self.prefix}.public.{t}" for t in TABLES]

    @classmethod
    def create(cls, bootstrap: str, events: int, seed: int = 11) -> Changes:
        prefix = f"benchcdc{uuid.uuid4().hex[:6]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        topics = [f"{prefix}.public.{t}" for t in TABLES]
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
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        for table in tables.values():
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')
            conn.execute(f'CREATE TABLE "{table}" ({COLUMNS})')
    probe = Consumer({"bootstrap.servers": changes.bootstrap, "group.id": f"twophase.{name}"})
    started = time.monotonic()
    try:
        seconds, cpu, rss = tp.timed(
            s,
            "exactly_once",
            tp.PARTICIPANTS,
            lambda: (
                _committed(probe, changes) >= changes.messages
                and _replica_ids(s.pg_dsn, tables) == changes.live
            ),
            timeout_s,
        )
    finally:
        probe.close()
    wall = time.monotonic() - started
    control = control_summary(s)
    rows = {t: len(ids) for t, ids in _replica_ids(s.pg_dsn, tables).items()}
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        for table in tables.values():
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')
    n = changes.messages
    return tp.RunResult(
        "exactly_once", ["pg"], n, n / seconds, seconds, wall, rows, control, cpu, rss
    )


def plain_source(bootstrap: str, records: int) -> tp.Source:
    """Plain JSON records on as many partitions as the change topics have together."""
    return tp.Source.create(
        bootstrap, records, "cdcplain", partitions=len(TABLES) * PARTITIONS_PER_TOPIC
    )
