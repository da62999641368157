"""The PostgreSQL sink against the real server of the local stack (``make stack-up``).

Every test uses its own pipeline, sink name and tables, and its fixture rolls back whatever
prepared transactions of that pipeline are left, so a failing test never leaves locks behind.
The ``max_prepared_transactions = 0`` test starts a throwaway cluster of its own.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from pydantic import ValidationError

from twophase.participants.sdk import (
    AbortTransactionError,
    FatalSinkError,
    PartId,
    RawBatch,
    Record,
    Rejected,
    RetriableSinkError,
    SinkContext,
    UnknownPartError,
)
from twophase.participants.sinks.postgres import PostgresSink, PostgresSinkConfig

pytestmark = pytest.mark.stack

TOPIC = "orders"
MakeSink = Callable[..., PostgresSink]


# -- fixtures ------------------------------------------------------------------------------


def _base_name(unique_name: Any) -> str:
    raw = unique_name("pg") if callable(unique_name) else f"{unique_name}_pg"
    name = re.sub(r"[^a-z0-9_]", "_", str(raw).lower()).strip("_")
    # Leaves room for suffixes within PostgreSQL's 63-byte identifiers and the 40-char sink name.
    return ("t" + name)[-30:].lstrip("_")


class PgEnv:
    """One test's names, an autocommit reader connection, and the clean-up of both."""

    def __init__(self, dsn: str, base: str) -> None:
        self.dsn = dsn
        self.base = base
        self.pipeline = f"p{base}"[:60]
        self.reader = psycopg.connect(dsn, autocommit=True)
        self.tables: list[str] = []
        self.functions: list[str] = []  # dropped after the tables (with their triggers)
        self.collations: list[str] = []  # dropped after the tables that use them
        self.sinks: list[PostgresSink] = []
        self.pipelines = {self.pipeline}

    def table(self, suffix: str, ddl: str) -> str:
        name = f"{self.base}_{suffix}"
        self.reader.execute(f'DROP TABLE IF EXISTS "{name}"')
        self.reader.execute(f'CREATE TABLE "{name}" ({ddl})')
        self.tables.append(name)
        return name

    def rows(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.reader.execute(query, params).fetchall()

    def prepared_gids(self, pipeline: str | None = None) -> list[str]:
        rows = self.rows(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            " AND gid LIKE 'twophase:%%' ORDER BY gid"
        )
        wanted = [pipeline] if pipeline else list(self.pipelines)
        return [g for (g,) in rows if any(f":{p}~" in g for p in wanted)]

    def cleanup_now(self) -> None:
        """Clean up before the end of the test (e.g. to drop a type the tables use)."""
        self.cleanup(keep_reader=True)
        self.sinks, self.tables = [], []

    def cleanup(self, *, keep_reader: bool = False) -> None:
        stages = {s.staging_table for s in self.sinks} - {None}
        for sink in self.sinks:
            sink.close()
        for gid in self.prepared_gids():
            self.reader.execute(f"ROLLBACK PREPARED '{gid}'")
        for stage in stages:
            self.reader.execute(f"DROP TABLE IF EXISTS {stage}")
        for name in self.tables:
            self.reader.execute(f'DROP TABLE IF EXISTS "{name}" CASCADE')  # others' keys to it
        for function in self.functions:
            self.reader.execute(f'DROP FUNCTION IF EXISTS "{function}"() CASCADE')
        for collation in self.collations:
            self.reader.execute(f'DROP COLLATION IF EXISTS "{collation}"')
        if self.rows("SELECT to_regclass('twophase_parts')")[0][0] is not None:
            self.reader.execute(
                "DELETE FROM twophase_parts WHERE pipeline = ANY(%s)", (sorted(self.pipelines),)
            )
        if not keep_reader:
            self.reader.close()


@pytest.fixture
def make_sink(env: PgEnv) -> MakeSink:
    def make(
        table: str,
        *,
        participant: str = "w1",
        pipeline: str | None = None,
        name: str | None = None,
        setup: bool = True,
        **options: Any,
    ) -> PostgresSink:
        pipeline = pipeline or env.pipeline
        env.pipelines.add(pipeline)
        sink_name = name or f"s{env.base}"[:40]
        raw = {"name": sink_name, "type": "postgres", "dsn": env.dsn, "table": table, **options}
        context = SinkContext(
            pipeline=pipeline,
            participant=participant,
            sink_name=sink_name,
            logger=logging.getLogger(f"test.{sink_name}"),
        )
        sink = PostgresSink.from_mapping(raw, context)
        assert isinstance(sink, PostgresSink)
        env.sinks.append(sink)
        if setup:
            sink.setup()
        return sink

    return make


def rec(offset: int, value: dict[str, Any], *, partition: int = 0) -> Record:
    return Record(TOPIC, partition, offset, 1_700_000_000_000 + offset, None, value)


def part(env: PgEnv, txn: int, participant: str = "w1", pipeline: str | None = None) -> PartId:
    return PartId(pipeline or env.pipeline, txn, participant)


def positions_of(records: Sequence[Record]) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for r in records:
        tp = (r.topic, r.partition)
        out[tp] = max(out.get(tp, 0), r.offset + 1)
    return out


def run_part(
    sink: PostgresSink, pid: PartId, *batches: Sequence[Record], commit: bool = True
) -> list[Rejected]:
    sink.begin(pid)
    rejected: list[Rejected] = []
    for batch in batches:
        rejected.extend(sink.write(pid, batch))
    sink.prepare(pid, positions_of([r for b in batches for r in b]))
    if commit:
        sink.commit(pid)
    return rejected


ORDERS_DDL = """
    id bigint PRIMARY KEY,
    name text,
    amount numeric(12, 2),
    paid boolean,
    at timestamptz,
    doc jsonb,
    day date,
    score double precision,
    qty integer NOT NULL DEFAULT 1
"""


# -- insert and upsert end to end ------------------------------------------------------------


def test_insert_mode_end_to_end_invisible_until_commit(env: PgEnv, make_sink: MakeSink) -> None:
    table = env.table("orders", ORDERS_DDL)
    sink = make_sink(table)
    batch1 = [
        rec(
            0,
            {
                "id": 1,
                "name": "ada",
                "amount": 12.5,
                "paid": True,
                "at": "2024-05-01T10:00:00Z",
                "doc": {"tags": ["a", "b"], "n": 1},
                "day": "2024-05-01",
                "score": 0.25,
                "qty": 3,
                "ignored_field": "x",
            },
        ),
        rec(1, {"id": "2", "name": None, "amount": "7.10", "paid": False, "doc": [1, 2]}),
    ]
    batch2 = [rec(2, {"id": 3, "at": "2024-05-01T12:00:00+02:00", "day": "2024-05-02"})]
    pid = part(env, 1)
    sink.begin(pid)
    assert sink.write(pid, batch1) == []
    assert sink.write(pid, batch2) == []
    sink.prepare(pid, {(TOPIC, 0): 3, (TOPIC, 1): 17})

    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(0,)]
    assert env.prepared_gids() == [f"twophase:{sink.name}:{pid.token}"]
    assert sink.state(pid) == "prepared"

    sink.commit(pid)
    assert sink.state(pid) == "committed"
    assert env.prepared_gids() == []
    rows = env.rows(
        f'SELECT id, name, amount, paid, at, doc, day, score, qty FROM "{table}" ORDER BY id'
    )
    assert [r[0] for r in rows] == [1, 2, 3]
    r1, r2, r3 = rows
    assert r1[1:4] == ("ada", Decimal("12.50"), True)
    assert r1[4].isoformat() in ("2024-05-01T10:00:00+00:00",)
    assert r1[5] == {"tags": ["a", "b"], "n": 1}
    assert str(r1[6]) == "2024-05-01" and r1[7] == 0.25 and r1[8] == 3
    assert r2[1] is None and r2[2] == Decimal("7.10") and r2[5] == [1, 2]
    assert r2[8] == 1, "an absent field lets the column DEFAULT apply"
    assert r3[4].timestamp() == 1714557600.0  # 12:00+02:00 == 10:00Z
    marker = env.rows(
        "SELECT sink, txn, participant, positions, records, rejected, target"
        " FROM twophase_parts WHERE pipeline = %s",
        (env.pipeline,),
    )
    assert marker == [
        (sink.name, 1, "w1", {TOPIC: {"0": 3, "1": 17}}, 3, 0, table),
    ]


def test_upsert_last_value_wins_within_and_across_parts(env: PgEnv, make_sink: MakeSink) -> None:
    table = env.table("accounts", "k text, region int, v int, note text, PRIMARY KEY (k, region)")
    sink = make_sink(table, mode="upsert", key=["k", "region"])
    first = [
        rec(0, {"k": "a", "region": 1, "v": 1, "note": "first"}),
        rec(1, {"k": "b", "region": 1, "v": 10, "note": "b"}),
        rec(2, {"k": "a", "region": 1, "v": 2}),  # note absent: keeps "first"
        rec(3, {"k": "a", "region": 2, "v": 100, "note": "other region"}),
    ]
    second_batch = [
        rec(4, {"k": "a", "region": 1, "v": 3}),
        rec(5, {"k": "b", "region": 1, "v": 11}),
    ]
    assert run_part(sink, part(env, 1), first, second_batch) == []
    assert env.rows(f'SELECT k, region, v, note FROM "{table}" ORDER BY k, region') == [
        ("a", 1, 3, "first"),
        ("a", 2, 100, "other region"),
        ("b", 1, 11, "b"),
    ]
    later = [
        rec(6, {"k": "b", "region": 1, "v": 12, "note": None}),
        rec(7, {"k": "c", "region": 1, "v": 0}),
        rec(8, {"k": "b", "region": 1, "v": 13}),
    ]
    assert run_part(sink, part(env, 2), later) == []
    assert env.rows(f'SELECT k, region, v, note FROM "{table}" ORDER BY k, region') == [
        ("a", 1, 3, "first"),
        ("a", 2, 100, "other region"),
        ("b", 1, 13, None),
        ("c", 1, 0, None),
    ]
    counts = env.rows(
        "SELECT txn, records FROM twophase_parts WHERE pipeline = %s ORDER BY txn", (env.pipeline,)
    )
    assert counts == [(1, 6), (2, 3)]


def test_column_mapping_nested_fields_and_server_typed_columns(
    env: PgEnv, make_sink: MakeSink
) -> None:
    env.reader.execute(f'DROP TYPE IF EXISTS "{env.base}_mood"')
    env.reader.execute(f"CREATE TYPE \"{env.base}_mood\" AS ENUM ('happy', 'sad')")
    try:
        table = env.table(
            "people",
            f'id int PRIMARY KEY, city text, mood "{env.base}_mood", tags text[], n int[], '
            "created timestamptz DEFAULT now()",
        )
        columns = {
            "id": "person.id",
            "city": "person.address.city",
            "mood": "mood",
            "tags": "tags",
            "n": "n",
        }
        for mode in ("insert", "upsert"):
            env.reader.execute(f'TRUNCATE "{table}"')
            sink = make_sink(
                table,
                mode=mode,
                columns=columns,
                **({"key": ["id"]} if mode == "upsert" else {}),
                name=f"s{env.base}{mode[0]}"[:40],
            )
            records = [
                rec(
                    0,
                    {
                        "person": {"id": 1, "address": {"city": "Oslo"}},
                        "mood": "happy",
                        "tags": ["x", 'q"uote'],
                        "n": [1, 2],
                    },
                ),
                rec(1, {"person": {"id": 2}, "mood": "sad", "tags": [], "n": None}),
                rec(2, {"person": {"id": 3}, "mood": "angry"}),  # not in the enum: server says no
                rec(3, {"person": {"address": {"city": "no id"}}}),
            ]
            rejected = run_part(sink, part(env, 1 if mode == "insert" else 2), records)
            assert sorted(r.record.offset for r in rejected) == [2, 3], rejected
            reasons = {r.record.offset: r.reason for r in rejected}
            assert "22P02" in reasons[2] and "angry" in reasons[2]
            assert "'id'" in reasons[3] and "person.id" in reasons[3]
            assert env.rows(
                f'SELECT id, city, mood::text, tags, n, created IS NOT NULL FROM "{table}" ORDER BY id'
            ) == [
                (1, "Oslo", "happy", ["x", 'q"uote'], [1, 2], True),
                (2, None, "sad", [], None, True),
            ]
    finally:
        env.cleanup_now()
        env.reader.execute(f'DROP TYPE IF EXISTS "{env.base}_mood"')


# -- durability, recovery, idempotency -------------------------------------------------------


def test_prepared_part_survives_closing_the_sink(env: PgEnv, make_sink: MakeSink) -> None:
    table = env.table("orders", ORDERS_DDL)
    first = make_sink(table)
    pid = part(env, 7)
    run_part(first, pid, [rec(0, {"id": 1}), rec(1, {"id": 2})], commit=False)
    first.close()
    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(0,)]

    second = make_sink(table, participant="w2")
    assert second.in_doubt() == [pid]
    second.commit(pid)
    assert second.in_doubt() == []
    assert env.rows(f'SELECT id FROM "{table}" ORDER BY id') == [(1,), (2,)]
    second.commit(pid)  # replayed decision: no-op
    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(2,)]


def test_abort_of_prepared_part_leaves_nothing(env: PgEnv, make_sink: MakeSink) -> None:
    table = env.table("orders", ORDERS_DDL)
    sink = make_sink(table)
    pid = part(env, 3)
    run_part(sink, pid, [rec(0, {"id": 1})], commit=False)
    sink.abort(pid)
    assert env.prepared_gids() == []
    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(0,)]
    assert env.rows("SELECT count(*) FROM twophase_parts WHERE pipeline = %s", (env.pipeline,)) == [
        (0,)
    ]
    assert sink.state(pid) == "unknown"
    sink.abort(pid)  # idempotent
    with pytest.raises(UnknownPartError):
        sink.commit(pid)

    # The same from a fresh instance that only knows the gid.
    pid2 = part(env, 4)
    run_part(sink, pid2, [rec(1, {"id": 2})], commit=False)
    other = make_sink(table, participant="w9")
    other.abort(pid2)
    assert env.prepared_gids() == [] and env.rows(f'SELECT count(*) FROM "{table}"') == [(0,)]


def test_abort_of_open_part_and_next_part_reuses_the_sink(env: PgEnv, make_sink: MakeSink) -> None:
    table = env.table("orders", ORDERS_DDL)
    sink = make_sink(table)
    pid = part(env, 1)
    sink.begin(pid)
    sink.write(pid, [rec(0, {"id": 1})])
    sink.abort(pid)
    sink.abort(pid)
    with pytest.raises(AbortTransactionError):
        sink.write(pid, [rec(1, {"id": 2})])
    run_part(sink, part(env, 2), [rec(0, {"id": 1})])
    assert env.rows(f'SELECT id FROM "{table}"') == [(1,)]


def test_commit_and_abort_are_idempotent_and_strict(env: PgEnv, make_sink: MakeSink) -> None:
    table = env.table("orders", ORDERS_DDL)
    sink = make_sink(table)
    pid = part(env, 1)
    run_part(sink, pid, [rec(0, {"id": 1})])
    sink.commit(pid)  # second commit: no-op
    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(1,)]
    with pytest.raises(FatalSinkError, match="already committed"):
        sink.abort(pid)
    with pytest.raises(UnknownPartError):
        sink.commit(part(env, 99))
    sink.abort(part(env, 98))  # unknown: no-op
    with pytest.raises(FatalSinkError, match="never be reused"):
        sink.begin(pid)


def test_two_instances_commit_the_same_part_at_once(env: PgEnv, make_sink: MakeSink) -> None:
    table = env.table("orders", ORDERS_DDL)
    owner = make_sink(table)
    others = [make_sink(table, participant=f"w{i}") for i in range(2, 6)]
    pid = part(env, 5)
    run_part(owner, pid, [rec(0, {"id": 1})], commit=False)
    start = threading.Barrier(len(others) + 1)

    def decide(sink: PostgresSink) -> int:
        start.wait()
        for attempt in range(50):
            try:
                sink.commit(pid)
                return attempt
            except RetriableSinkError:  # "is busy": the runtime retries
                time.sleep(0.05)
        raise AssertionError("still busy after 50 tries")

    with ThreadPoolExecutor(len(others) + 1) as pool:
        futures = [pool.submit(decide, s) for s in [owner, *others]]
        for future in futures:
            future.result(timeout=30)  # re-raises what went wrong in the thread
    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(1,)]
    assert env.prepared_gids() == []


# -- housekeeping: committed positions and forget ---------------------------------------------


def run_positions(
    sink: PostgresSink, pid: PartId, positions: dict[tuple[str, int], int], *, commit: bool = True
) -> None:
    sink.begin(pid)
    sink.write(pid, [rec(pid.txn, {"id": pid.txn})])
    sink.prepare(pid, positions)
    if commit:
        sink.commit(pid)


def marker_txns(env: PgEnv, sink: PostgresSink, pipeline: str | None = None) -> list[int]:
    rows = env.rows(
        "SELECT txn FROM twophase_parts WHERE pipeline = %s AND sink = %s ORDER BY txn",
        (pipeline or env.pipeline, sink.name),
    )
    return [txn for (txn,) in rows]


def test_positions_are_the_best_committed_and_forget_keeps_the_best_marker_per_partition(
    env: PgEnv, make_sink: MakeSink
) -> None:
    table = env.table("orders", "id bigint, name text")
    sink = make_sink(table)
    o0, o1, pay = (TOPIC, 0), (TOPIC, 1), ("payments", 3)
    run_positions(sink, part(env, 1), {o0: 10})
    run_positions(sink, part(env, 2), {o0: 100, o1: 5})
    run_positions(make_sink(table, participant="w2"), part(env, 3, "w2"), {o1: 7})
    run_positions(sink, part(env, 4), {o0: 200}, commit=False)  # prepared, older than before
    run_positions(sink, part(env, 5), {pay: 1})
    run_positions(sink, part(env, 6), {pay: 9}, commit=False)
    sink.abort(part(env, 6))
    # Another pipeline and another sink of this pipeline share the marker table: neither is
    # counted nor forgotten.
    other_pipeline = f"{env.pipeline}-x"
    other = make_sink(table, pipeline=other_pipeline)
    run_positions(other, part(env, 1, pipeline=other_pipeline), {o0: 999})
    sibling = make_sink(table, name=f"z{env.base}"[:40])
    run_positions(sibling, part(env, 1), {o0: 998})
    assert sink.committed_positions() == {o0: 100, o1: 7, pay: 1}

    assert sink.forget(5) == 1  # part 1; part 2 holds o0's best, part 3 o1's
    assert marker_txns(env, sink) == [2, 3, 5]
    assert sink.forget(5) == 0
    assert sink.in_doubt() == [part(env, 4)]
    assert make_sink(table, participant="w9").committed_positions() == {o0: 100, o1: 7, pay: 1}

    sink.commit(part(env, 4))  # now part 4 holds o0's best and part 2 nothing needed
    assert sink.committed_positions() == {o0: 200, o1: 7, pay: 1}
    assert sink.forget(10) == 1
    assert marker_txns(env, sink) == [3, 4, 5]
    assert sink.committed_positions() == {o0: 200, o1: 7, pay: 1}
    assert other.committed_positions() == {o0: 999}
    assert sibling.committed_positions() == {o0: 998}
    assert marker_txns(env, other, other_pipeline) == [1]
    assert marker_txns(env, sibling) == [1]

    # A forgotten part is unknown now: callers only forget long-decided transactions.
    with pytest.raises(UnknownPartError):
        sink.commit(part(env, 1))
    sink.abort(part(env, 2))  # no-op, no longer "already committed"
    assert sorted(env.rows(f'SELECT id FROM "{table}"')) == [
        (1,),
        (1,),
        (1,),
        (2,),
        (3,),
        (4,),
        (5,),
    ]


def test_forget_decides_by_offset_not_by_txn(env: PgEnv, make_sink: MakeSink) -> None:
    """Decisions applied out of order: the best marker of a partition may be the older part.
    The newest part's marker stays too, whatever its positions (``last_committed``)."""
    sink = make_sink(env.table("orders", "id bigint, name text"))
    run_positions(sink, part(env, 2), {(TOPIC, 0): 50}, commit=False)
    run_positions(sink, part(env, 1), {(TOPIC, 0): 80})
    sink.commit(part(env, 2))
    run_positions(sink, part(env, 3), {(TOPIC, 0): 60})  # newest, no partition's best
    assert sink.committed_positions() == {(TOPIC, 0): 80}
    assert sink.forget(4) == 1
    assert marker_txns(env, sink) == [1, 3]
    assert sink.committed_positions() == {(TOPIC, 0): 80}
    last = sink.last_committed()
    assert last is not None and last.part == part(env, 3)


def test_forget_from_several_processes_while_parts_commit_keeps_the_positions(
    env: PgEnv, make_sink: MakeSink
) -> None:
    table = env.table("orders", "id bigint, name text")
    writer = make_sink(table)
    forgetters = [make_sink(table, participant=f"f{i}") for i in range(3)]
    expected: dict[tuple[str, int], int] = {}
    stop = threading.Event()

    def forget_repeatedly(sink: PostgresSink) -> int:
        total = 0
        while not stop.is_set():
            total += sink.forget(10**6)
        return total

    with ThreadPoolExecutor(len(forgetters)) as pool:
        futures = [pool.submit(forget_repeatedly, s) for s in forgetters]
        try:
            for txn in range(1, 121):
                # Offsets not monotonic in txn, so every forget has to compare.
                tp, offset = (TOPIC, txn % 4), (txn * 7919) % 1000 + 1
                expected[tp] = max(expected.get(tp, 0), offset)
                run_positions(writer, part(env, txn), {tp: offset})
                assert writer.committed_positions() == expected
        finally:
            stop.set()
        forgotten = sum(f.result(timeout=30) for f in futures)
    forgotten += writer.forget(10**6)
    # Each marker forgotten once; the best of each partition stays, and so does the newest
    # (txn 120, not its partition's best).
    assert forgotten == 120 - 5
    assert len(marker_txns(env, writer)) == 5 and 120 in marker_txns(env, writer)
    assert make_sink(table, participant="w9").committed_positions() == expected


def test_positions_and_forget_with_thousands_of_markers_timed(
    env: PgEnv, make_sink: MakeSink
) -> None:
    """Timings are printed, never asserted."""
    sink = make_sink(env.table("orders", "id bigint, name text"))
    n = 5_000
    for pipeline in (env.pipeline, f"{env.pipeline}-x"):  # the other pipeline: noise
        env.pipelines.add(pipeline)
        env.reader.execute(
            "INSERT INTO twophase_parts (pipeline, sink, txn, participant, positions, records,"
            " target) SELECT %s, %s, t, 'w' || (t %% 3), jsonb_build_object(%s::text,"
            " jsonb_build_object('0', t * 4, '1', t * 4 + 1, '2', t * 4 + 2, '3', t * 4 + 3)),"
            " 1, 'x' FROM generate_series(1, %s) t",
            (pipeline, sink.name, TOPIC, n),
        )
    expected = {(TOPIC, k): n * 4 + k for k in range(4)}
    started = time.perf_counter()
    assert sink.committed_positions() == expected
    read = time.perf_counter()
    assert sink.forget(n + 1) == n - 1
    forgot = time.perf_counter()
    assert sink.committed_positions() == expected
    after = time.perf_counter()
    print(
        f"\npostgres sink: {n} markers: committed_positions {read - started:.3f}s, "
        f"forget {forgot - read:.3f}s, then committed_positions {after - forgot:.4f}s"
    )


# -- pipelining: T prepared while T+1 fills ---------------------------------------------------


def test_commit_from_another_thread_while_next_part_is_written(
    env: PgEnv, make_sink: MakeSink
) -> None:
    table = env.table("orders", ORDERS_DDL)
    sink = make_sink(table)
    t1, t2 = part(env, 1), part(env, 2)
    run_part(sink, t1, [rec(i, {"id": i}) for i in range(100)], commit=False)
    sink.begin(t2)
    committed = threading.Event()

    def decide() -> None:
        time.sleep(0.05)
        sink.commit(t1)
        committed.set()

    with ThreadPoolExecutor(1) as pool:
        decision = pool.submit(decide)
        offset = 100
        while not decision.done() and offset < 100_000:
            assert sink.write(t2, [rec(offset + i, {"id": offset + i}) for i in range(50)]) == []
            offset += 50
        decision.result(timeout=10)
    assert committed.is_set() and offset > 100, "T+1 should have been written meanwhile"
    # T committed, T+1 still open: a reader sees exactly T.
    assert env.rows(f'SELECT count(*), max(id) FROM "{table}"') == [(100, 99)]
    sink.prepare(t2, {(TOPIC, 0): offset})
    assert sink.in_doubt() == [t2]
    sink.commit(t2)
    assert env.rows(f'SELECT count(*), max(id) FROM "{table}"') == [(offset, offset - 1)]


@pytest.mark.parametrize("isolation", [None, "repeatable read", "serializable"])
def test_upsert_next_part_waits_for_the_decision_on_shared_keys(
    env: PgEnv, make_sink: MakeSink, isolation: str | None
) -> None:
    """T+1 writing a key that prepared T holds waits until T is decided, so order is kept --
    also where the server's or the role's default isolation is above READ COMMITTED: T+1
    began before T committed, and at REPEATABLE READ its write of the row T committed would
    fail ("could not serialize access") however often it was retried."""
    table = env.table("kv", "k text PRIMARY KEY, v int")
    options: dict[str, Any] = {}
    if isolation is not None:
        default = "-c default_transaction_isolation=" + isolation.replace(" ", "\\ ")
        options["dsn"] = psycopg.conninfo.make_conninfo(env.dsn, options=default)
    sink = make_sink(table, mode="upsert", key=["k"], **options)
    t1, t2 = part(env, 1), part(env, 2)
    run_part(sink, t1, [rec(0, {"k": "x", "v": 1})], commit=False)
    sink.begin(t2)
    assert sink.write(t2, [rec(1, {"k": "y", "v": 1})]) == []  # T+1's first statement

    def decide() -> None:
        time.sleep(0.5)
        sink.commit(t1)

    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        decision = pool.submit(decide)
        assert sink.write(t2, [rec(2, {"k": "x", "v": 2})]) == []
        waited = time.monotonic() - started
        decision.result(timeout=10)
    assert waited >= 0.4, "the write should have waited for T's row lock"
    sink.prepare(t2, {(TOPIC, 0): 3})
    sink.commit(t2)
    assert sorted(env.rows(f'SELECT k, v FROM "{table}"')) == [("x", 2), ("y", 1)]
    with sink._admin_conn() as admin:  # its statements outside the parts, too
        assert admin.execute("SHOW transaction_isolation").fetchone() == ("read committed",)


@pytest.mark.parametrize("timeout", ["idle_in_transaction_session_timeout", "idle_session_timeout"])
def test_the_servers_idle_timeouts_end_no_part_and_no_connection(
    env: PgEnv, make_sink: MakeSink, timeout: str
) -> None:
    """A server or role whose idle timeout is shorter than the sink's waits: an open part idles
    between batches until the cycle's PREPARE, a prepared part's connection until the decision,
    the admin and spare connections until the next part. With the server's 300 ms none of them
    may end: every part commits, none is aborted, nothing is retried."""
    table = env.table("kv", "k text PRIMARY KEY, v int")
    dsn = psycopg.conninfo.make_conninfo(env.dsn, options=f"-c {timeout}=300")
    sink = make_sink(table, mode="upsert", key=["k"], dsn=dsn)
    idle = 0.6
    for txn in (1, 2, 3):
        t = part(env, txn)
        sink.begin(t)  # on the connection the last part committed on, idle since
        assert sink.write(t, [rec(2 * txn, {"k": f"a{txn}", "v": txn})]) == []
        time.sleep(idle)  # the part's transaction, idle between batches
        assert sink.write(t, [rec(2 * txn + 1, {"k": f"b{txn}", "v": txn})]) == []
        time.sleep(idle)  # ... and until the PREPARE
        sink.prepare(t, {(TOPIC, 0): 2 * txn + 2})
        time.sleep(idle)  # the prepared part's connection, until the decision
        sink.commit(t)
        time.sleep(idle)  # the admin and spare connections, until the next part
    assert sorted(env.rows(f'SELECT k, v FROM "{table}"')) == [
        (f"{k}{txn}", txn) for k in "ab" for txn in (1, 2, 3)
    ]
    assert sink.committed_positions() == {(TOPIC, 0): 8}
    with sink._admin_conn() as admin:
        assert admin.execute(f"SHOW {timeout}").fetchone() == ("0",)


# -- bad records ------------------------------------------------------------------------------


def test_bad_records_are_rejected_and_the_rest_commit(env: PgEnv, make_sink: MakeSink) -> None:
    table = env.table(
        "checked",
        "id bigint PRIMARY KEY, amount int NOT NULL CHECK (amount >= 0), "
        "code varchar(3), at timestamptz",
    )
    env.reader.execute(f'INSERT INTO "{table}" VALUES (500, 1, NULL, NULL)')
    sink = make_sink(table)
    records = [
        rec(0, {"id": 1, "amount": 5}),
        rec(1, {"id": 2, "amount": "five"}),  # wrong type (client)
        rec(2, {"id": 3, "amount": -1}),  # CHECK (server)
        rec(3, {"id": 4}),  # NOT NULL without default, missing (client)
        rec(4, {"id": 5, "amount": 1, "code": "toolong"}),  # varchar(3) (client)
        rec(5, {"id": 6, "amount": 1, "at": "yesterday"}),  # timestamp (client)
        rec(6, {"id": 500, "amount": 2}),  # duplicate of a committed row (server, unique)
        rec(7, {"id": 7, "amount": 2**40}),  # out of range for int (client)
        rec(8, {"id": 8, "amount": 8}),
        rec(9, {"id": 8, "amount": 9}),  # duplicate within the batch (server)
        rec(10, {"id": 9, "amount": None}),  # explicit null in NOT NULL (client)
    ] + [rec(100 + i, {"id": 100 + i, "amount": i}) for i in range(200)]
    rejected = run_part(sink, part(env, 1), records)
    reasons = {r.record.offset: r.reason for r in rejected}
    assert sorted(reasons) == [1, 2, 3, 4, 5, 6, 7, 9, 10]
    assert "'amount'" in reasons[1] and "five" in reasons[1]
    assert f"{table}_amount_check" in reasons[2] and "23514" in reasons[2]
    assert "'amount'" in reasons[3] and "missing" in reasons[3]
    assert "'code'" in reasons[4] and "3" in reasons[4]
    assert "'at'" in reasons[5]
    assert "23505" in reasons[6] and f"{table}_pkey" in reasons[6]
    assert "out of range" in reasons[7]
    assert "23505" in reasons[9]
    assert "'amount'" in reasons[10] and "null" in reasons[10]
    assert env.rows(f'SELECT id, amount FROM "{table}" WHERE id < 100 ORDER BY id') == [
        (1, 5),
        (8, 8),
    ]
    assert env.rows(f'SELECT count(*) FROM "{table}" WHERE id >= 100 AND id < 500') == [(200,)]
    assert env.rows(
        "SELECT records, rejected FROM twophase_parts WHERE pipeline = %s", (env.pipeline,)
    ) == [(202, 9)]


def test_values_past_what_the_columns_hold_are_the_record_s_refusal_never_the_part_s(
    env: PgEnv, make_sink: MakeSink
) -> None:
    """Numbers past numeric's reach (psycopg refuses them while sending the COPY: the whole
    part failed, and failed again on every try), instants outside the years 1-9999 once in
    UTC (an OverflowError), and numbers spelled in other scripts' digits are refused with the
    reason; the rest commit."""
    table = env.table("reach", "id bigint PRIMARY KEY, n numeric, at timestamp")
    sink = make_sink(table)
    bad = {
        1: {"id": 1, "n": "1e-20000"},
        2: {"id": 2, "n": "1E+200000"},
        3: {"id": 3, "n": "1e-16384"},
        4: {"id": 4, "n": "\u0661\u0662.\u0665"},
        5: {"id": 5, "n": "12 5"},
        6: {"id": 6, "at": "0001-01-01T00:00:00+01:00"},
        7: {"id": 7, "at": "9999-12-31T23:00:00-01:00"},
    }
    good = {0: {"id": 1000, "n": "1e-16383", "at": "2024-05-01T13:45:00+02:00"}}
    good |= {10 + i: {"id": 10 + i, "n": i} for i in range(100)}
    records = [rec(o, v) for o, v in sorted((good | bad).items())]
    checked = {r.record.offset: r.reason for r in sink.check(records)}
    rejected = {r.record.offset: r.reason for r in run_part(sink, part(env, 1), records)}
    assert sorted(rejected) == sorted(checked) == sorted(bad), rejected
    for offset, reason in rejected.items():
        column = "'n'" if "n" in bad[offset] else "'at'"
        assert f"column {column}" in reason, reason
    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(101,)]
    assert env.rows(f'SELECT n = 1e-16383, at::text FROM "{table}" WHERE id = 1000') == [
        (True, "2024-05-01 11:45:00")
    ]


def test_upsert_rejects_null_key_and_pins_server_errors_on_the_right_record(
    env: PgEnv, make_sink: MakeSink
) -> None:
    table = env.table("kv", "k text PRIMARY KEY, v int CHECK (v < 100)")
    sink = make_sink(table, mode="upsert", key=["k"])
    records = [
        rec(0, {"k": None, "v": 1}),
        rec(1, {"v": 1}),
        rec(2, {"k": "a", "v": 1}),
        rec(3, {"k": "a", "v": 500}),  # CHECK fails for the merged row: only this one goes
        rec(4, {"k": "b", "v": 2}),
    ]
    rejected = run_part(sink, part(env, 1), records)
    reasons = {r.record.offset: r.reason for r in rejected}
    assert sorted(reasons) == [0, 1, 3]
    assert "upsert key" in reasons[0] and "upsert key" in reasons[1]
    assert "23514" in reasons[3]
    assert env.rows(f'SELECT k, v FROM "{table}" ORDER BY k') == [("a", 1), ("b", 2)]


def _long_key(seed: int) -> str:
    """3,000 random characters: past the btree limit (2,704 bytes) even compressed."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(3000))


#: A row-level refusal from each class that names one row: 54000 (index row over the btree
#: limit), P0004 (a trigger's ASSERT), 23505 (unique), 22003 (numeric out of range).
_ONE_ROW_DDL = "k text PRIMARY KEY, v int, n numeric(4, 1)"
_ASSERT_TRIGGER = """
    CREATE FUNCTION "{t}_check"() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN ASSERT NEW.v <> 13, 'v must not be 13'; RETURN NEW; END $$;
    CREATE TRIGGER "{t}_check" BEFORE INSERT OR UPDATE ON "{t}"
        FOR EACH ROW EXECUTE FUNCTION "{t}_check"();
"""


@pytest.mark.parametrize(
    ("mode", "raw", "compiled"),
    [
        ("insert", False, False),
        ("insert", True, True),
        ("insert", True, False),
        ("upsert", False, False),
        ("upsert", True, False),
    ],
    ids=["insert", "insert-compiled", "insert-raw-python", "upsert", "upsert-raw"],
)
def test_every_refusal_of_one_row_isolates_that_row(
    env: PgEnv, make_sink: MakeSink, mode: str, raw: bool, compiled: bool
) -> None:
    table = env.table("onerow", _ONE_ROW_DDL)
    env.reader.execute(_ASSERT_TRIGGER.format(t=table))
    options: dict[str, Any] = {"mode": mode}
    if mode == "upsert":
        options["key"] = ["k"]
    if not compiled:
        options["compiled_copy"] = False
    sink = make_sink(table, **options)
    assert sink.accepts_raw() == compiled
    values: list[dict[str, Any]] = [{"k": f"ok{i}", "v": 100 + i, "n": 1} for i in range(40)]
    bad = {
        5: ({"k": _long_key(5), "v": 1, "n": 1}, "54000"),
        17: ({"k": "assert", "v": 13, "n": 1}, "P0004"),
        29: ({"k": "big", "v": 1, "n": 12345}, "22003"),
    }
    if mode == "insert":
        bad[33] = ({"k": "ok1", "v": 1, "n": 1}, "23505")
    for offset, (value, _) in bad.items():
        values[offset] = value
    pid = part(env, 1)
    sink.begin(pid)
    if raw:
        rejected = list(sink.write_raw(pid, raw_batch([orjson.dumps(v) for v in values])))
    else:
        rejected = list(sink.write(pid, [rec(i, v) for i, v in enumerate(values)]))
    sink.prepare(pid, {(TOPIC, 0): len(values)})
    sink.commit(pid)
    reasons = {r.record.offset: r.reason for r in rejected}
    assert sorted(reasons) == sorted(bad), reasons
    for offset, (_, state) in bad.items():
        assert f"SQLSTATE {state}" in reasons[offset], reasons[offset]
    stored = {k for (k,) in env.rows(f'SELECT k FROM "{table}"')}
    assert stored == {v["k"] for i, v in enumerate(values) if i not in bad}


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_a_part_level_error_names_the_record_it_met(
    env: PgEnv, make_sink: MakeSink, compiled: bool
) -> None:
    table = env.table("partlevel", "k text PRIMARY KEY, v int")
    # An error of no row class (XX000, internal): the part fails, and says which record.
    env.reader.execute(
        f"""CREATE FUNCTION "{table}_boom"() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN IF NEW.v = 7 THEN RAISE EXCEPTION 'boom' USING ERRCODE = 'XX000'; END IF;
        RETURN NEW; END $$;
        CREATE TRIGGER "{table}_boom" BEFORE INSERT ON "{table}"
            FOR EACH ROW EXECUTE FUNCTION "{table}_boom"();"""
    )
    sink = make_sink(table, compiled_copy=compiled)
    assert sink.accepts_raw() == compiled
    pid = part(env, 1)
    sink.begin(pid)
    values = [{"k": f"k{i}", "v": i} for i in range(20)]
    values[3] = {"k": "k3", "v": None}  # taken the Python way: the stream's lines skip it
    with pytest.raises(AbortTransactionError) as caught:
        if compiled:
            sink.write_raw(pid, raw_batch([orjson.dumps(v) for v in values]))
        else:
            sink.write(pid, [rec(i, v, partition=2) for i, v in enumerate(values)])
    where = f"{TOPIC}[{0 if compiled else 2}]@7"
    assert "XX000" in str(caught.value) and where in str(caught.value), caught.value
    sink.abort(pid)


# -- lost connections --------------------------------------------------------------------------


def _terminate(env: PgEnv, conn: psycopg.Connection[Any]) -> None:
    pid = conn.info.backend_pid
    env.reader.execute("SELECT pg_terminate_backend(%s)", (pid,))
    for _ in range(100):
        if not env.rows("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)):
            return
        time.sleep(0.05)


def _open_with_one_row(
    env: PgEnv, make_sink: MakeSink, txn: int
) -> tuple[str, PostgresSink, PartId]:
    """A table, a sink and its part ``txn`` open with one row written."""
    table = env.table("orders", ORDERS_DDL)
    sink = make_sink(table)
    pid = part(env, txn)
    sink.begin(pid)
    sink.write(pid, [rec(0, {"id": 1})])
    assert sink._open is not None and sink._open.conn is not None
    return table, sink, pid


def test_lost_connection_of_open_part_asks_for_abort(env: PgEnv, make_sink: MakeSink) -> None:
    table, sink, pid = _open_with_one_row(env, make_sink, 1)
    assert sink._open is not None and sink._open.conn is not None
    _terminate(env, sink._open.conn)
    with pytest.raises(AbortTransactionError):
        sink.write(pid, [rec(1, {"id": 2})])
    with pytest.raises(AbortTransactionError):
        sink.prepare(pid, {(TOPIC, 0): 2})
    sink.abort(pid)
    run_part(sink, part(env, 2), [rec(0, {"id": 1}), rec(1, {"id": 2})])
    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(2,)]


def test_lost_connection_of_prepared_part_still_commits(env: PgEnv, make_sink: MakeSink) -> None:
    table = env.table("orders", ORDERS_DDL)
    sink = make_sink(table)
    pid = part(env, 1)
    run_part(sink, pid, [rec(0, {"id": 1})], commit=False)
    _terminate(env, sink._prepared[pid])
    assert sink._admin is not None
    _terminate(env, sink._admin)
    with pytest.raises(RetriableSinkError):  # the admin connection was lost too: retry
        sink.commit(pid)
    sink.commit(pid)
    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(1,)]
    assert env.prepared_gids() == []


@pytest.mark.parametrize("state", ["open", "broken", "prepare_refused_before_sent"])
def test_an_abort_never_ends_another_attempts_prepared_part_of_the_same_id(
    env: PgEnv, make_sink: MakeSink, state: str
) -> None:
    """A part id is begun again after a rewind, and a dead incarnation's PREPARE can land after
    a new one began the same id. An abort of an attempt that never sent PREPARE -- open, broken
    (its connection lost), or refused before PREPARE went out -- must leave a prepared part of
    that gid alone: the transaction's decision settles it. Rolling back by name from there is
    how a committed part could vanish (its owner then finds the gid gone at commit)."""
    table = env.table("orders", ORDERS_DDL)
    mine = make_sink(table)
    other = make_sink(table)  # the other attempt: same pipeline, participant and sink name
    pid = part(env, 7)
    mine.begin(pid)
    mine.write(pid, [rec(0, {"id": 1})])
    other.begin(pid)  # the id is not prepared yet, so the other attempt may begin it too
    other.write(pid, [rec(5, {"id": 2})])
    other.prepare(pid, {(TOPIC, 0): 6})
    assert mine._open is not None and mine._open.conn is not None
    if state == "broken":
        _terminate(env, mine._open.conn)
        with pytest.raises(AbortTransactionError):
            mine.write(pid, [rec(1, {"id": 3})])
    elif state == "prepare_refused_before_sent":
        # The marker row waits on the other attempt's (same key, prepared) and gives up: the
        # prepare fails before PREPARE goes out.
        mine._open.conn.execute("SET lock_timeout = '200ms'")
        with pytest.raises(AbortTransactionError, match="lock timeout"):
            mine.prepare(pid, {(TOPIC, 0): 1})
    mine.abort(pid)
    assert env.prepared_gids() == [other.gid(pid)], "the other attempt's part must stay prepared"
    other.commit(pid)  # its decision
    assert env.rows(f'SELECT id FROM "{table}" ORDER BY id') == [(2,)]
    assert env.prepared_gids() == []


def test_an_abort_after_a_prepare_lost_in_flight_rolls_back_by_gid(
    env: PgEnv, make_sink: MakeSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of the rule above: once PREPARE was sent, the server may hold the gid
    although the client saw an error (the answer lost with the connection), so the abort looks
    for it by gid and rolls it back."""
    table, sink, pid = _open_with_one_row(env, make_sink, 3)
    assert sink._open is not None and sink._open.conn is not None
    conn = sink._open.conn
    real_prepare = conn.tpc_prepare

    def prepared_then_lost() -> None:
        real_prepare()  # the server prepares it ...
        _terminate(env, conn)  # ... and the answer is lost with the connection
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(conn, "tpc_prepare", prepared_then_lost)
    with pytest.raises(AbortTransactionError):
        sink.prepare(pid, {(TOPIC, 0): 1})
    assert env.prepared_gids() == [sink.gid(pid)]
    sink.abort(pid)
    assert env.prepared_gids() == []
    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(0,)]


def test_after_a_failed_test_only_its_own_pipelines_parts_are_rolled_back(
    env: PgEnv, make_sink: MakeSink
) -> None:
    """The suite's clean-up after a failed test (tests/conftest.py) rolls back what the test's
    pipelines left prepared -- and never a part of a pipeline running beside the suite on the
    same server, whether its processes are connected or all dead between two kills (it
    committed before the test began). Rolling those back by name lost a chaos run's part."""
    from harness.store_faults import pg_left_by_a_test

    table = env.table("orders", ORDERS_DDL)
    names = {k: f"{env.pipeline}-{k}" for k in ("own", "live", "older")}
    older = make_sink(table, pipeline=names["older"])
    run_part(older, part(env, 1, pipeline=names["older"]), [rec(0, {"id": 1})])
    time.sleep(0.05)
    started = datetime.datetime.now(datetime.UTC)
    sinks = {k: make_sink(table, pipeline=n) for k, n in names.items() if k != "older"}
    sinks["older"] = older
    gids = {}
    for i, (k, sink) in enumerate(sorted(sinks.items())):
        pid = part(env, 2, pipeline=names[k])
        run_part(sink, pid, [rec(10 + i, {"id": 10 + i})], commit=False)
        gids[k] = sink.gid(pid)
    sinks["own"].close()  # a failed test's processes are gone
    older.close()  # so are the chaos run's, between two kills
    raw = f"raw-{env.pipeline}"  # a gid not of twophase (a smoke test's, an XA peer's)
    other = psycopg.connect(env.dsn)
    other.tpc_begin(raw)
    other.execute("SELECT 1")
    other.tpc_prepare()
    other.close()
    try:
        left = set(pg_left_by_a_test(env.reader, started))
    finally:
        env.reader.execute(f"ROLLBACK PREPARED '{raw}'")
    assert raw in left
    assert gids["own"] in left
    assert gids["live"] not in left, "a pipeline with live sessions is not the test's"
    assert gids["older"] not in left, "a pipeline that committed before the test is not its"


# -- in_doubt ---------------------------------------------------------------------------------


def test_in_doubt_lists_every_participant_of_the_pipeline_only(
    env: PgEnv, make_sink: MakeSink
) -> None:
    table = env.table("orders", ORDERS_DDL)
    other_pipeline = f"{env.pipeline}_other"[:60]
    # "_" is a LIKE wildcard: a pipeline differing only there must not be listed.
    assert "_" in env.pipeline
    lookalike = env.pipeline.replace("_", "x", 1)
    w1 = make_sink(table, participant="w1")
    w2 = make_sink(table, participant="w2")
    foreign = make_sink(table, participant="w1", pipeline=other_pipeline)
    alike = make_sink(table, participant="w1", pipeline=lookalike)
    other_sink = make_sink(table, participant="w1", name=f"z{env.base}"[:40])
    mine = [part(env, 1, "w1"), part(env, 2, "w1"), part(env, 1, "w2")]
    run_part(w1, mine[0], [rec(0, {"id": 1})], commit=False)
    run_part(w1, mine[1], [rec(1, {"id": 2})], commit=False)
    run_part(w2, mine[2], [rec(2, {"id": 3})], commit=False)
    run_part(foreign, part(env, 1, "w1", other_pipeline), [rec(3, {"id": 4})], commit=False)
    run_part(alike, part(env, 1, "w1", lookalike), [rec(4, {"id": 5})], commit=False)
    run_part(other_sink, part(env, 3, "w1"), [rec(5, {"id": 6})], commit=False)

    assert w2.in_doubt() == sorted(mine)
    assert foreign.in_doubt() == [part(env, 1, "w1", other_pipeline)]
    assert other_sink.in_doubt() == [part(env, 3, "w1")]
    for p in w2.in_doubt():
        w2.abort(p)
    assert w1.in_doubt() == []
    assert len(env.prepared_gids()) == 3  # the other pipelines' and sink's: cleaned by the fixture


# -- set-up and configuration -----------------------------------------------------------------


def test_missing_table_is_fatal_and_create_table_creates_it(
    env: PgEnv, make_sink: MakeSink
) -> None:
    name = f"{env.base}_made"
    env.tables.append(name)
    with pytest.raises(FatalSinkError, match=f"target table {name} does not exist"):
        make_sink(name)
    sink = make_sink(
        name,
        mode="upsert",
        key=["id"],
        create_table={"id": "bigint", "payload": "jsonb", "at": "timestamp with time zone"},
    )
    run_part(
        sink, part(env, 1), [rec(0, {"id": 1, "payload": {"a": 1}, "at": "2024-01-01T00:00:00"})]
    )
    assert env.rows(f'SELECT id, payload FROM "{name}"') == [(1, {"a": 1})]
    with pytest.raises(FatalSinkError, match="unique index"):
        make_sink(env.table("nokey", "id int, v int"), mode="upsert", key=["id"])
    with pytest.raises(FatalSinkError, match="no column 'nope'"):
        make_sink(name, columns={"nope": "x"})


def test_config_errors_name_the_field_and_hide_secrets(pg_dsn: str) -> None:
    base = {"name": "pg", "type": "postgres", "dsn": pg_dsn, "table": "t"}

    def error_of(**changes: Any) -> str:
        with pytest.raises(ValidationError) as info:
            PostgresSinkConfig.model_validate({**base, **changes})
        return str(info.value)

    assert "key" in error_of(mode="insert", key=["id"])  # upsert without key: the primary key
    assert "name" in error_of(name="x" * 41)
    assert "name" in error_of(name="a:b")
    assert "dsn" in error_of(dsn="host=127.0.0.1 port")
    assert "table" in error_of(table="a.b.c")
    assert "create_table" in error_of(create_table={"id": "int); DROP TABLE x; --"})
    assert "columns" in error_of(mode="upsert", key=["id"], columns={"v": "v"})
    assert "mode" in error_of(mode="merge")
    config = PostgresSinkConfig.model_validate({**base, "password": "hunter2"})
    assert "hunter2" not in repr(config) and "hunter2" not in str(config)
    assert pg_dsn not in repr(config)


def test_sink_name_too_long_for_gid_is_fatal(pg_dsn: str) -> None:
    config = PostgresSinkConfig.model_validate(
        {"name": "pg", "type": "postgres", "dsn": pg_dsn, "table": "t"}
    )
    context = SinkContext("p", "w", "n" * 60, logging.getLogger("test"))
    with pytest.raises(FatalSinkError, match="200-byte"):
        PostgresSink(config, context)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """A throwaway PostgreSQL cluster on its own port: for server settings and crashes that
    the shared stack's server must not be put through."""

    def __init__(self, bin_dir: Path, root: Path, settings: dict[str, str]) -> None:
        self.bin_dir = bin_dir
        self.root = root
        self.port = _free_port()
        self.settings = {
            "port": str(self.port),
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": "''",
            **settings,
        }
        # initdb and postgres refuse to run as root: as root, run them as the postgres user.
        self.as_pg = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 120) -> None:
        done = subprocess.run(
            [*self.as_pg, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            log = self.root / "log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            pytest.fail(f"{args[0]} failed: {done.stdout}{done.stderr}\n{tail}")

    def _ctl(self, *args: str) -> None:
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.root / "data"), *args)

    def start(self) -> None:
        options = " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        self._ctl("-o", options, "-l", str(self.root / "log"), "-w", "-t", "60", "start")

    def crash(self) -> None:
        """Immediate shutdown: no checkpoint, the next start runs crash recovery."""
        self._ctl("-m", "immediate", "-w", "stop")


@pytest.fixture
def cluster_factory(stack_env: dict[str, str]) -> Iterator[Callable[..., Cluster]]:
    bin_dir = Path(stack_env.get("TWOPHASE_PG_BIN", ""))
    if not (bin_dir / "initdb").exists():
        pytest.fail(f"no initdb in TWOPHASE_PG_BIN={bin_dir!s}; run `make stack-up`")
    started: list[Cluster] = []

    def make(**settings: str) -> Cluster:
        root = Path(tempfile.mkdtemp(prefix="twophase-pgtest-", dir="/tmp"))
        if os.geteuid() == 0:
            shutil.chown(root, "postgres")
        cluster = Cluster(bin_dir, root, settings)
        started.append(cluster)
        cluster._run(
            str(bin_dir / "initdb"),
            "-D",
            str(root / "data"),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-locale",
        )
        cluster.start()
        return cluster

    yield make
    for cluster in started:
        subprocess.run(
            [*cluster.as_pg, str(bin_dir / "pg_ctl"), "-D", str(cluster.root / "data")]
            + ["-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        shutil.rmtree(cluster.root, ignore_errors=True)


def _sink_on(dsn: str, table: str, participant: str = "w") -> PostgresSink:
    context = SinkContext("p", participant, "pg", logging.getLogger("test.cluster"))
    sink = PostgresSink.from_mapping(
        {"name": "pg", "type": "postgres", "dsn": dsn, "table": table}, context
    )
    assert isinstance(sink, PostgresSink)
    return sink


def test_max_prepared_transactions_zero_is_a_clear_fatal_error(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory(max_prepared_transactions="0", fsync="off")
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int)")
    sink = _sink_on(cluster.dsn, "t")
    try:
        with pytest.raises(FatalSinkError) as info:
            sink.setup()
    finally:
        sink.close()
    assert (
        "PostgreSQL max_prepared_transactions is 0; two-phase commit needs it > 0 "
        "(set it in postgresql.conf and restart)"
    ) in str(info.value)


def test_prepared_parts_survive_a_server_crash(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(max_prepared_transactions="10")
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text)")
    sink = _sink_on(cluster.dsn, "t")
    sink.setup()
    keep, drop, open_part = PartId("p", 1, "w"), PartId("p", 2, "w"), PartId("p", 3, "w")
    run_part(sink, keep, [rec(0, {"id": 1, "v": "kept"})], commit=False)
    run_part(sink, drop, [rec(1, {"id": 2, "v": "dropped"})], commit=False)
    sink.begin(open_part)
    sink.write(open_part, [rec(2, {"id": 3, "v": "never prepared"})])
    cluster.crash()
    sink.close()
    cluster.start()

    after = _sink_on(cluster.dsn, "t", participant="w2")
    after.setup()
    try:
        assert after.in_doubt() == [keep, drop]
        after.commit(keep)
        after.abort(drop)
        assert after.in_doubt() == []
        assert after.state(open_part) == "unknown"
    finally:
        after.close()
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT id, v FROM t").fetchall() == [(1, "kept")]
        assert conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchall() == [(0,)]


_CRASHING_CHILD = """
import logging, os, signal, sys
from twophase.participants.sdk import PartId, Record, SinkContext
from twophase.participants.sinks.postgres import PostgresSink

dsn, table, pipeline, sink_name = sys.argv[1:5]
context = SinkContext(pipeline, "child", sink_name, logging.getLogger("child"))
sink = PostgresSink.from_mapping(
    {"name": sink_name, "type": "postgres", "dsn": dsn, "table": table}, context
)
sink.setup()
prepared, open_part = PartId(pipeline, 1, "child"), PartId(pipeline, 2, "child")
sink.begin(prepared)
sink.write(prepared, [Record("orders", 0, 0, 0, None, {"id": 1})])
sink.prepare(prepared, {("orders", 0): 1})
sink.begin(open_part)
sink.write(open_part, [Record("orders", 0, 1, 0, None, {"id": 2})])
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_parts_of_a_killed_process_are_finished_by_another(env: PgEnv, make_sink: MakeSink) -> None:
    table = env.table("orders", ORDERS_DDL)
    sink_name = f"s{env.base}"[:40]
    child = subprocess.run(
        [sys.executable, "-c", _CRASHING_CHILD, env.dsn, table, env.pipeline, sink_name],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    survivor = make_sink(table, participant="w1")
    prepared = part(env, 1, "child")
    assert survivor.in_doubt() == [prepared]
    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(0,)]
    survivor.commit(prepared)
    assert env.rows(f'SELECT id FROM "{table}"') == [(1,)]
    # The open part died with its connection: nothing of it exists anywhere.
    assert survivor.state(part(env, 2, "child")) == "unknown"


def test_connections_stay_bounded_while_parts_wait_for_decisions(
    env: PgEnv, make_sink: MakeSink
) -> None:
    table = env.table("orders", ORDERS_DDL)
    sink = make_sink(table)
    parts = [part(env, txn) for txn in range(1, 9)]
    for i, pid in enumerate(parts):
        run_part(sink, pid, [rec(i, {"id": i})], commit=False)
    connections = env.rows(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
        (f"twophase/{env.pipeline}/{sink.name}/{sink.context.participant}",),
    )[0][0]
    # >= 1: the name matched (PostgreSQL keeps 63 bytes of it; a longer one would count 0).
    assert 1 <= connections <= 1 + 4 + 2, "admin + held prepared parts + idle"
    assert sink.in_doubt() == parts
    for pid in parts:
        sink.commit(pid)
    assert env.rows(f'SELECT count(*) FROM "{table}"') == [(len(parts),)]
    assert env.prepared_gids() == []


# -- volume -----------------------------------------------------------------------------------


def _payload(i: int) -> dict[str, Any]:
    return {
        "id": i,
        "customer": f"customer-{i % 977:05d}",
        "amount": (i % 10_000) / 100,
        "paid": i % 3 == 0,
        "at": "2024-05-01T10:00:00.123456Z",
        "attrs": {"channel": "web", "segment": i % 7, "note": "x" * 40},
        "region": i % 13,
    }


@pytest.mark.parametrize("mode", ["insert", "upsert"])
def test_100k_row_part_timed(env: PgEnv, make_sink: MakeSink, mode: str) -> None:
    table = env.table(
        f"big_{mode}",
        "id bigint PRIMARY KEY, customer text, amount numeric(12, 2), paid boolean, "
        "at timestamptz, attrs jsonb, region int",
    )
    options: dict[str, Any] = {"mode": mode, "key": ["id"]} if mode == "upsert" else {}
    sink = make_sink(table, **options)
    n, batch = 100_000, 5_000
    records = [rec(i, _payload(i)) for i in range(n)]
    size = len(str(records[0].value))
    pid = part(env, 1)
    started = time.perf_counter()
    sink.begin(pid)
    for i in range(0, n, batch):
        assert sink.write(pid, records[i : i + batch]) == []
    written = time.perf_counter()
    sink.prepare(pid, {(TOPIC, 0): n})
    sink.commit(pid)
    done = time.perf_counter()
    print(
        f"\npostgres sink {mode}: {n} rows of ~{size} B JSON: write {n / (written - started):,.0f}"
        f" rows/s, write+prepare+commit {n / (done - started):,.0f} rows/s"
        f" ({done - started:.2f}s, batches of {batch})"
    )
    assert env.rows(f'SELECT count(*), sum(id) FROM "{table}"') == [(n, n * (n - 1) // 2)]


# -- transient errors -------------------------------------------------------------------------


def test_timed_out_write_is_undone_whole_and_can_be_retried(
    env: PgEnv, make_sink: MakeSink
) -> None:
    """A statement timeout in the second COPY of a write undoes the first one too."""
    table = env.table("orders", ORDERS_DDL)
    sink = make_sink(table, statement_timeout_ms=1000)
    pid = part(env, 1)
    sink.begin(pid)
    assert sink.write(pid, [rec(0, {"id": 10, "name": "before"})]) == []
    # Two shapes of record, hence two COPYs; the second waits on another session's
    # uncommitted row with the same key until the statement timeout cancels it.
    batch = [rec(1, {"id": 1, "name": "one"}), rec(2, {"id": 2})]
    with psycopg.connect(env.dsn) as blocker:
        blocker.execute(f'INSERT INTO "{table}" (id) VALUES (2)')
        with pytest.raises(RetriableSinkError, match="57014"):
            sink.write(pid, batch)
        blocker.rollback()
    assert sink.write(pid, batch) == [], "the retry must not find its own first COPY"
    sink.prepare(pid, {(TOPIC, 0): 3})
    sink.commit(pid)
    assert env.rows(f'SELECT id, name FROM "{table}" ORDER BY id') == [
        (1, "one"),
        (2, None),
        (10, "before"),
    ]


def test_wrong_password_is_fatal(env: PgEnv, make_sink: MakeSink) -> None:
    table = env.table("orders", ORDERS_DDL)
    info = psycopg.conninfo.conninfo_to_dict(env.dsn)
    info["password"] = "not-the-password"
    dsn = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
    with pytest.raises(FatalSinkError, match="password authentication failed") as error:
        make_sink(table, dsn=dsn)
    assert "not-the-password" not in str(error.value)


# -- the compiled COPY encoder (twophase-native) ---------------------------------------------

ALL_TYPES_DDL = """
    seq bigint NOT NULL,
    i2 smallint, i4 integer, i8 bigint,
    f4 real, f8 double precision,
    n numeric, n2 numeric(14, 2),
    b boolean,
    t text, vc varchar(5), ch char(3),
    ts timestamptz, tsn timestamp, d date, u uuid
"""


def raw_batch(values: list[bytes]) -> RawBatch:
    """A RawBatch decoding as the runtime does (orjson; not an object -> a reason)."""

    def decode(i: int) -> Record | str:
        try:
            obj = orjson.loads(values[i])
        except orjson.JSONDecodeError as exc:
            return f"undecodable: not JSON ({exc})"
        if not isinstance(obj, dict):
            return "undecodable: not an object"
        return rec(i, obj)

    return RawBatch(values, decode)


def _regular(rng: random.Random, seq: int) -> dict[str, Any]:
    """A record every column of ALL_TYPES_DDL takes as is, drawn across each type's range."""

    def a_float() -> float:
        return rng.choice(
            [
                rng.uniform(-1e6, 1e6),
                round(rng.uniform(-1e4, 1e4), rng.randint(0, 6)),
                float(rng.randint(-(10**17), 10**17)),
                rng.uniform(-1, 1) * 10.0 ** rng.randint(-300, 300),
                0.0,
                -0.0,
                1e16,
                1e15,
                1e-5,
                1e-4,
                0.1,
                100.0,
                5e-324,
                1.7976931348623157e308,
            ]
        )

    def a_decimal_text() -> str:
        """A decimal as text, as Debezium (decimal.handling.mode: string) writes one, and
        spellings only Python's Decimal reads."""
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 45)))
        cut = rng.randint(0, len(digits))
        plain = f"{rng.choice(['', '-'])}{digits[:cut] or '0'}" + (
            f".{digits[cut:]}" if digits[cut:] else ""
        )
        return rng.choice(
            [plain, plain, plain, "-0.00", "0", "007.50", "1E+3", " 1.5", "1.", ".5", "-12"]
        )

    def a_text(n: int) -> str:
        alphabet = "abcxyz ÄéØ€日本🙂\"\\/\t\n\x01'"
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, n)))

    day = f"{rng.randint(1900, 2100):04d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    clock = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
    frac = rng.choice(["", ".5", ".123", ".123456", ".000001", ".12"])
    zone = rng.choice(["", "Z", "+00:00", "-00:00", "+05:30", "-11:45", "+23:59"])
    u = uuid.UUID(int=rng.getrandbits(128))
    return {
        "seq": seq,
        "i2": rng.randint(-(2**15), 2**15 - 1),
        "i4": rng.choice([rng.randint(-(2**31), 2**31 - 1), -0, 0]),
        "i8": rng.choice([rng.randint(-(10**18) + 1, 10**18 - 1), rng.randint(-99, 99)]),
        "f4": rng.uniform(-1e30, 1e30) if rng.random() < 0.8 else rng.randint(-1000, 1000),
        "f8": a_float() if rng.random() < 0.8 else rng.randint(-(10**18) + 1, 10**18 - 1),
        "n": rng.choice(
            [a_float(), a_float(), a_decimal_text(), rng.randint(-(10**18) + 1, 10**18 - 1)]
        ),
        "n2": round(rng.uniform(-1e9, 1e9), rng.randint(0, 4))
        if rng.random() < 0.8
        else f"{rng.randint(-(10**9), 10**9)}.{rng.randint(0, 999):0{rng.randint(1, 3)}d}",
        "b": rng.random() < 0.5,
        "t": rng.choice([a_text(30), rng.randint(-5, 5), True, False]),
        "vc": rng.choice([a_text(5), rng.randint(-999, 9999)]),
        "ch": a_text(3),
        "ts": f"{day}{rng.choice('T ')}{clock}{frac}{zone}",
        "tsn": f"{day}T{clock}{frac}{zone}",
        "d": day,
        "u": str(u).upper() if rng.random() < 0.3 else str(u),
    }


_PLAIN_DECIMAL = re.compile(r"-?(\d+)(?:\.(\d+))?")


def _unmodelled_decimal(value: dict[str, Any]) -> bool:
    """A numeric field holds text the compiled encoder leaves to Decimal: not the plain
    spelling, more than 40 significant digits, or a negative zero."""
    for name in ("n", "n2"):
        text = value.get(name)
        if not isinstance(text, str):
            continue
        m = _PLAIN_DECIMAL.fullmatch(text)
        if m is None:
            return True
        digits = m.group(1).lstrip("0") + (m.group(2) or "")  # counted as the encoder does
        if len(digits) > 40 or (text.startswith("-") and not digits.strip("0")):
            return True
    return False


def _encodings(rng: random.Random, value: dict[str, Any]) -> bytes:
    """The same object spelled as producers do: orjson, the standard library (ASCII escapes),
    or with whitespace and a key order of its own."""
    how = rng.randint(0, 2)
    if how == 0:
        return orjson.dumps(value)
    if how == 1:
        return json.dumps(value).encode()
    items = list(value.items())
    rng.shuffle(items)
    return json.dumps(dict(items), ensure_ascii=False, indent=rng.choice([None, 1])).encode()


_FULL = {
    "i2": "1",
    "i4": "2",
    "i8": "3",
    "f4": "1.5",
    "f8": "2.5",
    "n": "3.5",
    "n2": "4.5",
    "b": "true",
    "t": '"x"',
    "vc": '"y"',
    "ch": '"z"',
    "ts": '"2021-01-01T00:00:00Z"',
    "tsn": '"2021-01-01T00:00:00"',
    "d": '"2021-01-01"',
    "u": '"12345678-1234-5678-1234-567812345678"',
}


def full(seq: int, extra: str = "", **raw: str) -> bytes:
    """A record with every column present (so only the one odd value decides), the fields in
    ``raw`` spelled as given (raw JSON text), and ``extra`` members appended as they are."""
    members = [f'"seq": {seq}', *(f'"{k}": {raw.get(k, v)}' for k, v in _FULL.items())]
    return ("{" + ", ".join(members) + extra + "}").encode("utf-8", "surrogateescape")


#: Values the Python path stores, rejects or dead-letters by rules the encoder does not model:
#: each must come back to it (or be stored identically).
IRREGULAR: list[bytes] = [
    full(1, i8="null"),
    b'{"seq": 2}',
    full(3, i4='"42"', i8="4.0", f8='"1.5"', n='"12.50"', b='"TRUE"'),
    full(4, i2="32768"),
    full(5, i4="1.5"),
    full(6, t='"nul \\u0000 inside"'),
    full(7, vc='"\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9"'),
    full(8, vc='"\u00e9\u00e9\u00e9\u00e9\u00e9"'),
    full(9, d='"2021-02-29"'),
    full(10, ts='"2021-01-01T24:00:00"'),
    full(11, ts='"2021-01-01T10:00:00.1234567"'),
    full(12, ts='"2021-01-01"'),
    full(13, u='"{12345678-1234-5678-1234-567812345678}"'),
    full(14, i8="1234567890123456789"),
    full(15, f8="1e400"),
    full(16, t='[1, 2, {"a": null}]', vc='{"k": 1}'),
    full(17, t="1.5"),
    full(18, ', "seq": 19'),
    b'{"s\\u0065q": 20, "i8": 7}',
    full(21, ', "x": "\\ud800"'),
    full(22, ', "x": "\\ud83d\\ude42"', t='"\\ud83d\\ude42"'),
    full(23, b="1"),
    full(24, f4="1e39"),
    full(25, ', "x": 12345678901234567890123'),
    full(26) + b" trailing",
    b"\xef\xbb\xbf" + full(27),
    full(28, t='"\xff"'.encode("latin-1").decode("utf-8", "surrogateescape")),
    b"[1, 2]",
    b'"a string"',
    b"{}",
    full(29, ', "x": {"y": [[[[[[]]]]]]}, "z": [true, false, null, -0.0, 1E+2]'),
    full(30, ts='"2021-01-01T10:00:00+24:00"', tsn='"0001-01-01T00:00:00+01:00"'),
    full(31, ts='"2021-01-01t10:00:00"'),
    full(32, d='"20210101"', u='"12345678123456781234567812345678"'),
    full(33, n="-0.0", f8="-0", i4="-0", t="-0"),
    full(34, ch='"abcd"'),
    full(35, i8="-9223372036854775808"),
    b' {"seq" : 36 , "t" : "\\/\\b\\f\\n\\r\\t\\"\\\\" } ',
    full(37, n2="123456789012.345"),
    full(38, ', "x": 01'),
    full(39, ', "x": .5'),
    full(40, ', "x": "tab\there"'),
    full(41, ', "x": "\\udc00"'),
    full(42, ', "x": "\\ud800\\u0041"'),
    full(43, vc='"abcdef"'),
    full(44, f8="1.5e-7", n="1e16", f4="-3.4028234663852886e38"),
    full(45, ts='"2021-01-01T10:00:00+05:30:15"'),
    full(46, ', "x": 1.0e'),
    # Exactly halfway between two shortest spellings: Python's repr picks the even digit.
    full(47, n="70368744177664.125", f8="70368744177664.125", t='"tie"'),
    full(48, n="910230031439427.25"),
]


def _compare_paths(
    env: PgEnv, make_sink: MakeSink, ddl: str, values: list[bytes]
) -> tuple[PostgresSink, list[Rejected]]:
    """Write ``values`` once through the compiled encoder and once through the Python path;
    both tables and both rejection lists must be identical. Returns the compiled sink and its
    rejections."""
    compiled_sink = make_sink(env.table("compiled", ddl), name=f"c{env.base}"[:40])
    python_sink = make_sink(env.table("python", ddl), name=f"p{env.base}"[:40], compiled_copy=False)
    assert compiled_sink.accepts_raw() and not python_sink.accepts_raw()
    results = []
    for i, sink in enumerate((compiled_sink, python_sink)):
        batch = raw_batch(values)
        pid = part(env, 1 + i)
        sink.begin(pid)
        rejected = list(sink.write_raw(pid, batch))
        sink.prepare(pid, {(TOPIC, 0): len(values)})
        sink.commit(pid)
        rows = env.rows(f"SELECT w::text FROM {sink.cfg.table} AS w ORDER BY seq, w::text")
        results.append((rows, sorted((r.record.offset, r.reason) for r in rejected), batch))
    (c_rows, c_rejected, c_batch), (p_rows, p_rejected, p_batch) = results
    assert c_rows == p_rows
    assert c_rejected == p_rejected
    assert c_batch.undecodable() == p_batch.undecodable()
    return compiled_sink, [r for r in rejected]


def test_compiled_copy_stores_exactly_what_the_python_path_stores(
    env: PgEnv, make_sink: MakeSink
) -> None:
    rng = random.Random(20261121)
    regular = [_encodings(rng, _regular(rng, 1000 + i)) for i in range(3000)]
    values = regular + IRREGULAR
    rng.shuffle(values)
    sink, _ = _compare_paths(env, make_sink, ALL_TYPES_DDL, values)
    # The encoder really took the regular records (else this test compares Python to Python).
    assert sink._encoder is not None
    payload, unsure = sink._encoder.encode(regular)
    assert payload.startswith(b"PGCOPY\n\xff\r\n\0")
    # It took all but the decimal texts it does not model (beyond 40 digits, other spellings).
    assert [i for i in unsure if not _unmodelled_decimal(orjson.loads(regular[i]))] == []
    _, unsure = sink._encoder.encode(IRREGULAR)
    taken = {orjson.loads(v)["seq"] for i, v in enumerate(IRREGULAR) if i not in unsure}
    assert taken == {8, 22, 29, 33, 37, 44}  # odd-looking, but the encoder models them
    stored = env.rows(f"SELECT count(*) FROM {sink.cfg.table}")[0][0]
    assert stored >= len(regular)


def test_compiled_copy_rows_the_server_refuses_are_isolated_the_careful_way(
    env: PgEnv, make_sink: MakeSink
) -> None:
    ddl = """
        seq bigint NOT NULL CHECK (seq <> 13),
        amount numeric(6, 2),
        name varchar(10) NOT NULL
    """
    values = [
        orjson.dumps({"seq": i, "amount": [1.5, 12345.678, 9999.99][i % 3], "name": f"n{i}"})
        for i in range(40)
    ]
    sink, rejected = _compare_paths(env, make_sink, ddl, values)
    assert sink._encoder is not None
    assert sink._encoder.encode(values)[1] == []  # all compiled: the server refused them
    refused = sorted(r.record.offset for r in rejected)
    assert refused == sorted({13} | {i for i in range(40) if i % 3 == 1})
    assert all("SQLSTATE" in r.reason or "numeric" in r.reason for r in rejected)


# -- deletes (change data capture, docs/cdc.md) -----------------------------------------------
# Applied inside the part, atomic with its writes, in the order of the source: the last change
# of a key wins within a part, and parts apply in order.

CDC_DDL = "id bigint PRIMARY KEY, name text, qty integer NOT NULL DEFAULT 1, note text"


def delete(offset: int, value: dict[str, Any]) -> Record:
    return rec(offset, value)._replace(deleted=True)


def table_rows(env: PgEnv, table: str) -> dict[int, tuple[Any, ...]]:
    return {r[0]: r[1:] for r in env.rows(f'SELECT id, name, qty, note FROM "{table}"')}


def test_a_delete_is_applied_at_commit_with_the_parts_writes(
    env: PgEnv, make_sink: MakeSink
) -> None:
    table = env.table("t", CDC_DDL)
    sink = make_sink(table, mode="upsert", key=["id"])
    assert sink.supports_deletes
    run_part(sink, part(env, 1), [rec(0, {"id": 1, "name": "a"}), rec(1, {"id": 2, "name": "b"})])

    p2 = part(env, 2)
    sink.begin(p2)
    assert sink.write(p2, [delete(2, {"id": 1}), rec(3, {"id": 3, "name": "c"})]) == []
    sink.prepare(p2, {("orders", 0): 4})
    # Prepared: nothing of the part is visible, the deleted row is still there.
    assert set(table_rows(env, table)) == {1, 2}
    sink.commit(p2)
    assert set(table_rows(env, table)) == {2, 3}

    # An aborted part's delete leaves the row.
    p3 = part(env, 3)
    sink.begin(p3)
    sink.write(p3, [delete(4, {"id": 2})])
    sink.prepare(p3, {("orders", 0): 5})
    sink.abort(p3)
    assert set(table_rows(env, table)) == {2, 3}


def test_a_prepared_delete_is_committed_by_another_process_after_a_crash(
    env: PgEnv, make_sink: MakeSink
) -> None:
    table = env.table("t", CDC_DDL)
    first = make_sink(table, mode="upsert", key=["id"])
    run_part(first, part(env, 1), [rec(0, {"id": 1, "name": "a"})])
    p2 = part(env, 2)
    first.begin(p2)
    first.write(p2, [delete(1, {"id": 1})])
    first.prepare(p2, {("orders", 0): 2})
    first.close()  # the process is gone; its prepared transaction lives on in the server
    second = make_sink(table, mode="upsert", key=["id"], participant="w1")
    assert p2 in second.in_doubt()
    second.commit(p2)
    assert table_rows(env, table) == {}
    second.commit(p2)  # a repeated commit: nothing more happens
    assert second.committed_positions() == {("orders", 0): 2}


def test_a_delete_without_its_key_is_rejected_and_the_rest_written(
    env: PgEnv, make_sink: MakeSink
) -> None:
    table = env.table("t", CDC_DDL)
    sink = make_sink(table, mode="upsert", key=["id"])
    rejected = run_part(
        sink,
        part(env, 1),
        [rec(0, {"id": 1}), delete(1, {"name": "no id"}), delete(2, {"id": None})],
    )
    assert [r.reason for r in rejected] == [
        "a delete needs its key: field 'id' (column 'id') is missing",
        "a delete needs its key: field 'id' (column 'id') is null",
    ]
    assert set(table_rows(env, table)) == {1}


def test_an_insert_mode_sink_does_not_apply_deletes(env: PgEnv, make_sink: MakeSink) -> None:
    assert not make_sink(env.table("t", CDC_DDL)).supports_deletes


def test_a_delete_then_a_reinsert_in_a_later_part_leaves_the_row(
    env: PgEnv, make_sink: MakeSink
) -> None:
    table = env.table("t", CDC_DDL)
    sink = make_sink(table, mode="upsert", key=["id"])
    run_part(sink, part(env, 1), [rec(0, {"id": 1, "name": "a", "qty": 5, "note": "x"})])
    run_part(sink, part(env, 2), [delete(1, {"id": 1})])
    run_part(sink, part(env, 3), [rec(2, {"id": 1, "name": "back"})])
    # The re-inserted row is a new row: what it does not say takes the defaults.
    assert table_rows(env, table) == {1: ("back", 1, None)}


class Model:
    """What applying the changes one by one in order leaves: the reference."""

    def __init__(self, rows: dict[int, dict[str, Any]], *, update_only: bool = False) -> None:
        self.rows = {k: dict(v) for k, v in rows.items()}
        self.update_only = update_only

    def apply(self, record: Record) -> None:
        key = record.value["id"]
        if record.deleted:
            self.rows.pop(key, None)
            return
        if self.update_only and key not in self.rows:
            return  # update-only: a key with no row changes nothing
        row = self.rows.setdefault(key, {"name": None, "qty": 1, "note": None})
        row.update({k: v for k, v in record.value.items() if k != "id"})

    def table(self) -> dict[int, tuple[Any, ...]]:
        return {k: (v["name"], v["qty"], v["note"]) for k, v in self.rows.items()}


@pytest.mark.parametrize("mode", ["upsert", "update"])
@pytest.mark.parametrize("seed", range(6))
def test_the_last_change_of_a_key_wins_whatever_the_mix_and_the_batching(
    env: PgEnv, make_sink: MakeSink, seed: int, mode: str
) -> None:
    """Random inserts, partial updates and deletes over a few keys, cut into random writes and
    parts: the table always equals applying the changes one by one -- in ``upsert`` mode, and in
    ``update`` mode where a write to a key with no row changes nothing."""
    rnd = random.Random(seed)
    table = env.table("t", CDC_DDL)
    # Rows for update mode to update (some of them get deleted on the way).
    env.reader.execute(
        f"INSERT INTO \"{table}\" (id, name) VALUES (1, 'one'), (2, 'two'), (3, NULL)"
    )
    sink = make_sink(table, mode=mode, key=["id"])
    model = Model(
        {k: {"name": n, "qty": 1, "note": None} for k, n in [(1, "one"), (2, "two"), (3, None)]},
        update_only=mode == "update",
    )
    offset = 0
    for txn in range(1, 5):
        batches: list[list[Record]] = []
        for _ in range(rnd.randint(1, 4)):
            batch = []
            for _ in range(rnd.randint(1, 25)):
                key = rnd.randint(1, 6)
                kind = rnd.random()
                if kind < 0.3:
                    r = delete(offset, {"id": key})
                else:
                    fields = {
                        f: rnd.choice([None, f"{f}{offset}"])
                        for f in ("name", "note")
                        if rnd.random() < 0.6
                    }
                    if rnd.random() < 0.4:
                        fields["qty"] = rnd.randint(2, 9)
                    r = rec(offset, {"id": key, **fields})
                batch.append(r)
                offset += 1
            batches.append(batch)
        commit = rnd.random() < 0.8
        assert run_part(sink, part(env, txn), *batches, commit=commit) == []
        if not commit:
            sink.abort(part(env, txn))
            continue
        for batch in batches:
            for r in batch:
                model.apply(r)
        assert table_rows(env, table) == model.table(), f"seed {seed}, txn {txn}"


def test_a_delete_the_server_refuses_is_rejected_alone(env: PgEnv, make_sink: MakeSink) -> None:
    """A delete of a row another table still references (a foreign key): that record goes to
    the dead letters with the server's reason, the other changes of the write are applied."""
    parent = env.table("parent", CDC_DDL)
    child = env.table("child", f'id bigint PRIMARY KEY, parent bigint REFERENCES "{parent}"(id)')
    sink = make_sink(parent, mode="upsert", key=["id"])
    run_part(sink, part(env, 1), [rec(0, {"id": 1}), rec(1, {"id": 2}), rec(2, {"id": 3})])
    env.reader.execute(f'INSERT INTO "{child}" VALUES (10, 2)')
    rejected = run_part(
        sink,
        part(env, 2),
        [delete(3, {"id": 1}), delete(4, {"id": 2}), rec(5, {"id": 3, "name": "kept"})],
    )
    assert [(r.record.offset, r.reason.split(":")[0]) for r in rejected] == [
        (4, "PostgreSQL refused the row")
    ]
    assert "foreign key" in rejected[0].reason
    assert table_rows(env, parent) == {2: (None, 1, None), 3: ("kept", 1, None)}
    env.reader.execute(f'DROP TABLE "{child}"')  # before the clean-up drops the parent
    env.tables.remove(child)


def test_participants_setting_up_one_upsert_table_at_once_all_succeed(
    env: PgEnv, make_sink: MakeSink
) -> None:
    """Participants of one pipeline start together: each creates the marker table, the target
    (create_table) and the staging table if missing -- concurrent CREATE ... IF NOT EXISTS can
    still collide in PostgreSQL's catalog (a type or a name "already exists"), which is not a
    failure: the other one created it (seen: a participant exiting at start-up)."""
    for round_ in range(12):
        table = f"{env.base}_race{round_}"
        env.tables.append(table)
        sinks = [
            make_sink(
                table,
                participant=f"w{i}",
                setup=False,
                mode="upsert",
                key=["id"],
                create_table={"id": "bigint", "v": "text"},
                marker_table=f"{env.base}_m{round_}",
            )
            for i in range(8)
        ]
        env.tables.append(f"{env.base}_m{round_}")
        barrier = threading.Barrier(len(sinks))

        def setup(sink: PostgresSink, barrier: threading.Barrier) -> None:
            barrier.wait()
            sink.setup()

        with ThreadPoolExecutor(len(sinks)) as pool:
            for future in [pool.submit(setup, s, barrier) for s in sinks]:
                future.result()  # raises what a set-up raised


# -- a table per topic (table: ${topic}) --------------------------------------------------------


def trec(topic: str, offset: int, value: dict[str, Any], *, deleted: bool = False) -> Record:
    r = Record(topic, 0, offset, 1_700_000_000_000 + offset, None, value)
    return r._replace(deleted=True) if deleted else r


def test_a_table_template_writes_each_topic_into_its_table_in_one_prepared_transaction(
    env: PgEnv, make_sink: MakeSink
) -> None:
    """One part spans several tables of differing shapes: nothing of it is visible before the
    commit, a new instance commits it from its prepared transaction, an abort leaves every
    table as it was, and a record whose table cannot be had is rejected with the reason."""
    ta = env.table("ta", "id int PRIMARY KEY, v text, n int NOT NULL DEFAULT 0")
    tb = env.table("tb", "id int PRIMARY KEY, w int")
    sink = make_sink(
        "${topic}", mode="upsert", key=["id"], topic_replace=[r"^cdc\.", ""], name=f"s{env.base}"
    )
    batch = [
        trec(f"cdc.{ta}", 0, {"id": 1, "v": "a1"}),
        trec(f"cdc.{tb}", 0, {"id": 1, "w": 10}),
        trec(f"cdc.{ta}", 1, {"id": 2, "v": "a2", "n": 5}),
        trec(f"cdc.{tb}", 1, {"id": 2, "w": 20}),
        trec(f"cdc.{ta}", 2, {"id": 1}, deleted=True),  # the last change of ta's 1: gone
        trec("cdc.nosuchtable_xyz", 0, {"id": 1}),
        trec(f"cdc.{tb}", 2, {"id": 3, "w": "not a number"}),
    ]
    pid = part(env, 1)
    sink.begin(pid)
    rejected = sink.write(pid, batch)
    sink.prepare(pid, positions_of(batch))
    reasons = {(r.record.topic, r.record.offset): r.reason for r in rejected}
    assert set(reasons) == {("cdc.nosuchtable_xyz", 0), (f"cdc.{tb}", 2)}, reasons
    assert "nosuchtable_xyz does not exist" in reasons[("cdc.nosuchtable_xyz", 0)]
    assert env.rows(f'SELECT * FROM "{ta}"') == [] and env.rows(f'SELECT * FROM "{tb}"') == []
    sink.close()  # the writer is gone; its part stays prepared
    later = make_sink("${topic}", mode="upsert", key=["id"], topic_replace=[r"^cdc\.", ""],
                      name=f"s{env.base}", participant="w2")  # fmt: skip
    assert later.in_doubt() == [pid]
    later.commit(pid)
    assert env.rows(f'SELECT id, v, n FROM "{ta}" ORDER BY id') == [(2, "a2", 5)]
    assert env.rows(f'SELECT id, w FROM "{tb}" ORDER BY id') == [(1, 10), (2, 20)]

    aborted = [trec(f"cdc.{ta}", 3, {"id": 2}, deleted=True), trec(f"cdc.{tb}", 3, {"id": 9})]
    run_part(later, part(env, 2, "w2"), aborted, commit=False)
    later.abort(part(env, 2, "w2"))
    assert env.rows(f'SELECT id FROM "{ta}"') == [(2,)]
    assert env.rows(f'SELECT id FROM "{tb}" ORDER BY id') == [(1,), (2,)]
    assert env.prepared_gids() == []


def test_a_table_template_with_create_table_makes_a_new_topics_table(
    env: PgEnv, make_sink: MakeSink
) -> None:
    name = env.table("tnew", "x int")  # registered for clean-up; made again by the sink
    env.reader.execute(f'DROP TABLE "{name}"')
    sink = make_sink("${value.kind}", mode="upsert", key=["id"],
                     create_table={"id": "bigint", "label": "text"})  # fmt: skip
    batch = [trec("t", 0, {"kind": name, "id": 7, "label": "x"}), trec("t", 1, {"id": 8})]
    rejected = run_part(sink, part(env, 1), batch)
    assert [(r.record.offset, r.reason) for r in rejected] == [
        (1, "target ${value.kind}: no value for ${value.kind}")
    ]
    assert env.rows(f'SELECT id, label FROM "{name}"') == [(7, "x")]


def test_without_key_each_table_is_keyed_on_its_own_primary_key(
    env: PgEnv, make_sink: MakeSink
) -> None:
    one = env.table("k1", "id int PRIMARY KEY, v text")
    two = env.table("k2", "order_id int, line int, v text, PRIMARY KEY (line, order_id)")
    none = env.table("k3", "id int, v text")  # no primary key: its records are rejected
    sink = make_sink("${topic}", mode="upsert")
    batch = [
        trec(one, 0, {"id": 1, "v": "a"}),
        trec(two, 0, {"order_id": 1, "line": 1, "v": "x"}),
        trec(two, 1, {"order_id": 1, "line": 2, "v": "y"}),
        trec(one, 1, {"id": 1, "v": "b"}),
        trec(two, 2, {"order_id": 1, "line": 1, "v": "x2"}),
        trec(two, 3, {"order_id": 1, "line": 2}, deleted=True),
        trec(none, 0, {"id": 1, "v": "z"}),
    ]
    rejected = run_part(sink, part(env, 1), batch)
    assert [(r.record.topic, "no primary key" in r.reason) for r in rejected] == [(none, True)]
    assert env.rows(f'SELECT id, v FROM "{one}"') == [(1, "b")]
    assert env.rows(f'SELECT order_id, line, v FROM "{two}"') == [(1, 1, "x2")]
    with pytest.raises(FatalSinkError, match="no primary key"):
        make_sink(none, mode="upsert")
