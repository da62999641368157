"""The iceberg sink against the stack's PostgreSQL (its SQL catalog) and a local warehouse.

What the conformance kit cannot see: that the table's new snapshot and the part's marker are
one transaction, that an abort fences a late commit (and a commit in flight fences an abort),
two participants committing into one table in the same cycle, partition specs, readers that
never see part of a part, and configuration errors named at start-up. Every check reads the
table the way a reader does: a pyiceberg scan through its own catalog.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.table import Table

from twophase.participants.sdk import (
    FatalSinkError,
    PartId,
    Record,
    SinkContext,
    UnknownPartError,
)
from twophase.participants.sinks.iceberg import IcebergSink
from twophase.participants.sinks.iceberg._parts import Parts

pytestmark = pytest.mark.stack

TOPIC = "orders"


def _record(offset: int, partition: int = 0, **value: Any) -> Record:
    body = {"id": offset, "name": f"n{offset}", **value}
    return Record(TOPIC, partition, offset, 1_700_000_000_000 + offset, None, body)


def _positions(records: list[Record]) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for r in records:
        out[(r.topic, r.partition)] = max(out.get((r.topic, r.partition), 0), r.offset + 1)
    return out


class Lake:
    """A catalog of its own (by name) in the stack's PostgreSQL, a warehouse, and a reader."""

    def __init__(self, pg_dsn: str, warehouse: Path) -> None:
        self.pg_dsn = pg_dsn
        self.warehouse = warehouse
        self.catalog = f"it{uuid.uuid4().hex[:10]}"
        self.pipeline = f"p{uuid.uuid4().hex[:8]}"
        self._reader: SqlCatalog | None = None
        self._made: list[IcebergSink] = []

    def config(self, **extra: Any) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "name": "lake",
            "type": "iceberg",
            "catalog": {"uri": self.pg_dsn, "name": self.catalog, "warehouse": str(self.warehouse)},
            "table": "sales.orders",
            "create_table": {"id": "long", "name": "string"},
        }
        cfg.update(extra)
        return cfg

    def sink(self, participant: str = "w0", **extra: Any) -> IcebergSink:
        ctx = SinkContext(self.pipeline, participant, "lake", logging.getLogger("test"))
        sink = IcebergSink.from_mapping(self.config(**extra), ctx)
        assert isinstance(sink, IcebergSink)
        sink.setup()
        self._made.append(sink)
        return sink

    def table(self) -> Table:
        if self._reader is None:
            uri = self.pg_dsn.replace("postgresql://", "postgresql+psycopg://", 1)
            self._reader = SqlCatalog(
                self.catalog,
                uri=f"{uri}?options=-csearch_path%3Diceberg_catalog",
                warehouse=f"file://{self.warehouse}",
            )
        return self._reader.load_table("sales.orders")

    def ids(self) -> list[int]:
        return sorted(self.table().scan().to_arrow().column("id").to_pylist())

    def close(self) -> None:
        for sink in self._made:
            sink.close()
        if self._reader is not None:
            self._reader.engine.dispose()


@pytest.fixture
def lake(pg_dsn: str, tmp_path: Path) -> Iterator[Lake]:
    made = Lake(pg_dsn, tmp_path / "warehouse")
    try:
        yield made
    finally:
        made.close()


def _prepare(sink: IcebergSink, txn: int, records: list[Record], participant: str = "w0") -> PartId:
    part = PartId(sink.context.pipeline, txn, participant)
    sink.begin(part)
    assert not sink.write(part, records)
    sink.prepare(part, _positions(records))
    return part


def _data_files(warehouse: Path) -> list[Path]:
    return sorted(p for p in warehouse.rglob("*.parquet"))


# -- the snapshot and the marker are one transaction ---------------------------------------------


def test_a_commit_that_dies_before_its_transaction_ends_leaves_the_table_as_it_was(
    lake: Lake, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = lake.sink()
    part = _prepare(sink, 1, [_record(i) for i in range(10)])

    def die(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the process dies after the table pointer moved in its transaction")

    monkeypatch.setattr(Parts, "set_state", die)
    with pytest.raises(RuntimeError):
        sink.commit(part)
    monkeypatch.undo()
    table = lake.table()
    assert table.current_snapshot() is None and lake.ids() == []
    assert sink.load_marker(part).state == "prepared"  # type: ignore[union-attr]
    assert sink.in_doubt() == [part]
    # Any process commits it later, once.
    lake.sink("other-process").commit(part)
    assert lake.ids() == list(range(10))
    snapshots = lake.table().snapshots()
    assert len(snapshots) == 1
    assert snapshots[0].summary.additional_properties["twophase.part"] == part.token


def test_an_abort_fences_a_late_commit(lake: Lake) -> None:
    """A zombie that prepared a part commits it after another process aborted it: nothing."""
    zombie = lake.sink()
    part = _prepare(zombie, 1, [_record(i) for i in range(5)])
    written = _data_files(lake.warehouse)
    assert written
    lake.sink("sweeper").abort(part)
    assert not any(p.exists() for p in written)  # the abort deleted the part's files
    with pytest.raises(UnknownPartError):
        zombie.commit(part)
    assert lake.table().current_snapshot() is None


def test_a_commit_in_flight_fences_an_abort(lake: Lake, monkeypatch: pytest.MonkeyPatch) -> None:
    """An abort that comes while a commit holds the marker waits for it, then refuses."""
    sink = lake.sink()
    sweeper = lake.sink("sweeper")
    part = _prepare(sink, 1, [_record(i) for i in range(5)])
    holding, release = threading.Event(), threading.Event()
    real = Parts.set_state

    def slow(self: Parts, conn: Any, p: PartId, state: str) -> None:
        real(self, conn, p, state)  # type: ignore[arg-type]
        if state == "committed":
            holding.set()
            release.wait(10)

    monkeypatch.setattr(Parts, "set_state", slow)
    committer = threading.Thread(target=sink.commit, args=(part,))
    committer.start()
    assert holding.wait(20)
    outcome: list[BaseException | None] = []

    def abort() -> None:
        try:
            sweeper.abort(part)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    aborter = threading.Thread(target=abort)
    aborter.start()
    time.sleep(1.0)
    assert not outcome, "the abort did not wait for the commit holding the marker"
    release.set()
    committer.join(20)
    aborter.join(20)
    assert isinstance(outcome[0], FatalSinkError) and "committed" in str(outcome[0])
    assert lake.ids() == list(range(5))


# -- concurrency ---------------------------------------------------------------------------------


def test_two_participants_commit_into_one_table_in_the_same_cycle(lake: Lake) -> None:
    sinks = [lake.sink("w0"), lake.sink("w1")]
    for txn in (1, 2, 3):
        parts = [
            _prepare(s, txn, [_record(txn * 1000 + w * 100 + i, w) for i in range(50)], f"w{w}")
            for w, s in enumerate(sinks)
        ]
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def commit(
            s: IcebergSink,
            p: PartId,
            barrier: threading.Barrier = barrier,
            errors: list[BaseException] = errors,
        ) -> None:
            barrier.wait()
            try:
                s.commit(p)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                errors.append(exc)

        threads = [
            threading.Thread(target=commit, args=sp) for sp in zip(sinks, parts, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
    expected = sorted(t * 1000 + w * 100 + i for t in (1, 2, 3) for w in (0, 1) for i in range(50))
    assert lake.ids() == expected
    tokens = [s.summary.additional_properties["twophase.part"] for s in lake.table().snapshots()]
    assert len(tokens) == 6 == len(set(tokens))
    assert sinks[0].committed_positions() == {(TOPIC, 0): 3050, (TOPIC, 1): 3150}


def test_a_reader_never_sees_part_of_a_part(lake: Lake) -> None:
    """Parts of 300 rows (many data files: partitioned by id) commit while a reader scans."""
    sink = lake.sink(partition_by=["bucket(8, id)"])
    seen: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.append(len(lake.ids()))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for txn in range(1, 7):
            part = _prepare(sink, txn, [_record(txn * 1000 + i) for i in range(300)])
            sink.commit(part)
    finally:
        stop.set()
        reader.join(30)
    assert seen and all(n % 300 == 0 for n in seen), sorted(set(seen))
    assert len(lake.ids()) == 1800


# -- tables: partition specs, types, upserts -----------------------------------------------------


def test_partition_spec_from_config(lake: Lake) -> None:
    sink = lake.sink(
        create_table={"id": "long", "name": "string", "ts": "timestamptz", "region": "string"},
        partition_by=["day(ts)", "bucket(4, id)", "region"],
    )
    records = [
        _record(i, ts=f"2024-01-0{1 + i % 3}T12:00:00Z", region=("eu", "us")[i % 2])
        for i in range(60)
    ]
    sink.commit(_prepare(sink, 1, records))
    table = lake.table()
    assert [f.name for f in table.spec().fields] == ["ts_day", "id_bucket_4", "region"]
    files = table.inspect.files().to_pylist()
    partitions = {(f["partition"]["ts_day"], f["partition"]["region"]) for f in files}
    assert len(partitions) == 6  # 3 days x 2 regions
    got = table.scan().to_arrow().sort_by("id").to_pylist()
    assert [r["id"] for r in got] == list(range(60))
    assert got[4]["ts"] == datetime(2024, 1, 2, 12, tzinfo=UTC) and got[4]["region"] == "eu"


def test_values_the_column_types_refuse_are_rejected_with_the_column(lake: Lake) -> None:
    sink = lake.sink(
        create_table={"id": "long", "name": "string", "amount": "decimal(6, 2)", "day": "date"}
    )
    part = PartId(lake.pipeline, 1, "w0")
    sink.begin(part)
    good = _record(1, amount="12.50", day="2024-05-01")
    bad = [
        _record(2, amount="12.345"),  # more decimals than the column's scale
        _record(3, day="yesterday"),
        _record(4, colour="red"),  # no such column
        Record(TOPIC, 0, 5, 0, None, {"name": "no id"}),  # ok: id is not required here
    ]
    rejected = sink.write(part, [good, *bad])
    reasons = {r.record.offset: r.reason for r in rejected}
    assert set(reasons) == {2, 3, 4}
    assert "amount" in reasons[2] and "day" in reasons[3] and "colour" in reasons[4]
    sink.prepare(part, {(TOPIC, 0): 6})
    sink.commit(part)
    rows = lake.table().scan().to_arrow().sort_by("name").to_pylist()
    assert len(rows) == 2 and str(rows[0]["amount"]) == "12.50"


def test_upsert_replaces_rows_by_key_across_parts(lake: Lake) -> None:
    sink = lake.sink(mode="upsert", key=["id"])
    sink.commit(_prepare(sink, 1, [_record(i) for i in range(100)]))
    changes = [_record(i, name="again") for i in range(0, 100, 10)]
    deletes = [Record(TOPIC, 0, 500 + i, 0, None, {"id": i}, deleted=True) for i in (1, 2)]
    sink.commit(_prepare(sink, 2, [*changes, *deletes]))
    rows = {r["id"]: r["name"] for r in lake.table().scan().to_arrow().to_pylist()}
    assert len(rows) == 98 and 1 not in rows and 2 not in rows
    assert rows[10] == "again" and rows[11] == "n11"


# -- configuration named at start-up --------------------------------------------------------------


def test_a_missing_table_without_create_table_fails_at_setup_naming_it(lake: Lake) -> None:
    with pytest.raises(FatalSinkError, match=r"sales\.orders does not exist"):
        lake.sink(create_table=None)


def test_bad_configurations_name_the_field(lake: Lake) -> None:
    ctx = SinkContext(lake.pipeline, "w0", "lake", logging.getLogger("test"))
    for extra, field in [
        ({"mode": "upsert"}, "key"),
        ({"partition_by": ["bucket(id)"]}, "partition_by"),
        ({"partition_by": ["day(when)"]}, "partition_by"),
        ({"create_table": {"id": "bigint"}}, "create_table"),
        ({"table": "orders"}, "table"),
        ({"catalog": {"uri": "sqlite:///x.db", "warehouse": "/tmp/w"}}, "uri"),
    ]:
        with pytest.raises(ValidationError, match=field):
            IcebergSink.from_mapping(lake.config(**extra), ctx)
