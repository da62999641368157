"""A participant's writes to the control and reply topics (:class:`twophase.kafka.ControlWriter`),
against the real Kafka of the local stack: replies go to partition 0 of the reply topic the
coordinator named, DRAINED always to the control topic, and a reply topic that refuses the
writes (here: one that does not exist) is given up for the control topic, which the coordinator
reads too -- the vote is not lost and the process does not stop."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import Producer

from tests.e2e.e2e_support import read_topic
from twophase.config import PipelineConfig, parse_config
from twophase.kafka import ControlWriter, client_settings
from twophase.protocol.codec import decode
from twophase.protocol.messages import Applied, Drained, Vote, VoteValue

pytestmark = pytest.mark.stack


@pytest.fixture
def cfg(kafka_bootstrap: str, create_topic: Any, unique_name: str) -> PipelineConfig:
    """A pipeline of its own, with its control topic and a reply topic of three partitions
    (the writer must still use partition 0, the one the coordinator reads)."""
    config = parse_config(
        {
            "pipeline": unique_name.replace("_", "-"),
            "kafka": {"bootstrap_servers": kafka_bootstrap},
            "sources": [{"topic": f"{unique_name}-src"}],
            "sinks": [{"name": "out", "type": "files", "path": "/tmp/unused"}],
        }
    )
    create_topic(config.control_topic)
    create_topic(config.reply_topic, partitions=3)
    return config


def _writer(cfg: PipelineConfig, **settings: Any) -> ControlWriter:
    producer = Producer(
        client_settings(cfg, "participant", **{"enable.idempotence": True, **settings})
    )
    return ControlWriter(cfg, "participant:p-0", producer)


def _types(cfg: PipelineConfig, topic: str, partitions: int = 1) -> list[tuple[int, str]]:
    return [
        (
            m.partition(),
            type(decode(m.value(), m.headers(), pipeline=cfg.pipeline).payload).__name__,
        )
        for m in read_topic(cfg.kafka.bootstrap_servers, topic, partitions=partitions)
    ]


VOTE = Vote(txn=1, participant="p-0", generation=1, member_id="m", vote=VoteValue.ABORT)


def test_replies_go_to_partition_0_of_the_named_topic_and_drained_to_the_control_topic(
    cfg: PipelineConfig,
) -> None:
    w = _writer(cfg)
    assert w.send(VOTE).reply_to == ""  # nothing named yet: the control topic
    w.reply_to = cfg.reply_topic
    sent = [w.send(VOTE), w.send(Applied(1, "p-0", "p-0"))]
    w.post(Drained(after_txn=1, participant="p-0", generation=1))
    w.producer.flush(10)
    assert [e.reply_to for e in sent] == [cfg.reply_topic] * 2
    assert _types(cfg, cfg.reply_topic, partitions=3) == [(0, "Vote"), (0, "Applied")]
    assert _types(cfg, cfg.control_topic) == [(0, "Vote"), (0, "Drained")]


def test_a_reply_topic_that_refuses_the_writes_is_given_up_for_the_control_topic(
    cfg: PipelineConfig,
) -> None:
    # librdkafka waits this long for a topic it does not find before it fails the writes
    # (default 30 s; a topic just made may not be known to every broker yet).
    w = _writer(cfg, **{"topic.metadata.propagation.max.ms": 1000})
    w.reply_to = f"{cfg.reply_topic}-not-there"
    sent = w.send(VOTE)  # refused there, sent again to the control topic: not lost, no error
    assert sent.reply_to == ""
    assert w.send(Applied(1, "p-0", "p-0")).reply_to == ""  # and the next goes there at once
    w.reply_to = cfg.reply_topic  # a coordinator naming another topic: that one is used
    assert w.send(VOTE).reply_to == cfg.reply_topic
    assert _types(cfg, cfg.control_topic) == [(0, "Vote"), (0, "Applied")]
    assert _types(cfg, cfg.reply_topic, partitions=3) == [(0, "Vote")]


def test_a_reply_topic_given_up_is_tried_again_once_the_coordinator_stopped_naming_it(
    cfg: PipelineConfig,
) -> None:
    """The coordinator gave it up too (its messages name none), then names it again (made
    again): this writer tries it again."""
    w = _writer(cfg, **{"topic.metadata.propagation.max.ms": 1000})
    missing = f"{cfg.reply_topic}-later"
    w.reply_to = missing
    assert w.send(VOTE).reply_to == ""  # refused: given up
    w.reply_to = missing
    assert w.send(VOTE).reply_to == ""  # still given up while it is named
    w.reply_to = ""  # a coordinator message naming no reply topic
    w.reply_to = missing  # and one naming it again: tried again, and librdkafka, which knows
    assert w.send(VOTE).reply_to == ""  # it is missing, refuses it in produce() itself
    w.reply_to = ""
    w.reply_to = cfg.reply_topic  # a topic that is there
    assert w.send(VOTE).reply_to == cfg.reply_topic
    assert [t for _, t in _types(cfg, cfg.control_topic)] == ["Vote"] * 3
