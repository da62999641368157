"""Rows per second of the coordinated ``foreachBatch`` writer against plain ``foreachBatch`` code.

Same run, same SparkSession, same stream (order events from Kafka, parsed and enriched as in
:mod:`twophase.jobs.orders_writer`), same PostgreSQL table layout, one fresh table per run:

* ``plain-rows``    -- what people write by hand: ``df.foreachPartition`` over Rows, psycopg
                       ``COPY`` per partition, one local transaction each (at-least-once).
* ``plain-json``    -- the same COPY, fed the JSON lines the coordinated writer uses, so the
                       difference to ``coordinated`` is the protocol and the sink's write path
                       (per-value conversion, savepoint, prepare), not the transport.
* ``coordinated``   -- :func:`twophase.participants.spark.coordinated_writer` with one PostgreSQL sink:
                       PREPARE, parts prepared on the executors, DECISION, COMMIT PREPARED,
                       COMPLETE (exactly-once, all-or-nothing).

Rows/s = rows written / time spent inside the ``foreachBatch`` calls (reading Kafka and parsing
happen inside them too, equally for all). Runs alternate so a noisy neighbour hurts all alike.

    python -m bench.spark_writer --rows 200000 --batch 50000 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg
import yaml
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from harness import load_stack_env
from twophase.jobs.orders import enrich, order_events, produce_events, read_orders
from twophase.jobs.orders_writer import ORDER_COLUMNS, orders_table_ddl, writer_config
from twophase.participants.spark import coordinated_writer, load_spark_config
from twophase.participants.spark.writer import _json_lines

COPY_COLUMNS = ", ".join(ORDER_COLUMNS)


def _copy_rows(dsn: str, table: str, rows: Iterator[Any]) -> None:
    with (
        psycopg.connect(dsn) as conn,
        conn.cursor() as cur,
        cur.copy(f"COPY {table} ({COPY_COLUMNS}) FROM STDIN") as copy,
    ):
        for row in rows:
            copy.write_row(tuple(row))


def _copy_json(dsn: str, table: str, lines: Iterator[str]) -> Iterator[int]:
    n = 0
    with (
        psycopg.connect(dsn) as conn,
        conn.cursor() as cur,
        cur.copy(f"COPY {table} ({COPY_COLUMNS}) FROM STDIN") as copy,
    ):
        for line in lines:
            v = orjson.loads(line)
            copy.write_row(tuple(v[c] for c in ORDER_COLUMNS))
            n += 1
    yield n


@dataclass
class Timed:
    """Wraps a foreachBatch function and adds up the time spent in it."""

    fn: Callable[[Any, int], None]
    seconds: float = 0.0
    batches: int = 0
    per_batch: list[float] = field(default_factory=list)

    def __call__(self, df: Any, batch_id: int) -> None:
        started = time.perf_counter()
        self.fn(df, batch_id)
        took = time.perf_counter() - started
        self.seconds += took
        self.batches += 1
        self.per_batch.append(took)


def _plain_rows(dsn: str, table: str) -> Callable[[Any, int], None]:
    def write(df: Any, _batch_id: int) -> None:
        df.foreachPartition(lambda rows: _copy_rows(dsn, table, rows))

    return write


def _plain_json(dsn: str, table: str) -> Callable[[Any, int], None]:
    def write(df: Any, _batch_id: int) -> None:
        _json_lines(df).mapPartitions(lambda lines: _copy_json(dsn, table, lines)).collect()

    return write


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark_writer", description=__doc__)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=50_000, help="maxOffsetsPerTrigger")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="uncounted rounds first (JIT, workers)")
    ap.add_argument("--json", default="", help="also write the results to this file")
    ap.add_argument("--verbose", action="store_true", help="log the writer's phase timings")
    args = ap.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
        logging.getLogger("twophase.spark").setLevel(logging.INFO)

    from twophase.jobs.session import local_session

    env = load_stack_env()
    bootstrap, dsn = env["TWOPHASE_KAFKA_BOOTSTRAP"], env["TWOPHASE_PG_DSN"]
    run_id = uuid.uuid4().hex[:6]
    raw = f"bench-spark-{run_id}.raw"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(raw, num_partitions=2, replication_factor=1)])[raw].result()
    produce_events(bootstrap, raw, order_events(0, args.rows), partitions=2)
    workdir = Path(tempfile.mkdtemp(prefix="twophase-bench-spark-"))
    os.environ.setdefault("TWOPHASE_SPARK_JARS", env.get("TWOPHASE_SPARK_JARS", ""))
    spark = local_session("twophase-bench-spark-writer")
    results: dict[str, list[dict[str, float]]] = {
        "plain-rows": [],
        "plain-json": [],
        "coordinated": [],
    }
    try:
        for round_no in range(-args.warmup, args.rounds):
            for kind in results:
                name = f"bench_{run_id}_{round_no + args.warmup}_{kind.replace('-', '_')}"
                table = f"{name}_orders"
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(orders_table_ddl(table))
                if kind == "coordinated":
                    config = workdir / f"{name}.yaml"
                    pipeline = name.replace("_", "-")
                    config.write_text(
                        yaml.safe_dump(
                            writer_config(pipeline, bootstrap=bootstrap, pg_dsn=dsn, pg_table=table)
                        )
                    )
                    timed = Timed(coordinated_writer(load_spark_config(config)))
                elif kind == "plain-rows":
                    timed = Timed(_plain_rows(dsn, table))
                else:
                    timed = Timed(_plain_json(dsn, table))
                orders = enrich(
                    read_orders(
                        spark, bootstrap=bootstrap, topic=raw, max_offsets_per_trigger=args.batch
                    )
                ).select(*ORDER_COLUMNS)
                started = time.perf_counter()
                query = (
                    orders.writeStream.foreachBatch(timed)
                    .option("checkpointLocation", str(workdir / f"{name}-checkpoint"))
                    .trigger(availableNow=True)
                    .start()
                )
                query.awaitTermination()
                wall = time.perf_counter() - started
                with psycopg.connect(dsn, autocommit=True) as conn:
                    got = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
                    conn.execute(f"DROP TABLE {table}")
                rows = int(got[0]) if got else 0
                if rows != args.rows:
                    print(f"{kind}: wrote {rows} rows, expected {args.rows}", file=sys.stderr)
                    return 1
                entry = {
                    "rows": rows,
                    "batches": timed.batches,
                    "seconds_in_foreach_batch": round(timed.seconds, 3),
                    "rows_per_s": round(rows / timed.seconds),
                    "query_wall_s": round(wall, 3),
                }
                if round_no >= 0:
                    results[kind].append(entry)
                label = f"round {round_no}" if round_no >= 0 else "warm-up"
                print(f"{label:8} {kind:12} {json.dumps(entry)}", flush=True)
    finally:
        spark.stop()
        admin.delete_topics([raw])

    summary = {k: statistics.median(e["rows_per_s"] for e in v) for k, v in results.items()}
    print()
    print(f"{'writer':14} {'rows/s (median of ' + str(args.rounds) + ')':>26}")
    for kind, rate in summary.items():
        print(f"{kind:14} {rate:26,.0f}")
    ratio_rows = summary["coordinated"] / summary["plain-rows"]
    ratio_json = summary["coordinated"] / summary["plain-json"]
    print(f"\ncoordinated / plain-rows = {ratio_rows:.2f}")
    print(f"coordinated / plain-json = {ratio_json:.2f}  (protocol + the sink's write path)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "runs": results,
                    "rows_per_s": summary,
                    "ratio_vs_plain_rows": ratio_rows,
                    "ratio_vs_plain_json": ratio_json,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
