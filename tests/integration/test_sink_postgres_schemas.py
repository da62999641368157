"""``auto_create`` and ``auto_evolve`` of the PostgreSQL sink against the real server
(``docs/schema-changes.md``): tables made from record schemas, changes inside the part's
prepared transaction, and the lock order that keeps participants from waiting on each other.

Schemas are made the way ``value_format: connect_json`` makes them (the Kafka Connect envelope's
schema, through the decoder's own ``record_schema``); values are in the JSON value model the
decoder gives (decimals as exact strings, dates and times ISO-8601, bytes base64).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import pytest
from test_sink_postgres import PgEnv, _base_name, part, positions_of  # the sink tests' helpers

from twophase.participants.decoding.connect import record_schema
from twophase.participants.sdk import Held, PartId, Record, RecordSchema, Rejected, SinkContext
from twophase.participants.sinks.postgres import PostgresSink, _evolve
from twophase.participants.sinks.postgres._evolve import GATE_TABLE, LOCK_TIMEOUT_S

pytestmark = pytest.mark.stack

TOPIC = "orders"


def fld(field: str, kind: str, optional: bool = False, **kw: Any) -> dict[str, Any]:
    """A Connect schema field (``name=`` names a logical type)."""
    return {"field": field, "type": kind, "optional": optional, **kw}


def connect(*fields: dict[str, Any], key: tuple[str, ...] = ("id",)) -> RecordSchema:
    """The record schema connect_json gives a value with this Connect schema and a key with
    the fields ``key``."""
    got = record_schema({"type": "struct", "name": "orders.Value", "fields": list(fields)})
    assert got is not None
    return RecordSchema(got.fields, id=got.id, name=got.name, key=key)


V1 = connect(
    fld("id", "int64"), fld("qty", "int32"), fld("price", "float32"), fld("name", "string")
)
#: V1 evolved: qty int32 -> int64, price float32 -> float64, an optional field added, the
#: required name made optional.
V2 = connect(
    fld("id", "int64"),
    fld("qty", "int64"),
    fld("price", "float64"),
    fld("name", "string", True),
    fld("note", "string", True),
)


def rec(
    offset: int, value: dict[str, Any], schema: RecordSchema | None, partition: int = 0
) -> Record:
    return Record(TOPIC, partition, offset, 1_700_000_000_000, None, value, schema=schema)


def v1(i: int, offset: int | None = None) -> Record:
    return rec(
        i if offset is None else offset, {"id": i, "qty": i, "price": 0.5, "name": f"n{i}"}, V1
    )


def v2(i: int, offset: int | None = None) -> Record:
    value = {"id": i, "qty": 2**40 + i, "price": 0.1, "name": None, "note": f"note {i}"}
    return rec(i if offset is None else offset, value, V2)


MakeSink = Callable[..., PostgresSink]


@pytest.fixture
def genv(pg_dsn: str, unique_name: Any) -> Iterator[PgEnv]:
    """The sink tests' environment (names, reader, clean-up), and this test's schema change
    requests cleaned up."""
    env = PgEnv(pg_dsn, _base_name(unique_name))
    try:
        yield env
    finally:
        env.cleanup(keep_reader=True)  # rolls back what is prepared first: it may hold rows
        if env.rows("SELECT to_regclass(%s)", (GATE_TABLE,))[0][0] is not None:
            env.reader.execute(
                f"DELETE FROM {GATE_TABLE} WHERE pipeline = ANY(%s)", (sorted(env.pipelines),)
            )
        env.reader.close()


@pytest.fixture
def make_sink(genv: PgEnv) -> MakeSink:
    def make(
        table: str, *, participant: str = "w1", name: str | None = None, **options: Any
    ) -> PostgresSink:
        sink_name = name or f"s{genv.base}"[:40]
        raw = {"name": sink_name, "type": "postgres", "dsn": genv.dsn, "table": table, **options}
        context = SinkContext(
            pipeline=genv.pipeline,
            participant=participant,
            sink_name=sink_name,
            logger=logging.getLogger(f"test.{sink_name}.{participant}"),
        )
        sink = PostgresSink.from_mapping(raw, context)
        assert isinstance(sink, PostgresSink)
        genv.sinks.append(sink)
        sink.setup()
        return sink

    return make


def made(env: PgEnv, suffix: str) -> str:
    """A table name for auto_create, dropped after the test."""
    name = f"{env.base}_{suffix}"
    env.reader.execute(f'DROP TABLE IF EXISTS "{name}"')
    env.tables.append(name)
    return name


def columns(env: PgEnv, table: str) -> list[tuple[str, str, bool]]:
    """The table's committed columns, read from the catalog (no lock on the table)."""
    return [
        (str(n), str(t), bool(nn))
        for n, t, nn in env.rows(
            "SELECT attname, format_type(atttypid, atttypmod), attnotnull FROM pg_attribute"
            " WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped"
            " ORDER BY attnum",
            (f'"{table}"',),
        )
    ]


def requests(env: PgEnv) -> list[tuple[str, str]]:
    return [
        (str(t), str(p))
        for t, p in env.rows(
            f"SELECT target, participant FROM {GATE_TABLE} WHERE pipeline = ANY(%s)",
            (sorted(env.pipelines),),
        )
    ]


def write_part(
    sink: PostgresSink, pid: PartId, records: Sequence[Record], *, begin: bool = True
) -> tuple[list[Rejected], list[Held]]:
    """``open_targets`` then ``write`` of what it lets through, as the runtime does (a held
    record ends its partition's share of the batch)."""
    if begin:
        sink.begin(pid)
    answer = sink.open_targets(pid, records)
    rejected = [a for a in answer if isinstance(a, Rejected)]
    held = [a for a in answer if isinstance(a, Held)]
    stop: dict[int, int] = {}
    for h in held:
        stop[h.record.partition] = min(
            stop.get(h.record.partition, h.record.offset), h.record.offset
        )
    gone = {r.record.record_id for r in rejected}
    rest = [
        r
        for r in records
        if r.record_id not in gone and r.offset < stop.get(r.partition, r.offset + 1)
    ]
    rejected += list(sink.write(pid, rest))
    return rejected, held


def finish(sink: PostgresSink, pid: PartId, records: Sequence[Record], commit: bool = True) -> None:
    sink.prepare(pid, positions_of(list(records)) or {(TOPIC, 0): 0})
    if commit:
        sink.commit(pid)


# -- auto_create ----------------------------------------------------------------------------


EVERY_TYPE = connect(
    fld("id", "int64"),
    fld("flag", "boolean"),
    fld("small", "int16"),
    fld("qty", "int32"),
    fld("f32", "float32"),
    fld("f64", "float64"),
    fld(
        "amount",
        "bytes",
        name="org.apache.kafka.connect.data.Decimal",
        parameters={"scale": "2", "connect.decimal.precision": "12"},
    ),
    fld("name", "string"),
    fld("blob", "bytes", True),
    fld("day", "int32", name="org.apache.kafka.connect.data.Date"),
    fld("at_time", "int32", True, name="org.apache.kafka.connect.data.Time"),
    fld("at", "int64", name="org.apache.kafka.connect.data.Timestamp"),
    fld("tags", "array", True, items={"type": "int32"}),
    fld("attrs", "map", True, keys={"type": "string"}, values={"type": "string"}),
    fld("addr", "struct", True, fields=[fld("city", "string")]),
    fld("note", "string", True),
)

EVERY_VALUE = {
    "id": 1,
    "flag": True,
    "small": 7,
    "qty": 2_000_000_000,
    "f32": 1.5,
    "f64": 0.1,
    "amount": "12345.67",
    "name": "ada",
    "blob": "AAEC",
    "day": "2024-05-01",
    "at_time": "13:45:00.123000",
    "at": "2024-05-01T10:00:00.123Z",
    "tags": [1, 2],
    "attrs": {"a": "b"},
    "addr": {"city": "Paris"},
    "note": None,
}


def test_auto_create_makes_the_table_from_the_first_schema_with_its_key_as_primary_key(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    table = made(genv, "made")
    sink = make_sink(table, mode="upsert", auto_create=True)  # setup with the table missing
    pid = part(genv, 1)
    records = [rec(0, EVERY_VALUE, EVERY_TYPE), rec(1, {**EVERY_VALUE, "id": 2}, EVERY_TYPE)]
    rejected, held = write_part(sink, pid, records)
    assert (rejected, held) == ([], [])
    # Created outside the part: there at once, empty until the part commits.
    assert columns(genv, table) == [
        ("id", "bigint", True),
        ("flag", "boolean", True),
        ("small", "integer", True),
        ("qty", "integer", True),
        ("f32", "real", True),
        ("f64", "double precision", True),
        ("amount", "numeric(12,2)", True),
        ("name", "text", True),
        ("blob", "bytea", False),
        ("day", "date", True),
        ("at_time", "time without time zone", False),
        ("at", "timestamp with time zone", True),
        ("tags", "jsonb", False),
        ("attrs", "jsonb", False),
        ("addr", "jsonb", False),
        ("note", "text", False),
    ]
    primary = genv.rows(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid"
        " AND a.attnum = ANY (i.indkey) WHERE i.indrelid = to_regclass(%s) AND i.indisprimary",
        (f'"{table}"',),
    )
    assert primary == [("id",)]
    assert genv.rows(f'SELECT count(*) FROM "{table}"') == [(0,)]
    finish(sink, pid, records)
    row = genv.rows(f'SELECT * FROM "{table}" WHERE id = 1')[0]
    assert row[1:8] == (True, 7, 2_000_000_000, 1.5, 0.1, Decimal("12345.67"), "ada")
    assert bytes(row[8]) == b"\x00\x01\x02"
    assert str(row[9]) == "2024-05-01" and str(row[10]) == "13:45:00.123000"
    assert row[11].isoformat() == "2024-05-01T10:00:00.123000+00:00"
    assert row[12:] == ([1, 2], {"a": "b"}, {"city": "Paris"}, None)
    assert genv.rows(f'SELECT count(*) FROM "{table}"') == [(2,)]


def test_auto_create_per_table_of_a_template_and_no_key_in_insert_mode(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    """Each table a template names is created on its first record; an insert-mode table gets
    no primary key (it holds every record, repeats of a key too)."""
    a, b = made(genv, "log_a"), made(genv, "log_b")
    sink = make_sink(f"{genv.base}_log_${{value.kind}}", auto_create=True)
    schema = connect(fld("id", "int64"), fld("kind", "string"))
    records = [
        rec(0, {"id": 1, "kind": "a"}, schema),
        rec(1, {"id": 1, "kind": "a"}, schema),
        rec(2, {"id": 2, "kind": "b"}, schema),
    ]
    pid = part(genv, 1)
    assert write_part(sink, pid, records) == ([], [])
    finish(sink, pid, records)
    assert genv.rows(f'SELECT id FROM "{a}"') == [(1,), (1,)]
    assert genv.rows(f'SELECT id FROM "{b}"') == [(2,)]
    assert genv.rows(
        "SELECT count(*) FROM pg_index WHERE indrelid = ANY(ARRAY[to_regclass(%s), to_regclass(%s)])",
        (f'"{a}"', f'"{b}"'),
    ) == [(0,)]


def test_a_record_with_no_schema_to_create_its_table_from_is_rejected_with_the_reason(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    table = made(genv, "none")
    sink = make_sink(table, auto_create=True)
    pid = part(genv, 1)
    records = [rec(0, {"id": 1}, None)]
    rejected, held = write_part(sink, pid, records)
    assert held == []
    assert [r.reason for r in rejected] == [
        f"table {table} does not exist, and the record has no schema to create it from "
        "(auto_create)"
    ]
    # Upsert needs a key: a schema without one cannot make the table.
    keyed = make_sink(
        made(genv, "nokey"), mode="upsert", auto_create=True, name=f"k{genv.base}"[:40]
    )
    rejected, _ = write_part(
        keyed, part(genv, 1), [rec(0, {"id": 1}, connect(fld("id", "int64"), key=()))]
    )
    assert "needs a key" in rejected[0].reason
    sink.abort(pid)


def test_concurrent_creators_of_one_table_both_succeed(genv: PgEnv, make_sink: MakeSink) -> None:
    table = made(genv, "race")
    sinks = [make_sink(table, mode="upsert", auto_create=True, participant=f"w{i}") for i in (1, 2)]
    records = [[v1(1)], [v1(2, offset=0)]]
    with ThreadPoolExecutor(2) as pool:
        got = list(
            pool.map(lambda i: write_part(sinks[i], part(genv, 1, f"w{i + 1}"), records[i]), (0, 1))
        )
    assert got == [([], []), ([], [])]
    for i in (0, 1):
        finish(sinks[i], part(genv, 1, f"w{i + 1}"), records[i])
    assert genv.rows(f'SELECT id FROM "{table}" ORDER BY id') == [(1,), (2,)]


# -- auto_evolve: the change inside the part ---------------------------------------------------


def evolving(
    genv: PgEnv, make_sink: MakeSink, suffix: str = "ev", **options: Any
) -> tuple[str, PostgresSink]:
    """A table made from V1 (rows 1 and 2 committed) and an evolving upsert sink on it."""
    table = made(genv, suffix)
    sink = make_sink(table, mode="upsert", auto_create=True, auto_evolve=True, **options)
    pid = part(genv, 1, sink.context.participant)
    records = [v1(1), v1(2)]
    assert write_part(sink, pid, records) == ([], [])
    finish(sink, pid, records)
    return table, sink


V1_COLUMNS = [
    ("id", "bigint", True),
    ("qty", "integer", True),
    ("price", "real", True),
    ("name", "text", True),
]
V2_COLUMNS = [
    ("id", "bigint", True),
    ("qty", "bigint", True),
    ("price", "double precision", True),
    ("name", "text", False),
    ("note", "text", False),
]


def test_an_evolution_commits_with_the_first_rows_that_need_it(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    table, sink = evolving(genv, make_sink)
    pid = part(genv, 2)
    records = [v1(3, 0), v2(4, 1), v2(1, 2)]  # an old-schema record beside new ones
    assert write_part(sink, pid, records) == ([], [])
    # Inside the open part only: the committed catalog still has V1's columns.
    assert columns(genv, table) == V1_COLUMNS
    finish(sink, pid, records, commit=False)
    assert columns(genv, table) == V1_COLUMNS
    held = genv.rows(  # a prepared transaction's locks belong to no backend
        "SELECT mode FROM pg_locks WHERE relation = to_regclass(%s) AND pid IS NULL",
        (f'"{table}"',),
    )
    assert ("AccessExclusiveLock",) in held  # until the decision
    assert requests(genv) == [(f"public.{table}", "w1")]  # the gate opens with the commit
    sink.commit(pid)
    assert columns(genv, table) == V2_COLUMNS
    assert requests(genv) == []
    assert genv.rows(f'SELECT id, qty, price, name, note FROM "{table}" ORDER BY id') == [
        (1, 2**40 + 1, 0.1, None, "note 1"),
        (2, 2, 0.5, "n2", None),
        (3, 3, 0.5, "n3", None),
        (4, 2**40 + 4, 0.1, None, "note 4"),
    ]
    # The table as changed is what the sink works with from now on, with nothing more to do.
    pid3 = part(genv, 3)
    assert write_part(sink, pid3, [v2(5, 3), v1(6, 4)]) == ([], [])
    finish(sink, pid3, [v2(5, 3), v1(6, 4)])
    assert genv.rows(f'SELECT count(*) FROM "{table}"') == [(6,)]


@pytest.mark.parametrize("when", ["prepared", "open"])
def test_an_aborted_part_leaves_no_column_and_the_next_one_changes_the_table_again(
    genv: PgEnv, make_sink: MakeSink, when: str
) -> None:
    table, sink = evolving(genv, make_sink)
    pid = part(genv, 2)
    records = [v2(3, 0)]
    assert write_part(sink, pid, records) == ([], [])
    if when == "prepared":
        finish(sink, pid, records, commit=False)
    sink.abort(pid)
    assert columns(genv, table) == V1_COLUMNS
    assert requests(genv) == [(f"public.{table}", "w1")]  # still wanted: the owner tries again
    # The rewind reads the same records into the same part again; the sink knows the table
    # is back as it was, and changes it again.
    assert write_part(sink, pid, records) == ([], [])
    finish(sink, pid, records)
    assert columns(genv, table) == V2_COLUMNS
    assert genv.rows(f'SELECT qty, note FROM "{table}" WHERE id = 3') == [(2**40 + 3, "note 3")]


def test_incompatible_changes_are_rejected_with_the_reason_and_the_rest_goes_on(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    table, sink = evolving(genv, make_sink)
    dropped = connect(fld("id", "int64"), fld("qty", "int32"), fld("price", "float32"))
    retyped = connect(
        fld("id", "int64"), fld("qty", "string"), fld("price", "float32"), fld("name", "string")
    )
    records = [
        rec(0, {"id": 10, "qty": 1, "price": 1.0}, dropped),
        rec(1, {"id": 11, "qty": "many", "price": 1.0, "name": "x"}, retyped),
        rec(2, {"id": 12, "qty": 12}, None),
        v2(13, 3),
    ]
    pid = part(genv, 2)
    rejected, held = write_part(sink, pid, records)
    assert held == []
    assert [(r.record.offset, r.reason) for r in rejected] == [
        (
            0,
            f"table {table}: field 'name' is required by the target and missing from the "
            "record's schema",
        ),
        (
            1,
            f"table {table}: field 'qty': int32 -> string is not a widening (stored values "
            "would change)",
        ),
        (
            2,
            f"table {table}: the record has no schema, and auto_evolve compares every "
            "record's schema with its table (a source with schemas: value_format "
            "connect_json, a Debezium envelope)",
        ),
    ]
    finish(sink, pid, records)
    assert genv.rows(f'SELECT id FROM "{table}" ORDER BY id') == [(1,), (2,), (13,)]


def test_with_auto_evolve_off_any_change_is_rejected_and_the_table_stays(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    table = made(genv, "fixed")
    sink = make_sink(table, mode="upsert", auto_create=True)
    records = [v1(1, 0), v2(2, 1), v1(3, 2)]
    pid = part(genv, 1)
    rejected, held = write_part(sink, pid, records)
    assert held == []
    assert [(r.record.offset, r.reason) for r in rejected] == [
        (
            1,
            f"table {table}: the record's schema needs a change (column 'qty' from integer "
            "to bigint, column 'price' from real to double precision, column 'name' nullable, "
            "column 'note' added (text)), and auto_evolve is off",
        )
    ]
    finish(sink, pid, records)
    assert columns(genv, table) == V1_COLUMNS
    assert genv.rows(f'SELECT id FROM "{table}" ORDER BY id') == [(1,), (3,)]


def test_check_leaves_records_that_need_a_change_to_open_targets(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    """As a later sink, check() judges only by the table as it is: a record whose value fits
    only the changed table (2**40 in an integer column) is not refused before the change."""
    _, sink = evolving(genv, make_sink)
    assert sink.check([v2(3)]) == []
    bad = rec(0, {"id": 4, "qty": "x", "price": 1.0, "name": "n"}, V1)
    assert [r.record.offset for r in sink.check([bad])] == [0]


def test_the_schema_is_judged_once_per_table_and_schema(
    genv: PgEnv, make_sink: MakeSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, sink = evolving(genv, make_sink)
    calls: list[int] = []
    real = _evolve.plan

    def counting(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(_evolve, "plan", counting)
    pid = part(genv, 2)
    sink.begin(pid)
    for batch in range(3):
        records = [v1(i, i) for i in range(batch * 100, batch * 100 + 100)]
        assert write_part(sink, pid, records, begin=False) == ([], [])
    assert len(calls) == 0  # V1 was judged when the table was made, and kept
    records = [v2(i, 300 + i) for i in range(100)]
    assert write_part(sink, pid, records, begin=False) == ([], [])
    assert len(calls) == 2  # judged, then folded into the change; the reload judged nothing
    assert write_part(sink, pid, [v2(500, 500)], begin=False) == ([], [])
    assert len(calls) == 3  # the changed table: judged again, once
    sink.abort(pid)


# -- auto_evolve: several participants, one table -------------------------------------------


def test_two_participants_change_one_table_in_one_cycle_without_waiting_on_each_other(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    """Both get newer records in the same cycle; w2 has written the table in its open part
    already. w1 claims the change; its ACCESS EXCLUSIVE cannot be had within the lock timeout
    (w2's open part holds ROW EXCLUSIVE), so it holds its records; w2 finds w1's claim and holds
    its newer ones. Next cycle w2 keeps off the table (it reads the claim once per part), and w1
    gets the table once w2's prepared part is decided. Nobody ever waits on an open part for
    longer than the lock timeout, and every record lands exactly once."""
    table, w1 = evolving(genv, make_sink)
    w2 = make_sink(table, mode="upsert", auto_create=True, auto_evolve=True, participant="w2")
    # cycle 1
    p1, p2 = part(genv, 2, "w1"), part(genv, 2, "w2")
    w1.begin(p1)
    w2.begin(p2)
    assert write_part(w2, p2, [v1(20, 0)], begin=False) == ([], [])  # ROW EXCLUSIVE
    started = time.monotonic()
    _, held1 = write_part(w1, p1, [v2(10, 0)], begin=False)
    waited = time.monotonic() - started
    assert [h.record.offset for h in held1] == [0]
    assert "no ACCESS EXCLUSIVE lock" in held1[0].reason
    assert LOCK_TIMEOUT_S - 0.2 < waited < LOCK_TIMEOUT_S + 1.0
    started = time.monotonic()
    _, held2 = write_part(w2, p2, [v2(21, 1)], begin=False)
    assert time.monotonic() - started < 1.0  # the claim says who: no lock wait
    assert "is being changed by participant w1" in held2[0].reason
    assert requests(genv) == [(f"public.{table}", "w1")]
    finish(w1, p1, [])
    finish(w2, p2, [v1(20, 0)])
    # cycle 2: w2 keeps off the table, w1 changes it
    p1, p2 = part(genv, 3, "w1"), part(genv, 3, "w2")
    w1.begin(p1)
    w2.begin(p2)
    started = time.monotonic()
    _, held2 = write_part(w2, p2, [v2(21, 1), v1(22, 2)], begin=False)
    assert time.monotonic() - started < 1.0
    assert [h.record.offset for h in held2] == [1, 2]
    assert "is being changed by participant w1" in held2[0].reason
    started = time.monotonic()
    assert write_part(w1, p1, [v2(10, 0)], begin=False) == ([], [])
    assert time.monotonic() - started < 1.0  # w2's cycle-1 part is decided: nothing to wait for
    finish(w1, p1, [v2(10, 0)])
    finish(w2, p2, [])
    # cycle 3: the gate is open; w2 reloads the table and writes its newer records
    p2 = part(genv, 4, "w2")
    assert write_part(w2, p2, [v2(21, 1), v1(22, 2)]) == ([], [])
    finish(w2, p2, [v2(21, 1), v1(22, 2)])
    assert columns(genv, table) == V2_COLUMNS
    assert genv.rows(f'SELECT id, qty FROM "{table}" ORDER BY id') == [
        (1, 1), (2, 2), (10, 2**40 + 10), (20, 20), (21, 2**40 + 21), (22, 22)
    ]  # fmt: skip
    assert requests(genv) == []


def test_the_owner_waits_for_a_prepared_writer_within_the_timeout(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    """A lock a prepared part holds goes with its decision: the owner's ACCESS EXCLUSIVE waits
    for it (within the lock timeout) instead of holding its records for a cycle."""
    table, w1 = evolving(genv, make_sink)
    w2 = make_sink(table, mode="upsert", auto_create=True, auto_evolve=True, participant="w2")
    p2 = part(genv, 2, "w2")
    assert write_part(w2, p2, [v1(20, 0)]) == ([], [])
    finish(w2, p2, [v1(20, 0)], commit=False)  # prepared: holds ROW EXCLUSIVE
    decide = threading.Timer(0.5, lambda: w2.commit(p2))
    decide.start()
    p1 = part(genv, 3, "w1")
    started = time.monotonic()
    assert write_part(w1, p1, [v2(10, 0)]) == ([], [])
    waited = time.monotonic() - started
    decide.join()
    assert 0.4 < waited < LOCK_TIMEOUT_S
    finish(w1, p1, [v2(10, 0)])
    assert columns(genv, table) == V2_COLUMNS


def test_a_writer_reloads_a_table_another_participant_changed(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    table, w1 = evolving(genv, make_sink)
    w2 = make_sink(table, mode="upsert", auto_create=True, auto_evolve=True, participant="w2")
    assert w2.check([v2(1)]) == []  # it knows the table as made: V2 needs a change
    p1 = part(genv, 2, "w1")
    assert write_part(w1, p1, [v2(10, 0)]) == ([], [])
    finish(w1, p1, [v2(10, 0)])
    # w2's first part after the change: the lock, the catalog read, the reload -- no change.
    p2 = part(genv, 2, "w2")
    assert write_part(w2, p2, [v2(11, 0)]) == ([], [])
    finish(w2, p2, [v2(11, 0)])
    assert genv.rows(f'SELECT note FROM "{table}" WHERE id = 11') == [("note 11",)]


def test_a_stale_request_is_taken_over_and_a_fresh_one_is_respected(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    table, sink = evolving(genv, make_sink)
    genv.reader.execute(
        f"INSERT INTO {GATE_TABLE} (target, pipeline, participant, sink, since)"
        " VALUES (%s, %s, 'gone', 'pg', now() - interval '1 hour')",
        (f"public.{table}", genv.pipeline),
    )
    pid = part(genv, 2)
    assert write_part(sink, pid, [v2(3, 0)]) == ([], [])  # a dead owner's request: taken over
    finish(sink, pid, [v2(3, 0)])
    assert requests(genv) == []
    genv.reader.execute(
        f"INSERT INTO {GATE_TABLE} (target, pipeline, participant, sink)"
        " VALUES (%s, %s, 'alive', 'pg')",
        (f"public.{table}", genv.pipeline),
    )
    pid = part(genv, 3)
    _, held = write_part(sink, pid, [v1(4, 0)])
    assert "is being changed by participant alive" in held[0].reason
    sink.abort(pid)


def test_a_table_the_sink_cannot_use_rejects_its_records_with_the_reason(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    """An existing table that does not suit the configuration (upsert without a key) is no
    error of open_targets: write() rejects its records, saying why."""
    table = genv.table("nokey", "id bigint, qty integer")
    sink = make_sink(f"{genv.base}_${{value.kind}}", mode="upsert", auto_evolve=True)
    record = rec(0, {"id": 1, "qty": 1, "kind": "nokey"}, V1)
    rejected, held = write_part(sink, part(genv, 1), [record])
    assert held == []
    assert len(rejected) == 1
    assert rejected[0].reason.endswith(
        f"key: table {table} has no primary key; name the key columns"
    )
    sink.abort(part(genv, 1))


def test_a_table_changed_by_someone_else_into_one_the_sink_cannot_use_stops_nothing(
    genv: PgEnv, make_sink: MakeSink
) -> None:
    table, sink = evolving(genv, make_sink)
    genv.reader.execute(f'DROP TABLE "{table}"')  # made again, without its key
    genv.reader.execute(f'CREATE TABLE "{table}" (id bigint, qty integer, price real, name text)')
    pid = part(genv, 2)
    rejected, held = write_part(sink, pid, [v1(3, 0)])
    assert held == [] and len(rejected) == 1
    assert rejected[0].reason.endswith(
        f"key: table {table} has no primary key; name the key columns"
    )
    sink.abort(pid)
