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
import os
import shlex
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError
from confluent_kafka.admin import AdminClient
from psycopg import sql

pytestmark = [pytest.mark.stack, pytest.mark.connect]

START_CONNECT = "TWOPHASE_STACK_CONNECT=1 make stack-up (or: bash stack/connect.sh up)"
# A new connector takes a replication slot, snapshots and starts streaming in a few seconds;
# the margin is for a busy 2-core machine that also runs the broker and PostgreSQL.
CONNECTOR_TIMEOUT_S = 120.0
EVENTS_TIMEOUT_S = 120.0


REPO = Path(__file__).resolve().parents[2]


def _connect_env_path() -> Path:
    """Written by ``stack/connect.sh up`` beside the stack's stack.env."""
    return Path(os.environ.get("TWOPHASE_STACK_DIR") or REPO / ".stack") / "connect.env"


def _connect_down(reason: str) -> NoReturn:
    pytest.fail(f"Kafka Connect is not running ({reason}): run `{START_CONNECT}`", pytrace=False)


def _rest(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        payload = response.read()
    return json.loads(payload) if payload else None


@pytest.fixture(scope="session")
def connect_url() -> str:
    path = _connect_env_path()
    if not path.is_file():
        _connect_down(f"no {path}")
    words = [shlex.split(line) for line in path.read_text().splitlines() if "=" in line]
    env = dict(w[0].split("=", 1) for w in words if len(w) == 1 and not w[0].startswith("#"))
    url = env.get("TWOPHASE_CONNECT_URL")
    if not url:
        _connect_down(f"TWOPHASE_CONNECT_URL missing from {path}")
    try:
        plugins = _rest("GET", f"{url}/connector-plugins")
    except (OSError, urllib.error.URLError) as exc:
        _connect_down(f"{url} does not answer: {exc}")
    classes = {plugin["class"] for plugin in plugins}
    if "io.debezium.connector.postgresql.PostgresConnector" not in classes:
        pytest.fail(f"the worker at {url} has no Debezium PostgreSQL connector: {sorted(classes)}")
    return url


@pytest.fixture
def source_db(pg_dsn: str, unique_name: str) -> Iterator[str]:
    """A database of its own, as a CDC source is in production; dropped afterwards."""
    admin = psycopg.connect(pg_dsn, autocommit=True)
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(unique_name)))
    try:
        yield unique_name
    finally:
        # A deleted connector's task stops (and drops its slot, slot.drop.on.stop) a moment
        # after the REST call returns; a slot left behind would keep WAL forever.
        deadline = time.monotonic() + CONNECTOR_TIMEOUT_S
        while (
            admin.execute(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", (unique_name,)
            ).fetchone()
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        admin.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s AND NOT active",
            (unique_name,),
        )
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(unique_name)))
        admin.close()


def _wait_running(connect_url: str, name: str) -> None:
    deadline = time.monotonic() + CONNECTOR_TIMEOUT_S
    status: Any = None
    while time.monotonic() < deadline:
        try:
            status = _rest("GET", f"{connect_url}/connectors/{name}/status")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:  # 404: the worker has not yet read the config back.
                raise
        else:
            tasks = status.get("tasks", [])
            states = [status["connector"]["state"]] + [task["state"] for task in tasks]
            if "FAILED" in states:
                pytest.fail(f"connector {name} failed: {json.dumps(status)[:4000]}")
            if tasks and all(state == "RUNNING" for state in states):
                return
        time.sleep(0.5)
    # Seen once: the task's start waited on CREATE_REPLICATION_SLOT, which PostgreSQL finishes
    # only after every transaction open at that moment ends -- a prepared one left by an earlier
    # test held it up for good.
    pytest.fail(
        f"connector {name} not RUNNING after {CONNECTOR_TIMEOUT_S}s: {status} (a task waits for "
        "its logical replication slot, which waits for every open transaction: is anything "
        "left in pg_prepared_xacts?)"
    )


def _debezium_config(pg_dsn: str, database: str) -> dict[str, str]:
    dsn = urlsplit(pg_dsn)
    return {
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "tasks.max": "1",
        "plugin.name": "pgoutput",
        "database.hostname": dsn.hostname or "127.0.0.1",
        "database.port": str(dsn.port or 5432),
        "database.user": dsn.username or "",
        "database.password": dsn.password or "",
        "database.dbname": database,
        "topic.prefix": database,
        "table.include.list": "public.items",
        "slot.name": database,
        "slot.drop.on.stop": "true",
        "publication.name": database,
        "publication.autocreate.mode": "filtered",
        "snapshot.mode": "initial",
        # The stack's broker does not auto-create topics: the worker creates them.
        "topic.creation.default.replication.factor": "1",
        "topic.creation.default.partitions": "1",
    }


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
    connect_url: str, pg_dsn: str, kafka_bootstrap: str, source_db: str
) -> None:
    source_dsn = urlsplit(pg_dsn)._replace(path=f"/{source_db}").geturl()
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, qty int)")
        conn.execute("INSERT INTO items VALUES (1, 'before-snapshot', 10)")

    name = source_db
    topic = f"{source_db}.public.items"
    _rest("PUT", f"{connect_url}/connectors/{name}/config", _debezium_config(pg_dsn, source_db))
    try:
        _wait_running(connect_url, name)
        # The snapshot record proves the slot exists: changes from here on are streamed.
        assert [v["payload"]["op"] for _, v in _read_events(kafka_bootstrap, topic, 1)] == ["r"]
        with psycopg.connect(source_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO items VALUES (2, 'new', 1)")
            conn.execute("UPDATE items SET qty = 2, name = 'changed' WHERE id = 2")
            conn.execute("DELETE FROM items WHERE id = 1")

        events = _read_events(kafka_bootstrap, topic, 5)
    finally:
        _rest("DELETE", f"{connect_url}/connectors/{name}")
        AdminClient({"bootstrap.servers": kafka_bootstrap}).delete_topics([topic])

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
    source = created["payload"]["source"]
    assert (source["connector"], source["db"], source["table"]) == (
        "postgresql",
        source_db,
        "items",
    )
    assert isinstance(source["lsn"], int)


def test_worker_has_the_stack_plugins(connect_url: str) -> None:
    """The plugins stack/connect/*/pom.xml fetch, loadable by the worker (issues #17, #18, #20)."""
    classes = {plugin["class"] for plugin in _rest("GET", f"{connect_url}/connector-plugins")}
    assert {
        "io.debezium.connector.postgresql.PostgresConnector",
        "io.debezium.connector.jdbc.JdbcSinkConnector",
        "com.mongodb.kafka.connect.MongoSinkConnector",
        "org.apache.iceberg.connect.IcebergSinkConnector",
    } <= classes
