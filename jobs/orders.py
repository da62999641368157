"""Order totals: a Structured Streaming job that feeds a twophase pipeline through Kafka.

::

    raw order events (JSON, Kafka)                  {"id", "customer", "amount", "currency", "ts", ...}
      -> parse, drop what does not parse
      -> enrich: amount in EUR from a rates table   (stream-static broadcast join)
      -> 1-minute event-time windows per customer, watermark 10 minutes, output mode "update"
      -> Spark's Kafka sink into the pipeline's source topic
         key   "<customer>|<window start>"
         value {"window_start", "window_end", "customer", "orders", "total_eur", "largest_eur"}

Spark's Kafka sink is **at-least-once**: a batch that ran before a crash, but was not yet marked
done in the checkpoint, runs again after the restart and writes its records a second time. The
pipeline absorbs that by **upserting** on the key (PostgreSQL ``mode: upsert, key: [customer,
window_start]``): the replayed batch carries the same keys and -- because its input offsets and
state version are the same -- the same values, so it rewrites rows with what they already hold.
Output mode "update" fits upserts: each batch emits the windows it changed, with their totals so
far; the last update of a window is its final total. Records with one key always go to one Kafka
partition (the key hash), so the pipeline applies a window's updates in order.

Everything here is deterministic: decimals, not floats, for money (``round`` half-up to cents), and
window times formatted with their offset. :func:`expected_totals` computes the same totals in
plain Python, for the tests and the demo.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from confluent_kafka import Producer

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

__all__ = [
    "EUR_RATES",
    "ORDER_SCHEMA",
    "WindowTotal",
    "enrich",
    "expected_totals",
    "order_events",
    "order_totals",
    "produce_events",
    "read_orders",
    "rewind_checkpoint",
    "start_order_totals",
    "stored_totals",
    "totals_table_ddl",
]

#: Fields of a raw order event, as ``harness.record()`` writes them.
ORDER_SCHEMA = (
    "id BIGINT, customer STRING, amount DECIMAL(12,2), currency STRING, ts STRING, note STRING"
)
#: Fixed rates, so that totals are reproducible (a real job would join a rates table that changes).
EUR_RATES: Mapping[str, Decimal] = {
    "EUR": Decimal("1.0000"),
    "USD": Decimal("0.9200"),
    "GBP": Decimal("1.1700"),
}
_CENT = Decimal("0.01")


# -- the events -------------------------------------------------------------------------------


def order_events(
    start: int,
    count: int,
    *,
    seed: int = 7,
    customers: int = 20,
    origin_ms: int = 1_795_262_400_000,  # 2026-11-21T12:00:00Z
    spacing_ms: int = 1000,
    jitter_ms: int = 5000,
) -> list[dict[str, Any]]:
    """Order events shaped like ``harness.record()``, with event times that move forward
    ``spacing_ms`` per order and arrive up to ``jitter_ms`` out of order. Few customers, so every
    window has several orders per customer and batches update each other's windows."""
    rng = random.Random(seed + start)
    events = []
    for i in range(start, start + count):
        ts_ms = origin_ms + i * spacing_ms + rng.randrange(-jitter_ms, jitter_ms + 1)
        events.append(
            {
                "id": i,
                "customer": f"customer-{rng.randrange(customers):05d}",
                "amount": round(rng.uniform(1, 5000), 2),
                "currency": rng.choice(["EUR", "USD", "GBP"]),
                "ts": datetime.fromtimestamp(ts_ms / 1000, UTC)
                .isoformat(timespec="milliseconds")
                .replace("+00:00", "Z"),
                "note": "x" * rng.randrange(60, 90),
            }
        )
    return events


def produce_events(
    bootstrap: str, topic: str, events: Iterable[Mapping[str, Any]], *, partitions: int = 0
) -> int:
    """Write events to ``topic``, keyed by order id; returns how many.

    ``partitions``: spread the events round-robin over that many partitions (in event order, so
    every partition moves forward in event time at the same pace and micro-batches come out even);
    0 leaves it to the key hash.
    """
    producer = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True}
    )
    n = 0
    for event in events:
        # -1 is librdkafka's "unassigned": the partitioner hashes the key.
        partition = n % partitions if partitions else -1
        while True:
            try:
                producer.produce(
                    topic,
                    key=str(event["id"]).encode(),
                    value=orjson.dumps(event),
                    partition=partition,
                )
                break
            except BufferError:
                producer.poll(0.1)
        n += 1
    if producer.flush(60) > 0:
        raise RuntimeError(f"order events not delivered to {topic}")
    return n


# -- the job ------------------------------------------------------------------------------------


def read_orders(
    spark: SparkSession, *, bootstrap: str, topic: str, max_offsets_per_trigger: int | None = None
) -> DataFrame:
    """Parsed order events from Kafka; records that do not parse as orders are dropped."""
    from pyspark.sql import functions as F

    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
    )
    if max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    parsed = reader.load().select(
        F.from_json(F.col("value").cast("string"), ORDER_SCHEMA).alias("o")
    )
    return (
        parsed.select("o.*")
        .withColumn("event_time", F.to_timestamp("ts"))
        .where(
            F.col("id").isNotNull()
            & F.col("customer").isNotNull()
            & F.col("amount").isNotNull()
            & F.col("event_time").isNotNull()
        )
        .drop("ts")
    )


def enrich(orders: DataFrame) -> DataFrame:
    """Adds ``amount_eur``: the amount at the currency's EUR rate, rounded half-up to cents."""
    from pyspark.sql import functions as F

    rates = orders.sparkSession.createDataFrame(
        [(c, r) for c, r in EUR_RATES.items()], "currency STRING, eur_rate DECIMAL(10,4)"
    )
    return orders.join(F.broadcast(rates), "currency", "left").withColumn(
        "amount_eur", F.round(F.col("amount") * F.coalesce("eur_rate", F.lit(Decimal(1))), 2)
    )


def order_totals(
    orders: DataFrame, *, window: str = "1 minute", watermark: str = "10 minutes"
) -> DataFrame:
    """Totals per customer and event-time window, as Kafka ``key``/``value`` columns."""
    from pyspark.sql import functions as F

    totals = (
        enrich(orders)
        .withWatermark("event_time", watermark)
        .groupBy(F.window("event_time", window), "customer")
        .agg(
            F.count(F.lit(1)).alias("orders"),
            F.sum("amount_eur").alias("total_eur"),
            F.max("amount_eur").alias("largest_eur"),
        )
    )
    start = F.col("window.start")
    return totals.select(
        F.concat_ws("|", "customer", F.date_format(start, "yyyy-MM-dd'T'HH:mm:ssXXX")).alias("key"),
        F.to_json(
            F.struct(
                start.alias("window_start"),
                F.col("window.end").alias("window_end"),
                "customer",
                "orders",
                "total_eur",
                "largest_eur",
            )
        ).alias("value"),
    )


def start_order_totals(
    spark: SparkSession,
    *,
    bootstrap: str,
    raw_topic: str,
    out_topic: str,
    checkpoint: str,
    max_offsets_per_trigger: int | None = None,
    available_now: bool = True,
    window: str = "1 minute",
    watermark: str = "10 minutes",
) -> StreamingQuery:
    """Start the job. ``available_now``: process what is in ``raw_topic`` and stop (tests, demo);
    otherwise a micro-batch every 5 seconds."""
    orders = read_orders(
        spark, bootstrap=bootstrap, topic=raw_topic, max_offsets_per_trigger=max_offsets_per_trigger
    )
    writer = (
        order_totals(orders, window=window, watermark=watermark)
        .writeStream.format("kafka")
        .outputMode("update")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("topic", out_topic)
        .option("checkpointLocation", checkpoint)
        .queryName(f"order-totals-{out_topic}")
    )
    writer = (
        writer.trigger(availableNow=True)
        if available_now
        else writer.trigger(processingTime="5 seconds")
    )
    return writer.start()


def rewind_checkpoint(checkpoint: str | Path, batch_id: int) -> None:
    """Make the next start of a stopped query run ``batch_id`` again.

    This is what a driver crash after the sink write and before the checkpoint commit leaves
    behind: the batch's offsets are in the offset log, its commit is not. Batches after it (the
    no-data batches that move the watermark) are dropped, as they would never have run. Used by
    the tests and the demo to make Spark's at-least-once Kafka sink deliver a batch twice.
    """
    root = Path(checkpoint)
    for log in ("commits", "offsets"):
        first_dropped = batch_id if log == "commits" else batch_id + 1
        for entry in (root / log).iterdir():
            if entry.name.isdigit() and int(entry.name) >= first_dropped:
                entry.unlink()
                crc = entry.with_name(f".{entry.name}.crc")
                if crc.exists():
                    crc.unlink()


# -- what the job should produce ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WindowTotal:
    orders: int
    total_eur: Decimal
    largest_eur: Decimal


def expected_totals(
    events: Iterable[Mapping[str, Any]], *, window_s: int = 60
) -> dict[tuple[str, int], WindowTotal]:
    """(customer, window start in epoch seconds) -> the totals the job must end with, computed
    without Spark. Assumes no event is later than the watermark (true of :func:`order_events`)."""
    acc: dict[tuple[str, int], list[Decimal]] = {}
    for e in events:
        ts = datetime.fromisoformat(str(e["ts"]).replace("Z", "+00:00"))
        start = int(ts.timestamp()) // window_s * window_s
        rate = EUR_RATES.get(str(e["currency"]), Decimal(1))
        eur = (Decimal(str(e["amount"])) * rate).quantize(_CENT, ROUND_HALF_UP)
        acc.setdefault((str(e["customer"]), start), []).append(eur)
    return {k: WindowTotal(len(v), sum(v, Decimal(0)), max(v)) for k, v in acc.items()}


def stored_totals(pg_dsn: str, table: str) -> dict[tuple[str, int], WindowTotal]:
    """What the pipeline upserted into PostgreSQL, keyed like :func:`expected_totals`."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT customer, extract(epoch FROM window_start)::bigint, orders, total_eur, "
                "largest_eur FROM {}"
            ).format(sql.Identifier(*table.split(".")))
        ).fetchall()
    return {(str(c), int(w)): WindowTotal(int(o), Decimal(t), Decimal(m)) for c, w, o, t, m in rows}


def totals_table_ddl(table: str) -> str:
    """The PostgreSQL table the pipeline upserts the totals into."""
    return (
        f"CREATE TABLE {table} (customer text NOT NULL, window_start timestamptz NOT NULL, "
        "window_end timestamptz NOT NULL, orders bigint NOT NULL, total_eur numeric(18,2) NOT NULL, "
        "largest_eur numeric(12,2) NOT NULL, PRIMARY KEY (customer, window_start))"
    )
