"""Spark reads the tables the iceberg sink writes, through Iceberg's JdbcCatalog on the sink's
own catalog (:mod:`twophase.jobs.read_iceberg`): on ``local[2]`` and on a standalone cluster whose
executors are processes of their own.

The tables are written by the sink itself, part by part (begin, write, prepare, commit), and every
read is compared row for row with what was written and with a pyiceberg scan of the same
snapshot.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.table import Table

from harness import iceberg_catalog
from tests.spark.cluster import StandaloneCluster
from tests.spark.helpers import REPO
from twophase.jobs.read_iceberg import add_catalog, read_table, table_summary
from twophase.participants.sdk import PartId, Record, SinkContext
from twophase.participants.sinks.iceberg import IcebergSink

pytestmark = [pytest.mark.stack, pytest.mark.spark]

TOPIC = "orders"
COLUMNS = {"id": "long", "name": "string", "amount": "decimal(12, 2)", "ts": "timestamptz"}
#: Rows per part of the partitioned table: three parts, over three days and four buckets.
PART_ROWS = 120
#: The job as its own driver process on the cluster: JVM starts (driver, two executors) and two
#: small reads; ~55 s on the 2-core machine with the stack, 160 s while other JVMs were busy.
JOB_TIMEOUT_S = 300
ORIGIN = datetime(2024, 1, 1, 6, tzinfo=UTC)

Row = tuple[int, str | None, str | None, str | None]


def _value(i: int, *, name: str = "", day: int | None = None) -> dict[str, Any]:
    ts = ORIGIN + timedelta(days=i % 3 if day is None else day, minutes=i)
    return {
        "id": i,
        "name": name or f"order-{i}",
        # Every 7th amount is missing: nulls must come through as nulls.
        "amount": None if i % 7 == 0 else f"{i * 3 + 0.5:.2f}",
        "ts": ts.isoformat().replace("+00:00", "Z"),
    }


def _canonical(row: dict[str, Any]) -> Row:
    """One row as comparable values, whoever read it: Spark's JSON, pyiceberg's Arrow."""
    amount, ts = row["amount"], row["ts"]
    if isinstance(ts, datetime):
        ts = f"{ts.astimezone(UTC):%Y-%m-%dT%H:%M:%S.%f}Z"
    elif isinstance(ts, str) and ts.endswith("Z") and "." not in ts:  # a written value
        ts = ts[:-1] + ".000000Z"
    return (
        int(row["id"]),
        row["name"],
        None if amount is None else str(Decimal(str(amount))),
        ts,
    )


@dataclass
class Lake:
    """A catalog of its own (by name) in the stack's PostgreSQL, with one warehouse."""

    pg_dsn: str
    warehouse: Path
    catalog: str = field(default_factory=lambda: f"sp{uuid.uuid4().hex[:10]}")
    pipeline: str = field(default_factory=lambda: f"p{uuid.uuid4().hex[:8]}")
    _sinks: list[IcebergSink] = field(default_factory=list)
    _reader: SqlCatalog | None = None

    def sink(self, table: str, **extra: Any) -> IcebergSink:
        cfg: dict[str, Any] = {
            "name": "lake",
            "type": "iceberg",
            "catalog": {"uri": self.pg_dsn, "name": self.catalog, "warehouse": str(self.warehouse)},
            "table": table,
            "create_table": COLUMNS,
            **extra,
        }
        # A participant per table: part ids (pipeline, txn, participant) never collide.
        participant = table.replace(".", "-")
        ctx = SinkContext(self.pipeline, participant, "lake", logging.getLogger("test"))
        sink = IcebergSink.from_mapping(cfg, ctx)
        assert isinstance(sink, IcebergSink)
        sink.setup()
        self._sinks.append(sink)
        return sink

    def commit(self, sink: IcebergSink, txn: int, records: list[Record]) -> None:
        """One part: begin, write, prepare, commit -- one snapshot."""
        part = PartId(self.pipeline, txn, sink.context.participant)
        sink.begin(part)
        assert not sink.write(part, records), "the sink refused a record"
        sink.prepare(part, {(TOPIC, 0): records[-1].offset + 1})
        sink.commit(part)

    def table(self, name: str) -> Table:
        if self._reader is None:
            self._reader = iceberg_catalog(self.pg_dsn, self.catalog, self.warehouse)
        return self._reader.load_table(name)

    def scan(self, name: str) -> list[Row]:
        return sorted(_canonical(r) for r in self.table(name).scan().to_arrow().to_pylist())

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        if self._reader is not None:
            self._reader.engine.dispose()


@dataclass(frozen=True)
class Written:
    lake: Lake
    #: table -> the rows it must hold, computed from the records sent (not read back).
    expected: dict[str, list[Row]]


def _records(start: int, values: list[dict[str, Any]], deleted: bool = False) -> list[Record]:
    return [
        Record(TOPIC, 0, start + n, 1_700_000_000_000, None, v, deleted=deleted)
        for n, v in enumerate(values)
    ]


@pytest.fixture(scope="module")
def written(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Written]:
    """Two tables, several parts each: ``sales.orders`` partitioned ``day(ts)``,
    ``bucket(4, id)``, appended; ``sales.customers`` upserted by ``id``, with updates and
    deletes across parts."""
    lake = Lake(pg_dsn, tmp_path_factory.mktemp("warehouse"))
    try:
        orders = lake.sink("sales.orders", partition_by=["day(ts)", "bucket(4, id)"])
        for txn in range(1, 4):
            first = (txn - 1) * PART_ROWS
            values = [_value(i) for i in range(first, first + PART_ROWS)]
            lake.commit(orders, txn, _records(first, values))

        customers = lake.sink(
            "sales.customers", mode="upsert", key=["id"], partition_by=["bucket(4, id)"]
        )
        state = {i: _value(i) for i in range(100)}
        lake.commit(customers, 1, _records(0, list(state.values())))
        # Part 2: every 5th row changes, ids 10-19 go, 100-109 arrive.
        changed = [_value(i, name=f"changed-{i}", day=2) for i in range(0, 100, 5)]
        gone = [{"id": i} for i in range(10, 20)]
        new = [_value(i) for i in range(100, 110)]
        lake.commit(
            customers,
            2,
            _records(1000, changed + new) + _records(2000, gone, deleted=True),
        )
        # Part 3: a key deleted and written again in one part ends written; 50 goes.
        again = [_value(12, name="back-12")]
        lake.commit(
            customers,
            3,
            _records(3000, [{"id": 12}, {"id": 50}], deleted=True) + _records(3100, again),
        )
        state.update({int(v["id"]): v for v in changed + new})
        for i in [*range(10, 20), 50]:
            state.pop(i)
        state[12] = again[0]

        yield Written(
            lake,
            {
                "sales.orders": sorted(_canonical(_value(i)) for i in range(3 * PART_ROWS)),
                "sales.customers": sorted(_canonical(v) for v in state.values()),
            },
        )
    finally:
        lake.close()


def _spark_rows(summary: dict[str, Any]) -> list[Row]:
    return sorted(_canonical(r) for r in summary["rows"])


def test_spark_reads_the_sinks_tables_row_for_row(spark: Any, written: Written) -> None:
    from pyspark.errors import AnalysisException

    lake = written.lake
    add_catalog(spark, lake.catalog, lake.pg_dsn, str(lake.warehouse))
    for table, expected in written.expected.items():
        summary = table_summary(spark, lake.catalog, table, rows=True)
        got = _spark_rows(summary)
        assert got == lake.scan(table), f"{table}: Spark and pyiceberg read different rows"
        assert got == expected, f"{table}: not the rows the parts wrote"
        assert summary["count"] == len(expected)
        current = lake.table(table).current_snapshot()
        assert current is not None and summary["snapshot_id"] == current.snapshot_id

    # Spark sees the partition spec the sink made: the same partitions as pyiceberg.
    name = f"{lake.catalog}.sales.orders"
    spark_partitions = spark.sql(f"SELECT * FROM {name}.partitions").count()
    pyiceberg_partitions = lake.table("sales.orders").inspect.partitions().num_rows
    assert spark_partitions == pyiceberg_partitions == 3 * 4  # 3 days x 4 buckets
    # A filter on the partition source column: one day of the three.
    day = read_table(spark, lake.catalog, "sales.orders").where(
        "ts < TIMESTAMP '2024-01-02T00:00:00Z'"
    )
    assert day.count() == len([i for i in range(3 * PART_ROWS) if i % 3 == 0])
    # One snapshot per part.
    snapshots = spark.sql(f"SELECT operation FROM {name}.snapshots").collect()
    assert sorted(r[0] for r in snapshots) == ["append"] * 3

    # The catalog's name is the Spark catalog's: under another name the table is not there.
    add_catalog(spark, "some_other_catalog", lake.pg_dsn, str(lake.warehouse))
    with pytest.raises(AnalysisException, match="TABLE_OR_VIEW_NOT_FOUND"):
        read_table(spark, "some_other_catalog", "sales.orders").count()


def test_spark_never_sees_part_of_a_part(spark: Any, pg_dsn: str, tmp_path: Path) -> None:
    """Parts of 200 rows, each in 8 data files (bucket(8, id)), commit while Spark counts."""
    lake = Lake(pg_dsn, tmp_path / "warehouse")
    parts, rows = 8, 200
    try:
        sink = lake.sink("sales.stream", partition_by=["bucket(8, id)"])
        lake.commit(sink, 1, _records(0, [_value(i) for i in range(rows)]))
        add_catalog(spark, lake.catalog, lake.pg_dsn, str(lake.warehouse))
        reads_started = threading.Semaphore(0)
        failure: list[BaseException] = []

        def write() -> None:
            try:
                for txn in range(2, parts + 1):
                    # Each commit lands while a read is under way (between its planning, which
                    # picks the snapshot, and its tasks reading files), or just after it.
                    reads_started.acquire(timeout=60)
                    time.sleep(0.2)
                    first = (txn - 1) * rows
                    values = [_value(i) for i in range(first, first + rows)]
                    lake.commit(sink, txn, _records(first, values))
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                failure.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        seen: list[int] = []
        while writer.is_alive():
            reads_started.release()
            seen.append(read_table(spark, lake.catalog, "sales.stream").count())
        writer.join()
        assert not failure, failure
        seen.append(read_table(spark, lake.catalog, "sales.stream").count())
        print(f"counts seen while parts committed: {seen}")
        assert all(n % rows == 0 for n in seen), f"a read saw part of a part: {seen}"
        assert seen == sorted(seen), f"a read went back in time: {seen}"
        assert len(set(seen)) >= 4, f"reads did not overlap the commits: {seen}"
        assert seen[-1] == parts * rows
    finally:
        lake.close()


# -- a standalone cluster ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A master and two workers (1 core, 1 GiB each) for this module's tests."""
    with StandaloneCluster(tmp_path_factory.mktemp("spark-cluster")) as cluster:
        yield cluster


def test_a_standalone_cluster_reads_the_same_snapshots(
    spark: Any, written: Written, spark_cluster: StandaloneCluster, spark_jars: list[str]
) -> None:
    lake = written.lake
    tables = list(written.expected)
    command = [
        sys.executable,
        "-m",
        "twophase.jobs.read_iceberg",
        "--uri",
        lake.pg_dsn,
        "--catalog",
        lake.catalog,
        "--warehouse",
        str(lake.warehouse),
        *[arg for table in tables for arg in ("--table", table)],
        "--master",
        spark_cluster.url,
        "--checksums",
        "--rows",
    ]
    env = {**os.environ, "TWOPHASE_SPARK_JARS": ",".join(spark_jars)}
    started = time.monotonic()
    run = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
    )
    assert run.returncode == 0, run.stderr[-3000:] + spark_cluster.logs()
    print(f"read job on {spark_cluster.url}: {time.monotonic() - started:.0f}s")
    summaries = {s["table"]: s for s in map(json.loads, run.stdout.splitlines())}
    assert set(summaries) == set(tables)

    add_catalog(spark, lake.catalog, lake.pg_dsn, str(lake.warehouse))
    for table, expected in written.expected.items():
        remote = summaries[table]
        assert _spark_rows(remote) == expected == lake.scan(table), table
        local = table_summary(spark, lake.catalog, table, checksums=True)
        assert remote["snapshot_id"] == local["snapshot_id"]
        assert remote["count"] == local["count"] == len(expected)
        assert remote["checksums"] == local["checksums"], table

    # The work ran in executors the workers started: two processes, one per worker.
    executors = spark_cluster.executor_dirs()
    assert {d.parent.parent.name for d in executors} == {"worker-0", "worker-1"}, executors
    assert len({d.parent.name for d in executors}) == 1, "one application"
    logs = [(d / "stderr").read_text(errors="replace") for d in executors]
    pids = {
        line.split("process name: ")[1].split("@")[0]
        for log in logs
        for line in log.splitlines()
        if "process name: " in line
    }
    assert len(pids) == 2, pids
    assert sum(log.count("Running task") for log in logs) > 0, "no task ran on an executor"
