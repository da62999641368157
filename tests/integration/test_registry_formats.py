"""Registry formats against the stack's real schema registry (Apicurio Registry, its
Confluent-compatible API): values written by confluent-kafka's own serializers -- what a
producer writes -- come out of twophase's decoders exactly, with their schemas, and every kind
of bad input is a named dead-letter reason."""

from __future__ import annotations

import base64
import logging
import re
import socket
import struct
import time
import uuid
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, timestamp_pb2
from google.protobuf.message_factory import GetMessageClass

from twophase.config import SchemaRegistryConfig
from twophase.participants.decoding.registry import RegistryFormat, RegistryUnavailable

pytestmark = pytest.mark.stack

ORDER_AVRO = {
    "type": "record",
    "name": "Order",
    "namespace": "shop",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "qty", "type": "int"},
        {
            "name": "price",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": 4},
        },
        {"name": "day", "type": ["null", {"type": "int", "logicalType": "date"}], "default": None},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "at_ms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "blob", "type": "bytes"},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B"]}},
        {"name": "ratio", "type": "double"},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "attrs", "type": {"type": "map", "values": "long"}},
        {
            "name": "ship",
            "type": {
                "type": "record",
                "name": "Ship",
                "fields": [{"name": "city", "type": "string"}, {"name": "zip", "type": "int"}],
            },
        },
    ],
}


def _ctx(topic: str) -> SerializationContext:
    return SerializationContext(topic, MessageField.VALUE)


@pytest.fixture
def client(schema_registry_url: str) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": schema_registry_url})


@pytest.fixture
def registry(schema_registry_url: str) -> SchemaRegistryConfig:
    return SchemaRegistryConfig(url=schema_registry_url)


def test_avro_values_come_out_exactly_with_their_schema(
    client: SchemaRegistryClient, registry: SchemaRegistryConfig, unique_name: str
) -> None:
    topic = f"{unique_name}-avro"
    serialize = AvroSerializer(client, _json(ORDER_AVRO))
    ref = uuid.UUID("12345678-1234-5678-1234-567812345678")
    value = {
        "id": 2**62 + 1,
        "qty": -7,
        "price": Decimal("-12345678901234567890123456789012.3456"),  # 38 digits
        "day": date(2024, 2, 29),
        "at": datetime(2024, 5, 1, 13, 45, 0, 123456, tzinfo=UTC),
        "at_ms": datetime(1969, 12, 31, 23, 59, 59, 999000, tzinfo=UTC),
        "ref": str(ref),
        "blob": b"\x00\xff\x10",
        "kind": "B",
        "ratio": float("inf"),
        "tags": ["x", ""],
        "attrs": {"a": 2**40},
        "ship": {"city": "Lyon", "zip": 69001},
    }
    data = serialize(value, _ctx(topic))
    got = RegistryFormat("avro", registry).decode(data, topic)
    assert not isinstance(got, str), got
    decoded, schema = got
    assert decoded == {
        "id": 2**62 + 1,
        "qty": -7,
        "price": "-12345678901234567890123456789012.3456",
        "day": "2024-02-29",
        "at": "2024-05-01T13:45:00.123456Z",
        "at_ms": "1969-12-31T23:59:59.999000Z",
        "ref": str(ref),
        "blob": base64.b64encode(b"\x00\xff\x10").decode(),
        "kind": "B",
        "ratio": "Infinity",
        "tags": ["x", ""],
        "attrs": {"a": 2**40},
        "ship": {"city": "Lyon", "zip": 69001},
    }
    assert schema is not None and schema.name == "Order"
    kinds = {f.name: f.type.describe() for f in schema}
    assert kinds == {
        "id": "int64",
        "qty": "int32",
        "price": "decimal(38,4)",
        "day": "date?",
        "at": "timestamp[us]",
        "at_ms": "timestamp[ms]",
        "ref": "uuid",
        "blob": "bytes",
        "kind": "enum",
        "ratio": "float64",
        "tags": "array<string>",
        "attrs": "map<int64>",
        "ship": "record",
    }


def test_an_evolved_schema_is_a_new_schema_id_and_both_decode(
    client: SchemaRegistryClient, registry: SchemaRegistryConfig, unique_name: str
) -> None:
    topic = f"{unique_name}-evolve"
    v1 = {"type": "record", "name": "R", "fields": [{"name": "id", "type": "int"}]}
    v2 = {
        "type": "record",
        "name": "R",
        "fields": [
            {"name": "id", "type": "long"},
            {"name": "note", "type": ["null", "string"], "default": None},
        ],
    }
    old = AvroSerializer(client, _json(v1))({"id": 1}, _ctx(topic))
    new = AvroSerializer(client, _json(v2))({"id": 2, "note": "n"}, _ctx(topic))
    assert old[1:5] != new[1:5]
    fmt = RegistryFormat("avro", registry)
    got_old, got_new = fmt.decode(old, topic), fmt.decode(new, topic)
    assert not isinstance(got_old, str) and not isinstance(got_new, str)
    assert got_old[0] == {"id": 1} and got_new[0] == {"id": 2, "note": "n"}
    assert got_old[1] is not None and got_new[1] is not None
    assert [f.type.describe() for f in got_old[1]] == ["int32"]
    assert [f.type.describe() for f in got_new[1]] == ["int64", "string?"]


def test_json_schema_values_are_validated_and_exact(
    client: SchemaRegistryClient, registry: SchemaRegistryConfig, unique_name: str
) -> None:
    topic = f"{unique_name}-json"
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "Order",
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "day": {"type": "string", "format": "date"},
            "note": {"type": ["string", "null"]},
            "lines": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["id", "day"],
        "additionalProperties": False,
    }
    serialize = JSONSerializer(_json(schema), client)
    fmt = RegistryFormat("json_schema", registry)
    framed = serialize({"id": 1, "day": "2024-05-01", "lines": [1.5]}, _ctx(topic))
    # A producer in another language may write integers wider than 64 bits (JSON has no
    # limit; Python's serializer refuses them): they must come out exact.
    good = framed[:5] + b'{"id": 18446744073709551617, "day": "2024-05-01", "lines": [1.5]}'
    got = fmt.decode(good, topic)
    assert not isinstance(got, str), got
    assert got[0] == {"id": 18446744073709551617, "day": "2024-05-01", "lines": [1.5]}
    assert got[1] is not None
    assert {f.name: f.type.describe() for f in got[1]} == {
        "id": "int64",
        "day": "date",
        "note": "string?",
        "lines": "array<float64>?",
    }
    # The same framing with a payload that breaks the schema: named, with the path.
    bad = good[:5] + b'{"id": "seven", "day": "2024-05-01"}'
    reason = fmt.decode(bad, topic)
    assert isinstance(reason, str)
    assert reason.startswith("undecodable: payload does not match its schema (id ")
    assert "id: 'seven' is not of type 'integer'" in reason


def test_protobuf_values_come_out_exactly_with_their_schema(
    client: SchemaRegistryClient, registry: SchemaRegistryConfig, unique_name: str
) -> None:
    topic = f"{unique_name}-proto"
    order = _proto_class()
    serialize = ProtobufSerializer(order, client, {"use.deprecated.format": False})
    msg = order(id=2**62, name="x", qty=2**64 - 1, tags=["a", "b"])
    msg.at.seconds, msg.at.nanos = 1_700_000_000, 123_456_000
    data = serialize(msg, _ctx(topic))
    got = RegistryFormat("protobuf", registry).decode(data, topic)
    assert not isinstance(got, str), got
    assert got[0] == {
        "id": 2**62,
        "name": "x",
        "at": "2023-11-14T22:13:20.123456Z",
        "qty": "18446744073709551615",
        "tags": ["a", "b"],
    }
    assert got[1] is not None
    assert [(f.name, f.type.describe()) for f in got[1]] == [
        ("id", "int64"),
        ("name", "string"),
        ("at", "timestamp[us]?"),
        ("qty", "decimal(20,0)"),
        ("tags", "array<string>"),
    ]
    msg.at.nanos = 1  # nanoseconds: no sink type holds them, so the record is refused
    refused = RegistryFormat("protobuf", registry).decode(serialize(msg, _ctx(topic)), topic)
    assert isinstance(refused, str) and "nanoseconds" in refused


def test_bad_framing_unknown_ids_other_formats_and_broken_payloads_are_named(
    client: SchemaRegistryClient, registry: SchemaRegistryConfig, unique_name: str
) -> None:
    topic = f"{unique_name}-bad"
    avro = AvroSerializer(client, _json(ORDER_AVRO["fields"][12]["type"]))  # type: ignore[index]
    good = avro({"city": "Oslo", "zip": 1}, _ctx(topic))
    fmt = RegistryFormat("avro", registry)
    assert fmt.decode(b'{"city": "Oslo"}', topic) == (
        "undecodable: no schema registry framing (magic byte 0x00 and a schema id)"
    )
    unknown = fmt.decode(b"\x00" + struct.pack(">I", 2**31 - 7) + good[5:], topic)
    assert unknown == f"undecodable: unknown schema id {2**31 - 7} in the registry"
    cut = fmt.decode(good[:-1], topic)
    assert isinstance(cut, str) and cut.startswith(
        "undecodable: payload does not match its schema (id "
    )
    json_id = client.register_schema(
        f"{topic}-other-value",
        Schema(
            _json(
                {
                    "$schema": "http://json-schema.org/draft-07/schema#",
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                }
            ),
            "JSON",
        ),
    )
    other = fmt.decode(b"\x00" + struct.pack(">I", json_id) + b"{}", topic)
    assert other == f"undecodable: schema id {json_id} is JSON, the source reads avro"


def _zigzag(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])


def test_an_avro_decimal_with_more_digits_than_its_precision_is_refused_never_rounded(
    client: SchemaRegistryClient, registry: SchemaRegistryConfig, unique_name: str
) -> None:
    """fastavro reads a decimal in a context of its schema's precision: 1234.56 in a
    decimal(4,2) came out as 1235. A writer should never write it, but one did: the value is
    refused with the reason, wherever the decimal sits (a field, an array's fixed items), and
    the compiled reader hands it back rather than store what the Python path refuses."""
    topic = f"{unique_name}-decimals"
    dec = {"logicalType": "decimal", "precision": 4, "scale": 2}
    schema = {
        "type": "record",
        "name": "Price",
        "fields": [
            {"name": "p", "type": {"type": "bytes", **dec}},
            {"name": "ps", "type": {"type": "array", "items": {"type": "fixed", "name": "F", "size": 4, **dec}}},
        ],
    }  # fmt: skip
    sid = client.register_schema(f"{topic}-value", Schema(_json(schema), "AVRO"))

    def framed(p: int, ps: list[int]) -> bytes:
        raw = p.to_bytes((p.bit_length() + 8) // 8, "big", signed=True)
        body = _zigzag(len(raw)) + raw
        if ps:
            body += _zigzag(len(ps)) + b"".join(x.to_bytes(4, "big", signed=True) for x in ps)
        return b"\x00" + struct.pack(">I", sid) + body + b"\x00"

    fmt = RegistryFormat("avro", registry)
    got = fmt.decode(framed(-9999, [1234, 0]), topic)
    assert not isinstance(got, str), got
    assert got[0] == {"p": "-99.99", "ps": ["12.34", "0.00"]}
    for value in (framed(123456, []), framed(1, [99999])):
        refused = fmt.decode(value, topic)
        assert isinstance(refused, str), refused
        assert refused.startswith("undecodable: payload does not match its schema"), refused
        assert "digits, more than its precision 4" in refused, refused
    import twophase_native

    encoder = twophase_native.AvroCopyEncoder([("p", "numeric", None)])
    encoder.add_schema(sid, _json(schema))
    assert encoder.encode([framed(-9999, []), framed(123456, [])])[1] == [1]


def test_a_registry_that_does_not_answer_is_retried_then_raised_never_dead_lettered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    fmt = RegistryFormat("avro", SchemaRegistryConfig(url=f"http://127.0.0.1:{port}"), retry_s=1.0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(RegistryUnavailable):
        fmt.decode(b"\x00\x00\x00\x00\x01payload", "t")
    elapsed = time.monotonic() - started
    # It retried, waiting as it said, before giving up. (Not a wall-clock bound: the waits are
    # jittered, and three of them once came to 0.46 s of the 1 s budget.)
    waits = [
        float(m.group(1))
        for r in caplog.records
        if (
            m := re.search(
                r"fetching schema id 1 failed \(try \d+\), retrying in ([\d.]+)s", r.message
            )
        )
    ]
    assert len(waits) >= 2, caplog.text
    assert elapsed >= sum(waits) * 0.9


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj)


def _proto_class() -> Any:
    """A message class made at run time, as a producer's generated code would define it."""
    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"order_{uuid.uuid4().hex[:6]}.proto",
        package="shop",
        syntax="proto3",
        dependency=["google/protobuf/timestamp.proto"],
    )
    m = fdp.message_type.add(name="Order")
    m.field.add(name="id", number=1, type=f.TYPE_INT64, label=f.LABEL_OPTIONAL)
    m.field.add(name="name", number=2, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    m.field.add(
        name="at",
        number=3,
        type=f.TYPE_MESSAGE,
        type_name=".google.protobuf.Timestamp",
        label=f.LABEL_OPTIONAL,
    )
    m.field.add(name="qty", number=4, type=f.TYPE_UINT64, label=f.LABEL_OPTIONAL)
    m.field.add(name="tags", number=5, type=f.TYPE_STRING, label=f.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(fdp)
    return GetMessageClass(pool.FindMessageTypeByName("shop.Order"))


PROTO_TEXT = """
syntax = "proto3";
package shop;
import "google/protobuf/timestamp.proto";
import "google/protobuf/wrappers.proto";

message Order {
  int64 id = 1;
  optional string note = 2;
  google.protobuf.Timestamp at = 3;
  google.protobuf.Int64Value maybe = 4;
  Status status = 5;
  map<string, int32> counts = 6;
  message Line { string sku = 1; uint32 qty = 2; }
  repeated Line lines = 7;
  enum Status { NEW = 0; PAID = 1; }
}
"""


def test_a_protobuf_schema_registered_as_proto_text_is_compiled_and_read(
    client: SchemaRegistryClient, registry: SchemaRegistryConfig, unique_name: str
) -> None:
    """Java producers register .proto text, and the registry hands it back as text: the
    decoder compiles it (protoc) and reads payloads by it, message indexes included."""
    from google.protobuf import wrappers_pb2

    schema_id = client.register_schema(f"{unique_name}-value", Schema(PROTO_TEXT, "PROTOBUF"))
    assert "message Order" in client.get_schema(schema_id).schema_str  # kept as text
    # The producer's message class, from the same text compiled the same way.
    from twophase.participants.decoding.registry import _proto_files

    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
    for fd in _proto_files("order.proto", PROTO_TEXT, {}):
        if not fd.name.startswith("google/"):
            pool.Add(fd)
    order = GetMessageClass(pool.FindMessageTypeByName("shop.Order"))
    line = GetMessageClass(pool.FindMessageTypeByName("shop.Order.Line"))
    msg = order(id=-5, status=1, counts={"a": 2}, lines=[line(sku="s", qty=3)])
    msg.maybe.value = 2**50
    payload = msg.SerializeToString()
    framed = b"\x00" + struct.pack(">I", schema_id) + b"\x00" + payload  # index [0]: Order
    got = RegistryFormat("protobuf", registry).decode(framed, unique_name)
    assert not isinstance(got, str), got
    assert got[0] == {
        "id": -5,
        "note": None,  # optional and unset: null, not ""
        "at": None,
        "maybe": 2**50,
        "status": "PAID",
        "counts": {"a": 2},
        "lines": [{"sku": "s", "qty": 3}],
    }
    assert got[1] is not None
    assert {f.name: f.type.describe() for f in got[1]} == {
        "id": "int64",
        "note": "string?",
        "at": "timestamp[us]?",
        "maybe": "int64?",
        "status": "enum",
        "counts": "map<int32>",
        "lines": "array<record>",
    }
    # Index [0, 1]: the nested message Order.Line (nested types in descriptor order: the map's
    # CountsEntry, then Line), with its own schema; the indexes are zigzag varints.
    nested = (
        b"\x00"
        + struct.pack(">I", schema_id)
        + b"\x04\x00\x02"
        + line(sku="t", qty=1).SerializeToString()
    )
    got_line = RegistryFormat("protobuf", registry).decode(nested, unique_name)
    assert not isinstance(got_line, str), got_line
    assert got_line[0] == {"sku": "t", "qty": 1}
    assert got_line[1] is not None and got_line[1].name == "shop.Order.Line"
