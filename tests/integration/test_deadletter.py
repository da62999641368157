"""The dead-letter topic against the real Kafka of the local stack (issue #14): any record can be
dead-lettered, whatever the limits of the producer and the topic, and a failed letter never
raises out of ``send`` (the part's ``flush`` reports it instead).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from confluent_kafka import Producer

from harness import Scenario
from tests.e2e.e2e_support import read_topic
from twophase.config import load_config
from twophase.errors import RetriableError
from twophase.kafka import topic_max_message_bytes
from twophase.participants.runtime.deadletter import DeadLetters

pytestmark = pytest.mark.stack

TOPIC_LIMIT = 100_000


def _letters(
    producer: Producer, topic: str, topic_limit: Callable[[], int | None] = lambda: None
) -> DeadLetters:
    return DeadLetters(producer, topic, "pipe", "p-0", topic_limit=topic_limit)


def _send(dlq: DeadLetters, offset: int, value: bytes, key: bytes | None = None) -> None:
    dlq.send(
        topic="orders",
        partition=0,
        offset=offset,
        key=key,
        value=value,
        reason="undecodable: not JSON",
        txn=1,
    )


def _headers(m: Any) -> dict[str, bytes]:
    return {k: v or b"" for k, v in m.headers() or []}


@pytest.mark.parametrize("known", [True, False], ids=["topic-limit-looked-up", "broker-refusal"])
def test_a_topic_smaller_than_the_producer_limit_gets_truncated_letters(
    kafka_bootstrap: str, create_topic: Any, tmp_path: Path, known: bool
) -> None:
    topic = create_topic(
        f"dlq-small-{uuid4().hex[:8]}", config={"max.message.bytes": str(TOPIC_LIMIT)}
    )
    s = Scenario.on_stack("dlqlimit", tmp_path)
    s.write()
    cfg = load_config(s.config_path)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    dlq = _letters(
        producer,
        topic,
        (lambda: topic_max_message_bytes(cfg, topic)) if known else (lambda: None),
    )
    small, big = b"<" * 1000, b"<" * 500_000
    _send(dlq, 1, small)
    _send(dlq, 2, big)
    _send(dlq, 3, b"<" * 50, key=b"k" * 300_000)
    dlq.flush(30)
    got = {m.key(): m for m in read_topic(kafka_bootstrap, topic)}
    assert set(got) == {b"orders:0:1", b"orders:0:2", b"orders:0:3"}
    first, second, third = (got[f"orders:0:{i}".encode()] for i in (1, 2, 3))
    assert first.value() == small and "twophase.truncated" not in _headers(first)
    h = _headers(second)
    assert h["twophase.truncated"] == b"value"
    assert h["twophase.original.value.size"] == b"500000"
    assert h["twophase.reason"] == b"undecodable: not JSON"
    assert h["twophase.source.offset"] == b"2"
    assert 0 < len(second.value()) < TOPIC_LIMIT and big.startswith(second.value())
    h = _headers(third)
    assert h["twophase.truncated"] == b"key"
    assert h["twophase.original.key.size"] == b"300000"
    assert third.value() == b"<" * 50


def test_a_full_producer_queue_and_a_missing_topic_never_raise_from_send(
    kafka_bootstrap: str, create_topic: Any
) -> None:
    topic = create_topic(f"dlq-queue-{uuid4().hex[:8]}")
    # A queue of two messages: most sends find it full and must wait for room.
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "queue.buffering.max.messages": 2})
    dlq = _letters(producer, topic)
    for offset in range(40):
        _send(dlq, offset, b"x" * 100)
    dlq.flush(30)
    assert len(read_topic(kafka_bootstrap, topic)) == 40
    # A topic that does not exist (and is not auto-created): the part's flush fails, send not.
    gone = Producer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "message.timeout.ms": 3000,
            "allow.auto.create.topics": False,
        }
    )
    missing = _letters(gone, "dlq-missing-topic-never-created")
    _send(missing, 1, b"x")
    with pytest.raises(RetriableError, match="dead letter"):
        missing.flush(30)
