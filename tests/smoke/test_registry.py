"""The stack's schema registry (Apicurio Registry, stack/registry/pom.xml) through
confluent-kafka's own Schema Registry client and serdes, as the product will use them.

For each of Avro, JSON Schema and Protobuf: a record goes through the Confluent wire format
(magic byte 0, the 4-byte big-endian schema id, for Protobuf the message indexes, then the
payload) and back, with the schema registered by the serializer and fetched by id by the
deserializer; then, with the subject set to BACKWARD, a compatible new version is accepted and
an incompatible one is refused with HTTP 409 and does not become a version.

Quirks of Apicurio's ccompat API seen here (stack/README.md has the list the product's decoders
need): ids are content ids (the same schema text has the same id in every subject); a refused
schema answers 409 with error_code 0, not Confluent's 409; a subject with no compatibility of
its own reports the global level instead of Confluent's 40408.
"""

from __future__ import annotations

import json
import struct
import uuid
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext, SerializationError
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

pytestmark = pytest.mark.stack

MAGIC = 0
# Apicurio answers a schema its compatibility rule refuses with HTTP 409 (as Confluent does).
CONFLICT = 409


@pytest.fixture
def client(schema_registry_url: str) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": schema_registry_url})


@pytest.fixture
def topic() -> str:
    # Subjects are never deleted here: the registry is in memory and empty after a restart.
    return f"registry-{uuid.uuid4().hex[:12]}"


def _wire_id(payload: bytes) -> int:
    """The schema id a Confluent-framed payload names; fails on anything else."""
    assert len(payload) > 5, payload
    magic, schema_id = struct.unpack(">bI", payload[:5])
    assert magic == MAGIC, payload[:5]
    return int(schema_id)


def _assert_refused(client: SchemaRegistryClient, subject: str, schema: Schema) -> None:
    before = client.get_versions(subject)
    assert client.test_compatibility(subject, schema) is False
    with pytest.raises(SchemaRegistryError) as refused:
        client.register_schema(subject, schema)
    assert refused.value.http_status_code == CONFLICT, refused.value
    assert client.get_versions(subject) == before


# ---------------------------------------------------------------------------- Avro

AVRO_V1: dict[str, Any] = {
    "type": "record",
    "name": "Order",
    "namespace": "twophase.test",
    "fields": [{"name": "id", "type": "long"}, {"name": "amount", "type": "double"}],
}
# BACKWARD-compatible: an optional field with a default.
AVRO_V2: dict[str, Any] = {
    **AVRO_V1,
    "fields": [*AVRO_V1["fields"], {"name": "note", "type": ["null", "string"], "default": None}],
}
# Incompatible: a v2 reader cannot read v1's long as a string.
AVRO_BAD: dict[str, Any] = {
    **AVRO_V1,
    "fields": [{"name": "id", "type": "string"}, {"name": "amount", "type": "double"}],
}


def test_avro_round_trip_and_evolution(client: SchemaRegistryClient, topic: str) -> None:
    ctx = SerializationContext(topic, MessageField.VALUE)
    subject = f"{topic}-value"
    deserialize = AvroDeserializer(client)

    v1_bytes = AvroSerializer(client, json.dumps(AVRO_V1))({"id": 2**40, "amount": 1.5}, ctx)
    assert v1_bytes is not None
    registered = client.get_latest_version(subject)
    assert registered.version == 1 and registered.schema.schema_type == "AVRO"
    assert _wire_id(v1_bytes) == registered.schema_id
    assert deserialize(v1_bytes, ctx) == {"id": 2**40, "amount": 1.5}

    client.set_compatibility(subject, "BACKWARD")
    assert client.get_compatibility(subject) == "BACKWARD"

    v2 = Schema(json.dumps(AVRO_V2), "AVRO")
    assert client.test_compatibility(subject, v2) is True
    v2_id = client.register_schema(subject, v2)
    assert v2_id != registered.schema_id
    assert client.get_versions(subject) == [1, 2]
    v2_bytes = AvroSerializer(client, json.dumps(AVRO_V2))(
        {"id": 3, "amount": 2.0, "note": "ok"}, ctx
    )
    assert v2_bytes is not None and _wire_id(v2_bytes) == v2_id
    assert deserialize(v2_bytes, ctx) == {"id": 3, "amount": 2.0, "note": "ok"}
    # Records of both versions stay readable: each names its own writer schema.
    assert deserialize(v1_bytes, ctx) == {"id": 2**40, "amount": 1.5}

    _assert_refused(client, subject, Schema(json.dumps(AVRO_BAD), "AVRO"))


# ---------------------------------------------------------------------------- JSON Schema

# Closed content models: with Confluent's JSON Schema rules (which Apicurio follows), adding
# even an optional property to an open model is not BACKWARD-compatible.
JSON_V1: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "Order",
    "type": "object",
    "properties": {"id": {"type": "integer"}, "amount": {"type": "number"}},
    "required": ["id"],
    "additionalProperties": False,
}
JSON_V2: dict[str, Any] = {
    **JSON_V1,
    "properties": {**JSON_V1["properties"], "note": {"type": "string"}},
}
JSON_BAD: dict[str, Any] = {
    **JSON_V1,
    "properties": {"id": {"type": "string"}, "amount": {"type": "number"}},
}


def test_json_schema_round_trip_and_evolution(client: SchemaRegistryClient, topic: str) -> None:
    ctx = SerializationContext(topic, MessageField.VALUE)
    subject = f"{topic}-value"
    serialize = JSONSerializer(json.dumps(JSON_V1), client)
    # No schema given: the deserializer takes the writer's schema from the registry by id.
    deserialize = JSONDeserializer(None, schema_registry_client=client)

    payload = serialize({"id": 12345678901234, "amount": 0.25}, ctx)
    assert payload is not None
    registered = client.get_latest_version(subject)
    assert registered.schema.schema_type == "JSON"
    assert _wire_id(payload) == registered.schema_id
    assert json.loads(payload[5:]) == {"id": 12345678901234, "amount": 0.25}
    assert deserialize(payload, ctx) == {"id": 12345678901234, "amount": 0.25}
    # The serializer validates against the schema before anything is written.
    with pytest.raises(SerializationError):
        serialize({"id": "not a number"}, ctx)

    client.set_compatibility(subject, "BACKWARD")
    v2 = Schema(json.dumps(JSON_V2), "JSON")
    assert client.test_compatibility(subject, v2) is True
    v2_id = client.register_schema(subject, v2)
    assert client.get_versions(subject) == [1, 2]
    v2_bytes = JSONSerializer(json.dumps(JSON_V2), client)({"id": 1, "note": "x"}, ctx)
    assert v2_bytes is not None and _wire_id(v2_bytes) == v2_id
    assert deserialize(v2_bytes, ctx) == {"id": 1, "note": "x"}

    _assert_refused(client, subject, Schema(json.dumps(JSON_BAD), "JSON"))


# ---------------------------------------------------------------------------- Protobuf

F = descriptor_pb2.FieldDescriptorProto


def _order_class(file_name: str, fields: list[tuple[str, int, int]]) -> Any:
    """The message class of a one-message proto3 file ``twophase.test.Order``, built in code
    so the test needs no protoc; it matches the .proto text of _order_proto()."""
    proto = descriptor_pb2.FileDescriptorProto(
        name=file_name, package="twophase.test", syntax="proto3"
    )
    message = proto.message_type.add(name="Order")
    for field_name, number, field_type in fields:
        message.field.add(name=field_name, number=number, type=field_type, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("twophase.test.Order"))


def _order_proto(fields: str) -> Schema:
    text = f'syntax = "proto3";\npackage twophase.test;\n\nmessage Order {{\n{fields}}}\n'
    return Schema(text, "PROTOBUF")


PROTO_CONF = {"use.deprecated.format": False}


def test_protobuf_round_trip(client: SchemaRegistryClient, topic: str) -> None:
    """The producer's default path: the serializer registers the schema itself, in the form
    confluent-kafka sends (a base64 FileDescriptorProto), and Apicurio stores it as sent."""
    ctx = SerializationContext(topic, MessageField.VALUE)
    order = _order_class(f"{topic}.proto", [("id", 1, F.TYPE_INT64), ("note", 2, F.TYPE_STRING)])

    payload = ProtobufSerializer(order, client, PROTO_CONF)(order(id=-(2**62), note="n"), ctx)
    assert payload is not None
    registered = client.get_latest_version(f"{topic}-value")
    assert registered.schema.schema_type == "PROTOBUF"
    assert _wire_id(payload) == registered.schema_id
    # Message indexes after the id: a single 0 means "the file's first message".
    assert payload[5] == 0
    assert ProtobufDeserializer(order, PROTO_CONF)(payload, ctx) == order(id=-(2**62), note="n")


def test_protobuf_evolution(client: SchemaRegistryClient, topic: str) -> None:
    """Compatibility rules on Protobuf need the schema as .proto text: Apicurio 2.4.2 parses
    only that when it checks (a base64 descriptor, as confluent-kafka registers, fails the
    check with HTTP 500). So the versions are registered as text, as Java producers do."""
    ctx = SerializationContext(topic, MessageField.VALUE)
    subject = f"{topic}-value"
    client.register_schema(subject, _order_proto("  int64 id = 1;\n"))
    client.set_compatibility(subject, "BACKWARD")

    added = _order_proto("  int64 id = 1;\n  string note = 2;\n")
    assert client.test_compatibility(subject, added) is True
    v2_id = client.register_schema(subject, added)
    assert client.get_versions(subject) == [1, 2]

    _assert_refused(client, subject, _order_proto("  string id = 1;\n"))

    # confluent-kafka's serializer cannot write with a version registered as text: it asks for
    # ?format=serialized, which Apicurio ignores, and decodes the answer as base64. A Java
    # producer frames such a record like this; the Python deserializer needs only the class.
    order = _order_class(f"{topic}.proto", [("id", 1, F.TYPE_INT64), ("note", 2, F.TYPE_STRING)])
    payload = (
        struct.pack(">bI", MAGIC, v2_id) + b"\x00" + order(id=7, note="v2").SerializeToString()
    )
    assert ProtobufDeserializer(order, PROTO_CONF)(payload, ctx) == order(id=7, note="v2")
    assert client.get_schema(v2_id).schema_str == added.schema_str


# ---------------------------------------------------------------------------- ids


def test_ids_are_content_ids(client: SchemaRegistryClient, topic: str) -> None:
    """The same schema text registered under two subjects gets one id (Apicurio's content id,
    `registry.ccompat.legacy-id-mode.enabled=false`), and that id serves the text back."""
    schema = Schema(json.dumps({**AVRO_V1, "name": f"Ids{uuid.uuid4().hex[:8]}"}), "AVRO")
    first = client.register_schema(f"{topic}-a-value", schema)
    second = client.register_schema(f"{topic}-b-value", schema)
    assert first == second
    assert json.loads(client.get_schema(first).schema_str) == json.loads(schema.schema_str)
    with pytest.raises(SchemaRegistryError) as missing:
        client.get_schema(first + 1_000_000)
    assert missing.value.http_status_code == 404
