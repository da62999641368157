"""Records at Kafka's limits end to end (issue #14): real coordinator and participant processes on
the real stack. A record larger than the dead-letter producer can send (a 2 MB value on a source
topic that allows 5 MB, a refused value just under ``max_record_bytes``, a huge key) is
dead-lettered truncated, with the coordinates, the reason and its original sizes; the participant
stays up and the records around it land exactly once.

Every check reads Kafka, PostgreSQL and the processes directly.
"""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pyarrow.parquet as pq
from confluent_kafka import Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from pymongo import MongoClient

from harness import Cluster, produce
from tests.e2e.e2e_support import dead_letters, scenario, settle, start
from twophase.config import load_config
from twophase.kafka import create_topics

#: The source topic's limit: larger than anything librdkafka's default producer sends.
SOURCE_MAX_BYTES = 5 * 1024 * 1024


def test_records_too_large_for_the_dead_letter_topic_are_dead_lettered_truncated(
    tmp_path: Path,
) -> None:
    s = scenario(tmp_path, "huge", interval_ms=500, mongo=False, files=False, create=False)
    admin = AdminClient({"bootstrap.servers": s.bootstrap})
    topic = NewTopic(
        s.topic,
        num_partitions=s.partitions,
        replication_factor=1,
        config={"max.message.bytes": str(SOURCE_MAX_BYTES)},
    )
    admin.create_topics([topic])[s.topic].result(timeout=30)
    create_topics(load_config(s.config_path))
    n = 300
    produce(s.bootstrap, s.topic, 0, n // 2)
    big_json = orjson.dumps({"id": 10_000_000, "note": "x" * (2 * 1024 * 1024)})
    # Not JSON and under max_record_bytes (1,048,576): refused as undecodable, yet over the
    # producer's 1,000,000-byte message.max.bytes with its headers.
    near_limit = b"<" * 1_020_000
    huge_key = b"k" * 700_000
    bad: list[tuple[int, bytes | None, bytes]] = [
        (0, None, big_json),
        (1, None, near_limit),
        (2, huge_key, b"<" * 400_000),
    ]
    where: dict[bytes, tuple[int, int]] = {}

    def delivered(err: Any, msg: Message) -> None:
        assert err is None, err
        where[msg.value()] = (msg.partition(), msg.offset())

    p = Producer({"bootstrap.servers": s.bootstrap, "message.max.bytes": SOURCE_MAX_BYTES})
    for partition, key, value in bad:
        p.produce(s.topic, value=value, key=key, partition=partition, on_delivery=delivered)
    assert p.flush(30) == 0
    produce(s.bootstrap, s.topic, n // 2, n // 2)
    c = Cluster(s)
    start(c, "coordinator", "coord-0")
    start(c, "participant", "p-0")
    try:
        report = settle(s, c, set(range(n)), 120)
        assert c.alive("p-0"), "the participant exited"
        # Later records keep committing after the huge ones.
        produce(s.bootstrap, s.topic, n, 100)
        report = settle(s, c, set(range(n + 100)), 120)
        assert all(c.alive(name) for name in c.procs), "a process exited"
    finally:
        c.stop_all()
    for sink, r in report.items():
        assert r.ok and (r.rows, r.distinct) == (n + 100, n + 100), f"{sink}: {r}"
    letters = {dl.key: dl for dl in dead_letters(s)}
    assert len(letters) == len(bad), list(letters)
    for partition, key, value in bad:
        _, offset = where[value]
        dl = letters[f"{s.topic}:{partition}:{offset}".encode()]
        reason = dl.header("twophase.reason")
        assert reason.startswith("oversize:" if value is big_json else "undecodable:"), reason
        assert dl.header("twophase.source.topic") == s.topic
        assert dl.header("twophase.source.partition") == str(partition)
        assert dl.header("twophase.source.offset") == str(offset)
        assert dl.header("twophase.original.value.size") == str(len(value))
        assert dl.value is not None and value.startswith(dl.value)
        if key is None:
            assert dl.header("twophase.truncated") == "value", dl.headers
            assert 0 < len(dl.value) < len(value)
        else:
            # The key is cut to a prefix; the value then fits whole.
            assert dl.header("twophase.truncated") == "key", dl.headers
            assert dl.header("twophase.original.key.size") == str(len(key))
            assert key.startswith(dl.headers["twophase.source.key"])
            assert dl.value == value


def test_record_timestamps_past_year_9999_land_and_the_pipeline_keeps_committing(
    tmp_path: Path,
) -> None:
    s = scenario(tmp_path, "farts", interval_ms=500, create=False)
    admin = AdminClient({"bootstrap.servers": s.bootstrap})
    # Any int64 timestamp is accepted once the topic's window is raised.
    window = {"message.timestamp.after.max.ms": str(2**63 - 1)}
    topic = NewTopic(s.topic, num_partitions=s.partitions, replication_factor=1, config=window)
    admin.create_topics([topic])[s.topic].result(timeout=30)
    create_topics(load_config(s.config_path))
    n = 200
    produce(s.bootstrap, s.topic, 0, n // 2)
    # Past 9999-12-31, int64's last millisecond, the first one, and negative create times
    # (which Kafka keeps as sent; -1 means none).
    stamps = {
        n + 1000: 253_402_300_800_000,
        n + 1001: 2**63 - 1,
        n + 1002: 1,
        n + 1003: -5,
        n + 1004: -1,
    }
    p = Producer({"bootstrap.servers": s.bootstrap})
    for i, ts in stamps.items():
        value = orjson.dumps({"id": i, "customer": "far", "amount": 1, "currency": "EUR"})
        p.produce(s.topic, value=value, partition=i % s.partitions, timestamp=ts)
    assert p.flush(30) == 0
    produce(s.bootstrap, s.topic, n // 2, n // 2)
    expected = set(range(n)) | set(stamps)
    c = Cluster(s)
    start(c, "coordinator", "coord-0")
    start(c, "participant", "p-0")
    try:
        report = settle(s, c, expected, 120)
        produce(s.bootstrap, s.topic, n, 100)
        expected |= set(range(n, n + 100))
        report = settle(s, c, expected, 120)
        assert all(c.alive(name) for name in c.procs), "a process exited"
    finally:
        c.stop_all()
    for sink, r in report.items():
        assert r.ok and r.rows == len(expected), f"{sink}: {r}"
    assert dead_letters(s) == []
    stored = {}
    for path in s.files_path.rglob("*.parquet"):
        if "_twophase" in path.parts:
            continue
        for row in pq.read_table(path).to_pylist():
            stored[row["id"]] = path.parent.name
    assert stored[n + 1000] == stored[n + 1001] == "date=__HIVE_DEFAULT_PARTITION__"
    assert stored[n + 1002] == "date=1970-01-01"
    # A record's timestamp is Kafka's value as it is (-1: none); no date names a negative one.
    assert stored[n + 1003] == stored[n + 1004] == "date=__HIVE_DEFAULT_PARTITION__"


def test_an_upsert_key_over_the_btree_limit_is_dead_lettered_and_commits_go_on(
    tmp_path: Path,
) -> None:
    s = scenario(tmp_path, "longkey", interval_ms=500, files=False, create=False)
    pg = {
        "name": "pg",
        "type": "postgres",
        "dsn": s.pg_dsn,
        "table": s.table,
        "mode": "upsert",
        "key": ["customer"],
    }
    mongo = {
        "name": "mongo",
        "type": "mongodb",
        "uri": s.mongo_uri,
        "database": s.table,
        "collection": "orders",
        "mode": "insert",
    }
    s.extra = {"sinks": [pg, mongo]}
    s.write()
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {s.table} ADD PRIMARY KEY (customer)")
    create_topics(load_config(s.config_path))
    n = 200
    # Unique customers, so the upsert keeps every id.
    good = [
        orjson.dumps({"id": i, "customer": f"c{i}", "amount": 1, "currency": "EUR"})
        for i in range(n)
    ]
    rng = random.Random(14)
    long_key = "".join(rng.choice(string.ascii_letters) for _ in range(3000))
    bad = orjson.dumps({"id": 10_000, "customer": long_key, "amount": 1, "currency": "EUR"})
    p = Producer({"bootstrap.servers": s.bootstrap})
    where: dict[bytes, tuple[int, int]] = {}

    def delivered(err: Any, msg: Message) -> None:
        assert err is None, err
        where[msg.value()] = (msg.partition(), msg.offset())

    for i, value in enumerate(good[: n // 2]):
        p.produce(s.topic, value=value, partition=i % s.partitions)
    p.produce(s.topic, value=bad, partition=1, on_delivery=delivered)
    for i, value in enumerate(good[n // 2 :]):
        p.produce(s.topic, value=value, partition=i % s.partitions)
    assert p.flush(30) == 0
    c = Cluster(s)
    start(c, "coordinator", "coord-0")
    start(c, "participant", "p-0")
    try:
        report = settle(s, c, set(range(n)), 120)
        assert all(c.alive(name) for name in c.procs), "a process exited"
    finally:
        c.stop_all()
    for sink, r in report.items():
        assert r.ok and (r.rows, r.distinct) == (n, n), f"{sink}: {r}"
    letters = dead_letters(s)
    assert len(letters) == 1, [dl.key for dl in letters]
    dl = letters[0]
    partition, offset = where[bad]
    assert dl.key == f"{s.topic}:{partition}:{offset}".encode()
    assert dl.value == bad
    assert dl.header("twophase.sink") == "pg"
    assert "SQLSTATE 54000" in dl.header("twophase.reason"), dl.headers


def test_a_document_the_mongodb_target_refuses_is_dead_lettered_and_commits_go_on(
    tmp_path: Path,
) -> None:
    """Mongo first: what its target refuses (a unique index besides _id) reaches no sink."""
    s = scenario(tmp_path, "mongouniq", interval_ms=500, files=False, create=False)
    mongo = {
        "name": "mongo",
        "type": "mongodb",
        "uri": s.mongo_uri,
        "database": s.table,
        "collection": "orders",
        "mode": "insert",
    }
    pg = {"name": "pg", "type": "postgres", "dsn": s.pg_dsn, "table": s.table, "mode": "insert"}
    s.extra = {"sinks": [mongo, pg]}
    s.write()
    client: MongoClient[dict[str, Any]] = MongoClient(s.mongo_uri)
    try:
        client.drop_database(s.table)
        client[s.table]["orders"].create_index("customer", unique=True)
        create_topics(load_config(s.config_path))
        n = 200
        good = [
            orjson.dumps({"id": i, "customer": f"c{i}", "amount": 1, "currency": "EUR"})
            for i in range(n)
        ]
        dup = orjson.dumps({"id": 10_000, "customer": "c7", "amount": 1, "currency": "EUR"})
        p = Producer({"bootstrap.servers": s.bootstrap})
        where: dict[bytes, tuple[int, int]] = {}

        def delivered(err: Any, msg: Message) -> None:
            assert err is None, err
            where[msg.value()] = (msg.partition(), msg.offset())

        for i, value in enumerate(good[: n // 2]):
            p.produce(s.topic, value=value, partition=i % s.partitions)
        assert p.flush(30) == 0
        c = Cluster(s)
        start(c, "coordinator", "coord-0")
        start(c, "participant", "p-0")
        try:
            settle(s, c, set(range(n // 2)), 120)
            # The duplicate meets a committed document; later records keep committing.
            p.produce(s.topic, value=dup, partition=2, on_delivery=delivered)
            for i, value in enumerate(good[n // 2 :]):
                p.produce(s.topic, value=value, partition=i % s.partitions)
            assert p.flush(30) == 0
            report = settle(s, c, set(range(n)), 120)
            assert all(c.alive(name) for name in c.procs), "a process exited"
        finally:
            c.stop_all()
    finally:
        client.drop_database(s.table)
        client.close()
    for sink, r in report.items():
        assert r.ok and (r.rows, r.distinct) == (n, n), f"{sink}: {r}"
    letters = dead_letters(s)
    assert len(letters) == 1, [dl.key for dl in letters]
    dl = letters[0]
    partition, offset = where[dup]
    assert dl.key == f"{s.topic}:{partition}:{offset}".encode()
    assert dl.header("twophase.sink") == "mongo"
    assert "11000" in dl.header("twophase.reason"), dl.headers
