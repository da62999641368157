"""The Spark half of ``make demo``: :func:`run_spark_demo`, or ``python -m harness.spark_demo``.

1. **A Spark job feeds a pipeline.** Order events go to a raw topic; the order-totals job
   (:mod:`twophase.jobs.orders`) writes per-customer, per-minute totals into the pipeline's source topic
   through Spark's Kafka sink; one batch is delivered twice, as after a crash between the write
   and the checkpoint; a coordinator and a participant upsert the totals into PostgreSQL. Verified
   against totals computed without Spark: exactly one row per window and customer, right values.
2. **The coordinated foreachBatch writer.** The same events, parsed and enriched, are written by
   :func:`twophase.participants.spark.coordinated_writer` into MongoDB, Parquet files and PostgreSQL at
   once, one transaction per micro-batch. The driver is killed (SIGKILL) in the middle of a batch
   with every part prepared, and restarted from its checkpoint. Verified sink by sink: every order
   exactly once, nothing left prepared or staged.

Returns 0 when both are verified, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import yaml
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from harness import (
    Cluster,
    Scenario,
    end_offsets,
    group_offsets,
    load_stack_env,
    wait_until,
)
from twophase.config import load_config
from twophase.jobs.orders import (
    expected_totals,
    order_events,
    produce_events,
    rewind_checkpoint,
    start_order_totals,
    stored_totals,
    totals_table_ddl,
)
from twophase.jobs.orders_writer import orders_table_ddl, writer_config, writer_process
from twophase.jobs.verify import check_sinks
from twophase.kafka import create_topics
from twophase.participants.spark import load_spark_config

__all__ = ["deliver_totals", "run_spark_demo", "totals_pipeline"]

REPO = Path(__file__).resolve().parents[1]
#: One writer process: a JVM start and a few batches on a small shared machine.
WRITER_RUN_TIMEOUT_S = 600


def run_spark_demo(
    *,
    events: int = 3000,
    workdir: str | Path | None = None,
    kill_driver: bool = True,
    out: Callable[[str], None] = print,
) -> int:
    """Run both demos on the local stack (``make stack-up``); 0 when everything verified."""
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="twophase-spark-demo-"))
    stack = load_stack_env()
    bootstrap = stack["TWOPHASE_KAFKA_BOOTSTRAP"]
    run_id = uuid.uuid4().hex[:6]
    raw = f"spark-demo-{run_id}.raw"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(raw, num_partitions=2, replication_factor=1)])[raw].result()
    sent = order_events(0, events)
    produce_events(bootstrap, raw, sent, partitions=2)
    out(f"Spark demo: {events} order events in {raw}; work directory {base}")
    started = time.monotonic()
    ok = _job_feeds_pipeline(base / "job", stack, raw, sent, run_id, out)
    ok = _coordinated_writer(base / "writer", stack, raw, events, run_id, kill_driver, out) and ok
    out(f"\nSPARK DEMO {'VERIFIED' if ok else 'FAILED'} ({time.monotonic() - started:.0f}s)")
    return 0 if ok else 1


def totals_pipeline(name: str, workdir: Path) -> Scenario:
    """A twophase pipeline that upserts the totals job's output into PostgreSQL, keyed by
    (customer, window): its config written, its topics created, its table fresh."""
    s = Scenario.on_stack(name, workdir, mongo=False, files=False)
    s.extra = {
        "sinks": [
            {
                "name": "pg",
                "type": "postgres",
                "dsn": s.pg_dsn,
                "table": s.table,
                "mode": "upsert",
                "key": ["customer", "window_start"],
            }
        ],
        "commit": {"interval_ms": 500, "vote_timeout_ms": 15_000},
    }
    s.write()
    create_topics(load_config(s.config_path))
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {s.table}")
        conn.execute(totals_table_ddl(s.table))
    return s


def deliver_totals(
    s: Scenario, expected: dict[Any, Any], timeout_s: float, out: Callable[[str], None]
) -> dict[Any, Any]:
    """Run a coordinator and a participant until the pipeline has committed its whole source
    topic and PostgreSQL holds ``expected``; the stored totals. On a timeout the processes'
    log tails go to ``out`` and the TimeoutError is raised."""
    cluster = Cluster(s)
    cluster.start("coordinator", "coordinator-0")
    cluster.start("participant", "participant-0")
    try:
        wait_until(
            lambda: (
                group_offsets(s.bootstrap, f"twophase.{s.name}", s.topic, s.partitions)
                == end_offsets(s.bootstrap, s.topic, s.partitions)
            ),
            timeout_s,
            "the pipeline to commit its whole source topic",
        )
        wait_until(lambda: stored_totals(s.pg_dsn, s.table) == expected, 60, "the totals")
    except TimeoutError:
        for name in cluster.procs:
            out(f"--- {name}\n{cluster.log_tail(name, 30)}")
        raise
    finally:
        cluster.stop_all()
    return stored_totals(s.pg_dsn, s.table)


def _job_feeds_pipeline(
    workdir: Path,
    stack: dict[str, str],
    raw: str,
    sent: list[dict[str, Any]],
    run_id: str,
    out: Callable[[str], None],
) -> bool:
    from twophase.jobs.session import local_session

    out("\n1. A Structured Streaming job feeds a twophase pipeline (Spark -> Kafka -> sinks)")
    s = totals_pipeline(f"spark-job-{run_id}", workdir)
    checkpoint = workdir / "checkpoint"
    os.environ.setdefault("TWOPHASE_SPARK_JARS", stack.get("TWOPHASE_SPARK_JARS", ""))
    spark = local_session("twophase-spark-demo")
    try:
        started = time.monotonic()
        progress = _run_totals(spark, s, raw, checkpoint)
        batches = [p for p in progress if p["numInputRows"] > 0]
        written = sum(int(p["sink"].get("numOutputRows", 0) or 0) for p in progress)
        out(
            f"   job: {len(batches)} micro-batches, {written} window updates -> {s.topic} "
            f"(1-minute windows per customer, watermark 10 minutes, output mode update) "
            f"in {time.monotonic() - started:.0f}s"
        )
        last = batches[-1]["batchId"]
        rewind_checkpoint(checkpoint, last)
        again = _run_totals(spark, s, raw, checkpoint)
        replayed = sum(int(p["sink"].get("numOutputRows", 0) or 0) for p in again)
        out(
            f"   crash simulated after the Kafka write of batch {last}, before its checkpoint "
            f"commit: the restart wrote its {replayed} records again (at-least-once)"
        )
    finally:
        # The state store's maintenance thread logs a harmless error when the context stops
        # under it; keep the demo's output to what matters.
        spark.sparkContext.setLogLevel("OFF")
        spark.stop()

    expected = expected_totals(sent)
    try:
        got = deliver_totals(s, expected, 300, out)
    except TimeoutError as exc:
        out(f"   FAILED: {exc}")
        return False
    out(
        f"   pipeline {s.name} upserted into PostgreSQL {s.table}: {len(got)} rows for "
        f"{len(expected)} (customer, window) keys, every total equal to one computed without "
        "Spark -- the replayed batch left no duplicate"
    )
    return got == expected


def _run_totals(spark: Any, s: Scenario, raw: str, checkpoint: Path) -> list[dict[str, Any]]:
    query = start_order_totals(
        spark,
        bootstrap=s.bootstrap,
        raw_topic=raw,
        out_topic=s.topic,
        checkpoint=str(checkpoint),
        max_offsets_per_trigger=1000,
    )
    query.awaitTermination()
    return list(query.recentProgress)


def _coordinated_writer(
    workdir: Path,
    stack: dict[str, str],
    raw: str,
    events: int,
    run_id: str,
    kill_driver: bool,
    out: Callable[[str], None],
) -> bool:
    out("\n2. The coordinated foreachBatch writer: one transaction per micro-batch, three sinks")
    workdir.mkdir(parents=True, exist_ok=True)
    pipeline = f"spark-writer-{run_id}"
    table = f"spark_writer_{run_id}_orders"
    with psycopg.connect(stack["TWOPHASE_PG_DSN"], autocommit=True) as conn:
        conn.execute(orders_table_ddl(table))
    config = workdir / "pipeline.yaml"
    config.write_text(
        yaml.safe_dump(
            writer_config(
                pipeline,
                bootstrap=stack["TWOPHASE_KAFKA_BOOTSTRAP"],
                pg_dsn=stack["TWOPHASE_PG_DSN"],
                pg_table=table,
                files_path=workdir / "files",
                mongo_uri=stack["TWOPHASE_MONGO_URI"],
                mongo_database=table,
            ),
            sort_keys=False,
        )
    )
    cfg = load_spark_config(config)
    out(
        f"   pipeline {pipeline}: MongoDB {table}.orders, Parquet under {workdir / 'files'}, "
        f"PostgreSQL {table}; batches of {events // 4} orders"
    )
    expected = set(range(events))
    if kill_driver:
        run = _writer_run(config, raw, workdir, events, crash_at="spark_after_prepare:2")
        if run.returncode != -signal.SIGKILL:
            out(f"   FAILED: the driver was to be killed, exit status {run.returncode}")
            out(run.stderr[-3000:])
            return False
        mid = check_sinks(cfg, expected)
        out(
            f"   run 1: driver SIGKILLed in batch 1 after every executor prepared its part "
            f"(before the decision): {mid['pg'].prepared} parts prepared in PostgreSQL, "
            f"{mid['pg'].rows} rows committed"
        )
    run = _writer_run(config, raw, workdir, events)
    if run.returncode != 0:
        out(f"   FAILED: exit status {run.returncode}")
        out(run.stderr[-3000:])
        return False
    if kill_driver:
        out(
            "   run 2: restarted from the checkpoint; the dead attempt's parts were aborted, "
            "batch 1 written again, the rest followed"
        )
    checks = check_sinks(cfg, expected)
    out("")
    out(
        f"   {'sink':8} {'rows':>6} {'distinct':>8} {'dupes':>6} {'missing':>7} "
        f"{'prepared':>8} {'staged':>6}"
    )
    for name, c in checks.items():
        out(
            f"   {name:8} {c.rows:6d} {c.distinct:8d} {c.duplicated:6d} {c.missing:7d} "
            f"{c.prepared:8d} {c.staged:6d}"
        )
    ok = all(c.ok for c in checks.values())
    out("   every order exactly once in every sink" if ok else "   VERIFICATION FAILED")
    return ok


def _writer_run(
    config: Path, raw: str, workdir: Path, events: int, crash_at: str = ""
) -> subprocess.CompletedProcess[str]:
    command, env = writer_process(
        config, raw, workdir / "checkpoint", max(1, events // 4), crash_at
    )
    with (workdir / "writer.log").open("a") as log:
        run = subprocess.run(
            command,
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.PIPE,
            text=True,
            timeout=WRITER_RUN_TIMEOUT_S,
        )
    with (workdir / "writer.log").open("a") as log:
        log.write(run.stderr)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.spark_demo", description=__doc__)
    ap.add_argument("--events", type=int, default=3000)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--no-kill", action="store_true", help="do not kill the writer's driver")
    args = ap.parse_args(argv)
    return run_spark_demo(
        events=args.events, workdir=args.workdir or None, kill_driver=not args.no_kill
    )


if __name__ == "__main__":
    sys.exit(main())
