"""Avro through a schema registry (``make bench``, section ``avro``).

The same logical records as the JSON benchmarks (:func:`harness.record`: ~200-byte orders),
written by confluent-kafka's ``AvroSerializer`` against the stack's schema registry -- a
``long`` id, ``double`` amount, ``timestamp-micros`` ts and strings -- on a topic of their own.
A PostgreSQL-only exactly-once pipeline reads them with ``value_format: avro`` into the same
table as the JSON pipeline reads its records into, timed as :mod:`bench.throughput` times its
runs; the other side is that JSON pipeline over the same records.
"""

from __future__ import annotations

import json
import random
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from bench import throughput as tp
from harness import record

SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Order",
    "namespace": "bench",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "customer", "type": "string"},
        {"name": "amount", "type": "double"},
        {"name": "currency", "type": "string"},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "note", "type": "string"},
    ],
}


def avro_source(bootstrap: str, registry_url: str, records: int) -> tp.Source:
    """A topic holding ``records`` orders in Avro, the same values as the JSON sources'
    (:func:`harness.produce` with the same seed)."""
    topic = f"bench-avro-{uuid.uuid4().hex[:6]}.orders"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=tp.PARTITIONS, replication_factor=1)])[
        topic
    ].result()
    serialize = AvroSerializer(SchemaRegistryClient({"url": registry_url}), json.dumps(SCHEMA))
    ctx = SerializationContext(topic, MessageField.VALUE)
    rng = random.Random(7)  # harness.produce's seed for start 0: the same records
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True})
    for i in range(records):
        order = orjson.loads(record(i, rng))
        order["ts"] = datetime.fromisoformat(order["ts"]).astimezone(UTC)
        value = serialize(order, ctx)
        while True:
            try:
                p.produce(topic, key=str(i).encode(), value=value)
                break
            except BufferError:
                p.poll(0.1)
    if p.flush(60) > 0:
        raise RuntimeError("source records not delivered")
    return tp.Source(
        bootstrap,
        topic,
        records,
        options={"value_format": "avro"},
        registry_url=registry_url,
    )
