"""Records with schemas through the real runtime into files (``auto_evolve``) and MongoDB (#18).

Kafka Connect JSON envelopes (``value_format: connect_json``, keys with their schema) are read
by real coordinator and participant processes. The schema changes while the pipeline runs (a
field added); one record's schema changes incompatibly. Every check reads the stores directly:
the Parquet dataset as one table from its ``_common_metadata``, the documents as BSON, the
dead letters from Kafka.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from bson import Decimal128, Int64
from confluent_kafka import Producer
from pymongo import MongoClient

from harness import Cluster, end_offsets, group_offsets, wait_until
from tests.e2e.e2e_support import dead_letters, scenario, start
from twophase.config import load_config
from twophase.kafka import create_topics

MICROS = 1_714_571_100_123_456  # 2024-05-01T13:45:00.123456Z
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
KEY_SCHEMA = {"type": "struct", "fields": [{"field": "id", "type": "int64"}], "optional": False}
AMOUNT = {
    "field": "amount",
    "type": "bytes",
    "optional": True,
    "name": "org.apache.kafka.connect.data.Decimal",
    "parameters": {"scale": "2", "connect.decimal.precision": "10"},
}
TS = {"field": "ts", "type": "int64", "optional": True, "name": "io.debezium.time.MicroTimestamp"}
V1 = {
    "type": "struct",
    "name": "orders",
    "optional": False,
    "fields": [{"field": "id", "type": "int64"}, AMOUNT, TS],
}
V2 = {**V1, "fields": [*V1["fields"], {"field": "note", "type": "string", "optional": True}]}
#: amount becomes a string: not a widening, refused by the files sink, so stored nowhere.
BAD = {**V1, "fields": [V1["fields"][0], {"field": "amount", "type": "string"}, TS]}
#: Schemas Kafka Connect never writes -- a producer's bug: each record is dead-lettered by the
#: decoder, and the participant that reads it goes on (it used to exit, and crash-loop on it).
MALFORMED_VALUES = [
    {"type": "struct", "fields": 5},
    {**V1, "fields": [V1["fields"][0], {**AMOUNT, "parameters": [1]}, TS]},
    {**V1, "fields": [{"field": ["id"], "type": "int64"}, AMOUNT, TS]},
]
MALFORMED_KEY = {"type": "struct", "fields": [{"field": "id", "type": "int64", "name": ["x"]}]}


def cents(n: int) -> str:
    """Connect's Decimal payload: the unscaled integer, big-endian two's complement, base64."""
    return base64.b64encode(n.to_bytes((n.bit_length() + 8) // 8, "big", signed=True)).decode()


def envelope(schema: dict[str, Any], payload: dict[str, Any]) -> bytes:
    return orjson.dumps({"schema": schema, "payload": payload})


def test_schemas_evolve_the_dataset_inside_the_transactions(tmp_path: Path) -> None:
    s = scenario(tmp_path, "schemas", create=False, interval_ms=400)
    s.mongo = s.files = True
    s.extra = {
        "sources": [
            {
                "topic": s.topic,
                "partitions": 2,
                "replication_factor": 1,
                "value_format": "connect_json",
                "key_format": "json",
            }
        ],
        "sinks": [
            {
                "name": "files",
                "type": "files",
                "path": str(s.files_path),
                "partition_by": "topic",
                "auto_evolve": True,
            },
            {
                "name": "mongo",
                "type": "mongodb",
                "uri": s.mongo_uri,
                "database": s.table,
                "collection": "orders",
                "mode": "upsert",  # no key: each record's schema names it
            },
        ],
    }
    s.write()
    MongoClient(s.mongo_uri).drop_database(s.table)
    create_topics(load_config(s.config_path))

    producer = Producer({"bootstrap.servers": s.bootstrap, "enable.idempotence": True})
    sent: dict[int, tuple[int, str | None]] = {}
    for i in range(400):
        schema = V1 if i < 200 else V2
        payload: dict[str, Any] = {"id": i, "amount": cents(i * 101 - 5000), "ts": MICROS + i}
        if i >= 200:
            payload["note"] = f"n{i}" if i % 3 else None
        sent[i] = (i * 101 - 5000, payload.get("note"))
        key = orjson.dumps({"schema": KEY_SCHEMA, "payload": {"id": i}})
        producer.produce(s.topic, key=key, value=envelope(schema, payload), partition=i % 2)
        if i == 100:
            for j, broken in enumerate(MALFORMED_VALUES):
                junk = {"id": 9000 + j, "amount": cents(1), "ts": MICROS}
                junk_key = orjson.dumps({"schema": KEY_SCHEMA, "payload": {"id": 9000 + j}})
                producer.produce(
                    s.topic, key=junk_key, value=envelope(broken, junk), partition=j % 2
                )
            junk_key = orjson.dumps({"schema": MALFORMED_KEY, "payload": {"id": 9009}})
            junk = envelope(V1, {"id": 9009, "amount": cents(1), "ts": MICROS})
            producer.produce(s.topic, key=junk_key, value=junk, partition=1)
        if i == 300:
            bad = {"id": 9999, "amount": "lots", "ts": MICROS}
            bad_key = orjson.dumps({"schema": KEY_SCHEMA, "payload": {"id": 9999}})
            producer.produce(s.topic, key=bad_key, value=envelope(BAD, bad), partition=0)
    assert producer.flush(30) == 0

    c = Cluster(s)
    for role in ("coordinator", "participant"):
        start(c, role, f"{role[:5]}-0")
    client: MongoClient[dict[str, Any]] = MongoClient(s.mongo_uri, tz_aware=True)
    orders = client[s.table]["orders"]
    dataset = s.files_path / s.topic

    def done() -> bool:
        ends = end_offsets(s.bootstrap, s.topic, 2)
        return group_offsets(
            s.bootstrap, f"twophase.{s.name}", s.topic, 2
        ) == ends and orders.count_documents({}) == len(sent)

    try:
        wait_until(done, 120, "every record in every sink")
        assert all(c.alive(name) for name in c.procs), "a process exited"
    except (AssertionError, TimeoutError):
        for name in c.procs:
            print(f"===== {name}\n{c.log_tail(name, 80)}")
        raise
    finally:
        c.stop_all()

    # Files: one table of the merged schema, every value exact.
    merged = pq.read_schema(dataset / "_common_metadata")
    assert {f.name: f.type for f in merged} == {
        "id": pa.int64(),
        "amount": pa.decimal128(10, 2),
        "ts": pa.timestamp("us", tz="UTC"),
        "note": pa.string(),
    }
    table = ds.dataset(dataset, format="parquet", schema=merged).to_table()
    got = {r["id"]: r for r in table.to_pylist()}
    assert sorted(got) == sorted(sent)
    for i, (unscaled, note) in sent.items():
        assert got[i]["amount"] == Decimal(unscaled).scaleb(-2)
        assert got[i]["note"] == note
        assert got[i]["ts"] == EPOCH + timedelta(microseconds=MICROS + i)
    # MongoDB: keyed on the schema's key, values as their BSON types.
    docs = {d["_id"]: d for d in orders.find({})}
    assert sorted(docs) == sorted(sent)
    for i, (unscaled, note) in sent.items():
        doc = docs[i]
        assert type(doc["_id"]) is Int64
        assert isinstance(doc["amount"], Decimal128)
        assert doc["amount"].to_decimal() == Decimal(unscaled).scaleb(-2)
        assert doc["ts"] == f"2024-05-01T13:45:00.{(MICROS + i) % 1_000_000:06d}Z"
        assert doc.get("note") == note
    # The malformed ones are in no sink, dead-lettered by the decoder with what is wrong.
    letters = dead_letters(s)
    assert len(letters) == len(MALFORMED_VALUES) + 2, [dl.headers for dl in letters]
    decoded = [dl for dl in letters if "twophase.sink" not in dl.headers]
    assert len(decoded) == len(MALFORMED_VALUES) + 1, [dl.headers for dl in letters]
    for dl in decoded:
        assert dl.header("twophase.reason").startswith(
            (
                "undecodable: schema: malformed Kafka Connect schema",
                "undecodable: payload.amount: not a valid",
                "key: schema: malformed Kafka Connect schema",
            )
        ), dl.headers
    # The incompatible record is in no sink, dead-lettered with the files sink's reason.
    [letter] = [dl for dl in letters if "twophase.sink" in dl.headers]
    assert letter.header("twophase.sink") == "files"
    assert letter.header("twophase.reason") == (
        f"rejected by sink files: dataset {s.topic!r}: schema change refused: field 'amount': "
        "decimal(10,2)? -> string is not a widening (stored values would change)"
    )
    client.close()
