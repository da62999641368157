"""The one transactional publisher of decisions (:class:`twophase.kafka.ControlPublisher`), used
by the coordinator and the Spark driver, against the real Kafka of the local stack: each message
lands in its own transaction at the offset it reports, a commit carries the source group's
offsets with it, a second publisher of the pipeline fences the first for good, and a write that
fails inside its transaction leaves no transaction open."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from tests.e2e.e2e_support import read_topic
from twophase.config import PipelineConfig, parse_config
from twophase.kafka import ControlPublisher
from twophase.protocol.codec import decode, new_envelope
from twophase.protocol.messages import Complete, Decision, Outcome, Position, Prepare

pytestmark = pytest.mark.stack


@pytest.fixture
def cfg(kafka_bootstrap: str, create_topic: Any, unique_name: str) -> PipelineConfig:
    """A pipeline of its own, with its control topic."""
    config = parse_config(
        {
            "pipeline": unique_name.replace("_", "-"),
            "kafka": {"bootstrap_servers": kafka_bootstrap},
            "sources": [{"topic": f"{unique_name}-src"}],
            "sinks": [{"name": "out", "type": "files", "path": "/tmp/unused"}],
        }
    )
    create_topic(config.control_topic)
    return config


def _payloads(cfg: PipelineConfig) -> list[Any]:
    return [
        decode(m.value(), m.headers(), pipeline=cfg.pipeline).payload
        for m in read_topic(cfg.kafka.bootstrap_servers, cfg.control_topic)
    ]


def test_each_message_lands_in_its_own_transaction_at_the_reported_offset(
    cfg: PipelineConfig,
) -> None:
    publisher = ControlPublisher(cfg, "test-producer")
    try:
        sent = [Prepare(1, 0), Decision(1, Outcome.ABORT, reason="test"), Complete(1)]
        results = [publisher.publish(new_envelope(cfg.pipeline, "t", p)) for p in sent]
    finally:
        publisher.close()
    assert all(not r.error for r in results), results
    offsets = [r.offset for r in results]
    # Every transaction ends with a commit marker, which takes an offset of its own.
    assert offsets == [0, 2, 4], offsets
    assert _payloads(cfg) == sent


def test_a_commit_moves_the_group_s_offsets_in_the_same_transaction(
    cfg: PipelineConfig, create_topic: Any
) -> None:
    source = create_topic(cfg.source_topics[0], 2)
    group = Consumer({"bootstrap.servers": cfg.kafka.bootstrap_servers, "group.id": cfg.group_id})
    publisher = ControlPublisher(cfg, "test-producer")
    try:
        decision = Decision(
            1, Outcome.COMMIT, positions=(Position(source, 0, 7), Position(source, 1, 3))
        )
        result = publisher.publish(
            new_envelope(cfg.pipeline, "t", decision),
            offsets=[TopicPartition(source, 0, 7), TopicPartition(source, 1, 3)],
            group=group,
        )
        assert not result.error, result
        committed = group.committed([TopicPartition(source, p) for p in (0, 1)], timeout=10)
    finally:
        publisher.close()
        group.close()
    assert [(c.partition, c.offset) for c in committed] == [(0, 7), (1, 3)]


def test_a_second_publisher_fences_the_first_for_good(cfg: PipelineConfig) -> None:
    first = ControlPublisher(cfg, "test-producer")
    assert not first.publish(new_envelope(cfg.pipeline, "first", Prepare(1, 0))).error
    second = ControlPublisher(cfg, "test-producer")  # init_transactions bumps the epoch
    try:
        fenced = first.publish(new_envelope(cfg.pipeline, "first", Prepare(2, 0)), attempts=5)
        assert fenced.fenced and fenced.error and fenced.offset is None, fenced
        again = first.publish(new_envelope(cfg.pipeline, "first", Prepare(3, 0)))
        assert again.fenced, again
        assert not second.publish(new_envelope(cfg.pipeline, "second", Prepare(2, 0))).error
    finally:
        first.close()
        second.close()
    assert _payloads(cfg) == [Prepare(1, 0), Prepare(2, 0)]


@pytest.mark.parametrize(
    "commit_error",
    [
        None,  # the broker's own answer to the commit (a fence, here)
        # What Kafka 4.1 answered a fenced EndTxn with in a CI run: not a fence code.
        KafkaError(KafkaError.UNKNOWN, "Failed to end transaction: Unknown broker error"),
    ],
    ids=["as_answered", "unknown"],
)
def test_a_publisher_fenced_inside_its_transaction_says_fenced(
    cfg: PipelineConfig, commit_error: KafkaError | None
) -> None:
    """A newer instance's init_transactions lands while this one's transaction is open: whatever
    its commit then fails with, the abort after it meets the fence. The result is fenced -- the
    coordinator steps down -- not a failure to retry, whose new producer would fence the newer
    instance back and go on leading beside it (a CI run's coordinator, answered UNKNOWN, never
    stepped down). Closing the fenced publisher is no failure either."""
    first = ControlPublisher(cfg, "test-producer")
    newer: list[ControlPublisher] = []

    def newer_instance() -> None:
        newer.append(ControlPublisher(cfg, "test-producer"))  # init_transactions: a new epoch
        if commit_error is not None:
            raise KafkaException(commit_error)

    try:
        fenced = first.publish(
            new_envelope(cfg.pipeline, "first", Prepare(1, 0)), before_commit=newer_instance
        )
        assert fenced.fenced and fenced.error and fenced.offset is None, fenced
        assert not newer[0].publish(new_envelope(cfg.pipeline, "newer", Prepare(1, 0))).error
    finally:
        first.close()
        for p in newer:
            p.close()
    assert _payloads(cfg) == [Prepare(1, 0)]


@pytest.mark.parametrize(
    "error",
    [
        # What AddOffsetsToTxn answered when the transaction coordinator's node was killed.
        KafkaError(KafkaError._TRANSPORT, "Broker transport failure"),
        KafkaError(KafkaError._TIMED_OUT, "timed out", retriable=True),
        KafkaError(KafkaError._TIMED_OUT, "timed out", txn_requires_abort=True),
    ],
    ids=["neither", "retriable", "abortable"],
)
def test_a_write_that_fails_inside_its_transaction_leaves_none_open(
    cfg: PipelineConfig, error: KafkaError
) -> None:
    """Whatever fails between begin and commit, the transaction is aborted: with one left open
    every later begin_transaction was refused ("Operation not valid in state InTransaction")
    and the leader never wrote again. The failed message never becomes visible."""
    publisher = ControlPublisher(cfg, "test-producer")

    def fail() -> None:
        raise KafkaException(error)

    try:
        failed = publisher.publish(
            new_envelope(cfg.pipeline, "t", Prepare(1, 0)), before_commit=fail
        )
        assert failed.error and not failed.fenced, failed
        later = publisher.publish(new_envelope(cfg.pipeline, "t", Prepare(2, 0)))
        assert not later.error, later
    finally:
        publisher.close()
    assert _payloads(cfg) == [Prepare(2, 0)]
