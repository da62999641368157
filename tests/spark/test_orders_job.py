"""The order-totals job feeding a twophase pipeline: Spark -> Kafka -> participants -> PostgreSQL.

Spark's Kafka sink is at-least-once. The test makes it deliver a batch twice, exactly as after a
crash between writing and checkpointing, and shows that the pipeline (coordinator and participant
processes, upsert mode) still ends with exactly one row per key holding the right totals.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from harness import Scenario
from harness.spark_demo import deliver_totals, totals_pipeline
from tests.spark.helpers import read_topic
from twophase.jobs.orders import (
    expected_totals,
    order_events,
    produce_events,
    rewind_checkpoint,
    start_order_totals,
)

pytestmark = [pytest.mark.stack, pytest.mark.spark]

JOB_TIMEOUT_S = 240


def _run_job(spark: Any, s: Scenario, raw: str, checkpoint: Path) -> list[dict[str, Any]]:
    query = start_order_totals(
        spark,
        bootstrap=s.bootstrap,
        raw_topic=raw,
        out_topic=s.topic,
        checkpoint=str(checkpoint),
        max_offsets_per_trigger=200,
    )
    try:
        assert query.awaitTermination(JOB_TIMEOUT_S), "availableNow job did not finish"
        assert query.exception() is None
    finally:
        query.stop()
    return list(query.recentProgress)


def test_job_replay_is_absorbed_by_upserts_exactly_one_row_per_key(
    spark: Any, tmp_path: Path, pg_dsn: str, create_topic: Any, unique_name: str
) -> None:
    s = totals_pipeline(f"job-{uuid.uuid4().hex[:6]}", tmp_path)

    raw = create_topic(f"{unique_name}-raw", 2)
    events = order_events(0, 800)
    produce_events(s.bootstrap, raw, events, partitions=2)
    checkpoint = tmp_path / "checkpoint"

    progress = _run_job(spark, s, raw, checkpoint)
    first = len(read_topic(s.bootstrap, s.topic, s.partitions))
    last_data = max(p["batchId"] for p in progress if p["numInputRows"] > 0)
    rewind_checkpoint(checkpoint, last_data)
    _run_job(spark, s, raw, checkpoint)
    records = read_topic(s.bootstrap, s.topic, s.partitions)
    replayed = len(records) - first
    assert replayed > 0, "the replayed batch wrote its records again"
    keys = {k for k, _v, _h in records}
    assert len(keys) < len(records), "the source topic holds the same key more than once"

    expected = expected_totals(events)
    got = deliver_totals(s, expected, 180, print)
    print(f"{len(records)} records ({replayed} replayed) -> {len(got)} rows, {len(keys)} keys")
    assert len(got) == len(keys) == len(expected)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        prepared = conn.execute(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s", (f"%:{s.name}~%",)
        ).fetchone()
    assert prepared is not None and prepared[0] == 0
