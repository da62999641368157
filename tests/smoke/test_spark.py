"""PySpark Structured Streaming through the Kafka connector that `make stack-up` fetches."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyspark
import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

pytestmark = [pytest.mark.stack, pytest.mark.spark]

CreateTopic = Callable[..., str]
TIMEOUT_S = 30.0


def test_pyspark_matches_the_connector(stack_env: dict[str, str]) -> None:
    assert pyspark.__version__ == stack_env["TWOPHASE_SPARK_VERSION"]


def test_stream_reads_one_topic_and_writes_another(
    spark: Any,
    kafka_bootstrap: str,
    create_topic: CreateTopic,
    unique_name: str,
    tmp_path: Path,
) -> None:
    source = create_topic(f"{unique_name}-in", 2)
    sink = create_topic(f"{unique_name}-out", 1)
    sent = {f"record-{i}" for i in range(20)}
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i, value in enumerate(sorted(sent)):
        producer.produce(source, value.encode(), partition=i % 2)
    producer.flush(TIMEOUT_S)

    stream = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", source)
        .option("startingOffsets", "earliest")
        .load()
        .selectExpr("upper(CAST(value AS STRING)) AS value")
    )
    query = (
        stream.writeStream.format("kafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("topic", sink)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(120), "availableNow query did not finish in 120 s"
        assert query.exception() is None
    finally:
        query.stop()

    assert _read_all(kafka_bootstrap, sink) == {value.upper() for value in sent}


def _read_all(bootstrap: str, topic: str) -> set[str]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"{topic}-check",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        values: set[str] = set()
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    return values
                raise KafkaException(msg.error())
            values.add(msg.value().decode())
        raise TimeoutError(f"no end of {topic} within {TIMEOUT_S}s")
    finally:
        consumer.close()
