"""Rows per second of the coordinated ``foreachBatch`` writer against plain ``foreachBatch`` code
and against Delta Lake's idempotent ``foreachBatch`` writes.

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
* ``delta``         -- Delta Lake's own exactly-once recipe: ``df.write.format("delta")`` appends
                       with ``txnAppId`` / ``txnVersion`` = the batch id, so a replayed batch is a
                       no-op; one fresh local table directory per run. The peer the issue sets
                       the target against (coordinated / delta >= 0.9). Its jars come from
                       ``bench/peers/delta/pom.xml`` through ``bench/peers/fetch.sh``, and the
                       session gets Delta's extension and catalog (:data:`DELTA_CONF`) -- only when
                       this side runs, so ``--sides`` without it measures the others in a session
                       without Delta.

After every run the rows are counted back (PostgreSQL: rows; Delta: rows and distinct ids).
Rows/s = rows written / time spent inside the ``foreachBatch`` calls (reading Kafka and parsing
happen inside them too, equally for all). Runs alternate so a noisy neighbour hurts all alike.

    python -m bench.spark_writer --rows 200000 --batch 50000 --rounds 2
    python -m bench.spark_writer --sides plain-rows,plain-json,coordinated   # no Delta
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
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
SIDES = ("plain-rows", "plain-json", "coordinated", "delta")
PEERS = Path(__file__).resolve().parent / "peers"
#: Static session settings Delta needs (its SQL extension and catalog: without them a Delta write
#: fails at once), and one runtime setting: Delta rebuilds a table's state (which also holds the
#: txnAppId -> txnVersion map it checks) in ``snapshotPartitions`` tasks, 50 by default, sized for
#: clusters. The session runs two shuffle partitions on this small machine; Delta gets the same,
#: which made its appends 2-3x faster here -- the peer is measured tuned, not at a default that
#: hurts it.
DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.databricks.delta.snapshotPartitions": "2",
}


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


def delta_jars() -> list[str]:
    """Delta Lake's jars, fetched by ``bench/peers/fetch.sh`` on first use (cached)."""
    out = subprocess.run(
        ["bash", str(PEERS / "fetch.sh"), "delta"], check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    return [j for j in out.strip().split(",") if j]


def delta_session(app_name: str) -> Any:
    """:func:`~twophase.jobs.session.local_session` with Delta's jars and :data:`DELTA_CONF`.

    Must be the first session of the process: jars, the SQL extension and the catalog are fixed
    when the JVM starts. ``local_session`` takes no extra settings, so the static ones travel in
    ``PYSPARK_SUBMIT_ARGS`` (pyspark's own hook for ``spark-submit`` options of its JVM) and the
    jars in ``$TWOPHASE_SPARK_JARS``, which it reads.
    """
    from twophase.jobs.session import connector_jars, local_session

    os.environ["TWOPHASE_SPARK_JARS"] = ",".join([*connector_jars(), *delta_jars()])
    confs = " ".join(f"--conf {k}={v}" for k, v in DELTA_CONF.items())
    os.environ["PYSPARK_SUBMIT_ARGS"] = (
        f"{confs} {os.environ.get('PYSPARK_SUBMIT_ARGS', 'pyspark-shell')}"
    )
    spark = local_session(app_name)
    for key, value in DELTA_CONF.items():
        if spark.conf.get(key, "") != value:
            raise RuntimeError(f"a Spark session without {key}={value} was already running")
    return spark


def delta_writer(path: str, app_id: str) -> Callable[[Any, int], None]:
    """Delta's idempotent ``foreachBatch`` write: a batch id Delta has already committed for
    ``app_id`` (in the table's own log, with the data) is skipped, so Spark's replay of a batch
    after a crash adds nothing. ``app_id`` must stay the same across restarts of one query."""

    def write(df: Any, batch_id: int) -> None:
        (
            df.write.format("delta")
            .mode("append")
            .option("txnAppId", app_id)
            .option("txnVersion", batch_id)
            .save(path)
        )

    return write


def delta_counts(spark: Any, path: str) -> tuple[int, int]:
    """(rows, distinct ids) of the Delta table at ``path``."""
    from pyspark.sql import functions as F

    got = (
        spark.read.format("delta")
        .load(path)
        .agg(F.count("*").alias("rows"), F.countDistinct("id").alias("ids"))
        .first()
    )
    return int(got["rows"]), int(got["ids"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark_writer", description=__doc__)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=50_000, help="maxOffsetsPerTrigger")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="uncounted rounds first (JIT, workers)")
    ap.add_argument(
        "--sides",
        default=",".join(SIDES),
        help=f"comma-separated, run in this order each round (default: {','.join(SIDES)})",
    )
    ap.add_argument("--json", default="", help="also write the results to this file")
    ap.add_argument("--verbose", action="store_true", help="log the writer's phase timings")
    args = ap.parse_args(argv)
    sides = [k for k in args.sides.split(",") if k]
    if not sides or set(sides) - set(SIDES) or len(set(sides)) != len(sides):
        ap.error(f"--sides: each of {', '.join(SIDES)} at most once")
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
    if "delta" in sides:
        spark = delta_session("twophase-bench-spark-writer")
    else:
        spark = local_session("twophase-bench-spark-writer")
    results: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    try:
        for round_no in range(-args.warmup, args.rounds):
            for kind in results:
                name = f"bench_{run_id}_{round_no + args.warmup}_{kind.replace('-', '_')}"
                table = f"{name}_orders"
                delta_path = workdir / f"{name}-delta"
                if kind != "delta":
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        conn.execute(orders_table_ddl(table))
                if kind == "delta":
                    timed = Timed(delta_writer(str(delta_path), app_id=name))
                elif kind == "coordinated":
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
                if kind == "delta":
                    rows, ids = delta_counts(spark, str(delta_path))
                    shutil.rmtree(delta_path)
                else:
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        got = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
                        conn.execute(f"DROP TABLE {table}")
                    rows = int(got[0]) if got else 0
                    ids = rows  # not counted: the PostgreSQL sides are checked by rows only
                if rows != args.rows or ids != args.rows:
                    print(
                        f"{kind}: wrote {rows} rows ({ids} distinct ids), expected {args.rows}",
                        file=sys.stderr,
                    )
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
    out: dict[str, Any] = {"args": vars(args), "runs": results, "rows_per_s": summary}
    print()
    for peer, key, note in (
        ("plain-rows", "ratio_vs_plain_rows", ""),
        ("plain-json", "ratio_vs_plain_json", "  (protocol + the sink's write path)"),
        ("delta", "spark_over_delta", "  (target >= 0.9)"),
    ):
        if "coordinated" in summary and peer in summary:
            out[key] = summary["coordinated"] / summary[peer]
            print(f"coordinated / {peer:10} = {out[key]:.2f}{note}")
    if "delta" in summary:
        out["spark_delta_rows_per_s"] = summary["delta"]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
