"""Avro values read by the PostgreSQL sink's compiled encoder (``RawShape`` ``avro``): values
written by confluent-kafka's ``AvroSerializer`` against the stack's registry, every type the
encoder models and many it hands back, extremes and broken payloads among them -- the compiled
path must store exactly what the Python path (fastavro, the registry decoder's value model, the
sink's converters) stores, reject the same records for the same reasons, and take the ordinary
values itself once it has learnt their schema."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import orjson
import pytest
from confluent_kafka import Message
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from test_sink_postgres import PgEnv, part
from test_sink_postgres_events import make_sink

from twophase.config import SchemaRegistryConfig, SourceConfig
from twophase.participants.decoding import JsonDecoder
from twophase.participants.sdk import AVRO, RawBatch

pytestmark = pytest.mark.stack

TOPIC = "orders"


def _nullable(t: Any) -> list[Any]:
    return ["null", t]


SCHEMA = {
    "type": "record",
    "name": "Row",
    "namespace": "avrotest",
    "fields": [
        {"name": "seq", "type": "long"},
        {"name": "i", "type": "int"},
        {"name": "s", "type": "string"},
        {"name": "vc", "type": "string"},
        {"name": "d", "type": "double"},
        {"name": "f", "type": "float"},
        {"name": "n", "type": "double"},
        {"name": "ni", "type": "long"},
        {"name": "b", "type": "boolean"},
        {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "tsn", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "tms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "u", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "ut", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "opt", "type": _nullable("long"), "default": None},
        {"name": "txt", "type": _nullable("string"), "default": None},
        {
            "name": "dec",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 20, "scale": 4},
        },
        {"name": "blob", "type": "bytes"},
    ],
}
DDL = """
    seq bigint, i integer, s text, vc varchar(5), d double precision, f real, n numeric,
    ni numeric(30, 0), b boolean, e text, ts timestamptz, tsn timestamp, tms timestamptz,
    day date, u uuid, ut text, opt bigint, txt text, dec numeric(20, 4)
"""
# The records' bytes field (`blob`) has no column: not mapped, not read.


def _value(rng: random.Random, seq: int) -> dict[str, Any]:
    def pick(ordinary: Any, *odd: Any) -> Any:
        """Mostly an ordinary value; one in ten, one of the odd ones."""
        return rng.choice(odd) if odd and rng.random() < 0.1 else ordinary

    def instant() -> datetime:
        return pick(
            datetime(2024, 1, 1, tzinfo=UTC) + timedelta(microseconds=rng.getrandbits(45)),
            datetime(1, 1, 1, tzinfo=UTC),
            datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
            datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
            datetime(2000, 1, 1, tzinfo=UTC),
        )

    return {
        "seq": seq,
        "i": pick(rng.randint(-1000, 1000), 0, -1, 2**31 - 1, -(2**31)),
        "s": pick(f"plain {seq}", "", "tab\there \u00e9\u4e2d", "nul\x00inside", "x" * 300),
        "vc": pick("abc", "abcde", "abcdef", "\u00e9\u00e9\u00e9\u00e9\u00e9"),
        "d": pick(rng.uniform(-1e6, 1e6), 0.1, -0.0, 1e300, 5e-324, float("nan"), float("inf")),
        "f": pick(rng.choice([0.1, 3.5, -2.25]), 1e38, float("-inf"), -0.0),
        "n": pick(round(rng.uniform(-1e4, 1e4), 3), 70368744177664.125, 1e16, float("nan")),
        "ni": pick(rng.getrandbits(40), 0, 2**63 - 1, -(2**63)),
        "b": rng.random() < 0.5,
        "e": rng.choice(["A", "B", "C"]),
        "ts": instant(),
        "tsn": instant(),
        "tms": instant().replace(microsecond=rng.randrange(1000) * 1000),
        "day": pick(date(2024, 2, 29), date(1, 1, 1), date(9999, 12, 31), date(1970, 1, 1)),
        "u": uuid.UUID(int=rng.getrandbits(128)),
        "ut": uuid.UUID(int=rng.getrandbits(128)),
        "opt": pick(5, None, -(2**63)),
        "txt": pick("t", None),
        "dec": pick(
            Decimal(rng.randint(-(10**15), 10**15)).scaleb(-4),
            Decimal(0).scaleb(-4),
            Decimal("-0.0001"),
            Decimal(10**16 - 1).scaleb(-4),
        ),
        "blob": b"\x00\x01",
    }


def _batch(decoder: JsonDecoder, values: list[bytes], first: int) -> RawBatch:
    msgs = [
        Message(topic=TOPIC, partition=0, offset=first + i, value=v, timestamp=(1, 1))
        for i, v in enumerate(values)
    ]
    return decoder.decode_batch(msgs, 1_000_000, decode=False).raw_batch()


def test_compiled_avro_stores_exactly_what_the_python_path_stores(
    env: PgEnv, schema_registry_url: str, unique_name: str
) -> None:
    rng = random.Random(20261126)
    topic = f"{unique_name}-avro"
    serialize = AvroSerializer(
        SchemaRegistryClient({"url": schema_registry_url}), orjson.dumps(SCHEMA).decode()
    )
    ctx = SerializationContext(topic, MessageField.VALUE)
    values = [serialize(_value(rng, i), ctx) for i in range(3000)]
    assert all(v is not None for v in values)
    framed: list[bytes] = [v for v in values if v is not None]
    # Broken payloads: cut short, or a byte changed after the framing.
    for k in range(0, 3000, 37):
        v = bytearray(framed[k])
        if k % 2:
            framed[k] = bytes(v[: rng.randint(5, len(v) - 1)])
        else:
            at = rng.randrange(5, len(v))
            v[at] = rng.randrange(256)
            framed[k] = bytes(v)
    registry = SchemaRegistryConfig(url=schema_registry_url)
    source = SourceConfig(topic=TOPIC, value_format="avro")

    results = []
    for compiled in (True, False):
        decoder = JsonDecoder(source, registry)
        assert decoder.raw_shape == AVRO
        table = env.table("c" if compiled else "p", DDL)
        sink = make_sink(env, table, f"{'c' if compiled else 'p'}{env.base}"[:40],
                         compiled_copy=compiled)  # fmt: skip
        assert sink.accepts_raw_shape(AVRO) == compiled
        rejected = []
        undecodable: dict[int, str] = {}
        # Three parts: the first teaches the encoder the schema, the others are its.
        for txn, (lo, hi) in enumerate([(0, 200), (200, 1600), (1600, 3000)], start=1):
            batch = _batch(decoder, framed[lo:hi], lo)
            pid = part(env, txn, pipeline=env.pipeline)
            sink.begin(pid)
            rejected += sink.write_raw(pid, batch)
            sink.prepare(pid, {(TOPIC, 0): hi})
            sink.commit(pid)
            undecodable.update({lo + at: why for at, why in batch.undecodable().items()})
        if compiled:
            encoder = sink._avro_encoder
            assert encoder is not None
            payload, unsure = encoder.encode(framed[1600:3000])
            # The ordinary values are the compiled path's (NaN, infinities, nulls, strings with
            # NUL, a varchar overflow, instants past what Python holds and the broken ones are
            # the Python path's).
            assert payload and len(unsure) < 700, len(unsure)
        rows = env.rows(f'SELECT w::text FROM "{table}" AS w ORDER BY seq, w::text')
        results.append((rows, sorted((r.record.offset, r.reason) for r in rejected), undecodable))
    (c_rows, c_rejected, c_bad), (p_rows, p_rejected, p_bad) = results
    assert c_bad == p_bad and c_bad  # the broken payloads are dead-lettered, the same way
    assert c_rejected == p_rejected and c_rejected  # varchar(5) overflows, NUL in text, ...
    assert len(c_rows) == len(p_rows) > 2000
    assert c_rows == p_rows
