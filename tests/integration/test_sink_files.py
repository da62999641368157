"""The files sink against the real file system: staging, atomic publish, recovery, crashes.

Every test reads back what a dataset reader would see under ``{path}/{topic}`` and compares it
exactly with what was written; crash tests kill real processes with SIGKILL.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from twophase.participants.sdk import (
    AbortTransactionError,
    BackpressureError,
    FatalSinkError,
    PartId,
    Record,
    RetriableSinkError,
    SinkContext,
    UnknownPartError,
)
from twophase.participants.sinks.files import FileSink, _layout, _publish, _staging

REPO = Path(__file__).resolve().parents[2]
PIPELINE = "orders-pipe"
T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z
DAY = 86_400_000


# -- helpers ---------------------------------------------------------------------------------


def make_sink(
    base: Path, *, pipeline: str = PIPELINE, participant: str = "p0", **config: Any
) -> FileSink:
    context = SinkContext(pipeline, participant, "files", logging.getLogger("test.files"))
    raw = {"name": "files", "type": "files", "path": str(base), **config}
    sink = FileSink.from_mapping(raw, context)
    assert isinstance(sink, FileSink)
    sink.setup()
    return sink


def rec(
    offset: int,
    *,
    topic: str = "orders",
    partition: int = 0,
    ts: int = T0,
    value: dict[str, Any] | None = None,
) -> Record:
    if value is None:
        value = {"id": offset, "name": f"n{offset}", "price": offset * 1.25, "ok": offset % 2 == 0}
    return Record(topic, partition, offset, ts, None, value)


def part(txn: int, participant: str = "p0", pipeline: str = PIPELINE) -> PartId:
    return PartId(pipeline, txn, participant)


def visible_files(base: Path) -> list[Path]:
    """What a dataset reader lists: files with no ``_``/``.``-prefixed component."""
    out = []
    for path in base.rglob("*"):
        rel = path.relative_to(base)
        if path.is_file() and not any(p.startswith(("_", ".")) for p in rel.parts):
            out.append(path)
    return sorted(out)


def parquet_rows(base: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in visible_files(base):
        assert path.suffix == ".parquet", path
        rows.extend(pq.read_table(path).to_pylist())
    return rows


def jsonl_rows(base: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in visible_files(base):
        assert path.suffix == ".jsonl", path
        with path.open() as f:
            rows.extend(json.loads(line) for line in f)
    return rows


def state_dir(base: Path, pipeline: str = PIPELINE) -> Path:
    return base / "_twophase" / pipeline


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def by_id(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: r["id"])


# -- end to end ------------------------------------------------------------------------------


def test_parquet_end_to_end(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, compression="zstd")
    p = part(42)
    records = [rec(i) for i in range(10)]
    records += [rec(100 + i, topic="payments", partition=3, ts=T0 + DAY) for i in range(5)]
    sink.begin(p)
    assert sink.write(p, records[:7]) == []
    assert sink.write(p, records[7:]) == []
    positions = {("orders", 0): 10, ("payments", 3): 105}
    sink.prepare(p, positions)
    sink.commit(p)

    files = [f.relative_to(base).as_posix() for f in visible_files(base)]
    assert files == [
        "orders/date=2023-11-14/part-000000000042-p0-0000.parquet",
        "payments/date=2023-11-15/part-000000000042-p0-0001.parquet",
    ]
    orders = pq.read_table(base / files[0])
    assert orders.schema.field("id").type == pa.int64()
    assert orders.to_pylist() == [r.value for r in records[:10]]
    assert pq.read_table(base / files[1]).to_pylist() == [r.value for r in records[10:]]
    assert pq.ParquetFile(base / files[0]).metadata.row_group(0).column(0).compression == "ZSTD"

    # A dataset reader pointed at the base path never sees the bookkeeping.
    dataset = ds.dataset(base / "orders", format="parquet", partitioning="hive")
    assert dataset.count_rows() == 10
    assert set(dataset.to_table().column("date").to_pylist()) == {"2023-11-14"}

    manifest = json.loads((state_dir(base) / "manifests" / "000000000042-p0.json").read_text())
    assert manifest["token"] == p.token
    assert manifest["records"] == 15
    assert manifest["positions"] == [
        {"topic": "orders", "partition": 0, "offset": 10},
        {"topic": "payments", "partition": 3, "offset": 105},
    ]
    assert [f["target"] for f in manifest["files"]] == files
    assert [f["records"] for f in manifest["files"]] == [10, 5]
    assert all(f["bytes"] == (base / f["target"]).stat().st_size for f in manifest["files"])
    assert entries(state_dir(base) / "open") == []
    assert entries(state_dir(base) / "prepared") == []
    assert sink.in_doubt() == []


def test_jsonl_end_to_end(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, format="jsonl", partition_by="topic")
    p = part(1)
    nested = {"id": 99, "deep": {"list": [1, "two", None, {"x": 1.5}], "empty": {}}, "u": "é✓"}
    records = [rec(i) for i in range(20)] + [rec(20, value=nested)]
    sink.begin(p)
    assert sink.write(p, records) == []
    sink.prepare(p, {("orders", 0): 21})
    assert visible_files(base) == []
    sink.commit(p)
    files = visible_files(base)
    assert [f.relative_to(base).as_posix() for f in files] == [
        "orders/part-000000000001-p0-0000.jsonl"
    ]
    assert jsonl_rows(base) == [r.value for r in records]


def test_source_columns_and_dates(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, source_columns=True)
    p = part(3)
    last_ms_of_day = (T0 // DAY + 1) * DAY - 1
    records = [
        rec(0, ts=last_ms_of_day),
        rec(1, ts=last_ms_of_day + 1),
        rec(2, ts=-1),  # no timestamp
        rec(3, value={}),  # an empty object is a row when source columns exist
    ]
    sink.begin(p)
    assert sink.write(p, records) == []
    sink.prepare(p, {("orders", 0): 4})
    sink.commit(p)
    dirs = sorted({f.parent.name for f in visible_files(base)})
    assert dirs == ["date=2023-11-14", "date=2023-11-15", "date=__HIVE_DEFAULT_PARTITION__"]
    rows = sorted(parquet_rows(base), key=lambda r: r["_offset"])
    assert [(r["_topic"], r["_partition"], r["_offset"], r["_timestamp_ms"]) for r in rows] == [
        ("orders", 0, r.offset, r.timestamp_ms) for r in records
    ]
    assert rows[3]["id"] is None


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_timestamps_no_date_can_name_go_to_the_null_partition_exactly(
    tmp_path: Path, fmt: str
) -> None:
    """Kafka takes any int64 timestamp once ``message.timestamp.after.max.ms`` is raised:
    past 9999-12-31 a record still lands, under the null date, its timestamp kept exact."""
    base = tmp_path / "out"
    sink = make_sink(base, source_columns=True, format=fmt)
    p = part(4)
    last_day_ms = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z
    stamps = [last_day_ms, last_day_ms + 1, 2**63 - 1, -1, 0]
    records = [rec(i, ts=ts) for i, ts in enumerate(stamps)]
    sink.begin(p)
    assert sink.write(p, records) == []
    sink.prepare(p, {("orders", 0): len(records)})
    sink.commit(p)
    days = {f.parent.name for f in visible_files(base)}
    assert days == {"date=9999-12-31", "date=__HIVE_DEFAULT_PARTITION__", "date=1970-01-01"}
    rows = parquet_rows(base) if fmt == "parquet" else jsonl_rows(base)
    assert sorted((r["_offset"], r["_timestamp_ms"]) for r in rows) == list(enumerate(stamps))


def test_empty_part_commits_a_manifest(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base)
    p = part(5)
    sink.begin(p)
    sink.prepare(p, {("orders", 0): 17})
    assert sink.in_doubt() == [p]
    sink.commit(p)
    manifest = json.loads((state_dir(base) / "manifests" / "000000000005-p0.json").read_text())
    assert manifest["files"] == [] and manifest["records"] == 0
    assert manifest["positions"] == [{"topic": "orders", "partition": 0, "offset": 17}]
    assert visible_files(base) == []


# -- visibility and recovery -----------------------------------------------------------------


def test_prepared_part_is_invisible_and_another_instance_commits_it(tmp_path: Path) -> None:
    base = tmp_path / "out"
    writer = make_sink(base, participant="p0", max_file_records=4)
    p = part(9)
    records = [rec(i) for i in range(10)]
    writer.begin(p)
    writer.write(p, records)
    assert len(entries(state_dir(base) / "open" / p.token)) == 3  # LOCK + two rolled files
    writer.prepare(p, {("orders", 0): 10})

    assert visible_files(base) == []
    assert not (base / "orders").exists()
    assert ds.dataset(base, format="parquet", partitioning="hive").count_rows() == 0
    staged = entries(state_dir(base) / "prepared" / p.token)
    assert staged == ["0000.parquet", "0001.parquet", "0002.parquet", "LOCK", "PREPARED.json"]
    writer.close()

    # A different participant process, started later, finds and finishes the part.
    recovery = make_sink(base, participant="p7")
    assert recovery.in_doubt() == [p]
    recovery.commit(p)
    assert by_id(parquet_rows(base)) == [r.value for r in records]
    assert recovery.in_doubt() == []
    recovery.commit(p)  # idempotent from any instance
    writer2 = make_sink(base)
    writer2.commit(p)
    assert len(parquet_rows(base)) == 10


def test_commit_resumes_after_some_files_were_published(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, max_file_records=3)
    p = part(11)
    records = [rec(i) for i in range(8)] + [rec(50 + i, topic="refunds") for i in range(4)]
    sink.begin(p)
    sink.write(p, records)
    sink.prepare(p, {("orders", 0): 8, ("refunds", 0): 54})
    prepared = state_dir(base) / "prepared" / p.token
    document = json.loads((prepared / "PREPARED.json").read_text())
    assert len(document["files"]) == 5

    # Crash simulation: the first file was moved by rename, the second hard-linked, then death.
    first, second = document["files"][0], document["files"][1]
    for entry, how in ((first, os.rename), (second, os.link)):
        target = base / entry["target"]
        target.parent.mkdir(parents=True, exist_ok=True)
        how(prepared / entry["name"], target)

    sink2 = make_sink(base)
    assert sink2.in_doubt() == [p]
    with pytest.raises(FatalSinkError, match="already published"):
        sink2.abort(p)  # half-committed: an abort would lose data, so it is refused
    sink2.commit(p)
    assert by_id(parquet_rows(base)) == by_id([r.value for r in records])
    assert len(visible_files(base)) == 5
    assert not prepared.exists()
    sink2.commit(p)
    assert len(parquet_rows(base)) == 12


def test_commit_resumes_after_manifest_before_cleanup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "out"
    sink = make_sink(base)
    p = part(12)
    sink.begin(p)
    sink.write(p, [rec(i) for i in range(5)])
    sink.prepare(p, {("orders", 0): 5})

    def crash(path: Path, trash: Path) -> bool:
        raise OSError(5, "simulated I/O error while cleaning up")

    monkeypatch.setattr(_layout, "discard_tree", crash)
    with pytest.raises(RetriableSinkError):
        sink.commit(p)
    monkeypatch.undo()
    assert (state_dir(base) / "prepared" / p.token).exists()
    assert (state_dir(base) / "manifests" / "000000000012-p0.json").exists()

    recovery = make_sink(base, participant="p1")
    assert recovery.in_doubt() == []  # committed: leftovers are cleaned, not reported
    assert entries(state_dir(base) / "prepared") == []
    recovery.commit(p)
    assert len(parquet_rows(base)) == 5


def test_abort_leaves_nothing_and_is_idempotent(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, max_file_records=2)
    opened, prepared = part(1), part(2)
    sink.begin(prepared)
    sink.write(prepared, [rec(i) for i in range(5)])
    sink.prepare(prepared, {("orders", 0): 5})
    sink.begin(opened)
    sink.write(opened, [rec(i) for i in range(5, 9)])

    sink.abort(opened)
    sink.abort(prepared)
    sink.abort(opened)
    sink.abort(prepared)
    sink.abort(part(77))  # never seen: no-op
    for kind in ("open", "prepared", "manifests", "trash"):
        assert entries(state_dir(base) / kind) == [], kind
    assert sorted(p.name for p in base.iterdir()) == ["_twophase"]
    assert sink.in_doubt() == []
    with pytest.raises(AbortTransactionError):
        sink.write(opened, [rec(10)])
    with pytest.raises(UnknownPartError):
        sink.commit(prepared)


def test_commit_of_unknown_part_raises(tmp_path: Path) -> None:
    sink = make_sink(tmp_path / "out")
    with pytest.raises(UnknownPartError):
        sink.commit(part(404))
    p = part(405)
    sink.begin(p)
    sink.write(p, [rec(0)])
    with pytest.raises(UnknownPartError):
        sink.commit(p)  # open, not prepared: the protocol never commits that


def test_abort_of_committed_part_is_fatal(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base)
    p = part(6)
    sink.begin(p)
    sink.write(p, [rec(0)])
    sink.prepare(p, {("orders", 0): 1})
    sink.commit(p)
    sink.commit(p)
    with pytest.raises(FatalSinkError, match="already committed"):
        sink.abort(p)
    assert len(parquet_rows(base)) == 1
    with pytest.raises(FatalSinkError, match="already committed"):
        sink.begin(p)


def test_prepare_repeated_is_a_no_op_unless_positions_differ(tmp_path: Path) -> None:
    sink = make_sink(tmp_path / "out")
    p = part(8)
    sink.begin(p)
    sink.write(p, [rec(0)])
    sink.prepare(p, {("orders", 0): 1})
    sink.prepare(p, {("orders", 0): 1})
    with pytest.raises(FatalSinkError, match="other positions"):
        sink.prepare(p, {("orders", 0): 2})
    with pytest.raises(AbortTransactionError):
        sink.prepare(part(9), {})  # never begun


def test_in_doubt_is_per_pipeline(tmp_path: Path) -> None:
    base = tmp_path / "out"
    a = make_sink(base, pipeline="alpha")
    b = make_sink(base, pipeline="beta", participant="p1")
    pa_, pb = part(1, pipeline="alpha"), part(1, "p1", pipeline="beta")
    for sink, p, topic in ((a, pa_, "t-alpha"), (b, pb, "t-beta")):
        sink.begin(p)
        sink.write(p, [rec(i, topic=topic) for i in range(3)])
        sink.prepare(p, {(topic, 0): 3})
    assert a.in_doubt() == [pa_]
    assert b.in_doubt() == [pb]
    with pytest.raises(FatalSinkError, match="pipeline"):
        a.commit(pb)
    a.commit(pa_)
    assert b.in_doubt() == [pb]
    assert {f.parts[-3] for f in visible_files(base)} == {"t-alpha"}
    b.abort(pb)
    assert b.in_doubt() == [] and a.in_doubt() == []


# -- housekeeping: committed positions and forget ---------------------------------------------


def commit_part(
    sink: FileSink, p: PartId, positions: dict[tuple[str, int], int], *, commit: bool = True
) -> None:
    sink.begin(p)
    sink.write(p, [rec(p.txn)])
    sink.prepare(p, positions)
    if commit:
        sink.commit(p)


def manifest_names(base: Path, pipeline: str = PIPELINE) -> list[str]:
    return [n for n in entries(state_dir(base, pipeline) / "manifests") if not n.startswith(".")]


def test_positions_are_the_best_committed_and_forget_keeps_the_best_manifest_per_partition(
    tmp_path: Path,
) -> None:
    base = tmp_path / "out"
    sink = make_sink(base)
    o0, o1, pay = ("orders", 0), ("orders", 1), ("payments", 3)
    commit_part(sink, part(1), {o0: 10})
    commit_part(sink, part(2), {o0: 100, o1: 5})
    commit_part(sink, part(3, "p1"), {o1: 7})
    commit_part(sink, part(4), {o0: 200}, commit=False)  # prepared, older than before_txn
    commit_part(sink, part(5), {pay: 1})
    commit_part(sink, part(6), {pay: 9}, commit=False)
    sink.abort(part(6))
    # Another pipeline on the same path: neither counted nor forgotten.
    other = make_sink(base, pipeline="other", participant="q0")
    commit_part(other, part(1, "q0", pipeline="other"), {o0: 999})
    assert sink.committed_positions() == {o0: 100, o1: 7, pay: 1}

    assert sink.forget(5) == 1  # part 1; part 2 holds o0's best, part 3 o1's
    assert manifest_names(base) == [
        "000000000002-p0.json",
        "000000000003-p1.json",
        "000000000005-p0.json",
    ]
    assert sink.forget(5) == 0
    assert sink.in_doubt() == [part(4)]
    assert make_sink(base, participant="p9").committed_positions() == {o0: 100, o1: 7, pay: 1}

    sink.commit(part(4))  # now part 4 holds o0's best and part 2 holds nothing needed
    assert sink.committed_positions() == {o0: 200, o1: 7, pay: 1}
    assert sink.forget(10) == 1
    assert manifest_names(base) == [
        "000000000003-p1.json",
        "000000000004-p0.json",
        "000000000005-p0.json",
    ]
    assert sink.committed_positions() == {o0: 200, o1: 7, pay: 1}
    assert other.committed_positions() == {o0: 999}
    assert manifest_names(base, "other") == ["000000000001-q0.json"]

    # A forgotten part is unknown now: callers only forget long-decided transactions.
    with pytest.raises(UnknownPartError):
        sink.commit(part(1))
    sink.abort(part(2))  # no-op, no longer "already committed"
    assert len(parquet_rows(base)) == 6  # data is never touched (parts 1-5 and other's)


def test_forget_decides_by_offset_not_by_txn(tmp_path: Path) -> None:
    """Decisions applied out of order: the best manifest of a partition may be the older part.
    The newest part's manifest stays too, whatever its positions (``last_committed``)."""
    base = tmp_path / "out"
    sink = make_sink(base)
    o0 = ("orders", 0)
    commit_part(sink, part(2), {o0: 50}, commit=False)
    commit_part(sink, part(1), {o0: 80})
    sink.commit(part(2))
    commit_part(sink, part(3), {o0: 60})  # newest, no partition's best
    assert sink.committed_positions() == {o0: 80}
    assert sink.forget(4) == 1
    assert manifest_names(base) == ["000000000001-p0.json", "000000000003-p0.json"]
    assert sink.committed_positions() == {o0: 80}
    last = make_sink(base, participant="p9").last_committed()
    assert last is not None and last.part == part(3) and last.committed_at is not None


def test_forget_removes_staged_leftovers_so_a_forgotten_part_never_looks_prepared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "out"
    sink = make_sink(base)
    commit_part(sink, part(1), {("orders", 0): 1}, commit=False)

    def crash(path: Path, trash: Path) -> bool:
        raise OSError(5, "simulated I/O error while cleaning up")

    monkeypatch.setattr(_layout, "discard_tree", crash)
    with pytest.raises(RetriableSinkError):
        sink.commit(part(1))  # the manifest is written, the staged directory is left
    monkeypatch.undo()
    commit_part(sink, part(2), {("orders", 0): 2})
    assert entries(state_dir(base) / "prepared") == [part(1).token]
    assert sink.forget(2) == 1
    assert entries(state_dir(base) / "prepared") == []
    assert sink.in_doubt() == []
    assert len(parquet_rows(base)) == 2


def test_positions_follow_manifests_written_and_forgotten_by_other_processes(
    tmp_path: Path,
) -> None:
    base = tmp_path / "out"
    reader, writer = make_sink(base), make_sink(base, participant="p1")
    o0, o1 = ("orders", 0), ("orders", 1)
    assert reader.committed_positions() == {}
    commit_part(writer, part(1, "p1"), {o0: 10, o1: 3})
    assert reader.committed_positions() == {o0: 10, o1: 3}  # cached from now on
    commit_part(writer, part(2, "p1"), {o0: 20})
    assert reader.committed_positions() == {o0: 20, o1: 3}
    commit_part(writer, part(3, "p1"), {o0: 30, o1: 9})
    assert writer.forget(4) == 2
    assert reader.committed_positions() == {o0: 30, o1: 9}
    assert reader.forget(4) == 0  # nothing left to forget, whatever it had cached


def test_forget_from_several_processes_at_once_keeps_the_positions(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base)
    mdir = state_dir(base) / "manifests"
    template = json.loads(_a_manifest(sink).read_text())  # part 1: ("orders", 0) at 1
    expected: dict[tuple[str, int], int] = {("orders", 0): 1}
    for txn in range(2, 600):
        # Offsets not monotonic in txn, so every process has to compare.
        positions = [{"topic": "orders", "partition": txn % 5, "offset": (txn * 7919) % 1000}]
        tp = ("orders", txn % 5)
        expected[tp] = max(expected.get(tp, 0), positions[0]["offset"])
        (mdir / f"{txn:012d}-p{txn % 3}.json").write_text(
            json.dumps({**template, "txn": txn, "positions": positions})
        )
    instances = [make_sink(base, participant=f"p{i}") for i in range(4)]
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda s=s: results.append(s.forget(10_000))) for s in instances
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Each manifest forgotten once; the best one per partition stays, and so does the newest
    # (txn 599, not its partition's best).
    assert sum(results) == 599 - 6
    assert len(manifest_names(base)) == 6 and "000000000599-p2.json" in manifest_names(base)
    assert make_sink(base, participant="p8").committed_positions() == expected


def _a_manifest(sink: FileSink) -> Path:
    commit_part(sink, part(1), {("orders", 0): 1})
    return state_dir(sink.base, sink.context.pipeline) / "manifests" / "000000000001-p0.json"


def test_positions_and_forget_with_thousands_of_manifests_timed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Timings are printed, never asserted (the first call parses every manifest, later calls
    only list the directory)."""
    base = tmp_path / "out"
    sink = make_sink(base)
    mdir = state_dir(base) / "manifests"
    template = json.loads(_a_manifest(sink).read_text())
    n = 5_000
    for txn in range(2, n + 1):
        positions = [{"topic": "orders", "partition": k, "offset": txn * 4 + k} for k in range(4)]
        document = {**template, "txn": txn, "positions": positions}
        (mdir / f"{txn:012d}-p0.json").write_text(json.dumps(document, indent=2))
    expected = {("orders", k): n * 4 + k for k in range(4)}
    fresh = make_sink(base, participant="p1")
    started = time.perf_counter()
    assert fresh.committed_positions() == expected
    cold = time.perf_counter()
    assert fresh.committed_positions() == expected
    warm = time.perf_counter()
    assert fresh.forget(n + 1) == n - 1
    forgot = time.perf_counter()
    assert make_sink(base, participant="p2").committed_positions() == expected
    after = time.perf_counter()
    assert manifest_names(base) == [f"{n:012d}-p0.json"]
    with capsys.disabled():
        print(
            f"\n[files sink] {n} manifests: committed_positions cold {cold - started:.3f}s, "
            f"warm {warm - cold:.3f}s; forget {forgot - warm:.3f}s; "
            f"then cold {after - forgot:.4f}s"
        )


# -- concurrency -----------------------------------------------------------------------------


def test_next_part_fills_while_previous_commits_on_another_thread(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, max_file_records=50)
    t1, t2 = part(1), part(2)
    first = [rec(i) for i in range(500)]
    second = [rec(i) for i in range(500, 1500)]
    sink.begin(t1)
    sink.write(t1, first)
    sink.prepare(t1, {("orders", 0): 500})

    sink.begin(t2)
    started = threading.Event()
    errors: list[BaseException] = []

    def decide() -> None:
        try:
            started.wait(5)
            sink.commit(t1)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    committer = threading.Thread(target=decide)
    committer.start()
    for i in range(0, len(second), 10):
        sink.write(t2, second[i : i + 10])
        started.set()
    committer.join(10)
    assert not committer.is_alive() and errors == []
    assert by_id(parquet_rows(base)) == [r.value for r in first]  # T2 still invisible
    sink.prepare(t2, {("orders", 0): 1500})
    sink.commit(t2)
    assert by_id(parquet_rows(base)) == [r.value for r in first + second]


def test_abort_of_open_part_from_another_thread_stops_its_writes(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, max_file_records=20)
    p = part(3)
    sink.begin(p)
    stop = threading.Event()
    outcome: list[BaseException] = []

    def writer() -> None:
        offset = 0
        try:
            while not stop.is_set():
                sink.write(p, [rec(offset + i) for i in range(7)])
                offset += 7
        except AbortTransactionError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    time.sleep(0.1)
    sink.abort(p)
    thread.join(5)
    stop.set()
    assert len(outcome) == 1
    with pytest.raises(AbortTransactionError):
        sink.prepare(p, {("orders", 0): 1})
    assert entries(state_dir(base) / "open") == []
    assert visible_files(base) == []
    sink.begin(part(4))  # the sink goes on with the next part


# -- schema and rejects ----------------------------------------------------------------------

SCHEMA = {
    "id": "int64",
    "name": "string",
    "qty": "int32",
    "price": "float64",
    "paid": "bool",
    "at": "timestamp",
    "day": "date",
    "meta": "json",
}


def test_configured_schema_rejects_values_that_do_not_fit(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, schema=SCHEMA)
    good: list[dict[str, Any]] = [
        {"id": 1, "name": "a", "qty": 2, "price": 3, "paid": True, "at": T0, "day": "2024-01-02"},
        {"id": 2, "name": None, "at": "2023-11-14T22:13:20.5Z", "meta": {"k": [1, 2]}},
        {"id": 3, "at": "2023-11-14T22:13:20"},  # naive means UTC
    ]
    bad: dict[str, dict[str, Any]] = {
        "qty": {"id": 10, "qty": 2**31},
        "price": {"id": 11, "price": "cheap"},  # "1.5" would be 1.5: docs/types.md
        "paid": {"id": 12, "paid": 1},
        "name": {"id": 13, "name": 5},
        "at": {"id": 14, "at": "yesterday"},
        "day": {"id": 15, "day": "2024-13-01"},
        "extra": {"id": 16, "extra": 1},
    }
    p = part(1)
    sink.begin(p)
    records = [rec(i, value=v) for i, v in enumerate(good)]
    records += [rec(100 + i, value=v) for i, v in enumerate(bad.values())]
    rejected = sink.write(p, records)
    assert [r.extra["field"] for r in rejected] == list(bad)
    for r in rejected:
        assert f"'{r.extra['field']}'" in r.reason
        assert r.record.value == bad[r.extra["field"]]
    assert "int32" in rejected[0].reason and "not in the configured schema" in rejected[-1].reason
    sink.prepare(p, {("orders", 0): 200})
    sink.commit(p)

    [path] = visible_files(base)
    table = pq.read_table(path)
    assert table.schema.names == list(SCHEMA)
    assert str(table.schema.field("at").type) == "timestamp[ms, tz=UTC]"
    assert table.schema.field("qty").type == pa.int32()
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert rows[0]["price"] == 3.0 and rows[0]["day"].isoformat() == "2024-01-02"
    assert [int(r["at"].timestamp() * 1000) for r in rows] == [T0, T0 + 500, T0]
    assert json.loads(rows[1]["meta"]) == {"k": [1, 2]}
    manifest = json.loads((state_dir(base) / "manifests" / "000000000001-p0.json").read_text())
    assert manifest["records"] == 3 and manifest["rejected"] == 7


def test_configured_schema_can_drop_unknown_fields_jsonl(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, format="jsonl", schema={"id": "int64"}, unknown_fields="drop")
    p = part(1)
    sink.begin(p)
    rejected = sink.write(p, [rec(0, value={"id": 1, "x": 2}), rec(1, value={"id": "one"})])
    assert [(r.record.offset, r.extra["field"]) for r in rejected] == [(1, "id")]
    sink.prepare(p, {("orders", 0): 2})
    sink.commit(p)
    assert jsonl_rows(base) == [{"id": 1}]


def test_inferred_schema_types_come_from_the_whole_file(tmp_path: Path) -> None:
    """No record is refused for the records around it (#14): a column's type is decided from
    all of the file's values of the field, in any order -- Arrow's exact inference, decimal
    for integers past int64, else the values' JSON text -- and no value changes."""
    base = tmp_path / "out"
    sink = make_sink(base)
    p = part(1)
    sink.begin(p)
    assert sink.write(p, [rec(0, value={"id": 0, "n": 1, "s": {"a": 1}})]) == []
    later = [
        rec(1, value={"id": 1, "n": 2.5, "s": {"b": "x"}}),
        rec(2, value={"id": 2, "n": "three", "w": 2**62 + 1}),  # n: mixed types -> JSON text
        rec(3, value={"id": 3, "big": 2**70}),  # past int64 -> decimal(38, 0)
        rec(4, value={"id": 4, "l": [1, "x"], "w": 0.5}),  # w: no exact double -> JSON text
        rec(5, value={}),
        rec(6, value={"id": 6, "n": None, "e": {}}),
    ]
    rejected = sink.write(p, later)
    assert [(r.record.offset, r.extra.get("field")) for r in rejected] == [(5, None)]
    assert "empty object" in rejected[0].reason
    assert sink.write(p, [rec(7, value={"id": 7, "k": "a"}), rec(8, value={"id": 8, "k": 1})]) == []
    sink.prepare(p, {("orders", 0): 9})
    sink.commit(p)
    [path] = visible_files(base)
    meta = pq.read_schema(path).metadata
    assert orjson.loads(meta[b"twophase.json_columns"]) == ["n", "w", "l", "k"]
    rows = {r["id"]: r for r in parquet_rows(base)}
    assert sorted(rows) == [0, 1, 2, 3, 4, 6, 7, 8]
    assert [rows[i]["n"] for i in (0, 1, 2, 6)] == ["1", "2.5", '"three"', None]
    assert rows[2]["w"] == "4611686018427387905" and rows[4]["w"] == "0.5"
    assert rows[3]["big"] == Decimal(2**70)
    assert rows[4]["l"] == '[1,"x"]'
    assert (rows[7]["k"], rows[8]["k"]) == ('"a"', "1")
    assert rows[0]["s"] == {"a": 1, "b": None} and rows[1]["s"] == {"a": None, "b": "x"}
    assert rows[6]["e"] is None  # Parquet has no empty group


@pytest.mark.parametrize("seed", range(3))
def test_inferred_schema_does_not_depend_on_record_order(tmp_path: Path, seed: int) -> None:
    """The case of #14: a string "12" first in a batch of integers refused the integers after
    it. Now every order gives the same files' values and refuses nothing."""
    values = [{"id": 0, "i": "12"}] + [{"id": i, "i": i} for i in range(1, 31)]
    rng = random.Random(seed)
    rng.shuffle(values)
    base = tmp_path / "out"
    sink = make_sink(base)
    p = part(1)
    sink.begin(p)
    batch = [rec(n, value=v) for n, v in enumerate(values)]
    while batch:  # in writes of random sizes: one file's chunks, whatever their types
        size = rng.randint(1, 10)
        assert sink.write(p, batch[:size]) == []
        batch = batch[size:]
    sink.prepare(p, {("orders", 0): len(values)})
    sink.commit(p)
    rows = {r["id"]: r["i"] for r in parquet_rows(base)}
    assert rows == {0: '"12"', **{i: str(i) for i in range(1, 31)}}


def test_configured_timestamps_are_refused_rather_than_cut_or_overflowed(tmp_path: Path) -> None:
    """A timestamp field holds milliseconds of the years 1-9999: digits below the millisecond
    are refused, not floored, and an epoch past int64 is the record's refusal -- it used to
    pass the check and end the write of the whole part (Arrow's OverflowError)."""
    sink = make_sink(tmp_path / "out", schema={"id": "int64", "at": "timestamp"})
    bad = [
        {"id": 10, "at": "2024-05-01T00:00:00.0019Z"},
        {"id": 11, "at": "2024-05-01T00:00:00.9999999Z"},
        {"id": 12, "at": 10**19},
        {"id": 13, "at": -(2**63) - 1},
        {"id": 14, "at": 253_402_300_800_000},  # 10000-01-01
    ]
    good = [{"id": 1, "at": "2024-05-01T00:00:00.123Z"}, {"id": 2, "at": -62_135_596_800_000}]
    records = [rec(i, value=v) for i, v in enumerate(good + bad)]
    checked = {r.record.offset for r in sink.check(records)}
    p = part(1)
    sink.begin(p)
    rejected = sink.write(p, records)
    assert checked == {r.record.offset for r in rejected} == set(range(2, 7))
    for r in rejected:
        assert "'at'" in r.reason, r.reason
    sink.prepare(p, {("orders", 0): 10})
    sink.commit(p)
    [path] = visible_files(tmp_path / "out")
    rows = pq.read_table(path).to_pylist()
    assert [r["id"] for r in rows] == [1, 2]
    assert rows[0]["at"].isoformat() == "2024-05-01T00:00:00.123000+00:00"


def test_bad_topic_names_are_rejected(tmp_path: Path) -> None:
    sink = make_sink(tmp_path / "out")
    p = part(1)
    sink.begin(p)
    rejected = sink.write(p, [rec(0, topic="_twophase"), rec(1, topic="../up"), rec(2)])
    assert [r.record.offset for r in rejected] == [0, 1]
    assert all("topic" in r.reason for r in rejected)


# -- files and memory ------------------------------------------------------------------------


def test_files_roll_at_max_file_records(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, format="jsonl", max_file_records=10)
    p = part(2)
    records = [rec(i) for i in range(35)]
    sink.begin(p)
    for i in range(0, 35, 4):  # batches that straddle file boundaries
        sink.write(p, records[i : i + 4])
    # Full files are already on disk: memory holds at most one unfinished file.
    assert entries(state_dir(base) / "open" / p.token) == [
        "0000.jsonl",
        "0001.jsonl",
        "0002.jsonl",
        "LOCK",
    ]
    sink.prepare(p, {("orders", 0): 35})
    sink.commit(p)
    files = visible_files(base)
    assert [f.name for f in files] == [f"part-000000000002-p0-000{i}.jsonl" for i in range(4)]
    assert [len(f.read_text().splitlines()) for f in files] == [10, 10, 10, 5]
    assert jsonl_rows(base) == [r.value for r in records]


def test_buffered_records_are_bounded_across_many_output_files(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, max_file_records=100, max_buffered_records=30)
    p = part(1)
    records = [rec(i, ts=T0 + (i % 10) * DAY) for i in range(100)]  # ten dates, ten buffers
    sink.begin(p)
    sink.write(p, records)
    op = sink._open_files.get(p)
    assert op is not None and op.buffered <= 30
    sink.prepare(p, {("orders", 0): 100})
    sink.commit(p)
    assert by_id(parquet_rows(base)) == [r.value for r in records]


def test_by_default_an_open_part_buffers_at_most_100k_records(tmp_path: Path) -> None:
    """A participant's memory is bounded at any rate: without ``max_buffered_records`` a part
    of one output file (``max_file_records`` 250,000) writes a file early past 100,000
    records; with small files the bound is still two files' worth."""
    base = tmp_path / "out"
    sink = make_sink(base)
    p = part(1)
    records = [rec(i) for i in range(120_000)]
    sink.begin(p)
    for at in range(0, len(records), 10_000):
        sink.write(p, records[at : at + 10_000])
        op = sink._open_files.get(p)
        assert op is not None and op.buffered <= 100_000
    sink.prepare(p, {("orders", 0): len(records)})
    sink.commit(p)
    assert len(visible_files(base)) == 2  # written early at 100,000, then the rest
    assert len(parquet_rows(base)) == len(records)
    small = make_sink(tmp_path / "small", max_file_records=1_000)
    assert small.config.buffered_limit == 2_000


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_100k_record_part_throughput(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, format=fmt)
    n = 100_000
    records = [
        rec(
            i,
            partition=i % 4,
            value={
                "id": i,
                "name": f"customer-{i}",
                "price": i * 0.01,
                "qty": i % 17,
                "ok": i % 3 == 0,
                "tags": ["a", "b"],
            },
        )
        for i in range(n)
    ]
    # Two parts in one process: the first pays for a cold heap, the second is the steady state
    # of a long-running participant. Timings are printed, never asserted.
    for txn, label in ((1, "cold"), (2, "warm")):
        p = part(txn)
        started = time.perf_counter()
        sink.begin(p)
        for i in range(0, n, 5_000):
            assert sink.write(p, records[i : i + 5_000]) == []
        written = time.perf_counter()
        sink.prepare(p, {("orders", k): n for k in range(4)})
        prepared = time.perf_counter()
        sink.commit(p)
        done = time.perf_counter()
        with capsys.disabled():
            print(
                f"\n[files sink {fmt}, {label}] {n} records: {n / (done - started):,.0f} "
                f"records/s (write {written - started:.3f}s, prepare {prepared - written:.3f}s, "
                f"commit {done - prepared:.3f}s)"
            )
        if txn == 1:
            rows = parquet_rows(base) if fmt == "parquet" else jsonl_rows(base)
            assert len(rows) == n
            assert rows[0] == records[0].value and rows[-1] == records[-1].value
    assert len(visible_files(base)) == 2


# -- crashes ---------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import logging, os, sys, time
    sys.path.insert(0, {repo!r})
    from twophase.participants.sdk import PartId, Record, SinkContext
    from twophase.participants.sinks.files import FileSink

    mode, base, kill_at, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    context = SinkContext({pipeline!r}, "p0", "files", logging.getLogger("child"))
    sink = FileSink.from_mapping(
        {{"name": "files", "type": "files", "path": base, "max_file_records": 40_000}}, context
    )
    sink.setup()
    part = PartId({pipeline!r}, 7, "p0")

    def arm():
        # Stop (to be killed) right before the kill_at-th fsync of the step under test.
        real, calls = os.fsync, [0]
        def fsync(fd):
            calls[0] += 1
            if calls[0] == kill_at:
                print("AT", calls[0], flush=True)
                time.sleep(60)
            return real(fd)
        os.fsync = fsync
        return calls

    if mode in ("prepare", "hold"):
        sink.begin(part)
        for i in range(0, n, 10_000):
            sink.write(part, [
                Record("orders", 0, o, 1_700_000_000_000, None, {{"id": o, "pad": "x" * 40}})
                for o in range(i, min(n, i + 10_000))
            ])
        if mode == "hold":
            print("OPEN", flush=True)
            time.sleep(60)
        print("PREPARING", flush=True)
        calls = arm()
        sink.prepare(part, {{("orders", 0): n}})
    else:
        calls = arm()
        sink.commit(part)
    print("DONE", calls[0], flush=True)
    """
)


def spawn(tmp_path: Path, mode: str, base: Path, kill_at: int, n: int) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO), pipeline=PIPELINE))
    return subprocess.Popen(
        [sys.executable, str(script), mode, str(base), str(kill_at), str(n)],
        stdout=subprocess.PIPE,
        text=True,
    )


def lines(proc: subprocess.Popen[str]) -> Iterator[str]:
    assert proc.stdout is not None
    for line in proc.stdout:
        yield line.strip()


def wait_for(proc: subprocess.Popen[str], *words: str) -> str:
    for line in lines(proc):
        if line.split()[0] in words:
            return line
    raise AssertionError(f"child exited ({proc.wait()}) before printing {words}")


def kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def assert_recoverable_after_crash(base: Path, n: int) -> str:
    """The part is open (abort it) or prepared (commit it); nothing ever half visible."""
    p = part(7)
    opened = state_dir(base) / "open" / p.token
    prepared = state_dir(base) / "prepared" / p.token
    assert opened.exists() != prepared.exists(), (
        entries(state_dir(base) / "open"),
        entries(state_dir(base) / "prepared"),
    )
    assert visible_files(base) == []
    sink = make_sink(base, participant="p1")
    if prepared.exists():
        assert sink.in_doubt() == [p]
        assert sink.stale_parts(0) == []
        sink.commit(p)
        rows = parquet_rows(base)
        assert len(rows) == n and sorted(r["id"] for r in rows) == list(range(n))
        return "prepared"
    assert sink.in_doubt() == []
    assert sink.stale_parts(0) == [p]  # the dead writer's flock is gone, whatever the txn
    sink.abort(p)
    assert entries(state_dir(base) / "open") == [] and visible_files(base) == []
    return "open"


N_CHILD = 100_000  # three files: two full at 40k during write, the rest written by prepare
# prepare fsyncs: file 3, PREPARED tmp, open dir, prepared/ parent, open/ parent; 6 = finished
PREPARE_FSYNCS = 6


@pytest.mark.parametrize("kill_at", range(1, PREPARE_FSYNCS + 1))
def test_sigkill_during_prepare_leaves_open_or_prepared(tmp_path: Path, kill_at: int) -> None:
    base = tmp_path / "out"
    proc = spawn(tmp_path, "prepare", base, kill_at, N_CHILD)
    line = wait_for(proc, "AT", "DONE")
    if line.startswith("AT"):
        kill(proc)
    else:
        proc.wait(10)
        assert int(line.split()[1]) == PREPARE_FSYNCS - 1  # keeps the parametrisation honest
    state = assert_recoverable_after_crash(base, N_CHILD)
    # Before the rename the part is open; the rename (between fsyncs 3 and 4) is the prepare.
    assert state == ("open" if kill_at <= 3 else "prepared")


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2])
def test_sigkill_at_a_random_moment_of_prepare(tmp_path: Path, delay: float) -> None:
    base = tmp_path / "out"
    proc = spawn(tmp_path, "prepare", base, 0, N_CHILD)
    wait_for(proc, "PREPARING")
    time.sleep(delay)
    kill(proc)
    assert_recoverable_after_crash(base, N_CHILD)


@pytest.mark.parametrize("kill_at", range(1, 13))
def test_sigkill_during_commit_then_commit_exactly_once(tmp_path: Path, kill_at: int) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, max_file_records=400)
    p = part(7)
    sink.begin(p)
    sink.write(p, [rec(i, ts=T0 + (i % 2) * DAY) for i in range(1000)])
    sink.prepare(p, {("orders", 0): 1000})
    sink.close()

    proc = spawn(tmp_path, "commit", base, kill_at, 0)
    line = wait_for(proc, "AT", "DONE")
    if line.startswith("AT"):
        kill(proc)
    manifest = state_dir(base) / "manifests" / "000000000007-p0.json"
    for path in visible_files(base):  # whatever is visible is complete
        assert pq.read_table(path).num_rows in (400, 200, 100)
    recovery = make_sink(base, participant="p1")
    if manifest.exists():
        assert recovery.in_doubt() == []
    else:
        assert recovery.in_doubt() == [p]
    recovery.commit(p)
    rows = parquet_rows(base)
    assert sorted(r["id"] for r in rows) == list(range(1000))
    assert recovery.in_doubt() == [] and entries(state_dir(base) / "prepared") == []
    with pytest.raises(FatalSinkError):
        recovery.abort(p)


def test_stale_parts_are_only_those_of_dead_writers(tmp_path: Path) -> None:
    # stale_parts(0): the files sink asks the part's lock, never the transaction number, so even
    # a bound below every part lists the dead writer's part and no live one.
    base = tmp_path / "out"
    live = spawn(tmp_path, "hold", base, 0, 10)
    try:
        wait_for(live, "OPEN")
        observer = make_sink(base, participant="p1")
        assert observer.stale_parts(0) == []  # the writer is alive and holds its lock
        with pytest.raises(RetriableSinkError, match="another live process"):
            observer.abort(part(7))
        mine = part(8, "p1")
        observer.begin(mine)
        assert observer.stale_parts(0) == []  # nor is this process's own open part stale
    finally:
        kill(live)
    assert observer.stale_parts(0) == [part(7)]
    observer.abort(part(7))
    assert entries(state_dir(base) / "open") == [mine.token]
    observer.close()
    assert entries(state_dir(base) / "open") == []


# -- safety nets -----------------------------------------------------------------------------


def test_commit_never_overwrites_a_foreign_file(tmp_path: Path) -> None:
    base = tmp_path / "out"
    sink = make_sink(base)
    p = part(1)
    sink.begin(p)
    sink.write(p, [rec(0)])
    sink.prepare(p, {("orders", 0): 1})
    target = base / "orders" / "date=2023-11-14" / "part-000000000001-p0-0000.parquet"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"someone else's data")
    with pytest.raises(FatalSinkError, match="refusing to overwrite"):
        sink.commit(p)
    assert target.read_bytes() == b"someone else's data"
    assert sink.in_doubt() == [p]


def test_begin_replaces_a_dead_writers_leftover_of_the_same_part(tmp_path: Path) -> None:
    base = tmp_path / "out"
    proc = spawn(tmp_path, "hold", base, 0, 10)
    wait_for(proc, "OPEN")
    kill(proc)
    sink = make_sink(base)
    p = part(7)
    sink.begin(p)
    sink.write(p, [rec(0)])
    sink.prepare(p, {("orders", 0): 1})
    sink.commit(p)
    assert parquet_rows(base) == [rec(0).value]


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    context = SinkContext(PIPELINE, "p0", "files", logging.getLogger("test.files"))
    base = {"name": "files", "type": "files", "path": str(tmp_path)}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"format": "jsonl", "compression": "zstd"}, "compression"),
        ({"max_file_records": 0}, "max_file_records"),
        ({"schema": {"id": "integer"}}, "schema"),
        ({"partition_by": "hour"}, "partition_by"),
        ({"shema": {"id": "int64"}}, "shema"),
        ({"schema": {"_offset": "int64"}, "source_columns": True}, "schema"),
    ]
    for extra, field in cases:
        with pytest.raises(ValidationError, match=field):
            FileSink.from_mapping({**base, **extra}, context)


def test_commit_by_rename_where_hard_links_are_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_link(src: Any, dst: Any) -> None:
        raise OSError(errno.EPERM, "hard links not supported here")

    monkeypatch.setattr(os, "link", no_link)
    base = tmp_path / "out"
    sink = make_sink(base, max_file_records=2)
    p = part(1)
    records = [rec(i) for i in range(5)]
    sink.begin(p)
    sink.write(p, records)
    sink.prepare(p, {("orders", 0): 5})
    prepared = state_dir(base) / "prepared" / p.token
    first = json.loads((prepared / "PREPARED.json").read_text())["files"][0]
    (base / first["target"]).parent.mkdir(parents=True)
    os.rename(prepared / first["name"], base / first["target"])  # interrupted commit
    sink.commit(p)
    sink.commit(p)
    assert by_id(parquet_rows(base)) == [r.value for r in records]

    q = part(2)
    sink.begin(q)
    sink.write(q, [rec(9)])
    sink.prepare(q, {("orders", 0): 6})
    foreign = base / "orders" / "date=2023-11-14" / "part-000000000002-p0-0000.parquet"
    foreign.write_bytes(b"not ours")
    with pytest.raises(FatalSinkError, match="refusing to overwrite"):
        sink.commit(q)
    assert foreign.read_bytes() == b"not ours"


def test_os_errors_map_to_the_three_branches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "out"
    sink = make_sink(base, max_file_records=2)
    real_write = _staging.write_durable

    def disk_full(path: Path, data: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    # A failed flush poisons the part: the runtime must abort it, never retry the write.
    p = part(1)
    sink.begin(p)
    monkeypatch.setattr(_staging, "write_durable", disk_full)
    with pytest.raises(AbortTransactionError, match="No space"):
        sink.write(p, [rec(0), rec(1)])
    monkeypatch.setattr(_staging, "write_durable", real_write)
    with pytest.raises(AbortTransactionError, match="can only be aborted"):
        sink.write(p, [rec(2)])
    with pytest.raises(AbortTransactionError):
        sink.prepare(p, {("orders", 0): 3})
    sink.abort(p)
    assert entries(state_dir(base) / "open") == []

    q = part(2)
    sink.begin(q)
    sink.write(q, [rec(0)])
    sink.prepare(q, {("orders", 0): 1})

    def denied(path: Path) -> None:
        raise OSError(errno.EACCES, "Permission denied")

    def full(path: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_publish, "makedirs_durable", full)
    with pytest.raises(BackpressureError) as caught:
        sink.commit(q)
    assert caught.value.retry_after_s > 0
    monkeypatch.setattr(_publish, "makedirs_durable", denied)
    with pytest.raises(FatalSinkError, match="Permission denied"):
        sink.commit(q)
    monkeypatch.undo()
    sink.commit(q)
    assert parquet_rows(base) == [rec(0).value]


# -- deletes as change rows (docs/cdc.md) -----------------------------------------------------


def replay(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """What a reader does with change rows: apply them in (partition, offset) order."""
    state: dict[int, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: (r["_topic"], r["_partition"], r["_offset"])):
        if row["_op"] == "d":
            state.pop(row["id"], None)
        else:
            state[row["id"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    return state


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_deletes_are_change_rows_that_replay_into_the_current_state(
    tmp_path: Path, fmt: str
) -> None:
    sink = make_sink(tmp_path, format=fmt, op_column="_op", source_columns=True)
    assert sink.supports_deletes
    rnd = random.Random(7)
    expected: dict[int, dict[str, Any]] = {}
    offset = 0
    for txn in range(1, 4):
        batch = []
        for _ in range(40):
            key = rnd.randint(1, 8)
            if rnd.random() < 0.3:
                batch.append(
                    rec(offset, partition=key % 2, value={"id": key})._replace(deleted=True)
                )
                expected.pop(key, None)
            else:
                value = {"id": key, "v": offset}
                batch.append(rec(offset, partition=key % 2, value=value))
                expected[key] = value
            offset += 1
        p = part(txn)
        sink.begin(p)
        assert sink.write(p, batch) == []
        sink.prepare(p, {("orders", 0): offset, ("orders", 1): offset})
        sink.commit(p)
    rows = parquet_rows(tmp_path) if fmt == "parquet" else jsonl_rows(tmp_path)
    assert {r["_op"] for r in rows} == {"u", "d"}
    assert replay(rows) == expected


def test_a_record_with_the_op_column_as_a_field_is_refused(tmp_path: Path) -> None:
    sink = make_sink(tmp_path, op_column="_op", source_columns=True)
    p = part(1)
    sink.begin(p)
    rejected = sink.write(p, [rec(0, value={"id": 1, "_op": "x"}), rec(1, value={"id": 2})])
    assert [(r.record.offset, r.reason) for r in rejected] == [
        (0, "field '_op' collides with op_column")
    ]
    sink.abort(p)


def test_without_op_column_the_sink_does_not_take_deletes(tmp_path: Path) -> None:
    assert not make_sink(tmp_path).supports_deletes
    with pytest.raises(ValidationError, match="needs source_columns"):
        make_sink(tmp_path, op_column="_op")
