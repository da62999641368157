"""Kafka Connect and Debezium's PostgreSQL source, as the stack runs them (stack/connect.sh).

A change stream end to end on the real services: a source database in the stack's PostgreSQL
(``wal_level=logical``), a Debezium connector with the built-in ``pgoutput`` plugin registered
through the worker's REST API, and the change events it writes to Kafka.

Marked ``connect``: plain ``make stack-up`` does not start Connect, ``make test`` does
(``TWOPHASE_STACK_CONNECT=1``). By hand: ``TWOPHASE_STACK_CONNECT=1 make stack-up`` then
``pytest tests/smoke/test_connect.py``. With the worker down the test FAILS, naming that
command.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError

from harness import debezium

pytestmark = [pytest.mark.stack, pytest.mark.connect]

EVENTS_TIMEOUT_S = 120.0


@pytest.fixture
def source(
    connect_url: str, pg_dsn: str, kafka_bootstrap: str, unique_name: str
) -> Iterator[debezium.DebeziumSource]:
    """A database of its own, as a CDC source is in production; dropped afterwards."""
    src = debezium.DebeziumSource(connect_url, pg_dsn, kafka_bootstrap, unique_name)
    src.create_database()
    try:
        yield src
    finally:
        src.stop()
        src.drop()


def _read_events(bootstrap: str, topic: str, want: int) -> list[tuple[Any, Any]]:
    """(key, value) pairs of the first ``want`` records, JSON-decoded (None for a tombstone)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"{topic}-reader",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    events: list[tuple[Any, Any]] = []
    deadline = time.monotonic() + EVENTS_TIMEOUT_S
    try:
        while len(events) < want and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                # The topic appears only with the connector's first record.
                if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                    continue
                raise AssertionError(f"consumer error on {topic}: {error}")
            key, value = message.key(), message.value()
            events.append(
                (
                    json.loads(key) if key is not None else None,
                    json.loads(value) if value is not None else None,
                )
            )
    finally:
        consumer.close()
    return events


def test_debezium_postgres_source_streams_inserts_updates_deletes_and_tombstones(
    source: debezium.DebeziumSource, kafka_bootstrap: str
) -> None:
    with psycopg.connect(source.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, qty int)")
        conn.execute("INSERT INTO items VALUES (1, 'before-snapshot', 10)")

    (topic,) = source.start(["public.items"])
    # The snapshot record proves the slot exists: changes from here on are streamed.
    assert [v["payload"]["op"] for _, v in _read_events(kafka_bootstrap, topic, 1)] == ["r"]
    with psycopg.connect(source.dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO items VALUES (2, 'new', 1)")
        conn.execute("UPDATE items SET qty = 2, name = 'changed' WHERE id = 2")
        conn.execute("DELETE FROM items WHERE id = 1")
    events = _read_events(kafka_bootstrap, topic, 5)

    # Keys and values in the JsonConverter's {schema, payload} envelope (the worker default).
    summary = [
        (key["payload"]["id"], value["payload"]["op"] if value is not None else None)
        for key, value in events
    ]
    assert summary == [(1, "r"), (2, "c"), (2, "u"), (1, "d"), (1, None)], summary
    snapshot, created, updated, deleted, _tombstone = (value for _, value in events)
    assert snapshot["payload"]["after"] == {"id": 1, "name": "before-snapshot", "qty": 10}
    assert created["payload"]["after"] == {"id": 2, "name": "new", "qty": 1}
    assert updated["payload"]["after"] == {"id": 2, "name": "changed", "qty": 2}
    # With the default replica identity the delete's `before` carries the key only.
    assert deleted["payload"]["before"]["id"] == 1
    assert deleted["payload"]["after"] is None
    origin = created["payload"]["source"]
    assert (origin["connector"], origin["db"], origin["table"]) == (
        "postgresql",
        source.name,
        "items",
    )
    assert isinstance(origin["lsn"], int)


def test_worker_has_the_stack_plugins(connect_url: str) -> None:
    """The plugins stack/connect/*/pom.xml fetch, loadable by the worker (issues #17, #18, #20)."""
    classes = {
        plugin["class"] for plugin in debezium.rest("GET", f"{connect_url}/connector-plugins")
    }
    assert {
        "io.debezium.connector.postgresql.PostgresConnector",
        "io.debezium.connector.jdbc.JdbcSinkConnector",
        "com.mongodb.kafka.connect.MongoSinkConnector",
        "org.apache.iceberg.connect.IcebergSinkConnector",
    } <= classes
