"""A Debezium PostgreSQL source on the stack's Kafka Connect worker (``stack/connect.sh``): a
source database of its own in the stack's PostgreSQL (``wal_level=logical``), a connector with
the built-in ``pgoutput`` plugin registered through the worker's REST API, and its clean-up
(connector, replication slot, topics, database).

Used by the Connect smoke test, the change-data-capture end-to-end test and ``make demo-cdc``.
"""

from __future__ import annotations

import json
import os
import shlex
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from confluent_kafka.admin import AdminClient
from psycopg import sql

__all__ = [
    "CONNECTOR_TIMEOUT_S",
    "START_CONNECT",
    "ConnectDown",
    "DebeziumSource",
    "connect_url",
    "rest",
]

START_CONNECT = "TWOPHASE_STACK_CONNECT=1 make stack-up (or: bash stack/connect.sh up)"
#: A new connector takes a replication slot, snapshots and starts streaming in a few seconds;
#: the margin is for a busy 2-core machine that also runs the broker and PostgreSQL.
CONNECTOR_TIMEOUT_S = 120.0
REPO = Path(__file__).resolve().parents[1]
POSTGRES_CONNECTOR = "io.debezium.connector.postgresql.PostgresConnector"


class ConnectDown(RuntimeError):
    """The Kafka Connect worker is not running; the message says how to start it."""


def rest(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    """One call of the worker's REST API; the decoded JSON answer (None when empty)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        payload = response.read()
    return json.loads(payload) if payload else None


def connect_url() -> str:
    """The worker's REST URL from ``connect.env`` (written by ``stack/connect.sh up`` beside
    stack.env), checked to answer and to have Debezium's PostgreSQL connector."""
    path = Path(os.environ.get("TWOPHASE_STACK_DIR") or REPO / ".stack") / "connect.env"
    if not path.is_file():
        raise ConnectDown(f"Kafka Connect is not running (no {path}): run `{START_CONNECT}`")
    words = [shlex.split(line) for line in path.read_text().splitlines() if "=" in line]
    env = dict(w[0].split("=", 1) for w in words if len(w) == 1 and not w[0].startswith("#"))
    url = env.get("TWOPHASE_CONNECT_URL")
    if not url:
        raise ConnectDown(f"TWOPHASE_CONNECT_URL missing from {path}: run `{START_CONNECT}`")
    try:
        plugins = rest("GET", f"{url}/connector-plugins")
    except (OSError, urllib.error.URLError) as exc:
        raise ConnectDown(f"{url} does not answer ({exc}): run `{START_CONNECT}`") from exc
    classes = {plugin["class"] for plugin in plugins}
    if POSTGRES_CONNECTOR not in classes:
        raise ConnectDown(f"the worker at {url} has no Debezium PostgreSQL connector: {classes}")
    return url


class DebeziumSource:
    """A source database ``name`` and the Debezium connector ``name`` streaming its tables
    to topics ``<name>.<schema>.<table>``."""

    def __init__(self, url: str, pg_dsn: str, bootstrap: str, name: str) -> None:
        self.url = url
        self.pg_dsn = pg_dsn
        self.bootstrap = bootstrap
        self.name = name
        self.dsn = urlsplit(pg_dsn)._replace(path=f"/{name}").geturl()
        self.topics: list[str] = []

    def create_database(self) -> None:
        with psycopg.connect(self.pg_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))

    def config(self, tables: list[str], **extra: str) -> dict[str, str]:
        """The connector's settings for ``tables`` (``schema.table``)."""
        dsn = urlsplit(self.pg_dsn)
        return {
            "connector.class": POSTGRES_CONNECTOR,
            "tasks.max": "1",
            "plugin.name": "pgoutput",
            "database.hostname": dsn.hostname or "127.0.0.1",
            "database.port": str(dsn.port or 5432),
            "database.user": dsn.username or "",
            "database.password": dsn.password or "",
            "database.dbname": self.name,
            "topic.prefix": self.name,
            "table.include.list": ",".join(tables),
            "slot.name": self.name,
            "slot.drop.on.stop": "true",
            "publication.name": self.name,
            "publication.autocreate.mode": "filtered",
            "snapshot.mode": "initial",
            # The stack's broker does not auto-create topics: the worker creates them.
            "topic.creation.default.replication.factor": "1",
            "topic.creation.default.partitions": "1",
            **extra,
        }

    def start(self, tables: list[str], **extra: str) -> list[str]:
        """Register the connector and wait until its task runs; the tables' topics."""
        rest("PUT", f"{self.url}/connectors/{self.name}/config", self.config(tables, **extra))
        self.topics = [f"{self.name}.{t}" for t in tables]
        self.wait_running()
        return self.topics

    def wait_running(self) -> None:
        deadline = time.monotonic() + CONNECTOR_TIMEOUT_S
        status: Any = None
        while time.monotonic() < deadline:
            try:
                status = rest("GET", f"{self.url}/connectors/{self.name}/status")
            except urllib.error.HTTPError as exc:
                if exc.code != 404:  # 404: the worker has not yet read the config back.
                    raise
            else:
                tasks = status.get("tasks", [])
                states = [status["connector"]["state"]] + [task["state"] for task in tasks]
                if "FAILED" in states:
                    raise RuntimeError(f"connector {self.name} failed: {json.dumps(status)[:4000]}")
                if tasks and all(state == "RUNNING" for state in states):
                    return
            time.sleep(0.5)
        # Seen once: the task's start waited on CREATE_REPLICATION_SLOT, which PostgreSQL
        # finishes only after every transaction open at that moment ends -- a prepared one left
        # by an earlier test held it up for good.
        raise TimeoutError(
            f"connector {self.name} not RUNNING after {CONNECTOR_TIMEOUT_S}s: {status} (a task "
            "waits for its logical replication slot, which waits for every open transaction: "
            "is anything left in pg_prepared_xacts?)"
        )

    def stop(self) -> None:
        """Delete the connector and its topics (the database stays until :meth:`drop`)."""
        try:
            rest("DELETE", f"{self.url}/connectors/{self.name}")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
        if self.topics:
            AdminClient({"bootstrap.servers": self.bootstrap}).delete_topics(self.topics)

    def drop(self) -> None:
        """Drop the database, once the stopped connector's slot is gone (a slot left behind
        would keep WAL for ever)."""
        with psycopg.connect(self.pg_dsn, autocommit=True) as admin:
            deadline = time.monotonic() + CONNECTOR_TIMEOUT_S
            while (
                admin.execute(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                    (self.name,),
                ).fetchone()
                and time.monotonic() < deadline
            ):
                time.sleep(0.2)
            admin.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                "WHERE slot_name = %s AND NOT active",
                (self.name,),
            )
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name))
            )
