"""A schema registry that does not answer is waited for like a store (#18, bad input): the
participant retries the schema fetch, never dead-letters a record for it and never exits; once
the registry answers again every record arrives, exactly once. The registry is the stack's
real one, behind a gate that answers every connection by closing it while shut."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from harness import Cluster, end_offsets, group_offsets, wait_until
from tests.e2e.e2e_support import dead_letters, scenario, start
from twophase.config import load_config
from twophase.kafka import create_topics

pytestmark = pytest.mark.stack

RECORDS = 40
#: How long the registry stays away: well inside the participant's retry budget for a fetch
#: (participant.sink_retry_s, 60 s), so the part waits instead of failing.
DOWN_S = 12.0


class _Gate:
    """A TCP proxy to ``target`` that, while shut, accepts and at once closes every connection
    (the client sees the server go away, as when it restarts)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.open = threading.Event()
        self.tried_while_shut = 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(32)
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                self.tried_while_shut += 1
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def test_a_registry_that_is_away_is_waited_for_and_nothing_is_lost(
    tmp_path: Path, schema_registry_url: str
) -> None:
    url = urlsplit(schema_registry_url)
    gate = _Gate((url.hostname or "127.0.0.1", url.port or 80))
    through_gate = f"http://127.0.0.1:{gate.port}{url.path}"
    s = scenario(tmp_path, "regdown", create=False, interval_ms=500, mongo=False, files=False)
    s.extra = {
        "schema_registry": {"url": through_gate},
        "sources": [
            {"topic": s.topic, "partitions": 1, "replication_factor": 1, "value_format": "avro"}
        ],
        "sinks": [
            {
                "name": "pg",
                "type": "postgres",
                "dsn": s.pg_dsn,
                "table": s.table,
                "auto_create": True,
            }
        ],
    }
    s.write()
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{s.table}"')
    create_topics(load_config(s.config_path))
    schema = {
        "type": "record",
        "name": "Reading",
        "fields": [{"name": "id", "type": "long"}, {"name": "v", "type": "double"}],
    }
    serialize = AvroSerializer(
        SchemaRegistryClient({"url": schema_registry_url}), json.dumps(schema)
    )
    ctx = SerializationContext(s.topic, MessageField.VALUE)
    producer = Producer({"bootstrap.servers": s.bootstrap})
    for i in range(RECORDS):
        producer.produce(s.topic, value=serialize({"id": i, "v": i / 4}, ctx))
    assert producer.flush(30) == 0

    c = Cluster(s)
    start(c, "coordinator", "coord-0")
    start(c, "participant", "worker-0")
    try:
        wait_until(lambda: gate.tried_while_shut >= 2, 60, "the participant to ask the registry")
        time.sleep(DOWN_S)
        # Nothing of the batch anywhere while it waits (the table is made by its first rows).
        assert _rows(s.pg_dsn, s.table) == 0
        assert all(c.alive(name) for name in c.procs), "a process exited"
        gate.open.set()

        def done() -> bool:
            ends = end_offsets(s.bootstrap, s.topic, 1)
            return group_offsets(s.bootstrap, f"twophase.{s.name}", s.topic, 1) == ends

        wait_until(done, 120, "every record committed once the registry answers")
        assert all(c.alive(name) for name in c.procs), "a process exited"
        log = c.log_tail("worker-0", 2000)
    finally:
        c.stop_all()
        gate.close()
    with psycopg.connect(s.pg_dsn) as conn:
        got: list[Any] = conn.execute(f'SELECT id, v FROM "{s.table}" ORDER BY id').fetchall()
    assert got == [(i, i / 4) for i in range(RECORDS)]
    assert dead_letters(s) == []
    # The wait was the retry policy's: one warning per try, naming what was fetched.
    assert "fetching schema id" in log and "retrying" in log


def _rows(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        if conn.execute("SELECT to_regclass(%s)", (f'"{table}"',)).fetchone() == (None,):
            return 0
        row = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()
    return int(row[0]) if row else 0
