"""The MongoDB sink typed by records' schemas (#18), on the stack's MongoDB-protocol server.

Documents are read back as raw BSON and decoded here, so each value's BSON type is checked as
well as its value. ``docs/types.md``, "From a record's schema", is the table these tests hold
the sink to.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import bson
import pytest
from bson import Binary, Decimal128, Int64
from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from pymongo import MongoClient
from pymongo.database import Database

from twophase.participants.sdk import (
    Field,
    FieldType,
    PartId,
    Record,
    RecordSchema,
    Rejected,
    SinkContext,
)
from twophase.participants.sinks.mongodb import MongoSink

pytestmark = pytest.mark.stack

Doc = dict[str, Any]
MakeSink = Callable[..., MongoSink]
F = FieldType
RAW: CodecOptions[RawBSONDocument] = CodecOptions(document_class=RawBSONDocument)
#: Decoded as stored: no UUID decoding (subtype 4 stays Binary), dates in UTC.
AS_STORED: CodecOptions[Doc] = CodecOptions(tz_aware=True)


@pytest.fixture
def db(mongo_uri: str, unique_name: str) -> Iterator[Database[Doc]]:
    name = f"{unique_name}_mschema"
    client: MongoClient[Doc] = MongoClient(mongo_uri)
    try:
        yield client[name]
    finally:
        client.drop_database(name)
        client.close()


@pytest.fixture
def make_sink(mongo_uri: str, db: Database[Doc]) -> Iterator[MakeSink]:
    made: list[MongoSink] = []

    def make(**cfg: Any) -> MongoSink:
        raw: Doc = {
            "name": "mongo",
            "type": "mongodb",
            "uri": mongo_uri,
            "database": db.name,
            "collection": "target",
            **cfg,
        }
        ctx = SinkContext("p1", "w1", "mongo", logging.getLogger("test.mongo.schema"))
        sink = MongoSink.from_mapping(raw, ctx)
        assert isinstance(sink, MongoSink)
        sink.setup()
        made.append(sink)
        return sink

    yield make
    for sink in made:
        sink.close()


def rec(offset: int, value: Doc, sch: RecordSchema | None, *, deleted: bool = False) -> Record:
    return Record("orders", 0, offset, 1_700_000_000_000, None, value, deleted=deleted, schema=sch)


def run_part(sink: MongoSink, txn: int, records: list[Record]) -> list[Rejected]:
    part = PartId("p1", txn, "w1")
    sink.begin(part)
    rejected = list(sink.write(part, records))
    sink.prepare(part, {("orders", 0): max(r.offset for r in records) + 1})
    sink.commit(part)
    return rejected


def stored(db: Database[Doc], query: Doc | None = None) -> list[Doc]:
    """The target's documents as their BSON says (types included), by ``_id``."""
    coll = db.get_collection("target", codec_options=RAW)
    docs = [bson.decode(d.raw, codec_options=AS_STORED) for d in coll.find(query or {})]
    for d in docs:
        d.pop("_twophase", None)
    return sorted(docs, key=lambda d: str(d["_id"]))


def same(got: Any, want: Any) -> bool:
    """Equal values of the same types, at every depth (1 == Int64(1) == 1.0 in Python)."""
    if type(got) is not type(want):
        return False
    if isinstance(want, dict):
        return list(got) == list(want) and all(same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, Decimal128):
        return str(got) == str(want)  # the same digits and exponent
    return bool(got == want)


def schema(*fields: Field, sid: str = "", key: tuple[str, ...] = ()) -> RecordSchema:
    return RecordSchema(tuple(fields), id=sid, name="orders", key=key)


EVERY_KIND = schema(
    Field("id", F("int64")),
    Field("flag", F("boolean", True)),
    Field("small", F("int32", True)),
    Field("big", F("int64", True)),
    Field("f32", F("float32", True)),
    Field("f64", F("float64", True)),
    Field("money", F("decimal", True, precision=10, scale=2)),
    Field("d34", F("decimal", True, precision=38, scale=0)),
    Field("hundreds", F("decimal", True, precision=5, scale=-2)),
    Field("numeric", F("decimal", True)),
    Field("text", F("string", True)),
    Field("blob", F("bytes", True)),
    Field("uid", F("uuid", True)),
    Field("state", F("enum", True, symbols=("NEW", "PAID"))),
    Field("day", F("date", True)),
    Field("at", F("time", True, unit="us")),
    Field("ts_ms", F("timestamp", True, unit="ms")),
    Field("ts_us", F("timestamp", True, unit="us")),
    Field("wall_ms", F("timestamp_local", True, unit="ms")),
    Field("wall_us", F("timestamp_local", True, unit="us")),
    Field("tags", F("array", True, items=F("int64", True))),
    Field("prices", F("map", True, values=F("decimal", True, precision=6, scale=2))),
    Field(
        "address",
        F(
            "record",
            True,
            fields=(
                Field("street", F("string")),
                Field("zip", F("int64", True)),
                Field("seen", F("timestamp", True, unit="ms")),
            ),
        ),
    ),
    Field("doc", F("json", True)),
    sid="every",
)

EVERY_VALUE: Doc = {
    "id": 1,
    "flag": True,
    "small": 7,
    "big": 7,
    "f32": 0.1,
    "f64": 0.1,
    "money": "1.5",
    "d34": "9" * 34,
    "hundreds": "1.2E+5",
    "numeric": "0.333333333333333333333333333333333",  # 33 digits
    "text": "héllo",
    "blob": "AAH/",
    "uid": "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
    "state": "PAID",
    "day": "2024-02-29",
    "at": "13:45:00",
    "ts_ms": "2024-05-01T15:45:00.123+02:00",
    "ts_us": "2024-05-01T13:45:00.654321Z",
    "wall_ms": "2024-05-01T13:45:00.123",
    "wall_us": "0001-01-01T00:00:00",
    "tags": [1, None, 2**40],
    "prices": {"small": "1.5", "none": None},
    "address": {"street": "Main", "zip": 75001, "seen": "2024-05-01T00:00:00Z", "extra": [1]},
    "doc": {"any": [1, "two", None], "wide": 18446744073709551617},
    "unnamed": "kept as it is",
}

EVERY_STORED: Doc = {
    "_id": "orders:0:0",
    "id": Int64(1),
    "flag": True,
    "small": 7,
    "big": Int64(7),  # int64 even when small
    "f32": 0.1,
    "f64": 0.1,
    "money": Decimal128("1.50"),  # at the schema's scale
    "d34": Decimal128("9" * 34),
    "hundreds": Decimal128("1.200E+5"),
    "numeric": Decimal128("0.333333333333333333333333333333333"),
    "text": "héllo",
    "blob": b"\x00\x01\xff",  # BSON binary subtype 0
    "uid": Binary(uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11").bytes, 4),
    "state": "PAID",
    "day": datetime(2024, 2, 29, tzinfo=UTC),
    "at": "13:45:00.000000",
    "ts_ms": datetime(2024, 5, 1, 13, 45, 0, 123000, tzinfo=UTC),
    "ts_us": "2024-05-01T13:45:00.654321Z",
    "wall_ms": datetime(2024, 5, 1, 13, 45, 0, 123000, tzinfo=UTC),
    "wall_us": "0001-01-01T00:00:00.000000",
    "tags": [Int64(1), None, Int64(2**40)],
    "prices": {"small": Decimal128("1.50"), "none": None},
    "address": {
        "street": "Main",
        "zip": Int64(75001),
        "seen": datetime(2024, 5, 1, tzinfo=UTC),
        "extra": [1],
    },
    "doc": {"any": [1, "two", None], "wide": Decimal128("18446744073709551617")},
    "unnamed": "kept as it is",
}


def test_every_kind_becomes_its_bson_type_exactly(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink()
    nulls = {name: None for name in EVERY_VALUE} | {"id": 2}
    assert run_part(sink, 1, [rec(0, EVERY_VALUE, EVERY_KIND), rec(1, nulls, EVERY_KIND)]) == []
    got = stored(db)
    assert list(got[0]) == list(EVERY_STORED)
    for name, want in EVERY_STORED.items():
        assert same(got[0][name], want), (name, got[0][name], want)
    assert got[1] == {"_id": "orders:0:1", **nulls}
    # What a query sees: a BSON date range and a UUID match.
    target = db["target"]
    assert target.count_documents({"ts_ms": {"$gte": datetime(2024, 5, 1, tzinfo=UTC)}}) == 1
    assert target.count_documents({"uid": EVERY_STORED["uid"]}) == 1


def test_values_without_an_exact_bson_form_are_refused_in_check_and_write(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    bad = {
        10: ("d34", "1" * 35, "has 35 digits; a BSON Decimal128 holds at most 34"),
        11: ("numeric", "0." + "3" * 35, "has 35 digits; a BSON Decimal128 holds at most 34"),
        12: ("money", "1.234", "more than 2 digits after the point"),
        13: ("hundreds", "1250", "not a multiple of 1E+2"),
        14: ("ts_ms", "2024-05-01T13:45:00.1234Z", "digits below the millisecond"),
        15: ("ts_us", "2024-05-01T13:45:00.1234567Z", "digits below the microsecond"),
        16: ("wall_us", "2024-05-01T13:45:00+01:00", "has an offset"),
        17: ("uid", "nope", "expected a UUID"),
        18: ("blob", "AA-/", "expected base64"),
        19: ("small", 2**31, "out of range for int32"),
        20: ("tags", [1, "x"], "expected an integer"),
        21: ("address", {"street": "x", "seen": "noon"}, "expected an ISO-8601 timestamp"),
        22: ("ts_us", "0001-01-01T00:00:00+01:00", "within the years 1-9999"),
        23: ("ts_ms", "9999-12-31T23:30:00-01:00", "within the years 1-9999"),
    }
    where = {20: "tags[1]", 21: "address.seen"}
    records = [rec(o, {"id": o, name: v}, EVERY_KIND) for o, (name, v, _) in bad.items()]
    records.append(rec(99, {"id": 99, "d34": "-" + "9" * 34}, EVERY_KIND))
    sink = make_sink()
    checked = {r.record.offset: r.reason for r in sink.check(records)}
    written = {r.record.offset: r.reason for r in run_part(sink, 1, records)}
    assert checked == written
    assert set(written) == set(bad)
    for offset, (name, _value, reason) in bad.items():
        assert written[offset].startswith(f"field {where.get(offset, name)!r}: "), written[offset]
        assert reason in written[offset], written[offset]
    [doc] = stored(db)
    assert same(doc["d34"], Decimal128("-" + "9" * 34))


def test_timestamps_with_microseconds_are_kept_as_exact_text(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    """A BSON date holds milliseconds: a timestamp whose unit is finer is its exact UTC text,
    fixed width, so that strings sort as the instants do; never a truncated date."""
    sch = schema(Field("id", F("int64")), Field("ts", F("timestamp", True, unit="us")), sid="t")
    values = [
        "2024-05-01T13:45:00Z",
        "2024-05-01T13:45:00.5Z",
        "2024-05-01T13:45:00.000001Z",
        "2024-05-01T15:45:00.999999+02:00",
        "2024-05-01T13:45:00.123456000Z",
    ]
    sink = make_sink()
    assert run_part(sink, 1, [rec(i, {"id": i, "ts": v}, sch) for i, v in enumerate(values)]) == []
    got = [d["ts"] for d in sorted(stored(db), key=lambda d: d["id"])]
    assert got == [
        "2024-05-01T13:45:00.000000Z",
        "2024-05-01T13:45:00.500000Z",
        "2024-05-01T13:45:00.000001Z",
        "2024-05-01T13:45:00.999999Z",
        "2024-05-01T13:45:00.123456Z",
    ]
    assert sorted(got) == [got[0], got[2], got[4], got[1], got[3]]  # the instants' order


KEYED = schema(
    Field("id", F("int64")),
    Field("name", F("string", True)),
    Field("uid", F("uuid", True)),
    sid="keyed",
    key=("id",),
)


def test_without_a_configured_key_documents_are_keyed_on_the_schema_key(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    sink = make_sink(mode="upsert")  # no key: each record's schema names it
    composite = schema(
        Field("region", F("string")),
        Field("uid", F("uuid")),
        Field("n", F("int32", True)),
        sid="two",
        key=("region", "uid"),
    )
    u = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    first = [
        rec(0, {"id": 1, "name": "one"}, KEYED),
        rec(1, {"id": 2, "name": "two"}, KEYED),
        rec(2, {"region": "eu", "uid": u, "n": 1}, composite),
        rec(3, {"id": 3, "name": "schemaless"}, None),
    ]
    [refused] = run_part(sink, 1, first)
    assert refused.record.offset == 3
    assert refused.reason.startswith("no key: the sink's key is empty and the record has no schema")
    assert run_part(sink, 2, [rec(4, {"id": 1, "name": "uno"}, KEYED)]) == []
    assert run_part(sink, 3, [rec(5, {"id": 2}, KEYED, deleted=True)]) == []
    assert run_part(sink, 4, [rec(6, {"region": "eu", "uid": u.upper(), "n": 2}, composite)]) == []
    docs = stored(db)
    assert [d["_id"] for d in docs] == [
        Int64(1),
        {"region": "eu", "uid": Binary.from_uuid(uuid.UUID(u))},
    ]
    assert same(docs[0]["_id"], Int64(1)) and docs[0]["name"] == "uno"
    assert docs[1]["n"] == 2  # the same UUID whatever its spelling: one document


def test_partial_updates_keep_the_types(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink(mode="upsert", partial=True)
    sch = schema(
        Field("id", F("int64")),
        Field("amount", F("decimal", True, precision=10, scale=2)),
        Field("at", F("timestamp", True, unit="ms")),
        sid="p",
        key=("id",),
    )
    assert run_part(sink, 1, [rec(0, {"id": 1, "amount": "1"}, sch)]) == []
    assert (
        run_part(
            sink,
            2,
            [
                rec(1, {"id": 1, "at": "2024-05-01T00:00:00Z"}, sch),
                rec(2, {"id": 1, "amount": "2.5"}, sch),
            ],
        )
        == []
    )
    [doc] = stored(db)
    assert same(doc["_id"], Int64(1)) and same(doc["amount"], Decimal128("2.50"))
    assert same(doc["at"], datetime(2024, 5, 1, tzinfo=UTC))


def test_documents_of_every_schema_version_live_side_by_side(
    make_sink: MakeSink, db: Database[Doc]
) -> None:
    """MongoDB has no schema to evolve (no DDL): each document is stored by its own record's
    schema, and nothing is refused for a change."""
    v1 = schema(Field("id", F("int32")), Field("price", F("float64")), sid="v1")
    v2 = schema(
        Field("id", F("int64")), Field("price", F("decimal", precision=10, scale=2)), sid="v2"
    )
    sink = make_sink()
    assert run_part(sink, 1, [rec(0, {"id": 1, "price": 1.5}, v1)]) == []
    assert (
        run_part(
            sink, 2, [rec(1, {"id": 2, "price": "1.50"}, v2), rec(2, {"id": 3, "price": 2}, None)]
        )
        == []
    )
    docs = sorted(stored(db), key=lambda d: d["id"])
    assert [type(d["id"]) for d in docs] == [int, Int64, int]
    assert [d["price"] for d in docs] == [1.5, Decimal128("1.50"), 2]


def test_records_without_a_schema_keep_todays_rules(make_sink: MakeSink, db: Database[Doc]) -> None:
    sink = make_sink()
    value = {"id": 1, "ts": "2024-05-01T13:45:00Z", "money": "1.50", "wide": 2**64 + 1}
    assert run_part(sink, 1, [rec(0, value, None)]) == []
    [doc] = stored(db)
    assert doc["ts"] == "2024-05-01T13:45:00Z" and doc["money"] == "1.50"
    assert same(doc["wide"], Decimal128(str(2**64 + 1)))
