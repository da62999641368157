"""Orders straight into a pipeline's sinks with the coordinated ``foreachBatch`` writer.

The raw order events are parsed and enriched (:mod:`twophase.jobs.orders`) and every micro-batch is
written into all the sinks of a Spark pipeline (PostgreSQL, files, MongoDB, ...) as one
transaction by :func:`twophase.participants.spark.coordinated_writer`: exactly once, all or nothing.

Run as a process (the crash tests and the demo kill it and start it again)::

    python -m twophase.jobs.orders_writer --config spark-pipeline.yaml --raw-topic orders.raw \\
        --checkpoint /tmp/ck --max-offsets-per-trigger 500

Exit status 0 when the query processed everything available and stopped, 1 when it failed (the
error is printed; a :class:`~twophase.participants.spark.TwophaseBatchError` names the sink and reason).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twophase.jobs.orders import enrich, read_orders
from twophase.participants.spark import coordinated_writer, load_spark_config

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

__all__ = [
    "ORDER_COLUMNS",
    "main",
    "orders_table_ddl",
    "start_orders_writer",
    "writer_config",
    "writer_process",
]

#: Columns each order carries into the sinks (``event_time`` as an ISO-8601 string in JSON).
ORDER_COLUMNS = ("id", "customer", "amount", "currency", "amount_eur", "event_time", "note")


def orders_table_ddl(table: str) -> str:
    """A PostgreSQL table for the orders; the CHECK is what the abort test trips on purpose."""
    return (
        f"CREATE TABLE {table} (id bigint NOT NULL, customer text NOT NULL, "
        "amount numeric(12,2) NOT NULL CONSTRAINT amount_not_negative CHECK (amount >= 0), "
        "currency text, amount_eur numeric(14,2), event_time timestamptz, note text)"
    )


def writer_config(
    pipeline: str,
    *,
    bootstrap: str,
    pg_dsn: str | None = None,
    pg_table: str = "",
    files_path: str | Path | None = None,
    mongo_uri: str | None = None,
    mongo_database: str = "",
    hmac_key: str = "spark-demo-hmac-key",
) -> dict[str, Any]:
    """A Spark pipeline's config: no sources (the stream is the source), the sinks asked for,
    in this order: MongoDB, files, PostgreSQL."""
    sinks: list[dict[str, Any]] = []
    if mongo_uri:
        sinks.append(
            {
                "name": "mongo",
                "type": "mongodb",
                "uri": mongo_uri,
                "database": mongo_database or pipeline.replace(".", "_"),
                "collection": "orders",
            }
        )
    if files_path is not None:
        sinks.append({"name": "files", "type": "files", "path": str(files_path)})
    if pg_dsn:
        sinks.append({"name": "pg", "type": "postgres", "dsn": pg_dsn, "table": pg_table})
    return {
        "pipeline": pipeline,
        "kafka": {"bootstrap_servers": bootstrap},
        "control": {"hmac_key": hmac_key, "replication_factor": 1},
        "metrics": {"port": 0},
        "sinks": sinks,
    }


def start_orders_writer(
    spark: SparkSession,
    *,
    config: str | Path,
    bootstrap: str,
    raw_topic: str,
    checkpoint: str,
    max_offsets_per_trigger: int | None = None,
    available_now: bool = True,
) -> StreamingQuery:
    """Start the query; every micro-batch is one coordinated transaction of the pipeline."""
    orders = enrich(
        read_orders(
            spark,
            bootstrap=bootstrap,
            topic=raw_topic,
            max_offsets_per_trigger=max_offsets_per_trigger,
        )
    ).select(*ORDER_COLUMNS)
    writer = (
        orders.writeStream.foreachBatch(coordinated_writer(load_spark_config(config)))
        .option("checkpointLocation", checkpoint)
        .queryName(f"orders-writer-{Path(config).stem}")
    )
    writer = (
        writer.trigger(availableNow=True)
        if available_now
        else writer.trigger(processingTime="5 seconds")
    )
    return writer.start()


def writer_process(
    config: Path, raw: str, checkpoint: Path, max_offsets: int, crash_at: str = "", **env: str
) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run this module as its own driver process (what the
    demo and the driver-crash tests start): executors use this interpreter, and
    ``TWOPHASE_CRASH_AT`` is set only when ``crash_at`` asks for a crash point."""
    full = {**os.environ, "PYSPARK_PYTHON": sys.executable, **env}
    full.pop("TWOPHASE_CRASH_AT", None)
    if crash_at:
        full["TWOPHASE_CRASH_AT"] = crash_at
    command = [
        sys.executable,
        "-m",
        "twophase.jobs.orders_writer",
        "--config",
        str(config),
        "--raw-topic",
        raw,
        "--checkpoint",
        str(checkpoint),
        "--max-offsets-per-trigger",
        str(max_offsets),
    ]
    return command, full


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m twophase.jobs.orders_writer", description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--bootstrap", default="")
    ap.add_argument("--raw-topic", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--max-offsets-per-trigger", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    logging.getLogger("py4j").setLevel(logging.WARNING)
    from twophase.jobs.session import local_session

    bootstrap = args.bootstrap or load_spark_config(args.config).kafka.bootstrap_servers
    spark = local_session("twophase-orders-writer")
    query = start_orders_writer(
        spark,
        config=args.config,
        bootstrap=bootstrap,
        raw_topic=args.raw_topic,
        checkpoint=args.checkpoint,
        max_offsets_per_trigger=args.max_offsets_per_trigger or None,
    )
    try:
        query.awaitTermination()
    except Exception as exc:  # noqa: BLE001 - reported as the exit status, with the cause
        print(f"query failed: {exc}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
