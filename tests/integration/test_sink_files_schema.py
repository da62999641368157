"""The files sink typed by records' schemas (#18), on the real file system.

Every value is read back with pyarrow and compared exactly; every dataset schema is read from
``_common_metadata`` as a reader would. ``docs/types.md``, "From a record's schema", is the
table these tests hold the sink to.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from datetime import UTC, date, datetime, time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from twophase.participants.sdk import (
    AbortTransactionError,
    Field,
    FieldType,
    Held,
    PartId,
    Record,
    RecordSchema,
    Rejected,
    SinkContext,
)
from twophase.participants.sinks.files import FileSink, read_dataset

REPO = Path(__file__).resolve().parents[2]
PIPELINE = "typed"
T0 = 1_700_000_000_000  # 2023-11-14
F = FieldType


def make_sink(base: Path, participant: str = "p0", **config: Any) -> FileSink:
    context = SinkContext(PIPELINE, participant, "files", logging.getLogger("test.files"))
    sink = FileSink.from_mapping(
        {"name": "files", "type": "files", "path": str(base), **config}, context
    )
    assert isinstance(sink, FileSink)
    sink.setup()
    return sink


def schema(*fields: Field, sid: str = "", key: tuple[str, ...] = ()) -> RecordSchema:
    return RecordSchema(tuple(fields), id=sid, name="orders", key=key)


def rec(
    offset: int, value: dict[str, Any], sch: RecordSchema | None, topic: str = "orders"
) -> Record:
    return Record(topic, 0, offset, T0, None, value, schema=sch)


def run_part(
    sink: FileSink, txn: int, records: list[Record], *, commit: bool = True
) -> list[Rejected | Held]:
    """One part through the runtime's steps: open_targets, write what it took, prepare."""
    p = PartId(PIPELINE, txn, sink.context.participant)
    sink.begin(p)
    answers = list(sink.open_targets(p, records))
    gone = {a.record.record_id for a in answers}
    refused = list(sink.write(p, [r for r in records if r.record_id not in gone]))
    sink.prepare(p, {("orders", 0): max(r.offset for r in records) + 1})
    if commit:
        sink.commit(p)
    return answers + refused


def data_files(base: Path, topic: str = "orders") -> list[Path]:
    return sorted((base / topic).rglob("*.parquet"))


def rows(base: Path, topic: str = "orders") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in data_files(base, topic):
        out.extend(pq.read_table(path).to_pylist())
    return sorted(out, key=lambda r: r["id"])


def dataset_schema(base: Path, topic: str = "orders") -> pa.Schema:
    return pq.read_schema(base / topic / "_common_metadata")


def twophase_schema(base: Path, topic: str = "orders") -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(dataset_schema(base, topic).metadata[b"twophase.schema"])
    return loaded


def manifests(base: Path) -> dict[str, dict[str, Any]]:
    directory = base / "_twophase" / PIPELINE / "manifests"
    return {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def reasons(answers: list[Rejected | Held]) -> dict[int, str]:
    return {a.record.offset: a.reason for a in answers}


# -- every kind, exactly --------------------------------------------------------------------------

EVERY_KIND = schema(
    Field("id", F("int64")),
    Field("flag", F("boolean", True)),
    Field("small", F("int32", True)),
    Field("big", F("int64", True)),
    Field("f32", F("float32", True)),
    Field("f64", F("float64", True)),
    Field("money", F("decimal", True, precision=10, scale=2)),
    Field("d38", F("decimal", True, precision=38, scale=0)),
    Field("d40", F("decimal", True, precision=40, scale=2)),  # wider than decimal128: text
    Field("hundreds", F("decimal", True, precision=5, scale=-2)),  # negative scale
    Field("tiny", F("decimal", True, precision=2, scale=4)),  # scale over precision
    Field("scaled", F("decimal", True, scale=3)),  # Connect Decimal without a precision
    Field("numeric", F("decimal", True)),  # Debezium VariableScaleDecimal
    Field("text", F("string", True)),
    Field("blob", F("bytes", True)),
    Field("uid", F("uuid", True)),
    Field("state", F("enum", True, symbols=("NEW", "PAID"))),
    Field("day", F("date", True)),
    Field("at_ms", F("time", True, unit="ms")),
    Field("at_us", F("time", True, unit="us")),
    Field("ts_ms", F("timestamp", True, unit="ms")),
    Field("ts_us", F("timestamp", True, unit="us")),
    Field("wall", F("timestamp_local", True, unit="us")),
    Field("tags", F("array", True, items=F("string", True))),
    Field("prices", F("map", True, values=F("decimal", True, precision=6, scale=2))),
    Field(
        "address",
        F(
            "record",
            True,
            fields=(
                Field("street", F("string")),
                Field("zip", F("int32", True)),
                Field("geo", F("record", True, fields=(Field("lat", F("float64")),))),
                Field(
                    "lines", F("array", True, items=F("record", fields=(Field("n", F("int32")),)))
                ),
            ),
        ),
    ),
    Field("empty", F("record", True)),  # no fields: Parquet has no empty group
    Field("doc", F("json", True)),
    sid="every",
)

EVERY_VALUE: dict[str, Any] = {
    "id": 1,
    "flag": True,
    "small": -(2**31),
    "big": 2**63 - 1,
    "f32": 0.1,
    "f64": 0.1,
    "money": "12345678.90",
    "d38": "9" * 38,
    "d40": "-" + "9" * 38 + ".99",
    "hundreds": "1.2E+5",
    "tiny": "0.0012",
    "scaled": "-1.5",
    "numeric": "0.33333333333333333333333333333333333333333",
    "text": "héllo\u2028",
    "blob": "AAH/",
    "uid": "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
    "state": "PAID",
    "day": "2024-02-29",
    "at_ms": "13:45:00.123000",
    "at_us": "23:59:59.999999",
    "ts_ms": "2024-05-01T13:45:00.123Z",
    "ts_us": "2024-05-01T15:45:00.654321+02:00",
    "wall": "0001-01-01T00:00:00.000001",
    "tags": ["a", None, ""],
    "prices": {"small": "1.5", "none": None},
    "address": {
        "street": "Main",
        "zip": None,
        "geo": {"lat": 48.85},
        "lines": [{"n": 1}, {"n": 2}],
    },
    "empty": {},
    "doc": {"any": [1, "two", 18446744073709551617, None]},
}

#: What pyarrow reads back for EVERY_VALUE, value for value.
EVERY_READ: dict[str, Any] = {
    "id": 1,
    "flag": True,
    "small": -(2**31),
    "big": 2**63 - 1,
    "f32": pytest.approx(0.1, rel=1e-7),  # the float32 that prints 0.1 (checked below)
    "f64": 0.1,
    "money": Decimal("12345678.90"),
    "d38": Decimal("9" * 38),
    "d40": "-" + "9" * 38 + ".99",
    "hundreds": Decimal("120000"),
    "tiny": Decimal("0.0012"),
    "scaled": Decimal("-1.500"),
    "numeric": "0.33333333333333333333333333333333333333333",
    "text": "héllo\u2028",
    "blob": b"\x00\x01\xff",
    "uid": "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
    "state": "PAID",
    "day": date(2024, 2, 29),
    "at_ms": time(13, 45, 0, 123000),
    "at_us": time(23, 59, 59, 999999),
    "ts_ms": datetime(2024, 5, 1, 13, 45, 0, 123000, tzinfo=UTC),
    "ts_us": datetime(2024, 5, 1, 13, 45, 0, 654321, tzinfo=UTC),
    "wall": datetime(1, 1, 1, 0, 0, 0, 1),
    "tags": ["a", None, ""],
    "prices": [("small", Decimal("1.50")), ("none", None)],
    "address": {
        "street": "Main",
        "zip": None,
        "geo": {"lat": 48.85},
        "lines": [{"n": 1}, {"n": 2}],
    },
    "empty": "{}",
    "doc": '{"any":[1,"two",18446744073709551617,null]}',
}

EVERY_TYPE: dict[str, pa.DataType] = {
    "id": pa.int64(),
    "flag": pa.bool_(),
    "small": pa.int32(),
    "big": pa.int64(),
    "f32": pa.float32(),
    "f64": pa.float64(),
    "money": pa.decimal128(10, 2),
    "d38": pa.decimal128(38, 0),
    "d40": pa.string(),
    "hundreds": pa.decimal128(7, 0),
    "tiny": pa.decimal128(4, 4),
    "scaled": pa.decimal128(38, 3),
    "numeric": pa.string(),
    "text": pa.string(),
    "blob": pa.binary(),
    "uid": pa.string(),
    "state": pa.string(),
    "day": pa.date32(),
    "at_ms": pa.time64("us"),
    "at_us": pa.time64("us"),
    "ts_ms": pa.timestamp("us", tz="UTC"),
    "ts_us": pa.timestamp("us", tz="UTC"),
    "wall": pa.timestamp("us"),
    "tags": pa.list_(pa.string()),
    "prices": pa.map_(pa.string(), pa.decimal128(6, 2)),
    "address": pa.struct(
        [
            ("street", pa.string()),
            ("zip", pa.int32()),
            ("geo", pa.struct([("lat", pa.float64())])),
            ("lines", pa.list_(pa.struct([("n", pa.int32())]))),
        ]
    ),
    "empty": pa.string(),
    "doc": pa.string(),
}


def test_every_kind_is_stored_by_its_schema_and_reads_back_exactly(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base)
    nulls = {name: None for name in EVERY_VALUE} | {"id": 2}
    assert run_part(sink, 1, [rec(0, EVERY_VALUE, EVERY_KIND), rec(1, nulls, EVERY_KIND)]) == []

    [path] = data_files(base)
    stored = pq.read_schema(path)
    assert {f.name: f.type for f in stored} == EVERY_TYPE  # the declared types, never inferred
    assert all(f.nullable for f in stored)
    got = rows(base)
    assert got[0] == EVERY_READ
    assert got[1] == {name: None for name in EVERY_VALUE} | {"id": 2}
    # float32: the value stored is the float32 that prints as the value sent.
    f32 = pq.read_table(path).column("f32")[0].as_py()
    assert f"{f32:.8g}".rstrip("0") == "0.1"
    # The file and the dataset carry the twophase schema (what Arrow cannot tell apart).
    meta = json.loads(stored.metadata[b"twophase.schema"])
    assert [f["name"] for f in meta["fields"]] == list(EVERY_VALUE)
    assert {f["name"]: f["type"]["kind"] for f in meta["fields"]}["uid"] == "uuid"
    assert dataset_schema(base).remove_metadata() == stored.remove_metadata()


def test_check_and_write_refuse_the_same_values_naming_the_field(tmp_path: Path) -> None:
    sch = EVERY_KIND
    bad = {
        10: ("small", 2**31, "out of range for int32"),
        11: ("f32", 0.123456789, "not a float32 value"),
        12: ("money", "1.234", "more than 2 digits after the point"),
        13: ("money", "123456789.00", "more than 10 digits"),
        14: ("d38", "1" + "0" * 38, "more than 38 digits"),
        15: ("hundreds", "1250", "not a multiple of 1E+2"),
        16: ("numeric", "NaN", "expected a decimal number"),
        17: ("blob", "AAH", "expected base64"),
        18: ("uid", "not-a-uuid", "expected a UUID"),
        19: ("ts_us", "2024-05-01T13:45:00.1234567Z", "digits below the microsecond"),
        20: ("wall", "2024-05-01T13:45:00Z", "has an offset"),
        21: ("day", "2023-02-29", "expected an ISO-8601 date"),
        22: ("at_us", "25:00:00", "expected an ISO-8601 time"),
        23: ("text", 12, "expected a string"),
        24: ("tags", ["a", 1], "expected a string"),
        25: ("address", {"street": "x", "geo": {"lat": "north"}}, "expected a number"),
        26: ("address", {"street": "x", "other": 1}, "not a field of the record's schema"),
    }
    where = {
        24: "tags[1]",
        25: "address.geo.lat",
        26: "address.other",
    }
    records = [rec(o, {"id": o, name: v}, sch) for o, (name, v, _) in bad.items()]
    records.append(rec(99, {"id": 99, "ts_us": "2024-05-01T13:45:00.123456000Z"}, sch))  # zeros
    base = tmp_path / "out"
    sink = make_sink(base)
    checked = {r.record.offset: r for r in sink.check(records)}
    written = {r.record.offset: r for r in run_part(sink, 1, records)}
    assert set(checked) == set(written) == set(bad)
    for offset, (name, _value, reason) in bad.items():
        field = where.get(offset, name)
        assert checked[offset].reason == written[offset].reason
        assert checked[offset].reason.startswith(f"field {field!r}: "), checked[offset].reason
        assert reason in checked[offset].reason, checked[offset].reason
        assert checked[offset].extra == {"field": field}
    assert [r["id"] for r in rows(base)] == [99]
    assert rows(base)[0]["ts_us"] == datetime(2024, 5, 1, 13, 45, 0, 123456, tzinfo=UTC)


def test_decimals_at_the_edges(tmp_path: Path) -> None:
    sch = schema(
        Field("id", F("int64")),
        Field("p38", F("decimal", True, precision=38, scale=10)),
        Field("p39", F("decimal", True, precision=39, scale=0)),
        Field("neg", F("decimal", True, precision=36, scale=-2)),
        Field("var", F("decimal", True)),
    )
    values = [
        {"id": 0, "p38": "9999999999999999999999999999.9999999999", "p39": "9" * 39},
        {"id": 1, "p38": "-0.0000000001", "p39": "-" + "9" * 39, "neg": "9" * 36 + "00"},
        {"id": 2, "p38": 12, "neg": 100, "var": "1E-40"},  # integers exactly
        {"id": 3, "p38": 0.1, "var": "-123456789012345678901234567890123456789.5"},
    ]
    base = tmp_path / "out"
    assert run_part(make_sink(base), 1, [rec(i, v, sch) for i, v in enumerate(values)]) == []
    types = {f.name: f.type for f in dataset_schema(base)}
    assert types["p38"] == pa.decimal128(38, 10)
    assert types["p39"] == pa.string() and types["var"] == pa.string()
    assert types["neg"] == pa.decimal128(38, 0)  # 36 digits and 2 zeros
    got = rows(base)
    assert got[0]["p38"] == Decimal("9999999999999999999999999999.9999999999")
    assert got[0]["p39"] == "9" * 39  # the exact text
    assert got[1]["p38"] == Decimal("-0.0000000001")
    assert got[1]["neg"] == Decimal("9" * 36 + "00")
    assert got[2]["p38"] == Decimal("12.0000000000") and got[2]["neg"] == Decimal(100)
    assert got[2]["var"] == "1E-40"
    assert got[3]["p38"] == Decimal("0.1000000000")
    assert got[3]["var"] == "-123456789012345678901234567890123456789.5"


def test_timestamps_keep_their_microseconds(tmp_path: Path) -> None:
    sch = schema(
        Field("id", F("int64")),
        Field("ts", F("timestamp", True, unit="us")),
        Field("wall", F("timestamp_local", True, unit="us")),
        Field("t", F("time", True, unit="us")),
    )
    micro = [
        ("2024-05-01T13:45:00.000001Z", "2024-05-01T13:45:00.000001", "00:00:00.000001"),
        ("2024-05-01T13:45:00.999999Z", "9999-12-31T23:59:59.999999", "23:59:59.999999"),
        ("1969-12-31T23:59:59.999999Z", "1969-12-31T23:59:59.999999", "12:00:00.5"),
        ("2024-05-01T13:45:00.123456789Z", None, None),  # nanoseconds: refused
    ]
    records = [
        rec(i, {"id": i, "ts": a, "wall": b, "t": c}, sch) for i, (a, b, c) in enumerate(micro)
    ]
    base = tmp_path / "out"
    answers = run_part(make_sink(base), 1, records)
    assert reasons(answers) == {
        3: "field 'ts': timestamp '2024-05-01T13:45:00.123456789Z' has digits below the microsecond"
    }
    got = rows(base)
    assert [r["ts"] for r in got] == [
        datetime(2024, 5, 1, 13, 45, 0, 1, tzinfo=UTC),
        datetime(2024, 5, 1, 13, 45, 0, 999999, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ]
    assert [r["wall"] for r in got] == [
        datetime(2024, 5, 1, 13, 45, 0, 1),
        datetime(9999, 12, 31, 23, 59, 59, 999999),
        datetime(1969, 12, 31, 23, 59, 59, 999999),
    ]
    assert [r["t"] for r in got] == [
        time(0, 0, 0, 1),
        time(23, 59, 59, 999999),
        time(12, 0, 0, 500000),
    ]


def test_fields_the_schema_does_not_name_are_typed_by_their_json_value(tmp_path: Path) -> None:
    """The record key's fields, Debezium's add_fields, kafka_fields: what the decoder adds."""
    sch = schema(Field("id", F("int64")), Field("name", F("string", True)), sid="v1")
    base = tmp_path / "out"
    sink = make_sink(base, source_columns=True, op_column="_op", auto_evolve=True)
    records = [
        rec(0, {"id": 1, "name": "a", "__table": "orders", "__lsn": 5, "__w": 1.5}, sch),
        rec(1, {"id": 2, "name": "b", "__table": "orders", "__lsn": None, "__big": 2**70}, sch),
        rec(2, {"id": 3, "__lsn": "five"}, sch),  # a string where an int64 was: refused
    ]
    answers = run_part(sink, 1, records[:2])
    assert answers == []
    types = {f.name: f.type for f in dataset_schema(base)}
    assert types == {
        "id": pa.int64(),
        "name": pa.string(),
        "__table": pa.string(),
        "__lsn": pa.int64(),
        "__w": pa.float64(),
        "_op": pa.string(),
        "_topic": pa.string(),
        "_partition": pa.int32(),
        "_offset": pa.int64(),
        "_timestamp_ms": pa.int64(),
        "__big": pa.string(),  # wider than int64: its JSON text
    }
    got = {r["id"]: r for r in read_dataset(base / "orders").to_table().to_pylist()}
    assert got[1]["__lsn"] == 5 and got[2]["__lsn"] is None and got[2]["__big"] == str(2**70)
    assert got[1]["_op"] == "u" and got[1]["_offset"] == 0 and got[2]["_timestamp_ms"] == T0
    answers = run_part(sink, 2, records[2:])
    [refused] = answers
    assert isinstance(refused, Rejected)
    assert refused.reason == (
        "dataset 'orders': schema change refused: field '__lsn': int64? -> string? is not a "
        "widening (stored values would change)"
    )


# -- evolution ---------------------------------------------------------------------------------

V1 = schema(Field("id", F("int32")), Field("name", F("string")), sid="v1")
V2 = schema(  # id widened, a field added (required by v2: older rows have none), name optional
    Field("id", F("int64")),
    Field("name", F("string", True)),
    Field("price", F("decimal", precision=10, scale=2)),
    sid="v2",
)
V3 = schema(  # the nested record grows
    Field("id", F("int64")),
    Field("name", F("string", True)),
    Field("price", F("decimal", True, precision=12, scale=2)),
    Field("secret", F("string", True)),
    sid="v3",
)


def test_an_evolution_across_parts_commits_with_its_part_and_an_aborted_one_leaves_no_trace(
    tmp_path: Path,
) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, auto_evolve=True)
    assert run_part(sink, 1, [rec(0, {"id": 1, "name": "one"}, V1)]) == []
    assert twophase_schema(base)["fields"] == [
        {"name": "id", "type": {"kind": "int32"}},
        {"name": "name", "type": {"kind": "string"}},
    ]
    [first] = manifests(base).values()
    assert "schemas" not in first or first["schemas"]["orders"]["fields"][0]["name"] == "id"

    # Part 2 changes the schema: nothing shows before its commit.
    p2 = PartId(PIPELINE, 2, "p0")
    sink.begin(p2)
    records = [
        rec(1, {"id": 2**40, "name": None, "price": "9.99"}, V2),
        rec(2, {"id": 3, "name": "old"}, V1),
    ]
    assert sink.open_targets(p2, records) == []
    assert sink.write(p2, records) == []
    sink.prepare(p2, {("orders", 0): 3})
    assert [f.name for f in dataset_schema(base)] == ["id", "name"]  # prepared: not yet
    sink.commit(p2)
    assert {f.name: f.type for f in dataset_schema(base)} == {
        "id": pa.int64(),
        "name": pa.string(),
        "price": pa.decimal128(10, 2),
    }
    v2 = manifests(base)["000000000002-p0.json"]
    assert [f["name"] for f in v2["schemas"]["orders"]["fields"]] == ["id", "name", "price"]

    # Part 3 changes it again and is aborted: no trace anywhere.
    p3 = PartId(PIPELINE, 3, "p0")
    sink.begin(p3)
    r3 = [rec(3, {"id": 4, "secret": "s"}, V3)]
    assert sink.open_targets(p3, r3) == []
    assert sink.write(p3, r3) == []
    sink.prepare(p3, {("orders", 0): 4})
    sink.abort(p3)
    assert "secret" not in dataset_schema(base).names
    assert "secret" not in json.dumps(manifests(base))
    assert not list((base / "_twophase").rglob("SCHEMAS.json"))
    assert [r["id"] for r in rows(base)] == [1, 3, 2**40]

    # An old producer's records still go in; the next change is made from what committed.
    assert run_part(sink, 4, [rec(4, {"id": 5, "name": "v1 again"}, V1)]) == []
    assert run_part(sink, 5, [rec(5, {"id": 6, "price": "1234567890.12"}, V3)]) == []
    assert {f.name: f.type for f in dataset_schema(base)} == {
        "id": pa.int64(),
        "name": pa.string(),
        "price": pa.decimal128(12, 2),
        "secret": pa.string(),
    }
    # Each file keeps the schema it was written with; the dataset reads as one table.
    stored = [pq.read_schema(p).field("id").type for p in data_files(base)]
    assert sorted(map(str, stored)) == ["int32", "int64", "int64", "int64"]
    table = read_dataset(base / "orders").to_table()
    assert table.schema.field("id").type == pa.int64()
    assert table.schema.field("price").type == pa.decimal128(12, 2)
    assert sorted(table.to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "name": "one", "price": None, "secret": None, "date": "2023-11-14"},
        {"id": 3, "name": "old", "price": None, "secret": None, "date": "2023-11-14"},
        {"id": 5, "name": "v1 again", "price": None, "secret": None, "date": "2023-11-14"},
        {
            "id": 6,
            "name": None,
            "price": Decimal("1234567890.12"),
            "secret": None,
            "date": "2023-11-14",
        },
        {"id": 2**40, "name": None, "price": Decimal("9.99"), "secret": None, "date": "2023-11-14"},
    ]
    # ... and with pyarrow alone, from _common_metadata.
    plain = ds.dataset(
        base / "orders",
        format="parquet",
        schema=pq.read_schema(base / "orders" / "_common_metadata"),
    )
    assert plain.to_table().num_rows == 5


def test_an_incompatible_change_is_refused_with_compares_reason(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, auto_evolve=True)
    assert run_part(sink, 1, [rec(0, {"id": 1, "name": "one"}, V1)]) == []
    retyped = schema(Field("id", F("int32")), Field("name", F("int64")), sid="bad1")
    dropped = schema(Field("id", F("int32")), sid="bad2")
    narrowed = schema(Field("id", F("int32")), Field("name", F("string", True)), sid="ok")
    answers = run_part(
        sink,
        2,
        [
            rec(1, {"id": 2, "name": 5}, retyped),
            rec(2, {"id": 3}, dropped),
            rec(3, {"id": 4, "name": "fine"}, narrowed),
        ],
    )
    assert all(isinstance(a, Rejected) for a in answers)
    assert reasons(answers) == {
        1: "dataset 'orders': schema change refused: field 'name': string -> int64 is not a "
        "widening (stored values would change)",
        2: "dataset 'orders': schema change refused: field 'name' is required by the target "
        "and missing from the record's schema",
    }
    assert [r["id"] for r in rows(base)] == [1, 4]
    assert twophase_schema(base)["fields"][1] == {
        "name": "name",
        "type": {"kind": "string", "nullable": True},
    }


def test_without_auto_evolve_the_first_schema_stays(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base)  # auto_evolve: false
    assert run_part(sink, 1, [rec(0, {"id": 1, "name": "one"}, V1)]) == []
    older = schema(Field("id", F("int32")), Field("name", F("enum", symbols=("a",))), sid="old")
    answers = run_part(
        sink,
        2,
        [
            rec(1, {"id": 2**40, "name": "x", "price": "1.00"}, V2),
            rec(2, {"id": 3, "name": "a"}, older),  # narrower: fits as it is
        ],
    )
    assert reasons(answers) == {
        1: "dataset 'orders': the record's schema changes it (field 'id' int32 -> int64, "
        "field 'name' made optional, field 'price' added (decimal(10,2))) and auto_evolve is "
        "false"
    }
    assert [r["id"] for r in rows(base)] == [1, 3]
    assert [f.name for f in dataset_schema(base)] == ["id", "name"]


def test_a_change_waits_while_another_undecided_part_changes_the_dataset(tmp_path: Path) -> None:
    base = tmp_path / "out"
    a = make_sink(base, participant="p0", auto_evolve=True)
    b = make_sink(base, participant="p1", auto_evolve=True)
    assert run_part(a, 1, [rec(0, {"id": 1, "name": "one"}, V1)]) == []

    pa_ = PartId(PIPELINE, 2, "p0")
    a.begin(pa_)
    assert a.open_targets(pa_, [rec(1, {"id": 2, "price": "1.00"}, V2)]) == []
    a.write(pa_, [rec(1, {"id": 2, "price": "1.00"}, V2)])

    pb = PartId(PIPELINE, 2, "p1")
    b.begin(pb)
    with_price = schema(
        Field("id", F("int32")), Field("name", F("string")), Field("qty", F("int32", True)), sid="q"
    )
    held = b.open_targets(pb, [rec(10, {"id": 10, "name": "x", "qty": 1}, with_price)])
    [h] = held
    assert isinstance(h, Held)
    assert h.reason == (
        "dataset 'orders': its schema is being changed by part typed~000000000002~p0, "
        "not decided yet"
    )
    # A record that needs no change goes on meanwhile; a write of the held one aborts the part.
    assert b.open_targets(pb, [rec(11, {"id": 11, "name": "y"}, V1)]) == []
    with pytest.raises(AbortTransactionError, match="being changed by part"):
        b.write(pb, [rec(10, {"id": 10, "name": "x", "qty": 1}, with_price)])
    b.abort(pb)

    a.prepare(pa_, {("orders", 0): 2})  # still held while prepared
    pb2 = PartId(PIPELINE, 3, "p1")
    b.begin(pb2)
    assert len(b.open_targets(pb2, [rec(10, {"id": 10, "name": "x", "qty": 1}, with_price)])) == 1
    b.abort(pb2)
    a.commit(pa_)

    # Decided: the held record goes in, and neither change is lost.
    assert run_part(b, 4, [rec(10, {"id": 10, "name": "x", "qty": 1}, with_price)]) == []
    assert [f.name for f in dataset_schema(base)] == ["id", "name", "price", "qty"]
    assert [r["id"] for r in read_dataset(base / "orders").to_table().to_pylist()] == [1, 2, 10]


def test_participants_changing_one_dataset_at_once_lose_no_change(tmp_path: Path) -> None:
    """Eight writers, each adding a field of its own, retry held parts until committed; the
    dataset's schema ends with all eight (a lost update would drop one)."""
    base = tmp_path / "out"
    sinks = [make_sink(base, participant=f"p{i}", auto_evolve=True) for i in range(8)]
    assert run_part(sinks[0], 1, [rec(0, {"id": 0, "name": "base"}, V1)]) == []
    errors: list[BaseException] = []
    holds = [0] * len(sinks)

    def writer(i: int) -> None:
        sink = sinks[i]
        own = schema(
            Field("id", F("int32")),
            Field("name", F("string")),
            Field(f"f{i}", F("int64", True)),
            sid=f"w{i}",
        )
        record = rec(100 + i, {"id": 100 + i, "name": f"w{i}", f"f{i}": i}, own)
        try:
            for txn in range(2, 10_000):
                p = PartId(PIPELINE, txn, sink.context.participant)
                sink.begin(p)
                answers = sink.open_targets(p, [record])
                if answers:
                    assert all(isinstance(a, Held) for a in answers), answers
                    holds[i] += 1
                    sink.abort(p)
                    continue
                assert sink.write(p, [record]) == []
                sink.prepare(p, {("orders", 0): record.offset + 1})
                sink.commit(p)
                return
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(sinks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sorted(dataset_schema(base).names) == sorted(
        ["id", "name"] + [f"f{i}" for i in range(8)]
    )
    got = {r["id"]: r for r in read_dataset(base / "orders").to_table().to_pylist()}
    assert sorted(got) == [0] + list(range(100, 108))
    assert all(got[100 + i][f"f{i}"] == i for i in range(8))
    assert sum(holds) > 0  # they did meet


CHILD = textwrap.dedent(
    """
    import logging, sys, time
    sys.path.insert(0, {repo!r})
    from twophase.participants.sdk import Field, FieldType, PartId, Record, RecordSchema, SinkContext
    from twophase.participants.sinks.files import FileSink

    context = SinkContext({pipeline!r}, "dead", "files", logging.getLogger("child"))
    sink = FileSink.from_mapping(
        {{"name": "files", "type": "files", "path": sys.argv[1], "auto_evolve": True}}, context
    )
    sink.setup()
    schema = RecordSchema(
        (Field("id", FieldType("int32")), Field("name", FieldType("string")),
         Field("zombie", FieldType("string", True))),
        id="zombie",
    )
    part = PartId({pipeline!r}, 50, "dead")
    sink.begin(part)
    record = Record("orders", 0, 7, 0, None, {{"id": 7, "name": "z", "zombie": "z"}}, schema=schema)
    assert sink.open_targets(part, [record]) == []
    print("RESERVED", flush=True)
    time.sleep(60)
    """
)


def test_a_dead_writers_reservation_does_not_hold_the_others(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, auto_evolve=True)
    assert run_part(sink, 1, [rec(0, {"id": 1, "name": "one"}, V1)]) == []
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO), pipeline=PIPELINE))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(base)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "RESERVED"
        p = PartId(PIPELINE, 2, "p0")
        sink.begin(p)
        [h] = sink.open_targets(p, [rec(1, {"id": 2, "price": "1.00"}, V2)])  # the writer lives
        assert isinstance(h, Held) and "typed~000000000050~dead" in h.reason
        sink.abort(p)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert run_part(sink, 3, [rec(1, {"id": 2, "price": "1.00"}, V2)]) == []
    assert "zombie" not in dataset_schema(base).names
    # The runtime's sweep aborts the dead part; its reservation goes with its directory.
    [stale] = sink.stale_parts(100)
    sink.abort(stale)
    assert not list((base / "_twophase").rglob("SCHEMAS.json"))


def test_a_commit_repeated_after_a_crash_merges_the_schema_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after the dataset's schema was merged and before the manifest (the commit
    point): the commit is repeated, by any process, and changes the schema no further."""
    from twophase.participants.sinks.files import sink as sink_module

    base = tmp_path / "out"
    sink = make_sink(base, auto_evolve=True)
    assert run_part(sink, 1, [rec(0, {"id": 1, "name": "one"}, V1)]) == []
    p = PartId(PIPELINE, 2, "p0")
    sink.begin(p)
    records = [rec(1, {"id": 2, "price": "1.00"}, V2)]
    assert sink.open_targets(p, records) == []
    sink.write(p, records)
    sink.prepare(p, {("orders", 0): 2})
    real = sink_module.write_json_atomic

    def crash(path: Path, document: Any) -> None:
        if path.parent.name == "manifests":
            raise OSError(5, "simulated crash before the manifest")
        real(path, document)

    monkeypatch.setattr(sink_module, "write_json_atomic", crash)
    with pytest.raises(Exception, match="simulated crash"):
        sink.commit(p)
    monkeypatch.undo()
    after_crash = (base / "orders" / "_common_metadata").read_bytes()
    assert "price" in dataset_schema(base).names  # merged before the commit point
    other = make_sink(base, participant="p1", auto_evolve=True)
    assert other.in_doubt() == [p]
    other.commit(p)
    other.commit(p)
    assert (base / "orders" / "_common_metadata").read_bytes() == after_crash
    assert [r["id"] for r in rows(base)] == [1, 2]


def test_records_without_a_schema_keep_todays_rules_and_configured_schemas_win(
    tmp_path: Path,
) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, schema={"id": "int64", "name": "string"})
    assert run_part(sink, 1, [rec(0, {"id": 1, "name": "x"}, V1)]) == []
    assert pq.read_schema(data_files(base)[0]).field("id").type == pa.int64()  # configured
    assert not (base / "orders" / "_common_metadata").exists()
    inferred = tmp_path / "inferred"
    assert run_part(make_sink(inferred), 1, [rec(0, {"id": 1, "name": "x"}, None)]) == []
    assert pq.read_schema(data_files(inferred)[0]).field("id").type == pa.int64()
    assert not (inferred / "orders" / "_common_metadata").exists()


def test_json_lines_write_each_value_as_it_came(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, format="jsonl")
    value = {"id": 1, "money": "12.50", "ts_us": "2024-05-01T13:45:00.1234567Z"}
    assert run_part(sink, 1, [rec(0, value, EVERY_KIND)]) == []
    [path] = sorted((base / "orders").rglob("*.jsonl"))
    assert json.loads(path.read_text()) == value
    with pytest.raises(ValidationError, match="JSON Lines files carry no schema"):
        make_sink(tmp_path / "x", format="jsonl", auto_evolve=True)
    with pytest.raises(ValidationError, match="a configured schema decides"):
        make_sink(tmp_path / "y", schema={"id": "int64"}, auto_evolve=True)


@pytest.mark.stack
def test_spark_reads_the_evolved_dataset_with_its_schema(tmp_path: Path, spark: Any) -> None:
    """Spark's ``mergeSchema`` merges added fields but not widened types (INT and BIGINT); the
    dataset's schema, from ``_common_metadata``, reads every file."""
    from pyspark.sql.pandas.types import from_arrow_schema

    base = tmp_path / "out"
    sink = make_sink(base, auto_evolve=True)
    assert run_part(sink, 1, [rec(0, {"id": 1, "name": "one"}, V1)]) == []
    assert run_part(sink, 2, [rec(1, {"id": 2**40, "price": "9.99"}, V2)]) == []
    merged = from_arrow_schema(pq.read_schema(base / "orders" / "_common_metadata"))
    got = spark.read.schema(merged).parquet(str(base / "orders")).collect()
    assert sorted((r["id"], r["name"], r["price"]) for r in got) == [
        (1, "one", None),
        (2**40, None, Decimal("9.99")),
    ]
