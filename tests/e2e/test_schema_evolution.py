"""Tables made and changed from record schemas, end to end on the real stack
(``docs/schema-changes.md``): a coordinator and two participants read Kafka Connect JSON
records (``value_format: connect_json``, keys with a schema) into a PostgreSQL table that no one
created, while the producer moves to newer schemas.

* The first records create the table (``auto_create``).
* Newer records reach both participants in the same cycle: one of them changes the table
  inside its part, the other keeps off it, and no cycle fails.
* A participant is killed (SIGKILL) with the part that holds an ALTER TABLE prepared: after
  its vote (the restarted participant commits the part) and before it (the cycle aborts, the
  ALTER is rolled back and made again): the column is invisible while the part is prepared,
  and in the end the table has it and every row exactly once.
* A record whose schema the table cannot follow is dead-lettered with the reason; the records
  after it are written; with ``auto_evolve: false`` every change is dead-lettered that way.

The table is in insert mode, so a record written twice would show as two rows.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
import yaml
from confluent_kafka import Producer

from harness import Cluster, Scenario, control_decisions, verify, wait_until
from tests.e2e.e2e_support import dead_letters, scenario, start
from twophase.config import load_config
from twophase.kafka import create_topics

pytestmark = pytest.mark.stack

PARTITIONS = 4


def fld(field: str, kind: str, optional: bool = False) -> dict[str, Any]:
    return {"field": field, "type": kind, "optional": optional}


V1 = [fld("id", "int64"), fld("qty", "int32"), fld("price", "float32"), fld("name", "string")]
#: qty int32 -> int64, price float32 -> float64, an optional field added.
V2 = [
    fld("id", "int64"),
    fld("qty", "int64"),
    fld("price", "float64"),
    fld("name", "string"),
    fld("note", "string", True),
]
#: One more optional field, and then another.
V3 = [*V2, fld("tag", "string", True)]
V4 = [*V3, fld("tag2", "string", True)]
#: qty became a string: not a widening.
BAD = [fld("id", "int64"), fld("qty", "string"), fld("price", "float64"), fld("name", "string")]

KEY_SCHEMA = {
    "type": "struct",
    "name": "orders.Key",
    "optional": False,
    "fields": [fld("id", "int64")],
}


def row(i: int, fields: list[dict[str, Any]]) -> dict[str, Any]:
    names = {f["field"] for f in fields}
    wide = "qty" in names and any(f["field"] == "qty" and f["type"] == "int64" for f in fields)
    out: dict[str, Any] = {
        "id": i,
        "qty": 2**40 + i if wide else i,
        "price": 0.5,
        "name": f"n{i}",
    }
    if "note" in names:
        out["note"] = f"note {i}"
    for tag in ("tag", "tag2"):
        if tag in names:
            out[tag] = f"{tag} {i}"
    if any(f["field"] == "qty" and f["type"] == "string" for f in fields):
        out["qty"] = "many"
    return out


def produce(s: Scenario, ids: range | list[int], fields: list[dict[str, Any]]) -> None:
    """Records as Kafka Connect's JSON converter writes them (``schemas.enable``), keyed by id."""
    schema = {"type": "struct", "name": "orders.Value", "optional": False, "fields": fields}
    producer = Producer({"bootstrap.servers": s.bootstrap, "linger.ms": 5})
    for i in ids:
        producer.produce(
            s.topic,
            key=orjson.dumps({"schema": KEY_SCHEMA, "payload": {"id": i}}),
            value=orjson.dumps({"schema": schema, "payload": row(i, fields)}),
            partition=i % PARTITIONS,
        )
    assert producer.flush(30) == 0


def pipeline(tmp_path: Path, prefix: str, **sink: Any) -> Scenario:
    s = scenario(tmp_path, prefix, create=False, mongo=False, files=False, interval_ms=1000)
    raw = s.config()
    raw["sources"] = [
        {
            "topic": s.topic,
            "partitions": PARTITIONS,
            "replication_factor": 1,
            "value_format": "connect_json",
            "key_format": "json",
        }
    ]
    raw["sinks"] = [
        {
            "name": "pg",
            "type": "postgres",
            "dsn": s.pg_dsn,
            "table": s.table,
            "mode": "insert",
            "auto_create": True,
            **sink,
        }
    ]
    s.config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {s.table}")  # made by the first record
    create_topics(load_config(s.config_path))
    return s


def columns(s: Scenario) -> dict[str, str]:
    """The table's committed columns (the catalog: no lock on the table)."""
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        return {
            str(n): str(t)
            for n, t in conn.execute(
                "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
                " WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
                (s.table,),
            )
        }


def prepared(s: Scenario) -> list[str]:
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        return [
            str(g)
            for (g,) in conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s", (f"%{s.name}~%",)
            )
        ]


def holds(s: Scenario, expected: set[int]) -> bool:
    try:
        return verify(s, expected)["pg"].ok and verify(s, expected)["pg"].rows == len(expected)
    except psycopg.errors.UndefinedTable:
        return False


def present(s: Scenario, ids: range) -> bool:
    """Every id of ``ids`` has a row (committed)."""
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        got = conn.execute(
            f"SELECT count(DISTINCT id) FROM {s.table} WHERE id >= %s AND id < %s",
            (ids.start, ids.stop),
        ).fetchone()
    return got == (len(ids),)


def alters(cluster: Cluster, *names: str) -> int:
    """ALTER TABLE statements the participants ran (each in a part)."""
    return sum(cluster.log_tail(n, 100_000).count("(visible when the part commits)") for n in names)


class SteadyProducer(threading.Thread):
    """Records of ``fields`` on every partition, about 200 a second, until stopped."""

    def __init__(self, s: Scenario, fields: list[dict[str, Any]], first: int) -> None:
        super().__init__(daemon=True)
        self.s, self.fields, self.next = s, fields, first
        self.first = first
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            produce(self.s, range(self.next, self.next + 20), self.fields)
            self.next += 20
            time.sleep(0.1)

    def ids(self) -> set[int]:
        return set(range(self.first, self.next))


class ReadLatency(threading.Thread):
    """A reader of the table (``SELECT count(*)``, every 20 ms): the longest a read took is how
    long an ACCESS EXCLUSIVE lock kept readers out."""

    def __init__(self, s: Scenario) -> None:
        super().__init__(daemon=True)
        self.s = s
        self.stop = threading.Event()
        self.worst = 0.0

    def run(self) -> None:
        with psycopg.connect(self.s.pg_dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                started = time.monotonic()
                conn.execute(f"SELECT count(*) FROM {self.s.table}")
                self.worst = max(self.worst, time.monotonic() - started)
                time.sleep(0.02)


def crash_during_change(
    s: Scenario, workdir: Path, point: str, column: str, expected: set[int]
) -> int:
    """With records that need ``column`` waiting in the source: run p-0 alone with no
    coordinator (so no PREPARE cuts its part) until it has changed the table in its open part,
    arm the crash ``point``, start the coordinator, and see p-0 killed there with the part
    prepared and the column invisible; restart everyone and wait for every row. Returns the
    killed part's transaction."""
    workdir.mkdir()
    crash_file = workdir / "crash"
    c = Cluster(s)
    try:
        before = alters(c, "p-0")
        start(c, "participant", "p-0", {"TWOPHASE_CRASH_FILE": str(crash_file)})
        wait_until(lambda: alters(c, "p-0") > before, 120, "p-0 to change the table in its part")
        assert prepared(s) == []  # the part with the ALTER is still open: the next vote is its
        crash_file.write_text(f"{point}:1:a")
        start(c, "coordinator", "coord-0")
        wait_until(lambda: not c.alive("p-0"), 120, f"p-0 to die at {point}")
        assert f"crash point {point} reached" in c.log_tail("p-0", 50)
        crashed = prepared(s)
        assert len(crashed) == 1  # the part with the ALTER, prepared
        assert column not in columns(s)  # invisible until COMMIT PREPARED
        crash_file.unlink()
        start(c, "participant", "p-0")
        start(c, "participant", "p-1")
        wait_until(lambda: holds(s, expected), 120, "recovery, and every row")
        assert prepared(s) == []
    finally:
        c.stop_all()
    return int(crashed[0].split("~")[1])


def test_tables_made_and_changed_from_schemas_while_the_pipeline_runs(tmp_path: Path) -> None:
    s = pipeline(tmp_path, "evolve", auto_evolve=True)
    c = Cluster(s)
    expected: set[int] = set()
    try:
        start(c, "coordinator", "coord-0")
        start(c, "participant", "p-0")
        start(c, "participant", "p-1")

        # 1. The first records make the table.
        produce(s, range(400), V1)
        expected |= set(range(400))
        wait_until(lambda: holds(s, expected), 120, "the V1 rows in a table made for them")
        assert columns(s) == {"id": "bigint", "qty": "integer", "price": "real", "name": "text"}

        # 2. Older records keep coming on every partition, so that each participant's open
        # part always has the table locked; then newer records on every partition at once:
        # both participants meet them in the same cycle, each while the other's open part
        # writes the table.
        steady = SteadyProducer(s, V1, first=10_000)
        steady.start()
        time.sleep(3)
        reader = ReadLatency(s)
        reader.start()
        started = time.monotonic()
        since_ms = int(time.time() * 1000)
        produce(s, range(400, 800), V2)
        expected |= set(range(400, 800))
        wait_until(lambda: present(s, range(400, 800)), 120, "the V2 rows")
        took = time.monotonic() - started
        until_ms = int(time.time() * 1000)
        steady.stop.set()
        steady.join()
        reader.stop.set()
        reader.join()
        expected |= steady.ids()
        wait_until(lambda: holds(s, expected), 60, "the older records produced meanwhile")
        assert columns(s)["qty"] == "bigint" and columns(s)["note"] == "text"
        assert alters(c, "p-0", "p-1") == 1  # one owner changed the table, once
        held = sum(c.log_tail(n, 100_000).count("ends before offset") for n in ("p-0", "p-1"))
    finally:
        c.stop_all()
    during = [d for d in control_decisions(s) if since_ms <= d[0] <= until_ms]
    # No cycle failed while the table changed: nobody waited for a lock another
    # participant's open part held (that wait lasts until the vote timeout aborts the cycle).
    assert [d for d in during if d[2] != "commit"] == [], during
    print(
        f"evolution: the V2 rows all visible {took:.1f}s after they were produced, "
        f"{len(during)} cycles (all committed); {held} partition parts ended early (held); "
        f"readers blocked up to {reader.worst:.2f}s"
    )

    # 3. A participant killed between the ALTER's prepare and its commit: after its vote
    # (the decision commits; recovery applies it), and before it (no vote: the cycle aborts,
    # the prepared ALTER is rolled back, and the change is made again when the records are
    # read again).
    for point, ids, fields, column, decided in [
        ("after_vote", range(800, 1000), V3, "tag", "commit"),
        ("after_prepare", range(1000, 1200), V4, "tag2", "abort"),
    ]:
        produce(s, ids, fields)
        expected |= set(ids)
        txn = crash_during_change(s, tmp_path / point, point, column, expected)
        assert {d[1]: d[2] for d in control_decisions(s)}[txn] == decided
        assert columns(s)[column] == "text"
        with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
            filled = conn.execute(
                f"SELECT count(*) FROM {s.table} WHERE {column} IS NOT NULL"
            ).fetchone()
        assert filled == (len(ids),)

    c = Cluster(s)
    try:
        start(c, "coordinator", "coord-0")
        start(c, "participant", "p-0")
        start(c, "participant", "p-1")
        # 4. A change the table cannot follow: dead-lettered with the reason; the pipeline goes on.
        produce(s, [5000], BAD)
        produce(s, range(2000, 2100), V4)
        expected |= set(range(2000, 2100))
        wait_until(lambda: holds(s, expected), 120, "the records after the refused one")
        letters = dead_letters(s)
        assert len(letters) == 1
        reason = letters[0].header("twophase.reason")
        assert reason == (
            f"rejected by sink pg: table {s.table}: field 'qty': int64 -> string is not a "
            "widening (stored values would change)"
        )
        assert letters[0].header("twophase.sink") == "pg"
    finally:
        c.stop_all()
    report = verify(s, expected)["pg"]
    assert report.ok and report.rows == len(expected), report  # every record exactly once


def test_with_auto_evolve_off_a_change_is_dead_lettered_and_the_pipeline_goes_on(
    tmp_path: Path,
) -> None:
    s = pipeline(tmp_path, "noevolve")
    c = Cluster(s)
    try:
        start(c, "coordinator", "coord-0")
        start(c, "participant", "p-0")
        produce(s, range(100), V1)
        produce(s, range(100, 110), V2)
        produce(s, range(110, 200), V1)
        expected = set(range(100)) | set(range(110, 200))
        wait_until(lambda: holds(s, expected), 120, "every V1 row")
        wait_until(lambda: len(dead_letters(s)) == 10, 60, "the V2 records' dead letters")
    finally:
        c.stop_all()
    assert columns(s) == {"id": "bigint", "qty": "integer", "price": "real", "name": "text"}
    reasons = {letter.header("twophase.reason") for letter in dead_letters(s)}
    assert reasons == {
        f"rejected by sink pg: table {s.table}: the record's schema needs a change (column "
        "'qty' from integer to bigint, column 'price' from real to double precision, column "
        "'note' added (text)), and auto_evolve is off"
    }
    assert verify(s, expected)["pg"].rows == len(expected)
