"""The iceberg sink against the stack's PostgreSQL (its SQL catalog) and a local warehouse.

What the conformance kit cannot see: that the table's new snapshot and the part's marker are
one transaction, that an abort fences a late commit (and a commit in flight fences an abort),
two participants committing into one table in the same cycle, partition specs, readers that
never see part of a part, and configuration errors named at start-up. Every check reads the
table the way a reader does: a pyiceberg scan through its own catalog.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from pydantic import ValidationError
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.table import Table

from harness import iceberg_catalog
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
        #: The sinks' catalog URI (the reader keeps ``pg_dsn``).
        self.uri = pg_dsn
        self.warehouse = warehouse
        self.catalog = f"it{uuid.uuid4().hex[:10]}"
        self.pipeline = f"p{uuid.uuid4().hex[:8]}"
        self._reader: SqlCatalog | None = None
        self._made: list[IcebergSink] = []

    def default_isolation(self, level: str) -> None:
        """The sinks' catalog connections start with ``level`` as their default isolation (as
        a server's or a role's setting would make it)."""
        self.server_setting("default_transaction_isolation", level.replace(" ", chr(92) + " "))

    def server_setting(self, name: str, value: str) -> None:
        """The sinks' catalog connections start with ``name`` set to ``value``, as a server's
        or a role's setting would."""
        option = quote(f"-c {name}={value}")
        self.uri += ("&" if "?" in self.uri else "?") + f"options={option}"

    def config(self, **extra: Any) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "name": "lake",
            "type": "iceberg",
            "catalog": {"uri": self.uri, "name": self.catalog, "warehouse": str(self.warehouse)},
            "table": "sales.orders",
            "create_table": {"id": "long", "name": "string"},
        }
        cfg.update(extra)
        return cfg

    def sink(self, participant: str = "w0", **extra: Any) -> IcebergSink:
        ctx = SinkContext(self.pipeline, participant, "lake", logging.getLogger("test"))
        if "table" in extra:
            extra["name"] = extra["table"].split(".")[-1]  # a sink per table, markers apart
        sink = IcebergSink.from_mapping(self.config(**extra), ctx)
        assert isinstance(sink, IcebergSink)
        sink.setup()
        self._made.append(sink)
        return sink

    def table(self, name: str = "sales.orders") -> Table:
        if self._reader is None:
            self._reader = iceberg_catalog(self.pg_dsn, self.catalog, self.warehouse)
        return self._reader.load_table(name)

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


@pytest.mark.parametrize("timeout", ["idle_in_transaction_session_timeout", "idle_session_timeout"])
def test_the_servers_idle_timeouts_end_no_part(lake: Lake, timeout: str) -> None:
    """A database or role whose idle timeout is shorter than the sink's waits between a part's
    steps (a thread's catalog connection is kept from part to part): with 300 ms, parts whose
    steps are 600 ms apart all commit, none fails."""
    lake.server_setting(timeout, "300")
    sink = lake.sink()
    for txn in (1, 2, 3):
        records = [_record(txn * 10 + i) for i in range(3)]
        part = PartId(sink.context.pipeline, txn, "w0")
        sink.begin(part)
        for record in records:
            assert not sink.write(part, [record])
            time.sleep(0.6)
        sink.prepare(part, _positions(records))
        time.sleep(0.6)
        sink.commit(part)
        time.sleep(0.6)
    assert lake.ids() == [txn * 10 + i for txn in (1, 2, 3) for i in range(3)]
    with sink._conn() as conn:
        assert conn.execute(f"SHOW {timeout}").fetchone() == ("0",)


@pytest.mark.parametrize("isolation", [None, "repeatable read", "serializable"])
def test_two_participants_commit_into_one_table_in_the_same_cycle(
    lake: Lake, isolation: str | None
) -> None:
    """Two commits race for the table pointer in every cycle, and both land -- also where the
    database's or the role's default isolation is above READ COMMITTED (the sink's catalog
    transactions are READ COMMITTED whatever it is)."""
    if isolation is not None:
        lake.default_isolation(isolation)
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
    # The statements outside those transactions and pyiceberg's own catalog sessions, too.
    with sinks[0]._conn() as conn:
        assert conn.execute("SHOW transaction_isolation").fetchone() == ("read committed",)
    assert sinks[0]._catalog is not None
    with sinks[0]._catalog.engine.connect() as engine_conn:
        shown = engine_conn.exec_driver_sql("SHOW transaction_isolation").scalar()
        assert shown == "read committed"
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


# -- maintenance -----------------------------------------------------------------------------------


def _referenced(table: Table) -> set[str]:
    return {p.removeprefix("file://") for p in table.inspect.files()["file_path"].to_pylist()}


def _age_files(warehouse: Path, seconds: float = 7200) -> None:
    """Make every file of the warehouse older than maintenance's grace period."""
    then = time.time() - seconds
    for p in warehouse.rglob("*"):
        if p.is_file():
            os.utime(p, (then, then))


def test_maintain_compacts_expires_and_deletes_only_what_nothing_needs(lake: Lake) -> None:
    maintenance = {"compact_min_files": 4, "expire_after_s": 0, "keep_snapshots": 1}
    sink = lake.sink(maintenance=maintenance)
    for txn in range(1, 11):
        sink.commit(_prepare(sink, txn, [_record(txn * 100 + i) for i in range(20)]))
    pending = _prepare(sink, 11, [_record(1100 + i) for i in range(20)])  # prepared, undecided
    before = lake.table()
    assert len(before.inspect.files()) == 10 and len(before.snapshots()) == 10
    _age_files(lake.warehouse)

    done = sink.maintain()

    after = lake.table()
    assert done["files_compacted"] == 10 and done["files_written"] == 1
    assert len(after.inspect.files()) == 1
    # The compaction's snapshot is the one kept: the ten before it read the old files.
    assert len(after.snapshots()) == 1 and done["snapshots_expired"] == 10
    assert lake.ids() == sorted(t * 100 + i for t in range(1, 11) for i in range(20))
    # Only the current snapshot's data file and the prepared part's are left on disk.
    on_disk = {str(p) for p in _data_files(lake.warehouse)}
    assert done["files_deleted"] >= 10
    assert on_disk - _referenced(after) and all(
        "twophase" not in p for p in on_disk
    )  # the prepared part's data file is the one not referenced yet
    sink.commit(pending)
    assert len(lake.ids()) == 220
    assert {str(p) for p in _data_files(lake.warehouse)} == _referenced(lake.table())


def test_maintain_keeps_files_younger_than_the_grace_period(lake: Lake) -> None:
    sink = lake.sink(
        maintenance={"compact_min_files": 2, "expire_after_s": 0, "keep_snapshots": 1}
    )  # orphan_grace_s: the default hour
    for txn in (1, 2, 3):
        sink.commit(_prepare(sink, txn, [_record(txn * 100 + i) for i in range(5)]))
    old_snapshot = lake.table()  # a reader that planned its scan before the maintenance
    done = sink.maintain()
    assert done["files_compacted"] == 3 and done["files_deleted"] == 0
    assert sorted(old_snapshot.scan().to_arrow().column("id").to_pylist()) == lake.ids()


def test_maintain_never_races_a_commit(lake: Lake) -> None:
    """Two participants commit parts while maintenance compacts and expires, over and over."""
    opts = {"compact_min_files": 2, "expire_after_s": 0, "keep_snapshots": 1}
    sinks = [lake.sink("w0", maintenance=opts), lake.sink("w1", maintenance=opts)]
    keeper = lake.sink("keeper", maintenance=opts)
    stop = threading.Event()
    failures: list[BaseException] = []

    def keep() -> None:
        while not stop.is_set():
            try:
                keeper.maintain()
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                failures.append(exc)

    def write(w: int) -> None:
        try:
            for txn in range(1, 16):
                records = [_record(txn * 1000 + w * 100 + i, w) for i in range(30)]
                sinks[w].commit(_prepare(sinks[w], txn, records, f"w{w}"))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            failures.append(exc)

    threads = [threading.Thread(target=keep)] + [
        threading.Thread(target=write, args=(w,)) for w in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(180)
    stop.set()
    threads[0].join(60)
    assert not failures, failures
    expected = sorted(
        t * 1000 + w * 100 + i for t in range(1, 16) for w in (0, 1) for i in range(30)
    )
    assert lake.ids() == expected
    _age_files(lake.warehouse)
    keeper.maintain()
    assert {str(p) for p in _data_files(lake.warehouse)} == _referenced(lake.table())


def test_sinks_maintain_command(lake: Lake, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    import yaml

    sink = lake.sink(maintenance={"compact_min_files": 2, "expire_after_s": 0})
    for txn in (1, 2, 3):
        sink.commit(_prepare(sink, txn, [_record(txn * 100 + i) for i in range(5)]))
    config = {
        "pipeline": lake.pipeline,
        "kafka": {"bootstrap_servers": "127.0.0.1:1"},
        "control": {"hmac_key": "k"},
        "sources": [{"topic": TOPIC}],
        "sinks": [lake.config(maintenance={"compact_min_files": 2, "expire_after_s": 0})],
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    run = subprocess.run(
        [sys.executable, "-m", "twophase.cli.main", "sinks", "maintain", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["ok"] and out["sinks"]["lake"]["files_compacted"] == 3
    assert len(lake.table().inspect.files()) == 1
    wrong = subprocess.run(
        [sys.executable, "-m", "twophase.cli.main", "sinks", "maintain", str(path), "--sink", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode != 0 and "no sink named ['x']" in wrong.stderr


# -- raw JSON into Arrow: the same rows and the same refusals as the decoded path -----------------

_RAW_COLUMNS = {
    "id": "long",
    "small": "int",
    "ratio": "double",
    "price": "decimal(10, 3)",
    "label": "string",
    "flag": "boolean",
    "at": "timestamptz",
}
#: Values of each column that the rules take or refuse, and that Arrow's reader may see
#: differently: each goes into a batch of its own, beside good records.
_ODD_VALUES: dict[str, list[Any]] = {
    "small": [2**31, -(2**31) - 1, 3.0, "12", 1.5, True, None],
    "ratio": [2**60 + 1, 1e308, -0.0, "1.5", "NaN", True, 0.1],
    # 12345678.5 and 123456789 have digits enough for precision 10, but not at scale 3.
    "price": [1234567.5, 12345678.125, 12345678.5, 123456789, 0.0005, -0.001, "2.5", 1e2, 7, True],
    "label": [3.0, True, {"a": 1}, [1], "a\u0000b", "é", ""],
    "flag": [1, "true", "false", 0, False],
    "at": [
        "2026-11-21T12:00:00Z",
        "2026-11-21 12:00:00+05:30",
        "2026-11-21T12:00:00.1234567Z",
        "2026-11-21T12:00:00.1234560Z",
        "2026-11-21",
        "2026-11-21T12:00",
        "2026-11-21T12:00:00+0530",
        "2026-02-30T00:00:00Z",
        "not a time",
        1_700_000_000,
    ],
    "id": [None, "7", 7.0, 2**63],
}


def _raw_record(i: int, rng: Any) -> dict[str, Any]:
    return {
        "id": i,
        "small": rng.randrange(-(2**31), 2**31),
        "ratio": rng.uniform(-1e6, 1e6),
        "price": f"{rng.randrange(-(10**9), 10**9) / 1000:.3f}",
        "label": "".join(rng.choice('abcé xyz"\\') for _ in range(rng.randrange(0, 12))),
        "flag": rng.random() < 0.5,
        "at": f"2026-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}T"
        f"{rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}"
        f".{rng.randrange(10**6):06d}Z",
    }


def test_raw_values_are_stored_and_refused_exactly_as_decoded_ones(lake: Lake) -> None:
    import random

    import orjson

    from twophase.participants.sdk import RawBatch

    rng = random.Random(7)
    batches: list[list[dict[str, Any]]] = [
        [_raw_record(b * 1000 + i, rng) for i in range(500)] for b in range(4)
    ]
    n = 10_000
    for column, odd in _ODD_VALUES.items():
        for value in odd:
            good = [_raw_record(n + i, rng) for i in range(3)]
            n += 3
            strange = {**_raw_record(n, rng), column: value}
            n += 1
            batches.append([*good, strange])
    extra = {**_raw_record(n, rng), "colour": "red"}  # a field that is no column
    batches.append([_raw_record(n + 1, rng), extra])
    raw_sink = lake.sink("raw", create_table=_RAW_COLUMNS, table="sales.raw")
    decoded_sink = lake.sink("decoded", create_table=_RAW_COLUMNS, table="sales.decoded")
    assert raw_sink.accepts_raw()
    reader = raw_sink._raw
    assert reader is not None
    read = reader.read
    taken: list[int] = []

    def counting(values: Any) -> Any:
        got = read(values)
        taken.append(got is not None)
        return got

    reader.read = counting  # type: ignore[method-assign]
    results = []
    for sink, raw in ((raw_sink, True), (decoded_sink, False)):
        part = PartId(lake.pipeline, 1, sink.context.participant)
        sink.begin(part)
        refused: dict[int, str] = {}
        offset = 0
        for values in batches:
            records = [Record(TOPIC, 0, offset + i, 0, None, v) for i, v in enumerate(values)]
            offset += len(values)
            if raw:
                blobs = [orjson.dumps(v) for v in values]
                got = sink.write_raw(part, RawBatch(blobs, lambda i, rs=records: rs[i]))
            else:
                got = sink.write(part, records)
            refused |= {r.record.offset: r.reason for r in got}
        sink.prepare(part, {(TOPIC, 0): offset})
        sink.commit(part)
        results.append(refused)
    assert results[0] == results[1]
    assert len(results[0]) >= 15  # the odd values the rules refuse are refused both ways
    # The random batches and the odd values the rules take exactly went the raw way.
    assert sum(taken) >= 4 + 10 and not all(taken)
    tables = [lake.table(f"sales.{t}").scan().to_arrow().sort_by("id") for t in ("raw", "decoded")]
    assert tables[0].num_rows == tables[1].num_rows > 2000
    # repr: a NaN ("NaN" spelled as a string is a double's value) equals itself there.
    assert [repr(r) for r in tables[0].to_pylist()] == [repr(r) for r in tables[1].to_pylist()]


# -- schema changes (auto_evolve) -----------------------------------------------------------------


def _schema(version: int) -> Any:
    from twophase.participants.sdk import Field, FieldType, RecordSchema

    fields = [Field("id", FieldType("int64")), Field("n", FieldType("int32", nullable=True))]
    if version >= 2:  # amount added, n widened to int64
        fields = [
            Field("id", FieldType("int64")),
            Field("n", FieldType("int64", nullable=True)),
            Field("amount", FieldType("decimal", nullable=True, precision=10, scale=2)),
        ]
    if version == 3:  # id as a string: no widening of a long
        fields[0] = Field("id", FieldType("string"))
    return RecordSchema(tuple(fields), id=f"test:v{version}")


def _typed(offset: int, version: int, **value: Any) -> Record:
    body = {"id": offset, "n": offset % 100, **value}
    return Record(TOPIC, 0, offset, 0, None, body, schema=_schema(version))


def test_auto_evolve_adds_and_promotes_columns_before_the_rows_that_need_them(lake: Lake) -> None:
    sink = lake.sink(create_table={"id": "long", "n": "int"}, auto_evolve=True)
    sink.commit(_prepare(sink, 1, [_typed(i, 1) for i in range(5)]))
    part = PartId(lake.pipeline, 2, "w0")
    sink.begin(part)
    assert not sink.write(part, [_typed(i, 1) for i in range(5, 10)])
    assert not sink.write(part, [_typed(i, 2, amount="12.50") for i in range(10, 15)])
    # Committed at once, before the part: the new column, empty, and n promoted.
    schema = lake.table().schema()
    assert [(f.name, str(f.field_type), f.required) for f in schema.fields] == [
        ("id", "long", False),
        ("n", "long", False),
        ("amount", "decimal(10, 2)", False),
    ]
    assert lake.ids() == list(range(5))
    refused = sink.write(part, [_typed(15, 3, id="x15"), _typed(16, 2, amount="1.25")])
    assert [r.record.offset for r in refused] == [15]
    assert "'id'" in refused[0].reason and "widening" in refused[0].reason
    sink.prepare(part, {(TOPIC, 0): 17})
    sink.commit(part)
    rows = {r["id"]: r for r in lake.table().scan().to_arrow().to_pylist()}
    assert sorted(rows) == [*range(15), 16]
    assert rows[3]["amount"] is None and str(rows[12]["amount"]) == "12.50"


@pytest.mark.parametrize("isolation", [None, "serializable"])
def test_two_participants_evolve_one_table_in_the_same_cycle(
    lake: Lake, isolation: str | None
) -> None:
    if isolation is not None:
        lake.default_isolation(isolation)
    sinks = [
        lake.sink(w, create_table={"id": "long", "n": "int"}, auto_evolve=True)
        for w in ("w0", "w1")
    ]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(w: int) -> None:
        try:
            part = PartId(lake.pipeline, 1, f"w{w}")
            sinks[w].begin(part)
            barrier.wait(30)
            records = [_typed(w * 100 + i, 2, amount=f"{i}.5") for i in range(20)]
            assert not sinks[w].write(part, records)
            sinks[w].prepare(part, {(TOPIC, w): 20})
            barrier.wait(30)
            sinks[w].commit(part)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    table = lake.table()
    assert [f.name for f in table.schema().fields] == ["id", "n", "amount"]
    assert lake.ids() == [*range(20), *range(100, 120)]


def test_without_auto_evolve_a_new_field_is_refused(lake: Lake) -> None:
    sink = lake.sink(create_table={"id": "long", "n": "int"})
    part = PartId(lake.pipeline, 1, "w0")
    sink.begin(part)
    refused = sink.write(part, [_typed(1, 1), _typed(2, 2, amount="1.00")])
    assert [r.record.offset for r in refused] == [2] and "amount" in refused[0].reason
    assert [f.name for f in lake.table().schema().fields] == ["id", "n"]
