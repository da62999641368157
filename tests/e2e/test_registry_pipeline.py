"""Every registry format into every sink, end to end (#18): Avro, Protobuf and JSON Schema
records, keys and values framed by confluent-kafka's own serializers against the stack's schema
registry (Apicurio), read by a real coordinator and participant into a PostgreSQL table the sink
creates from the schema (its primary key from the key's schema), a MongoDB collection keyed on
it, and a Parquet dataset typed by it. Halfway the producer moves to a newer compatible schema
(an optional field added): the table gains the column, the dataset's schema the field. A record
framed with a schema id the registry does not know is dead-lettered with its reason and
reaches no sink. Every check reads the stores directly."""

from __future__ import annotations

import json
import struct
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar

import psycopg
import pytest
from bson import Decimal128, Int64
from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, timestamp_pb2
from google.protobuf.message_factory import GetMessageClass
from pymongo import MongoClient

from harness import Cluster, end_offsets, group_offsets, wait_until
from tests.e2e.e2e_support import dead_letters, scenario, start
from twophase.config import load_config
from twophase.kafka import create_topics
from twophase.participants.sinks.files import read_dataset

pytestmark = pytest.mark.stack

RECORDS = 120
EVOLVE_AT = 60
AT = datetime(2024, 5, 1, 13, 45, 0, 123456, tzinfo=UTC)


class Format:
    """How one format's producer frames a record: key and value serializers for the old and
    the newer schema, and the column types the created table must have."""

    name: str
    pg_types: ClassVar[dict[str, str]]

    def __init__(self, client: SchemaRegistryClient) -> None:
        self.client = client

    def key(self, topic: str, i: int) -> bytes:
        raise NotImplementedError

    def value(self, topic: str, i: int, newer: bool) -> bytes:
        raise NotImplementedError


def _ctx(topic: str, field: str = MessageField.VALUE) -> SerializationContext:
    return SerializationContext(topic, field)


class Avro(Format):
    name = "avro"
    pg_types: ClassVar[dict[str, str]] = {
        "id": "bigint",
        "name": "text",
        "amount": "numeric(10,2)",
        "at": "timestamp with time zone",
        "tags": "jsonb",
        "note": "text",
    }
    V1: ClassVar[dict[str, Any]] = {
        "type": "record",
        "name": "Order",
        "fields": [
            {"name": "id", "type": "long"},
            {"name": "name", "type": "string"},
            {
                "name": "amount",
                "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2},
            },
            {"name": "at", "type": {"type": "long", "logicalType": "timestamp-micros"}},
            {"name": "tags", "type": {"type": "array", "items": "string"}},
        ],
    }
    V2: ClassVar[dict[str, Any]] = {
        **V1,
        "fields": [*V1["fields"], {"name": "note", "type": ["null", "string"], "default": None}],
    }
    KEY: ClassVar[dict[str, Any]] = {
        "type": "record",
        "name": "OrderKey",
        "fields": [{"name": "id", "type": "long"}],
    }

    def __init__(self, client: SchemaRegistryClient) -> None:
        super().__init__(client)
        self.keys = AvroSerializer(client, json.dumps(self.KEY))
        self.v1 = AvroSerializer(client, json.dumps(self.V1))
        self.v2 = AvroSerializer(client, json.dumps(self.V2))

    def key(self, topic: str, i: int) -> bytes:
        return self.keys({"id": i}, _ctx(topic, MessageField.KEY))

    def value(self, topic: str, i: int, newer: bool) -> bytes:
        v: dict[str, Any] = {
            "id": i,
            "name": f"n{i}",
            "amount": Decimal(i * 101 - 5000).scaleb(-2),
            "at": AT,
            "tags": [f"t{i}"],
        }
        if newer:
            v["note"] = f"note {i}" if i % 2 else None
            return self.v2(v, _ctx(topic))
        return self.v1(v, _ctx(topic))


class JsonSchema(Format):
    name = "json_schema"
    pg_types: ClassVar[dict[str, str]] = {
        "id": "bigint",
        "name": "text",
        "amount": "double precision",
        "at": "timestamp with time zone",
        "tags": "jsonb",
        "note": "text",
    }
    V1: ClassVar[dict[str, Any]] = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "Order",
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "amount": {"type": "number"},
            "at": {"type": "string", "format": "date-time"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["id", "name", "amount", "at", "tags"],
        "additionalProperties": False,
    }
    V2: ClassVar[dict[str, Any]] = {
        **V1,
        "properties": {**V1["properties"], "note": {"type": ["string", "null"]}},
    }
    KEY: ClassVar[dict[str, Any]] = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "OrderKey",
        "type": "object",
        "properties": {"id": {"type": "integer"}},
        "required": ["id"],
    }

    def __init__(self, client: SchemaRegistryClient) -> None:
        super().__init__(client)
        self.keys = JSONSerializer(json.dumps(self.KEY), client)
        self.v1 = JSONSerializer(json.dumps(self.V1), client)
        self.v2 = JSONSerializer(json.dumps(self.V2), client)

    def key(self, topic: str, i: int) -> bytes:
        return self.keys({"id": i}, _ctx(topic, MessageField.KEY))

    def value(self, topic: str, i: int, newer: bool) -> bytes:
        v: dict[str, Any] = {
            "id": i,
            "name": f"n{i}",
            "amount": (i * 101 - 5000) / 100,
            "at": "2024-05-01T13:45:00.123456Z",
            "tags": [f"t{i}"],
        }
        if newer:
            v["note"] = f"note {i}" if i % 2 else None
            return self.v2(v, _ctx(topic))
        return self.v1(v, _ctx(topic))


class Protobuf(Format):
    name = "protobuf"
    pg_types: ClassVar[dict[str, str]] = {
        "id": "bigint",
        "name": "text",
        "amount": "double precision",
        "at": "timestamp with time zone",
        "tags": "jsonb",
        "note": "text",
    }

    def __init__(self, client: SchemaRegistryClient) -> None:
        super().__init__(client)
        tag = uuid.uuid4().hex[:8]
        self.key_cls = _message(f"key_{tag}.proto", "OrderKey", [("id", "TYPE_INT64", False)])
        base = [
            ("id", "TYPE_INT64", False),
            ("name", "TYPE_STRING", False),
            ("amount", "TYPE_DOUBLE", False),
            ("at", ".google.protobuf.Timestamp", False),
            ("tags", "TYPE_STRING", True),
        ]
        self.v1_cls = _message(f"v1_{tag}.proto", "Order", base)
        self.v2_cls = _message(
            f"v2_{tag}.proto", "Order", [*base, ("note", "optional TYPE_STRING", False)]
        )
        conf = {"use.deprecated.format": False}
        self.keys = ProtobufSerializer(self.key_cls, client, conf)
        self.v1 = ProtobufSerializer(self.v1_cls, client, conf)
        self.v2 = ProtobufSerializer(self.v2_cls, client, conf)

    def key(self, topic: str, i: int) -> bytes:
        return self.keys(self.key_cls(id=i), _ctx(topic, MessageField.KEY))

    def value(self, topic: str, i: int, newer: bool) -> bytes:
        cls, serialize = (self.v2_cls, self.v2) if newer else (self.v1_cls, self.v1)
        m = cls(id=i, name=f"n{i}", amount=(i * 101 - 5000) / 100, tags=[f"t{i}"])
        m.at.seconds, m.at.nanos = int(AT.timestamp()), AT.microsecond * 1000
        if newer and i % 2:
            m.note = f"note {i}"
        return serialize(m, _ctx(topic))


def _message(file: str, name: str, fields: list[tuple[str, str, bool]]) -> Any:
    """A message class made at run time, as a producer's generated code would define it."""
    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name=file, package="shop", syntax="proto3", dependency=["google/protobuf/timestamp.proto"]
    )
    m = fdp.message_type.add(name=name)
    for number, (field, kind, repeated) in enumerate(fields, start=1):
        optional = kind.startswith("optional ")
        kind = kind.removeprefix("optional ")
        label = f.LABEL_REPEATED if repeated else f.LABEL_OPTIONAL
        if kind.startswith("."):
            m.field.add(name=field, number=number, type=f.TYPE_MESSAGE, type_name=kind, label=label)
        else:
            added = m.field.add(name=field, number=number, type=getattr(f, kind), label=label)
            if optional:  # proto3 `optional`: a synthetic oneof gives the field presence
                added.proto3_optional = True
                added.oneof_index = len(m.oneof_decl)
                m.oneof_decl.add(name=f"_{field}")
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(fdp)
    return GetMessageClass(pool.FindMessageTypeByName(f"shop.{name}"))


@pytest.mark.parametrize("format_cls", [Avro, Protobuf, JsonSchema], ids=lambda c: c.name)
def test_a_registry_format_reaches_every_sink_exactly_and_its_schema_evolves(
    format_cls: type[Format], tmp_path: Path, schema_registry_url: str
) -> None:
    s = scenario(tmp_path, f"reg-{format_cls.name.replace('_', '')}", create=False, interval_ms=400)
    fmt = format_cls(SchemaRegistryClient({"url": schema_registry_url}))
    s.extra = {
        "schema_registry": {"url": schema_registry_url},
        "sources": [
            {
                "topic": s.topic,
                "partitions": 2,
                "replication_factor": 1,
                "value_format": fmt.name,
                "key_format": fmt.name,
            }
        ],
        "sinks": [
            {
                "name": "pg",
                "type": "postgres",
                "dsn": s.pg_dsn,
                "table": s.table,
                "mode": "upsert",  # keyed on the key's schema
                "auto_create": True,
                "auto_evolve": True,
            },
            {
                "name": "mongo",
                "type": "mongodb",
                "uri": s.mongo_uri,
                "database": s.table,
                "collection": "orders",
                "mode": "upsert",
            },
            {
                "name": "files",
                "type": "files",
                "path": str(s.files_path),
                "partition_by": "topic",
                "auto_evolve": True,
            },
        ],
    }
    s.write()
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{s.table}"')
    MongoClient(s.mongo_uri).drop_database(s.table)
    create_topics(load_config(s.config_path))

    producer = Producer({"bootstrap.servers": s.bootstrap, "enable.idempotence": True})
    for i in range(RECORDS):
        value = fmt.value(s.topic, i, newer=i >= EVOLVE_AT)
        producer.produce(s.topic, key=fmt.key(s.topic, i), value=value, partition=i % 2)
        if i == EVOLVE_AT:
            # Framed for a schema id no registry ever gave: dead-lettered, in no sink.
            bogus = b"\x00" + struct.pack(">I", 2**31 - 11) + value[5:]
            producer.produce(s.topic, key=fmt.key(s.topic, 10_000), value=bogus, partition=0)
    assert producer.flush(30) == 0

    c = Cluster(s)
    start(c, "coordinator", "coord-0")
    start(c, "participant", "worker-0")
    client: MongoClient[dict[str, Any]] = MongoClient(s.mongo_uri, tz_aware=True)
    orders = client[s.table]["orders"]

    def done() -> bool:
        ends = end_offsets(s.bootstrap, s.topic, 2)
        return (
            group_offsets(s.bootstrap, f"twophase.{s.name}", s.topic, 2) == ends
            and orders.count_documents({}) == RECORDS
        )

    try:
        wait_until(done, 180, "every record in every sink")
        assert all(c.alive(name) for name in c.procs), "a process exited"
    except (AssertionError, TimeoutError):
        for name in c.procs:
            print(f"===== {name}\n{c.log_tail(name, 80)}")
        raise
    finally:
        c.stop_all()

    def amount(i: int) -> Decimal:
        return Decimal(i * 101 - 5000).scaleb(-2)

    def note(i: int) -> str | None:
        return f"note {i}" if i >= EVOLVE_AT and i % 2 else None

    # PostgreSQL: the table the schema made (the key's field as primary key), every row exact.
    with psycopg.connect(s.pg_dsn) as conn:
        columns = dict(
            conn.execute(
                "SELECT column_name, format_type(atttypid, atttypmod) FROM "
                "information_schema.columns JOIN pg_attribute ON attrelid = %s::regclass "
                "AND attname = column_name WHERE table_name = %s",
                (f'"{s.table}"', s.table),
            ).fetchall()
        )
        key = conn.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass AND i.indisprimary",
            (f'"{s.table}"',),
        ).fetchall()
        rows = conn.execute(
            f'SELECT id, name, amount, at, tags, note FROM "{s.table}" ORDER BY id'
        ).fetchall()
    assert columns == fmt.pg_types
    assert key == [("id",)]
    assert [r[0] for r in rows] == list(range(RECORDS))
    for i, name, amt, at, tags, n in rows:
        assert (name, at, tags, n) == (f"n{i}", AT, [f"t{i}"], note(i))
        assert Decimal(str(amt)) == amount(i)

    # MongoDB: keyed on the key's schema, values as their BSON types.
    docs = {d["_id"]: d for d in orders.find({})}
    assert sorted(docs) == list(range(RECORDS))
    for i, doc in docs.items():
        assert type(doc["_id"]) is Int64
        if fmt.name == "avro":
            assert doc["amount"] == Decimal128(amount(i))
        else:
            assert Decimal(str(doc["amount"])) == amount(i)
        assert doc["at"] == "2024-05-01T13:45:00.123456Z"
        assert (doc["name"], doc["tags"], doc.get("note")) == (f"n{i}", [f"t{i}"], note(i))

    # Files: one dataset of the merged schema, the newer field null in the older files.
    table = read_dataset(s.files_path / s.topic).to_table()
    assert "note" in table.schema.names
    got = {r["id"]: r for r in table.to_pylist()}
    assert sorted(got) == list(range(RECORDS))
    for i, r in got.items():
        assert (r["name"], r["at"], r["tags"], r["note"]) == (f"n{i}", AT, [f"t{i}"], note(i))

    # The record framed with an unknown schema id: dead-lettered with its reason only.
    [letter] = dead_letters(s)
    assert letter.header("twophase.reason") == (
        f"undecodable: unknown schema id {2**31 - 11} in the registry"
    )
    client.close()
