"""The coordinated writer's task body (:func:`write_partition`) on the real stack, without a
JVM: a partition's JSON lines -- what Spark's ``to_json`` hands to Python, as UTF-8 bytes --
go to a sink that reads JSON itself (PostgreSQL's compiled COPY) as they come, and decoded to
the others (MongoDB), into one prepared part; a line that is no JSON object fails the task,
naming its row, with nothing left prepared."""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson
import psycopg
import pymongo
import pytest

from twophase.participants.sdk import PartId
from twophase.participants.spark.executor import (
    OFFSET_STRIDE,
    TaskSpec,
    _drop_executor_sinks,
    _executor_sinks,
    write_partition,
)

pytestmark = [pytest.mark.stack]


def _spec(pg_dsn: str, mongo_uri: str, name: str, *, txn: int) -> TaskSpec:
    sinks = [
        {"name": "pg", "type": "postgres", "dsn": pg_dsn, "table": name, "mode": "insert"},
        {"name": "mongo", "type": "mongodb", "uri": mongo_uri, "database": name,
         "collection": "orders", "mode": "upsert", "key": ["id"]},
    ]  # fmt: skip
    return TaskSpec(
        pipeline=name.replace("_", "-"),
        sinks_json=json.dumps(sinks, sort_keys=True),
        batch_id=7,
        txn=txn,
        tag=1,
        chunk_rows=400,
        ts_ms=1_700_000_000_000,
    )


def _rows(n: int) -> list[dict[str, Any]]:
    return [
        {"id": i, "name": None if i % 7 == 0 else f"n\u00e9-{i}\t", "qty": i % 5, "price": i / 4}
        for i in range(n)
    ]


@pytest.fixture
def table(pg_dsn: str) -> Any:
    name = f"sparkexec_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {name} (id bigint PRIMARY KEY, name text, qty int, price float8)"
        )
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}")


def test_a_tasks_json_lines_reach_every_sink_as_one_prepared_part(
    pg_dsn: str, mongo_uri: str, table: str
) -> None:
    rows = _rows(1_000)
    spec = _spec(pg_dsn, mongo_uri, table, txn=3)
    sinks = _executor_sinks(spec)
    pg = next(s for s in sinks if s.name == "pg")
    raw_writes: list[int] = []
    write_raw = pg.write_raw

    def counted(part: PartId, batch: Any) -> Any:
        raw_writes.append(len(batch))
        return write_raw(part, batch)

    pg.write_raw = counted  # type: ignore[method-assign]
    try:
        (result,) = write_partition(spec, 2, [orjson.dumps(r) for r in rows])
        assert result.error == "" and result.rows == len(rows), result
        assert raw_writes == [400, 400, 200]  # PostgreSQL read the bytes itself, per chunk
        part = PartId(spec.pipeline, spec.txn, result.participant or "")
        for sink in sinks:
            sink.commit(part)
    finally:
        pg.write_raw = write_raw  # type: ignore[method-assign]
        _drop_executor_sinks(spec)
    with psycopg.connect(pg_dsn) as conn:
        got = conn.execute(f"SELECT id, name, qty, price FROM {table} ORDER BY id").fetchall()
    assert got == [(r["id"], r["name"], r["qty"], r["price"]) for r in rows]
    with pymongo.MongoClient(mongo_uri) as client:
        docs = {d["id"]: d for d in client[table]["orders"].find({}, {"_id": 0})}
        client.drop_database(table)
    assert len(docs) == len(rows)
    assert all({k: docs[r["id"]].get(k) for k in r} == r for r in rows)


@pytest.mark.parametrize("bad", [b"[1, 2]", b"{not json", b"17"], ids=["array", "broken", "number"])
def test_a_line_that_is_no_json_object_fails_the_task_and_leaves_nothing_prepared(
    pg_dsn: str, mongo_uri: str, table: str, bad: bytes
) -> None:
    rows = [orjson.dumps(r) for r in _rows(500)]
    rows[450] = bad  # in the second chunk: the first one was written already
    spec = _spec(pg_dsn, mongo_uri, table, txn=4)
    try:
        (result,) = write_partition(spec, 0, rows)
    finally:
        _drop_executor_sinks(spec)
    assert f"row {7 * OFFSET_STRIDE + 450}" in result.error, result
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
        prepared = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s", (f"%{spec.pipeline}%",)
        ).fetchall()
    assert prepared == []
