"""The PostgreSQL sink reading Debezium change events itself (``RawShape("debezium")``): the
compiled encoder stages the rows of creates, reads and updates with their place in the batch,
the Python path stages the rest (deletes, rows with nulls or missing fields, key changes), and
one statement applies each key's last change. Whatever the mix, it must leave exactly what
writing the decoded records leaves, and reject the same records for the same reasons (that
path is held to a model of applying the changes one by one in ``test_sink_postgres.py``)."""

from __future__ import annotations

import logging
import random
from typing import Any

import orjson
import pytest
from confluent_kafka import Message
from test_sink_postgres import PgEnv, part

from twophase.config import SourceConfig
from twophase.participants.decoding import DebeziumDecoder
from twophase.participants.sdk import RawBatch, RawShape, Record, Rejected, SinkContext
from twophase.participants.sinks.postgres import PostgresSink

DDL = (
    "id bigint PRIMARY KEY, name text, qty integer NOT NULL DEFAULT 1 CHECK (qty >= 0),"
    " amount numeric(12, 2)"
)
TABLES = ("ta", "tb")


def make_sink(env: PgEnv, table: str, name: str, **options: Any) -> PostgresSink:
    """A set-up sink of the test's pipeline (``table`` may be a template)."""
    env.pipelines.add(env.pipeline)
    raw = {"name": name, "type": "postgres", "dsn": env.dsn, "table": table, **options}
    context = SinkContext(
        pipeline=env.pipeline, participant="w1", sink_name=name, logger=logging.getLogger(name)
    )
    sink = PostgresSink.from_mapping(raw, context)
    assert isinstance(sink, PostgresSink)
    env.sinks.append(sink)
    sink.setup()
    return sink


def events_sink(env: PgEnv, name: str, **options: Any) -> PostgresSink:
    """A sink of a table per topic (``cdc.<table>``), upsert."""
    return make_sink(env, "${topic}", name, topic_replace=[r"^cdc\.", ""], mode="upsert", **options)


class Source:
    """Random change events of a few keys per table: mostly full rows; also nulls (one the
    table refuses client-side), rows missing a field, values the server refuses (a negative
    qty, a numeric overflow), deletes, key changes (a delete and a create), truncates."""

    def __init__(self, rng: random.Random, tables: dict[str, str]) -> None:
        self.rng = rng
        self.tables = tables  # short name -> real table
        self.offset = 0

    def events(self, n: int, dirty: bool) -> list[tuple[str, bytes, bytes]]:
        """(topic, value, key) of ``n`` events; only ``dirty`` ones have rows missing a field
        or values the server refuses (either sends a whole write the careful way)."""
        out = []
        rng = self.rng
        while len(out) < n:
            table = rng.choice(list(self.tables))
            topic = f"cdc.{self.tables[table]}"
            key = rng.randint(1, 8)
            kind = rng.random()
            ev: dict[str, Any] = {"before": None, "source": {"table": table}, "ts_ms": 1}
            if kind < 0.15:
                ev.update(op="d", before={"id": key}, after=None)
            elif kind < 0.18:
                ev.update(op="t", after=None)  # a truncate: dead-lettered, changes nothing
            elif kind < 0.22:
                # A key change: Debezium sends a delete of the old key and a create of the new.
                new = rng.randint(1, 8)
                old = {**ev, "op": "d", "before": {"id": key}, "after": None}
                out.append((topic, orjson.dumps(old), orjson.dumps({"id": key})))
                key = new
                row = {"id": new, "name": f"moved{self.offset}", "qty": 1, "amount": "1.50"}
                ev.update(op="c", after=row)
            else:
                row = {
                    "id": key,
                    "name": rng.choice([f"n{self.offset}", None, "tab\t\u00e9"]),
                    "qty": rng.choice([0, 3, 7, 12]) if rng.random() < 0.97 else None,
                    "amount": rng.choice(["12.25", 3, 2.5, None, "99999999.99"]),
                }
                if dirty and rng.random() < 0.05:
                    row["qty"] = -1  # the CHECK refuses it
                if dirty and rng.random() < 0.05:
                    row["amount"] = "99999999999.99"  # numeric(12, 2) overflows
                if dirty and rng.random() < 0.05:
                    del row[rng.choice(["name", "amount"])]
                ev.update(op=rng.choice(["c", "r", "u"]), after=row)
            out.append((topic, orjson.dumps(ev), orjson.dumps({"id": key})))
            self.offset += 1
        return out[:n]


def batch_of(events: list[tuple[str, bytes, bytes]], first_offset: int) -> RawBatch:
    decoder = DebeziumDecoder(SourceConfig(topic_pattern=r"cdc\..*", format="debezium",
                                           key_format="json"))  # fmt: skip
    shape = decoder.raw_shape
    assert shape == RawShape("debezium", key_fields=True)
    msgs = [
        Message(
            topic=t,
            partition=0,
            offset=first_offset + i,
            key=k,
            value=v,
            timestamp=(1, 1_700_000_000_000),
        )
        for i, (t, v, k) in enumerate(events)
    ]

    def decode(i: int) -> Record | str:
        m = msgs[i]
        return decoder.record(m, m.topic() or "", 0, m.offset() or 0, m.value())

    def coords(i: int) -> tuple[str, bytes | None]:
        return msgs[i].topic() or "", msgs[i].key()

    return RawBatch([v for _, v, _ in events], decode, shape=shape, coords=coords)


def table(env: PgEnv, name: str) -> dict[int, tuple[Any, ...]]:
    got = env.rows(f'SELECT id, name, qty, amount::text FROM "{name}"')
    return {r[0]: r[1:] for r in got}


@pytest.mark.parametrize("seed", range(4))
def test_change_events_read_raw_leave_what_the_decoded_records_leave(env: PgEnv, seed: int) -> None:
    rng = random.Random(20261126 + seed)
    raw_tables = {t: env.table(f"r{t}", DDL) for t in TABLES}
    dec_tables = {t: env.table(f"d{t}", DDL) for t in TABLES}
    raw_sink = events_sink(env, f"r{env.base}"[:40])
    dec_sink = events_sink(env, f"d{env.base}"[:40], compiled_copy=False)
    shape = RawShape("debezium", key_fields=True)
    assert raw_sink.accepts_raw_shape(shape) and not dec_sink.accepts_raw_shape(shape)
    source = Source(random.Random(seed), raw_tables)
    staged: list[int] = []
    stage = raw_sink._stage_events

    def counted(conn: Any, payload: bytes, rows: Any) -> None:
        stage(conn, payload, rows)
        staged.append(len(rows))  # the write took the staged path and the server took it

    raw_sink._stage_events = counted  # type: ignore[method-assign]
    offset = 0
    for txn in range(1, 8):
        raw_batches = []
        for _ in range(rng.randint(1, 3)):
            raw_batches.append(source.events(rng.randint(1, 400), dirty=rng.random() < 0.3))
        commit = rng.random() < 0.8
        results: list[list[tuple[int, str]]] = []
        for sink, tables in ((raw_sink, raw_tables), (dec_sink, dec_tables)):
            pid = part(env, txn, pipeline=env.pipeline)
            sink.begin(pid)
            rejected: list[Rejected] = []
            at = offset
            for events in raw_batches:
                # The same events, each topic renamed to this sink's tables.
                mine = [(f"cdc.{tables[_short(t, raw_tables)]}", v, k) for t, v, k in events]
                batch = batch_of(mine, at)
                at += len(events)
                if sink is raw_sink:
                    rejected += sink.write_raw(pid, batch)
                else:
                    rejected += sink.write(pid, batch.records())
            sink.prepare(pid, {("cdc", 0): at})
            if commit:
                sink.commit(pid)
            else:
                sink.abort(pid)
            results.append(sorted((r.record.offset, _named(r.reason, tables)) for r in rejected))
        assert results[0] == results[1], f"seed {seed} txn {txn}"
        offset = at
        for t in TABLES:
            assert table(env, raw_tables[t]) == table(env, dec_tables[t]), f"seed {seed} txn {txn}"
    # The compiled path did most writes (else this compares Python with Python), with rows of
    # the Python path staged beside the compiled ones.
    assert len(staged) >= 5 and sum(staged) > 0, staged
    assert any(table(env, raw_tables[t]) for t in TABLES)


def _short(topic: str, tables: dict[str, str]) -> str:
    real = topic.removeprefix("cdc.")
    return next(t for t, name in tables.items() if name == real)


def _named(reason: str, tables: dict[str, str]) -> str:
    """A reason with each sink's own table names made the same."""
    for short, name in sorted(tables.items(), key=lambda kv: -len(kv[1])):
        reason = reason.replace(name, short)
    return reason
