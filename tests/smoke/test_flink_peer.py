"""The Flink peer of ``make bench`` (:mod:`bench.flink_peer`), once on a few thousand records:
Flink 2.0's exactly-once JDBC (XA) sink on a local MiniCluster, built and run from
``bench/peers/flink/`` (``bench/peers/fetch.sh flink``), must put every source record into the
stack's PostgreSQL exactly once, each row equal to its record -- a job that fails to build or
start (a jar missing from the pom), a sink that cannot prepare on PostgreSQL, a lost, repeated
or mangled record fails here.

The first run fetches the jars and compiles the job (about a minute; cached after that).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bench import flink_peer
from bench import throughput as tp

pytestmark = [pytest.mark.stack]

RECORDS = 20_000
#: From the job's tasks running to done: ~3 s here (20,000 records, 1 s checkpoints), more on
#: the shared 2-core machine under load.
RUN_TIMEOUT_S = 120.0


@pytest.fixture
def source(kafka_bootstrap: str) -> Iterator[tp.Source]:
    with tp.Source.temporary(kafka_bootstrap, RECORDS, "flinkpeer") as src:
        yield src


def _expected(row: dict[str, Any]) -> tuple[Any, ...]:
    """A source record as the table must hold it: ``amount`` exact to the cent, ``ts`` the
    instant the ISO-8601 string names."""
    return (
        row["id"],
        row["customer"],
        Decimal(str(row["amount"])).quantize(Decimal("0.01")),
        row["currency"],
        datetime.fromisoformat(row["ts"].replace("Z", "+00:00")),
        row["note"],
    )


def test_flink_xa_sink_delivers_every_record_exactly_once(
    source: tp.Source, pg_dsn: str, tmp_path: Path
) -> None:
    r = flink_peer.flink_run(source, tmp_path, timeout_s=RUN_TIMEOUT_S, keep_table=True)
    table = r.control["table"]
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            rows = conn.execute(
                f"SELECT id, customer, amount, currency, ts, note FROM {table} ORDER BY id"
            ).fetchall()
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")

    expected = sorted((_expected(x) for x in tp.source_rows(source)), key=lambda t: t[0])
    assert len(rows) == RECORDS, r.asdict()
    assert [row[0] for row in rows] == list(range(RECORDS))  # every id once, nothing else
    assert rows == expected
    assert r.verified == {"pg": RECORDS}
    assert r.control["exact"] is True, r.asdict()
    assert r.control["subtasks"] == tp.PARTITIONS
    assert r.records_per_s > 0 and r.cpu_s["flink_jvm"] > 0, r.asdict()
