"""Kafka behaviour the protocol relies on, checked against the stack's real broker."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

CreateTopic = Callable[..., str]

pytestmark = pytest.mark.stack

# Generous: the first transactional producer on a fresh stack waits for the transaction
# state topic to load, and the first group for __consumer_offsets.
TIMEOUT_S = 30.0


def _consumer(bootstrap: str, group: str, **overrides: Any) -> Consumer:
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": True,
    }
    conf.update(overrides)
    return Consumer(conf)


def _txn_producer(bootstrap: str, transactional_id: str) -> Producer:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id})
    producer.init_transactions(TIMEOUT_S)
    return producer


def _read_to_end(bootstrap: str, topic: str, isolation: str) -> list[bytes]:
    """Every value of partition 0 up to its end (the last stable offset for
    read_committed), read with an assigned (group-less) consumer."""
    consumer = _consumer(bootstrap, f"{topic}-reader-{isolation}", **{"isolation.level": isolation})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        values: list[bytes] = []
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    return values
                raise KafkaException(msg.error())
            values.append(msg.value())
        raise TimeoutError(f"no end of partition on {topic} within {TIMEOUT_S}s")
    finally:
        consumer.close()


def _poll_one(consumer: Consumer) -> Message:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None:
            continue
        if msg.error():
            if msg.error().code() == KafkaError._PARTITION_EOF:
                continue
            raise KafkaException(msg.error())
        return msg
    raise TimeoutError(f"no record within {TIMEOUT_S}s")


def _group_offsets(admin: AdminClient, group: str, topic: str) -> int:
    """The group's committed offset of partition 0. ``require_stable``: commit_transaction
    returns before the commit markers reach __consumer_offsets, and until they do a plain
    fetch still answers the previous offset (KIP-447)."""
    request = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, 0)])
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        result = admin.list_consumer_group_offsets([request], require_stable=True)[group].result()
        partition = result.topic_partitions[0]
        if partition.error is None:
            return int(partition.offset)
        if (
            partition.error.code() != KafkaError.UNSTABLE_OFFSET_COMMIT
            or time.monotonic() > deadline
        ):
            raise KafkaException(partition.error)
        time.sleep(0.05)


def test_read_committed_sees_committed_transaction_and_not_aborted_one(
    kafka_bootstrap: str, create_topic: CreateTopic, unique_name: str
) -> None:
    topic = create_topic(unique_name)
    producer = _txn_producer(kafka_bootstrap, f"{unique_name}-txn")

    producer.begin_transaction()
    producer.produce(topic, b"aborted-1")
    producer.produce(topic, b"aborted-2")
    producer.flush(TIMEOUT_S)  # Really in the log before the abort marker.
    producer.abort_transaction(TIMEOUT_S)

    producer.begin_transaction()
    producer.produce(topic, b"committed-1")
    producer.produce(topic, b"committed-2")
    producer.commit_transaction(TIMEOUT_S)

    assert _read_to_end(kafka_bootstrap, topic, "read_committed") == [
        b"committed-1",
        b"committed-2",
    ]
    # The aborted records did reach the log: only isolation hides them.
    assert _read_to_end(kafka_bootstrap, topic, "read_uncommitted") == [
        b"aborted-1",
        b"aborted-2",
        b"committed-1",
        b"committed-2",
    ]


def test_new_producer_with_same_transactional_id_fences_the_old_one(
    kafka_bootstrap: str, create_topic: CreateTopic, unique_name: str
) -> None:
    """A stable transactional.id is what fences a coordinator that lost leadership."""
    topic = create_topic(unique_name)
    old = _txn_producer(kafka_bootstrap, f"{unique_name}-txn")
    old.begin_transaction()
    old.produce(topic, b"from-the-zombie")
    old.flush(TIMEOUT_S)

    new = _txn_producer(kafka_bootstrap, f"{unique_name}-txn")  # Bumps the epoch.
    new.begin_transaction()
    new.produce(topic, b"from-the-successor")
    new.commit_transaction(TIMEOUT_S)

    with pytest.raises(KafkaException) as raised:
        old.commit_transaction(TIMEOUT_S)
    error = raised.value.args[0]
    assert error.fatal() or error.txn_requires_abort(), error
    assert _read_to_end(kafka_bootstrap, topic, "read_committed") == [b"from-the-successor"]


def test_send_offsets_to_transaction_moves_committed_offsets_only_on_commit(
    kafka_bootstrap: str, kafka_admin: AdminClient, create_topic: CreateTopic, unique_name: str
) -> None:
    source = create_topic(f"{unique_name}-in")
    sink = create_topic(f"{unique_name}-out")
    plain = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(5):
        plain.produce(source, f"v{i}".encode())
    plain.flush(TIMEOUT_S)

    group = f"{unique_name}-group"
    consumer = _consumer(kafka_bootstrap, group, **{"isolation.level": "read_committed"})
    producer = _txn_producer(kafka_bootstrap, f"{unique_name}-txn")
    try:
        consumer.subscribe([source])
        consumed = [_poll_one(consumer) for _ in range(5)]
        assert [m.offset() for m in consumed] == [0, 1, 2, 3, 4]

        # Aborted: the offsets must not move.
        producer.begin_transaction()
        producer.produce(sink, b"aborted")
        producer.send_offsets_to_transaction(
            [TopicPartition(source, 0, 3)], consumer.consumer_group_metadata(), TIMEOUT_S
        )
        producer.abort_transaction(TIMEOUT_S)
        assert _group_offsets(kafka_admin, group, source) < 0  # Nothing committed yet.

        producer.begin_transaction()
        producer.produce(sink, b"processed")
        producer.send_offsets_to_transaction(
            [TopicPartition(source, 0, 5)], consumer.consumer_group_metadata(), TIMEOUT_S
        )
        producer.commit_transaction(TIMEOUT_S)
        assert _group_offsets(kafka_admin, group, source) == 5
        committed = consumer.committed([TopicPartition(source, 0)], TIMEOUT_S)
        assert committed[0].offset == 5
    finally:
        consumer.close()


# The design question: can a coordinator that is NOT a member of the participants' consumer
# group commit their offsets inside its own Kafka transaction, while a participant is an
# active member? It can, with the group metadata of a consumer that never subscribes
# (generation -1, empty member id) -- as long as that consumer speaks the classic protocol:
# a group.protocol=consumer client makes up a member id at creation, which the broker then
# rejects with UNKNOWN_MEMBER_ID. The active member may itself use either protocol.
@pytest.mark.parametrize("member_protocol", ["classic", "consumer"])
def test_non_member_can_commit_group_offsets_in_a_transaction_while_a_member_is_active(
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    create_topic: CreateTopic,
    unique_name: str,
    member_protocol: str,
) -> None:
    topic = create_topic(unique_name)
    plain = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(10):
        plain.produce(topic, f"v{i}".encode())
    plain.flush(TIMEOUT_S)
    group = f"{unique_name}-group"

    member = _consumer(kafka_bootstrap, group, **{"group.protocol": member_protocol})
    outsider = _consumer(kafka_bootstrap, group, **{"group.protocol": "classic"})
    producer = _txn_producer(kafka_bootstrap, f"{unique_name}-coordinator")
    try:
        member.subscribe([topic])
        assert [_poll_one(member).offset() for _ in range(3)] == [0, 1, 2]
        member.commit(offsets=[TopicPartition(topic, 0, 3)], asynchronous=False)
        assert member.assignment(), "the member must hold the partition during the commit"

        producer.begin_transaction()
        producer.send_offsets_to_transaction(
            [TopicPartition(topic, 0, 7)], outsider.consumer_group_metadata(), TIMEOUT_S
        )
        producer.commit_transaction(TIMEOUT_S)

        assert _group_offsets(kafka_admin, group, topic) == 7
        assert member.committed([TopicPartition(topic, 0)], TIMEOUT_S)[0].offset == 7
        # Until its next assignment the member keeps its own in-memory position...
        assert _poll_one(member).offset() == 3
        # ...and on the next one it starts from the offsets the transaction committed.
        member.unsubscribe()
        member.subscribe([topic])
        assert _poll_one(member).offset() == 7
    finally:
        member.close()
        outsider.close()


def test_consumer_protocol_group_metadata_of_a_non_member_is_rejected(
    kafka_bootstrap: str, create_topic: CreateTopic, unique_name: str
) -> None:
    """Pins the limit stated above, so a client or broker change that lifts it is noticed."""
    topic = create_topic(unique_name)
    group = f"{unique_name}-group"
    member = _consumer(kafka_bootstrap, group, **{"group.protocol": "consumer"})
    outsider = _consumer(kafka_bootstrap, group, **{"group.protocol": "consumer"})
    producer = _txn_producer(kafka_bootstrap, f"{unique_name}-coordinator")
    try:
        plain = Producer({"bootstrap.servers": kafka_bootstrap})
        plain.produce(topic, b"v0")
        plain.flush(TIMEOUT_S)
        member.subscribe([topic])
        _poll_one(member)

        producer.begin_transaction()
        with pytest.raises(KafkaException) as raised:
            producer.send_offsets_to_transaction(
                [TopicPartition(topic, 0, 1)], outsider.consumer_group_metadata(), TIMEOUT_S
            )
        error = raised.value.args[0]
        assert error.code() == KafkaError.UNKNOWN_MEMBER_ID, error
        assert error.txn_requires_abort(), error
        producer.abort_transaction(TIMEOUT_S)
    finally:
        member.close()
        outsider.close()
