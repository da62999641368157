"""The record path end to end (#14, PROTOCOL.md "The record path"): real participant (and
coordinator) processes on the real stack, PostgreSQL, MongoDB and files.

* A record is all-or-nothing across sinks: one that any sink refuses -- by its own rules, found
  before any sink writes (``Sink.check``), or by the server at write time after earlier sinks
  stored it (retracted by a rewind) -- is in no sink and in the dead-letter topic, naming the
  sink; the records around it are in every sink exactly once.
* Which record is refused never depends on the order of a batch (the files sink's types).
* No value is changed silently: integers wider than 64 bits stay exact in every sink.

Every check reads Kafka, PostgreSQL, MongoDB and the files directly.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pyarrow.parquet as pq
import pytest
from bson import Decimal128
from confluent_kafka import Message, Producer
from pymongo import MongoClient

from harness import Cluster, Scenario, end_offsets, group_offsets, wait_until
from tests.e2e.e2e_support import dead_letters, scenario, start
from twophase.config import load_config
from twophase.kafka import create_topics

WIDE = 18446744073709551617  # 2**64 + 1: orjson alone decodes it as 1.8446744073709552e+19


def produce_values(s: Scenario, values: list[bytes]) -> dict[bytes, str]:
    """Produce every value (round-robin over the partitions); value -> ``topic:p:offset``."""
    where: dict[bytes, str] = {}

    def delivered(err: Any, msg: Message) -> None:
        assert err is None, err
        where[msg.value()] = f"{msg.topic()}:{msg.partition()}:{msg.offset()}"

    p = Producer({"bootstrap.servers": s.bootstrap, "enable.idempotence": True, "linger.ms": 20})
    for n, value in enumerate(values):
        p.produce(s.topic, value=value, partition=n % s.partitions, on_delivery=delivered)
        p.poll(0)
    assert p.flush(30) == 0
    return where


def pipeline(
    tmp_path: Path, prefix: str, order: list[str], partitions: int = 4, **extra: Any
) -> Scenario:
    """A pipeline whose sinks come in ``order``; PostgreSQL holds ``id``, ``v`` (jsonb) and a
    ``n`` with a CHECK the server alone enforces (the client cannot know it)."""
    s = scenario(tmp_path, prefix, interval_ms=400, create=False, partitions=partitions)
    sinks = {
        "pg": {"name": "pg", "type": "postgres", "dsn": s.pg_dsn, "table": s.table},
        "mongo": {
            "name": "mongo",
            "type": "mongodb",
            "uri": s.mongo_uri,
            "database": s.table,
            "collection": "orders",
        },
        "files": {"name": "files", "type": "files", "path": str(s.files_path)},
    }
    s.extra = {"sinks": [sinks[name] for name in order], **extra}
    s.mongo, s.files = "mongo" in order, "files" in order
    s.write()
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {s.table}")
        conn.execute(
            f"CREATE TABLE {s.table} (id bigint NOT NULL, v jsonb, n numeric CHECK (n >= -1e30))"
        )
    if s.mongo:
        MongoClient(s.mongo_uri).drop_database(s.table)
    create_topics(load_config(s.config_path))
    return s


def pg_rows(s: Scenario) -> dict[int, tuple[Any, Any]]:
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT id, v::text, n::text FROM {s.table}").fetchall()
    ids = [r[0] for r in rows]
    assert len(ids) == len(set(ids)), "a record twice in PostgreSQL"
    return {r[0]: (r[1], r[2]) for r in rows}


def mongo_docs(s: Scenario) -> dict[int, dict[str, Any]]:
    client: MongoClient[dict[str, Any]] = MongoClient(s.mongo_uri)
    try:
        docs = list(client[s.table]["orders"].find({}))
    finally:
        client.close()
    ids = [d["id"] for d in docs]
    assert len(ids) == len(set(ids)), "a record twice in MongoDB"
    return {d["id"]: d for d in docs}


def file_rows(s: Scenario) -> dict[int, dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    data = s.files_path / s.topic
    for path in sorted(data.rglob("*.parquet")) if data.exists() else []:
        rows.extend(pq.read_table(path).to_pylist())
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a record twice in the files"
    return {r["id"]: r for r in rows}


def run_until_done(s: Scenario, roles: list[str], ids: set[int], timeout_s: float = 120) -> None:
    """Run the pipeline until the source group's committed offsets reach the end and every sink
    holds exactly ``ids`` (nothing else), then stop it; every process must still be alive."""
    c = Cluster(s)
    for role in roles:
        start(c, role, f"{role[:5]}-0")

    def done() -> bool:
        ends = end_offsets(s.bootstrap, s.topic, s.partitions)
        if group_offsets(s.bootstrap, f"twophase.{s.name}", s.topic, s.partitions) != ends:
            return False
        held = [set(pg_rows(s))]
        if s.mongo:
            held.append(set(mongo_docs(s)))
        if s.files:
            held.append(set(file_rows(s)))
        return all(h == ids for h in held)

    try:
        wait_until(done, timeout_s, "every sink to hold exactly the good records")
        assert all(c.alive(name) for name in c.procs), "a process exited"
    except (AssertionError, TimeoutError):
        for name in c.procs:
            print(f"===== {name}\n{c.log_tail(name, 80)}")
        raise
    finally:
        c.stop_all()


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"d": value}
    return value


#: Refused by MongoDB or the files after PostgreSQL (first) had stored them, before #14.
REFUSED_LATER = {
    1000: ({"id": 1000, "a\u0000b": 1}, "mongo"),  # NUL in a field name
    1001: ({"id": 1001, "$where": "1"}, "mongo"),
    1002: ({"id": 1002, "a.b": 1}, "mongo"),
    1003: ({"id": 1003, "v": deep(150)}, "mongo"),  # 150-deep nesting
}


@pytest.mark.parametrize("order", [["pg", "mongo", "files"], ["mongo", "pg", "files"]])
def test_a_record_any_sink_refuses_reaches_no_sink(tmp_path: Path, order: list[str]) -> None:
    s = pipeline(tmp_path, f"allornone-{order[0]}", order)
    good = [{"id": i, "v": {"k": i}, "n": i} for i in range(300)]
    values = [orjson.dumps(v) for v in good[:150]]
    bad = {
        **REFUSED_LATER,
        # Only the server knows its CHECK constraint: refused at write time, by PostgreSQL,
        # after MongoDB stored it when MongoDB comes first -- retracted by a rewind.
        2000: ({"id": 2000, "n": -1e31}, "pg"),
        # jsonb cannot hold NUL: PostgreSQL's own rule, refused in its check.
        2001: ({"id": 2001, "v": {"s": "x\u0000y"}}, "pg"),
    }
    values += [orjson.dumps(v) for v, _sink in bad.values()]
    values += [orjson.dumps(v) for v in good[150:]]
    where = produce_values(s, values)
    run_until_done(s, ["coordinator", "participant"], {v["id"] for v in good})
    letters = {dl.key.decode(): dl for dl in dead_letters(s)}
    for value, sink in bad.values():
        raw = orjson.dumps(value)
        dl = letters.pop(where[raw])
        assert dl.value == raw
        assert dl.header("twophase.sink") == sink, (value, dl.headers)
        assert dl.header("twophase.reason").startswith(f"rejected by sink {sink}: ")
    assert not letters, letters


def test_at_least_once_retracts_a_write_time_refusal_too(tmp_path: Path) -> None:
    """MongoDB first, then PostgreSQL refusing at write time (its CHECK): the batch is
    re-read without the record, which ends in neither sink."""
    s = pipeline(
        tmp_path,
        "alo-retract",
        ["mongo", "pg"],
        participant={"mode": "at_least_once", "sweep_interval_ms": 15_000},
    )
    good = [{"id": i, "n": i} for i in range(200)]
    values = [orjson.dumps(v) for v in good[:100]]
    values += [orjson.dumps({"id": 5000, "n": -1e31})]
    values += [orjson.dumps(v) for v in good[100:]]
    where = produce_values(s, values)
    run_until_done(s, ["participant"], {v["id"] for v in good})
    [dl] = dead_letters(s)
    assert dl.key.decode() == where[orjson.dumps({"id": 5000, "n": -1e31})]
    assert dl.header("twophase.sink") == "pg"


def test_files_refuse_nothing_for_the_order_of_a_batch(tmp_path: Path) -> None:
    """The case of #14: ``"i": "12"`` first, then 30 integers. Before, the integers were
    dead-lettered by the files sink yet committed in PostgreSQL and MongoDB."""
    # One partition, so that one batch holds them in this order.
    s = pipeline(tmp_path, "order", ["pg", "mongo", "files"], partitions=1)
    values = [orjson.dumps({"id": 0, "i": "12"})]
    values += [orjson.dumps({"id": i, "i": i}) for i in range(1, 31)]
    values += [orjson.dumps({"id": 31, "i": "NaN"}), orjson.dumps({"id": 32, "i": 3.5})]
    where = produce_values(s, values)
    assert len(where) == len(values)
    run_until_done(s, ["coordinator", "participant"], set(range(33)))
    assert dead_letters(s) == []
    files = file_rows(s)
    assert files[0]["i"] == '"12"' and files[5]["i"] == "5" and files[31]["i"] == '"NaN"'
    docs = mongo_docs(s)
    assert docs[0]["i"] == "12" and docs[5]["i"] == 5 and docs[32]["i"] == 3.5


def test_integers_wider_than_64_bits_stay_exact_in_every_sink(tmp_path: Path) -> None:
    s = pipeline(tmp_path, "wide", ["pg", "mongo", "files"])
    values = [orjson.dumps({"id": i, "v": {"k": i}, "n": i}) for i in range(20)]
    values.append(
        b'{"id": 100, "n": 18446744073709551617, "w": 18446744073709551617,'
        b' "v": {"x": 18446744073709551617, "y": -9223372036854775809}}'
    )
    # 35 digits: no exact BSON form (Decimal128 holds 34), so MongoDB refuses it, and it is
    # nowhere -- never rounded to a double.
    too_wide = b'{"id": 101, "w": 12345678901234567890123456789012345}'
    values.append(too_wide)
    where = produce_values(s, values)
    run_until_done(s, ["coordinator", "participant"], {*range(20), 100})
    v, n = pg_rows(s)[100]
    assert n == str(WIDE)
    assert orjson.loads(v.replace(str(WIDE), '"W"').replace("-9223372036854775809", '"Y"')) == {
        "x": "W",
        "y": "Y",
    }
    doc = mongo_docs(s)[100]
    assert doc["w"] == Decimal128(str(WIDE)) and doc["v"]["x"] == Decimal128(str(WIDE))
    assert doc["n"] == Decimal128(str(WIDE))
    row = file_rows(s)[100]
    assert row["w"] == Decimal(WIDE)
    assert row["v"] == '{"x":18446744073709551617,"y":-9223372036854775809}'
    [dl] = dead_letters(s)
    assert dl.key.decode() == where[too_wide] and dl.header("twophase.sink") == "mongo"
    assert "34 digits" in dl.header("twophase.reason")


def test_compiled_postgres_path_keeps_wide_integers_exact(tmp_path: Path) -> None:
    """A PostgreSQL-only insert pipeline reads raw values with the compiled encoder (native/):
    a value it hands back is decoded by the runtime, which must keep it exact too."""
    s = pipeline(tmp_path, "native", ["pg"])
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        # Column types the compiled encoder models (jsonb is not one): raw values, no decoding.
        conn.execute(f"DROP TABLE {s.table}")
        conn.execute(f"CREATE TABLE {s.table} (id bigint NOT NULL, v text, n numeric)")
    values = [orjson.dumps({"id": i, "n": i, "v": str(i)}) for i in range(50)]
    values.append(b'{"id": 100, "n": 18446744073709551617, "v": 18446744073709551617}')
    values.append(b'{"id": 101, "n": -9223372036854775809, "v": -99999999999999999999}')
    produce_values(s, values)
    run_until_done(s, ["coordinator", "participant"], {*range(50), 100, 101})
    rows = pg_rows(s)
    assert rows[100] == (str(WIDE), str(WIDE))
    assert rows[101] == ("-99999999999999999999", "-9223372036854775809")
    assert dead_letters(s) == []
    startup = (s.workdir / "logs" / "parti-0.log").read_text()
    assert "every sink reads the JSON values itself" in startup, "not the compiled path"
