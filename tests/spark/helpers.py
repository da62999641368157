"""Kafka helpers of the Spark tests."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 30.0


def produce_to(
    bootstrap: str, topic: str, partition: int, events: Iterable[Mapping[str, Any]]
) -> None:
    """Events into one partition, in order (the tests decide which rows share a batch)."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for event in events:
        producer.produce(
            topic, key=str(event["id"]).encode(), value=orjson.dumps(event), partition=partition
        )
    if producer.flush(TIMEOUT_S) > 0:
        raise RuntimeError(f"events not delivered to {topic}[{partition}]")


Headers = list[tuple[str, bytes | None]]


def read_topic(
    bootstrap: str, topic: str, partitions: int
) -> list[tuple[bytes | None, bytes, Headers]]:
    """Every record of ``topic`` (read_committed), as (key, value, headers)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"{topic}-reader",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    out: list[tuple[bytes | None, bytes, Headers]] = []
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        at_end: set[int] = set()
        while len(at_end) < partitions:
            msg = consumer.poll(TIMEOUT_S)
            if msg is None:
                raise TimeoutError(f"no end of {topic} within {TIMEOUT_S}s")
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition() or 0)
                    continue
                raise RuntimeError(err.str())
            key = msg.key()
            raw = msg.headers() or []
            headers = [(k, v if isinstance(v, bytes) or v is None else v.encode()) for k, v in raw]
            out.append((key if isinstance(key, bytes) else None, msg.value() or b"", headers))
    finally:
        consumer.close()
    return out
