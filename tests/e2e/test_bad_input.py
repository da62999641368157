"""Bad input end to end (PROTOCOL.md "Bad input"): real coordinator and participant processes on
the real stack. Oversize records and records without their upsert key go to the dead-letter
topic with the reason and source coordinates; the records around them land exactly once in
every sink. Garbage on the live control topic is skipped and counted by the running processes
while the pipeline keeps committing.

Every check reads Kafka, PostgreSQL, MongoDB, the files and the processes' /metrics directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from confluent_kafka import Message, Producer

from harness import Cluster, Scenario, control_summary, produce, wait_until
from tests.e2e.e2e_support import (
    SKIPPED,
    dead_letters,
    metric,
    scenario,
    scrape,
    settle,
    start,
)
from twophase.config import load_config
from twophase.kafka import create_topics
from twophase.protocol.codec import AUTH_HEADER, _mac, encode, new_envelope
from twophase.protocol.messages import Prepare


def _produce_values(s: Scenario, values: list[tuple[int, bytes]]) -> dict[bytes, tuple[int, int]]:
    """Produce ``(partition, value)`` pairs; returns value -> (partition, offset)."""
    where: dict[bytes, tuple[int, int]] = {}

    def delivered(err: Any, msg: Message) -> None:
        assert err is None, err
        where[msg.value()] = (msg.partition(), msg.offset())

    p = Producer({"bootstrap.servers": s.bootstrap, "enable.idempotence": True})
    for partition, value in values:
        p.produce(s.topic, value=value, partition=partition, on_delivery=delivered)
    assert p.flush(30) == 0
    return where


def _assert_exact(report: dict[str, Any], n: int) -> None:
    """Every sink holds ids 0..n-1 exactly once and nothing else (no rejected record in any)."""
    for sink, r in report.items():
        assert r.ok, f"{sink}: {r}"
        assert (r.rows, r.distinct) == (n, n), f"{sink}: {r}"


def test_oversize_records_are_dead_lettered_and_the_rest_lands_once(tmp_path: Path) -> None:
    limit = 2048
    s = scenario(
        tmp_path,
        "oversize",
        interval_ms=500,
        extra={"participant": {"sweep_interval_ms": 15_000, "max_record_bytes": limit}},
    )
    n = 600
    produce(s.bootstrap, s.topic, 0, n // 2)
    # Valid JSON objects with ids of their own: only their size can keep them out of the sinks.
    big = [
        (partition, orjson.dumps({"id": 1_000_000 + i, "customer": "big", "note": "x" * size}))
        for i, (partition, size) in enumerate([(0, limit), (2, 10 * limit), (3, 100_000)])
    ]
    where = _produce_values(s, big)
    produce(s.bootstrap, s.topic, n // 2, n // 2)
    c = Cluster(s)
    start(c, "coordinator", "coord-0")
    start(c, "participant", "p-0")
    try:
        report = settle(s, c, set(range(n)), 90)
    finally:
        c.stop_all()
    _assert_exact(report, n)
    letters = dead_letters(s)
    assert len(letters) == len(big), [dl.key for dl in letters]
    by_value = {dl.value: dl for dl in letters}
    for value, (partition, offset) in where.items():
        dl = by_value[value]  # the original bytes, unchanged
        assert dl.key == f"{s.topic}:{partition}:{offset}".encode()
        assert dl.header("twophase.reason").startswith("oversize:"), dl.headers
        assert f"{len(value)} bytes > {limit}" in dl.header("twophase.reason")
        assert dl.header("twophase.source.topic") == s.topic
        assert dl.header("twophase.source.partition") == str(partition)
        assert dl.header("twophase.source.offset") == str(offset)
        assert dl.header("twophase.pipeline") == s.name
        assert dl.header("twophase.participant") == "p-0"
        assert int(dl.header("twophase.txn")) >= 1
        assert "twophase.sink" not in dl.headers  # no sink saw it


def _upsert_sinks(s: Scenario, first: str) -> list[dict[str, Any]]:
    pg = {
        "name": "pg",
        "type": "postgres",
        "dsn": s.pg_dsn,
        "table": s.table,
        "mode": "upsert",
        "key": ["id"],
    }
    mongo = {
        "name": "mongo",
        "type": "mongodb",
        "uri": s.mongo_uri,
        "database": s.table,
        "collection": "orders",
        "mode": "upsert",
        "key": ["id"],
    }
    files = {"name": "files", "type": "files", "path": str(s.files_path), "format": "parquet"}
    return [pg, mongo, files] if first == "pg" else [mongo, pg, files]


@pytest.mark.parametrize("first", ["pg", "mongo"])
def test_records_without_their_upsert_key_are_dead_lettered(tmp_path: Path, first: str) -> None:
    s = scenario(tmp_path, f"nokey-{first}", interval_ms=500, create=False)
    s.extra = {"sinks": _upsert_sinks(s, first)}
    s.write()
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {s.table} ADD PRIMARY KEY (id)")
    create_topics(load_config(s.config_path))
    n = 400
    produce(s.bootstrap, s.topic, 0, n // 2)
    bad = [
        (1, b'{"customer": "no-id", "amount": 1.5, "currency": "EUR"}'),
        (2, b'{"id": null, "customer": "null-id", "amount": 2.5, "currency": "EUR"}'),
    ]
    where = _produce_values(s, bad)
    produce(s.bootstrap, s.topic, n // 2, n // 2)
    c = Cluster(s)
    start(c, "coordinator", "coord-0")
    start(c, "participant", "p-0")
    try:
        report = settle(s, c, set(range(n)), 90)
    finally:
        c.stop_all()
    # Nothing half-visible: the keyless records are in no sink (the counts would show them).
    _assert_exact(report, n)
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {s.table} WHERE customer IN ('no-id', 'null-id')"
        ).fetchone()
        assert row is not None and row[0] == 0
    letters = {dl.value: dl for dl in dead_letters(s)}
    assert set(letters) == set(where), list(letters)
    # Both key-keeping sinks refuse these records; the second one says so first, in its
    # check before any sink writes (PROTOCOL.md, "The record path"), and is named.
    second = "mongo" if first == "pg" else "pg"
    for value, (partition, offset) in where.items():
        dl = letters[value]
        reason = dl.header("twophase.reason")
        assert dl.header("twophase.sink") == second, dl.headers
        assert ("null" if b"null" in value else "missing") in reason, reason
        if second == "pg":
            assert "upsert key" in reason, reason
        else:
            assert "key field 'id'" in reason, reason
        assert dl.key == f"{s.topic}:{partition}:{offset}".encode()
        assert dl.header("twophase.source.topic") == s.topic
        assert dl.header("twophase.source.partition") == str(partition)
        assert dl.header("twophase.source.offset") == str(offset)


def _signed(key: bytes, value: bytes) -> list[tuple[str, bytes]]:
    return [(AUTH_HEADER, _mac(key, value).encode())]


def test_garbage_on_the_live_control_topic_is_counted_and_commits_go_on(tmp_path: Path) -> None:
    s = scenario(tmp_path, "ctlgarbage", interval_ms=300, mongo=False)
    cfg = load_config(s.config_path)
    key = s.hmac_key.encode()
    n = 500
    produce(s.bootstrap, s.topic, 0, n)
    c = Cluster(s)
    cport = start(c, "coordinator", "coord-0")
    pport = start(c, "participant", "p-0")
    try:
        settle(s, c, set(range(n)), 60)
        before = {p: scrape(p) for p in (cport, pport)}
        for text in before.values():
            assert metric(text, SKIPPED) == 0, text
        commits_before = metric(before[cport], "twophase_commit_cycles_total", outcome="commit")
        assert commits_before >= 1
        # Each signed with the pipeline's key, so the HMAC check passes and the decoder meets
        # the defect itself; one unsigned message is the bad_auth control.
        valid, _ = encode(
            new_envelope(s.name, "coordinator:x", Prepare(txn=10_000, deadline_ms=1)), key
        )
        future = {**orjson.loads(valid), "version": 2}
        unknown = {**orjson.loads(valid), "type": 42}
        junk: list[tuple[bytes, list[tuple[str, bytes]], str]] = [
            (valid[: len(valid) // 2], [], "malformed"),  # truncated JSON
            (b"\x00\xff\xfe binary", [], "malformed"),  # undecodable bytes
            (orjson.dumps(unknown), [], "unknown_type"),
            (orjson.dumps(future), [], "future_version"),
        ]
        p = Producer({"bootstrap.servers": s.bootstrap, "acks": "all"})
        for value, _h, _kind in junk:
            p.produce(
                cfg.control_topic, key=s.name.encode(), value=value, headers=_signed(key, value)
            )
        p.produce(cfg.control_topic, key=s.name.encode(), value=valid[:-1] + b" }")  # unsigned
        assert p.flush(30) == 0
        expected = {"malformed": 2, "unknown_type": 1, "future_version": 1, "bad_auth": 1}

        def counted(port: int) -> bool:
            text = scrape(port)
            return all(metric(text, SKIPPED, kind=k) == v for k, v in expected.items())

        wait_until(lambda: counted(pport), 30, "the participant to count every skipped message")
        wait_until(lambda: counted(cport), 30, "the coordinator to count every skipped message")
        produce(s.bootstrap, s.topic, n, n)
        report = settle(s, c, set(range(2 * n)), 60)
        after = [scrape(cport), scrape(pport)]
        assert c.alive("coord-0") and c.alive("p-0")
    finally:
        c.stop_all()
    _assert_exact(report, 2 * n)
    assert metric(after[0], "twophase_commit_cycles_total", outcome="commit") > commits_before
    for port_text in after:
        for k, v in expected.items():
            assert metric(port_text, SKIPPED, kind=k, pipeline=s.name) == v
    assert control_summary(s)["committed"] >= 2
