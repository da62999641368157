"""The ``delta`` side of :mod:`bench.spark_writer`: Delta Lake's idempotent ``foreachBatch`` writes.

The benchmark compares the coordinated writer against it, so it must really be exactly-once: every
row once, and a batch Spark runs again (after a driver crash between the Delta commit and the
checkpoint commit) adds nothing because Delta has already seen its ``txnAppId`` / ``txnVersion``.

Delta's jars and its SQL extension are fixed when a JVM starts, and the tests' shared session
(``tests/conftest.py``) has neither, so the Spark side runs as its own driver process: this module
run with ``python -m``, printing what it saw as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.spark.helpers import REPO
from twophase.jobs.orders import order_events, produce_events

pytestmark = [pytest.mark.stack, pytest.mark.spark]

ROWS = 3000
#: maxOffsetsPerTrigger: three batches of 1,000 over two partitions.
BATCH = 1000
#: Rows of the direct replays (a slice of the table, written again under a used batch id).
SLICE = 100
#: A JVM start (~15 s on this shared 2-core machine), six small Delta commits and a few reads;
#: one run under a load of 14 on the two cores took over 300 s. Below pytest's 600 s, so a hang
#: fails here with the driver's stderr.
RUN_TIMEOUT_S = 480


def test_delta_side_writes_every_row_once_and_a_replayed_batch_adds_nothing(
    kafka_bootstrap: str,
    spark_jars: list[str],
    create_topic: Any,
    unique_name: str,
    tmp_path: Path,
) -> None:
    topic = create_topic(f"{unique_name}.raw", partitions=2)
    produce_events(kafka_bootstrap, topic, order_events(0, ROWS), partitions=2)
    env = {**os.environ, "TWOPHASE_SPARK_JARS": ",".join(spark_jars)}
    env["PYSPARK_PYTHON"] = sys.executable
    env.pop("TWOPHASE_SPARK_MASTER", None)  # local[2]: the table is a local directory
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.spark.test_delta_peer",
            "--bootstrap",
            kafka_bootstrap,
            "--topic",
            topic,
            "--work",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])

    # The stream: every row once, one Delta commit per batch.
    first = got["stream"]
    assert first["batch_ids"] == list(range(len(first["batch_ids"])))
    assert len(first["batch_ids"]) >= 2, "one batch: nothing to replay"
    assert (first["rows"], first["ids"]) == (ROWS, ROWS)

    # Spark runs the last batch again (checkpoint rewound as a crash leaves it); Delta skips it.
    replay = got["stream_replay"]
    assert replay["batch_ids"] == [first["batch_ids"][-1]], "Spark did not replay the batch"
    assert (replay["rows"], replay["ids"]) == (ROWS, ROWS)

    # The same rows written again under a batch id already committed: nothing added.
    assert (got["direct_replay"]["rows"], got["direct_replay"]["ids"]) == (ROWS, ROWS)
    # ...and under a new batch id they are added: the counts above would see a duplicate.
    assert (got["new_batch"]["rows"], got["new_batch"]["ids"]) == (ROWS + SLICE, ROWS)

    # Delta's log: one commit per stream batch and one for the new batch, none for the replays.
    assert got["commits"] == len(first["batch_ids"]) + 1


# -- the driver process ---------------------------------------------------------------------------


def _driver(bootstrap: str, topic: str, work: Path) -> dict[str, Any]:
    from bench.spark_writer import delta_counts, delta_session, delta_writer
    from twophase.jobs.orders import enrich, read_orders, rewind_checkpoint
    from twophase.jobs.orders_writer import ORDER_COLUMNS

    spark = delta_session("twophase-test-delta-peer")
    table, checkpoint, app_id = str(work / "orders-delta"), work / "checkpoint", "orders-delta"
    write = delta_writer(table, app_id)
    out: dict[str, Any] = {}
    try:
        for step in ("stream", "stream_replay"):
            seen: list[int] = []

            def batch(df: Any, batch_id: int, seen: list[int] = seen) -> None:
                seen.append(batch_id)
                write(df, batch_id)

            orders = enrich(
                read_orders(spark, bootstrap=bootstrap, topic=topic, max_offsets_per_trigger=BATCH)
            ).select(*ORDER_COLUMNS)
            query = (
                orders.writeStream.foreachBatch(batch)
                .option("checkpointLocation", str(checkpoint))
                .trigger(availableNow=True)
                .start()
            )
            query.awaitTermination()
            rows, ids = delta_counts(spark, table)
            out[step] = {"batch_ids": seen, "rows": rows, "ids": ids}
            if step == "stream":
                # What a driver crash after Delta's commit and before Spark's leaves behind.
                rewind_checkpoint(checkpoint, seen[-1])

        last = out["stream"]["batch_ids"][-1]
        rows_again = spark.read.format("delta").load(table).orderBy("id").limit(SLICE)
        rows_again = spark.createDataFrame(rows_again.collect(), rows_again.schema)
        write(rows_again, 0)
        out["direct_replay"] = dict(zip(("rows", "ids"), delta_counts(spark, table), strict=True))
        write(rows_again, last + 1)
        out["new_batch"] = dict(zip(("rows", "ids"), delta_counts(spark, table), strict=True))
        history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").collect()
        out["commits"] = sum(1 for h in history if h["operation"] == "WRITE")
    finally:
        spark.stop()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--work", required=True, type=Path)
    a = ap.parse_args()
    print(json.dumps(_driver(a.bootstrap, a.topic, a.work)), flush=True)
