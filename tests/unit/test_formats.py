"""Value formats and the schemas they carry (participants/decoding/formats.py, connect.py):
Kafka Connect's JSON envelope as a value format, its schema as the record's, a Debezium row's
schema from the envelope's ``after``, and keys that name the schema's key."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest
from confluent_kafka import Message

from twophase.config import SourceConfig, parse_config
from twophase.errors import ConfigError
from twophase.participants.decoding import DebeziumDecoder, JsonDecoder
from twophase.participants.decoding.connect import field_schema, record_schema
from twophase.participants.sdk import Field, FieldType

TOPIC = "shop.orders"


def msg(offset: int, value: Any, key: Any = None) -> Message:
    def raw(v: Any) -> bytes | None:
        return v if v is None or isinstance(v, bytes) else orjson.dumps(v)

    return Message(
        topic=TOPIC, partition=0, offset=offset, key=raw(key), value=raw(value), timestamp=(1, 1)
    )


def decimal_b64(unscaled: int) -> str:
    size = (unscaled.bit_length() + 8) // 8
    return base64.b64encode(unscaled.to_bytes(size, "big", signed=True)).decode()


ROW = {
    "type": "struct",
    "name": "shop.orders.Value",
    "fields": [
        {"field": "id", "type": "int32"},
        {
            "field": "price",
            "type": "bytes",
            "optional": True,
            "name": "org.apache.kafka.connect.data.Decimal",
            "parameters": {"scale": "2", "connect.decimal.precision": "10"},
        },
        {"field": "day", "type": "int32", "optional": True, "name": "io.debezium.time.Date"},
        {"field": "at", "type": "int64", "name": "io.debezium.time.MicroTimestamp"},
        {"field": "tags", "type": "array", "items": {"type": "string"}, "optional": True},
        {"field": "note", "type": "string", "optional": True, "default": "-"},
    ],
}


def test_a_connect_schema_names_every_field_type() -> None:
    schema = record_schema(ROW)
    assert schema is not None and schema.name == "shop.orders.Value"
    assert schema.fields == (
        Field("id", FieldType("int32")),
        Field("price", FieldType("decimal", True, precision=10, scale=2)),
        Field("day", FieldType("date", True)),
        Field("at", FieldType("timestamp", unit="us")),
        Field("tags", FieldType("array", True, items=FieldType("string"))),
        Field("note", FieldType("string", True), has_default=True),
    )
    assert record_schema(ROW) is schema  # cached by its text
    assert record_schema({"type": "string"}) is None
    assert field_schema({"type": "map", "keys": {"type": "int32"}, "values": {}}).kind == "json"


def test_connect_json_values_are_unwrapped_with_their_schema() -> None:
    d = JsonDecoder(SourceConfig(topic=TOPIC, value_format="connect_json"))
    assert not d.raw_values  # the bytes are not the record: decoded here
    payload = {
        "id": 7,
        "price": decimal_b64(1999),
        "day": 19_000,
        "at": 1_700_000_000_000_001,
        "tags": None,
        "note": "x",
    }
    out = d.decode_batch(
        [
            msg(1, {"schema": ROW, "payload": payload}),
            msg(2, {"id": 8}),  # no envelope: not this format
            msg(3, {"schema": {"type": "string"}, "payload": "text"}),  # not a record
            msg(4, {"schema": ROW, "payload": {**payload, "day": "monday"}}),
        ],
        max_record_bytes=10_000,
    )
    (rec,) = out.records
    assert rec.value == {
        "id": 7,
        "price": "19.99",
        "day": "2022-01-08",
        "at": "2023-11-14T22:13:20.000001Z",
        "tags": None,
        "note": "x",
    }
    assert rec.schema is record_schema(ROW)
    reasons = [(u.msg.offset(), u.reason) for u in out.bad]
    assert reasons[0] == (2, "undecodable: not a Kafka Connect {schema, payload} envelope")
    assert reasons[1] == (3, "undecodable: connect_json str, expected a record")
    assert reasons[2][0] == 4 and "not a valid io.debezium.time.Date" in reasons[2][1]


def test_a_debezium_row_gets_the_schema_of_after_and_its_key_names_the_key() -> None:
    envelope_schema = {
        "type": "struct",
        "fields": [
            {"field": "before", **ROW, "optional": True},
            {"field": "after", **ROW, "optional": True},
            {"field": "op", "type": "string"},
        ],
    }
    d = DebeziumDecoder(SourceConfig(topic=TOPIC, format="debezium", key_format="json"))
    key = {"schema": {"type": "struct", "fields": [{"field": "id", "type": "int32"}]},
           "payload": {"id": 7}}  # fmt: skip
    value = {
        "schema": envelope_schema,
        "payload": {"op": "c", "before": None, "after": {"id": 7, "at": 0}, "source": {}},
    }
    gone = {"schema": envelope_schema, "payload": {"op": "d", "before": {"id": 7}, "after": None}}
    out = d.decode_batch([msg(1, value, key), msg(2, gone, key)], max_record_bytes=10_000)
    made, deleted = out.records
    assert made.schema is not None and made.schema.names == record_schema(ROW).names  # type: ignore[union-attr]
    assert made.schema.key == ("id",)
    assert deleted.deleted and deleted.schema is made.schema  # one schema object per (id, key)


def test_string_keys_become_the_key_field() -> None:
    d = JsonDecoder(SourceConfig(topic=TOPIC, key_format="string", key_field="sku"))
    out = d.decode_batch(
        [msg(1, {"n": 1}, b"A-1"), msg(2, {"n": 2}, b"\xff"), msg(3, {"n": 3})],
        max_record_bytes=10_000,
    )
    assert [r.value for r in out.records] == [{"n": 1, "sku": "A-1"}]
    assert [u.reason.split(" (")[0] for u in out.bad] == [
        "key: not UTF-8 text",
        "key: missing",
    ]


def test_format_options_fail_at_start_up_naming_the_field() -> None:
    base = {
        "pipeline": "p",
        "kafka": {"bootstrap_servers": "k:9092"},
        "sinks": [{"name": "f", "type": "files", "path": "/tmp/x"}],
    }
    with pytest.raises(ConfigError, match=r"key_field.*required with key_format: string"):
        parse_config({**base, "sources": [{"topic": "t", "key_format": "string"}]}, env={})
    with pytest.raises(ConfigError, match=r"set schema_registry\.url"):
        parse_config({**base, "sources": [{"topic": "t", "value_format": "avro"}]}, env={})
    with pytest.raises(ConfigError, match=r"schema_registry\.url"):
        parse_config(
            {**base, "sources": [{"topic": "t"}], "schema_registry": {"url": "registry:8081"}},
            env={},
        )
