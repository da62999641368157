"""The PostgreSQL sink reading Debezium change events itself (``RawShape("debezium")``): the
compiled encoder stages the rows of creates, reads and updates with their place in the batch,
the Python path stages the rest (deletes, rows with nulls or missing fields, key changes), and
one statement applies each key's last change. Whatever the mix, it must leave exactly what
writing the decoded records leaves, and reject the same records for the same reasons (that
path is held to a model of applying the changes one by one in ``test_sink_postgres.py``)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import psycopg
import pytest
import twophase_native
from confluent_kafka import Message
from psycopg import sql
from test_sink_postgres import ALL_TYPES_DDL, PgEnv, _encodings, _regular, part

from twophase.config import SourceConfig
from twophase.participants.decoding import DebeziumDecoder
from twophase.participants.sdk import (
    RawBatch,
    RawShape,
    Record,
    Rejected,
    RetriableSinkError,
    SinkContext,
)
from twophase.participants.sinks.postgres import PostgresSink
from twophase.participants.sinks.postgres._connections import RawArray, _RawArrayDumper, type_oid

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

    def events(self, n: int, dirty: bool, clean: bool = False) -> list[tuple[str, bytes, bytes]]:
        """(topic, value, key) of ``n`` events; only ``dirty`` ones have rows missing a field
        or values the server refuses (either sends a whole write the careful way); ``clean``
        ones only what the compiled encoder takes (no nulls, every delete keyed in before)."""
        out = []
        rng = self.rng
        while len(out) < n:
            table = rng.choice(list(self.tables))
            topic = f"cdc.{self.tables[table]}"
            key = rng.randint(1, 8)
            kind = rng.random()
            ev: dict[str, Any] = {"before": None, "source": {"table": table}, "ts_ms": 1}
            if kind < 0.15:
                # Most deletes name their key in before (the encoder takes them); some only in
                # the record key (the Python path's).
                before = {"id": key} if clean or rng.random() < 0.7 else None
                ev.update(op="d", before=before, after=None)
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
                if clean:
                    row.update(name=f"n{self.offset}", qty=3, amount=rng.choice(["12.25", 3]))
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


def table(env: PgEnv, name: str, more: str = "") -> dict[int, tuple[Any, ...]]:
    got = env.rows(f'SELECT id, name, qty, amount::text{more} FROM "{name}"')
    return {r[0]: r[1:] for r in got}


#: A column the sinks do not map (``columns``): a row after a delete of its key gets its
#: default again, a row after a row keeps what it holds.
UNMAPPED = ", note text DEFAULT 'default'"


@pytest.mark.parametrize("unmapped", [False, True], ids=["every-column", "a-column-unmapped"])
@pytest.mark.parametrize("seed", range(4))
def test_change_events_read_raw_leave_what_the_decoded_records_leave(
    env: PgEnv, seed: int, unmapped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(20261126 + seed)
    ddl = DDL + (UNMAPPED if unmapped else "")
    raw_tables = {t: env.table(f"r{t}", ddl) for t in TABLES}
    dec_tables = {t: env.table(f"d{t}", ddl) for t in TABLES}
    options: dict[str, Any] = {}
    more = ""
    if unmapped:
        options["columns"] = {c: c for c in ("id", "name", "qty", "amount")}
        more = ", note"
        for name in [*raw_tables.values(), *dec_tables.values()]:
            env.rows(
                f"INSERT INTO \"{name}\" (id, name, note) SELECT k, 'old', 'set' "
                "FROM generate_series(1, 8) AS k RETURNING 1"
            )
    # Row events are compared where every column is mapped; with a column unmapped, a key
    # deleted and written again shows in the rows (the column's default back) and the tables
    # carry no trigger, so deletes may go inside the MERGE.
    audit = None if unmapped else row_events(env, [*raw_tables.values(), *dec_tables.values()])
    raw_sink = events_sink(env, f"r{env.base}"[:40], **options)
    dec_sink = events_sink(env, f"d{env.base}"[:40], compiled_copy=False, **options)
    shape = RawShape("debezium", key_fields=True)
    assert raw_sink.accepts_raw_shape(shape) and not dec_sink.accepts_raw_shape(shape)
    source = Source(random.Random(seed), raw_tables)
    staged: list[int] = []
    stage = raw_sink._apply_events

    def counted(conn: Any, payload: bytes, rows: Any, *, settled: bool, fold: bool) -> None:
        stage(conn, payload, rows, settled=settled, fold=fold)
        staged.append(len(rows))  # the write took the staged path and the server took it

    raw_sink._apply_events = counted  # type: ignore[method-assign]
    run = statements_run(monkeypatch, *raw_tables.values())
    offset = 0
    for txn in range(1, 8):
        raw_batches = []
        for _ in range(rng.randint(1, 3)):
            # Small writes too: a delete with no later change of its key in the write is
            # rare among 400 events of 8 keys.
            size = rng.randint(1, 400) if rng.random() < 0.6 else rng.randint(1, 12)
            clean = rng.random() < 0.4  # all compiled: its deletes may go in the MERGE
            dirty = not clean and rng.random() < 0.3
            raw_batches.append(source.events(size, dirty=dirty, clean=clean))
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
            want = table(env, dec_tables[t], more)
            assert table(env, raw_tables[t], more) == want, f"seed {seed} txn {txn}"
            if audit is not None:
                # The same row events too (what triggers see): a key deleted and written again
                # within a write is a DELETE and an INSERT on both paths.
                want_events = audit(dec_tables[t])
                assert audit(raw_tables[t]) == want_events, f"seed {seed} txn {txn}"
    # The compiled path did most writes (else this compares Python with Python), with rows of
    # the Python path staged beside the compiled ones; deletes inside the MERGE (no key deleted
    # and written again) and before it -- never inside where a trigger could see the order.
    assert len(staged) >= 5 and sum(staged) > 0, staged
    assert "delete" in run and ("fold" in run) == unmapped, run
    assert any(table(env, raw_tables[t]) for t in TABLES)


def row_events(env: PgEnv, tables: list[str]) -> Callable[[str], dict[Any, list[str]]]:
    """Row triggers on ``tables`` logging every INSERT, UPDATE and DELETE; gives each table's
    row events (committed ones) per key (its text, or what ``key`` makes of it), in order."""
    log = env.table("row_events", "n bigserial, tab text, id text, op text")
    function = f"{env.base}_row_event"[:60]
    env.reader.execute(
        f'CREATE OR REPLACE FUNCTION "{function}"() RETURNS trigger LANGUAGE plpgsql AS $$'
        " BEGIN EXECUTE format('INSERT INTO %I (tab, id, op) VALUES ($1, $2, $3)', TG_ARGV[0])"
        " USING TG_TABLE_NAME, (CASE WHEN TG_OP = 'DELETE' THEN OLD.id ELSE NEW.id END)::text,"
        " TG_OP; RETURN NULL; END $$"
    )
    env.functions.append(function)
    for name in tables:
        env.reader.execute(
            f'CREATE TRIGGER row_event AFTER INSERT OR UPDATE OR DELETE ON "{name}"'
            f" FOR EACH ROW EXECUTE FUNCTION \"{function}\"('{log}')"
        )

    def events(name: str, key: Callable[[str], Any] = str) -> dict[Any, list[str]]:
        got: dict[Any, list[str]] = {}
        for k, op in env.rows(f'SELECT id, op FROM "{log}" WHERE tab = %s ORDER BY n', [name]):
            got.setdefault(key(k), []).append(op)
        return got

    return events


def _short(topic: str, tables: dict[str, str]) -> str:
    real = topic.removeprefix("cdc.")
    return next(t for t, name in tables.items() if name == real)


def _named(reason: str, tables: dict[str, str]) -> str:
    """A reason with each sink's own table names made the same."""
    for short, name in sorted(tables.items(), key=lambda kv: -len(kv[1])):
        reason = reason.replace(name, short)
    return reason


def test_a_key_another_process_inserts_meanwhile_is_redone_the_careful_way(
    env: PgEnv, caplog: pytest.LogCaptureFixture
) -> None:
    """A write with a delete applies its rows with ``MERGE``, which cannot wait out a key
    another process's undecided part inserted: the unique violation sends the write the careful
    way, whose upsert waits for that part and then updates the row -- nothing lost, nothing
    refused, nothing doubled."""
    name = env.table("rk", DDL)
    theirs = events_sink(env, f"o{env.base}"[:40])
    mine = events_sink(env, f"m{env.base}"[:40])
    topic = f"cdc.{name}"

    def change(op: str, key: int, label: str = "") -> tuple[str, bytes, bytes]:
        row = {"id": key, "name": label, "qty": 2, "amount": "1.25"}
        ev = {"before": {"id": key} if op == "d" else None, "after": None if op == "d" else row}
        return topic, orjson.dumps({**ev, "op": op, "source": {}}), orjson.dumps({"id": key})

    their_part = part(env, 1, participant="w2")
    theirs.begin(their_part)
    assert theirs.write_raw(their_part, batch_of([change("c", 7, "theirs")], 0)) == []
    theirs.prepare(their_part, {("cdc", 0): 1})
    my_part = part(env, 2)
    mine.begin(my_part)
    result: list[Any] = []
    batch = batch_of([change("c", 3, "x"), change("d", 3), change("u", 7, "mine")], 1)
    writer = threading.Thread(target=lambda: result.append(mine.write_raw(my_part, batch)))
    with caplog.at_level(logging.INFO):
        writer.start()
        deadline = time.monotonic() + 20
        while not env.rows(
            "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
            ["MERGE%"],
        ):
            assert time.monotonic() < deadline, "the MERGE never waited for the other part"
            time.sleep(0.05)
        theirs.commit(their_part)
        writer.join(30)
    assert result == [[]]
    assert "redone the careful way" in caplog.text and "duplicate key" in caplog.text
    mine.prepare(my_part, {("cdc", 0): 4})
    mine.commit(my_part)
    assert table(env, name) == {7: ("mine", 2, "1.25")}


# -- the rows as arrays: twophase_native.copy_columns ----------------------------------------

#: ALL_TYPES_DDL's columns as the encoder takes them: (field, base type, max length).
ALL_TYPES_COLUMNS = [
    ("seq", "int8", None), ("i2", "int2", None), ("i4", "int4", None), ("i8", "int8", None),
    ("f4", "float4", None), ("f8", "float8", None), ("n", "numeric", None),
    ("n2", "numeric", None), ("b", "bool", None), ("t", "text", None), ("vc", "varchar", 5),
    ("ch", "bpchar", 3), ("ts", "timestamptz", None), ("tsn", "timestamp", None),
    ("d", "date", None), ("u", "uuid", None),
]  # fmt: skip


def _read_back(env: PgEnv, payload: bytes) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """``payload`` COPYed into one table and, as arrays, unnested into another: both tables."""
    copied = env.table("copied", ALL_TYPES_DDL)
    unnested = env.table("unnested", ALL_TYPES_DDL)
    types = [base for _, base, _ in ALL_TYPES_COLUMNS]
    arrays = twophase_native.copy_columns(payload, [type_oid(t) for t in types])
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        conn.adapters.register_dumper(RawArray, _RawArrayDumper)
        with conn.cursor() as cur:
            if payload:
                with cur.copy(f'COPY "{copied}" FROM STDIN (FORMAT BINARY)') as copy:
                    copy.write(payload)
            casts = ", ".join(f"%b::{t}[]" for t in types)
            cur.execute(
                f'INSERT INTO "{unnested}" SELECT * FROM unnest({casts})',
                [RawArray(a) for a in arrays],
            )
    order = "ORDER BY seq, i2 NULLS FIRST, t NULLS FIRST"
    return (
        env.rows(f'SELECT * FROM "{copied}" {order}'),
        env.rows(f'SELECT * FROM "{unnested}" {order}'),
    )


def _row(values: list[bytes | None]) -> bytes:
    """One binary COPY row of these fields (None: NULL)."""
    out = len(values).to_bytes(2, "big")
    for v in values:
        out += b"\xff\xff\xff\xff" if v is None else len(v).to_bytes(4, "big") + v
    return out


def test_copy_columns_read_back_as_the_rows_of_the_stream(env: PgEnv) -> None:
    """Whatever rows the encoder streams -- every type it takes, across each type's range --
    the arrays unnest into exactly the rows COPY stores; and with NULLs, and with no row."""
    rng = random.Random(20261126)
    encoder = twophase_native.CopyEncoder(ALL_TYPES_COLUMNS)
    values = [_encodings(rng, _regular(rng, i)) for i in range(3000)]
    payload, unsure = encoder.encode(values)
    assert len(unsure) < len(values) // 4  # the encoder took most: these are its rows
    copied, unnested = _read_back(env, payload)
    assert len(copied) == len(values) - len(unsure)
    assert unnested == copied
    # NULLs in any column (the encoder hands them back; the arrays must carry them).
    header, trailer = payload[:19], b"\xff\xff"
    rows = []
    for seq in range(40):
        fields: list[bytes | None] = [seq.to_bytes(8, "big", signed=True)]
        fields += [None] * (len(ALL_TYPES_COLUMNS) - 1)
        at = rng.randrange(1, len(ALL_TYPES_COLUMNS))
        if ALL_TYPES_COLUMNS[at][1] == "int2":
            fields[at] = rng.randrange(-99, 99).to_bytes(2, "big", signed=True)
        elif ALL_TYPES_COLUMNS[at][1] == "bool":
            fields[at] = bytes([rng.randrange(2)])
        elif ALL_TYPES_COLUMNS[at][1] == "text":
            fields[at] = rng.choice(["", "x", "日本"]).encode()
        rows.append(_row(fields))
    copied, unnested = _read_back(env, header + b"".join(rows) + trailer)
    assert len(copied) == 40 and unnested == copied
    copied, unnested = _read_back(env, b"")
    assert copied == unnested == []


def test_copy_columns_refuses_what_is_not_such_a_stream() -> None:
    payload, _ = twophase_native.CopyEncoder(ALL_TYPES_COLUMNS[:2]).encode(
        [b'{"seq": 1, "i2": 2}', b'{"seq": 3, "i2": 4}']
    )
    oids = [type_oid("int8"), type_oid("int2")]
    assert len(twophase_native.copy_columns(payload, oids)) == 2
    for bad, of in [
        (payload[:-1], oids),  # cut short: no trailer
        (payload[:-5], oids),  # cut inside a field
        (payload + b"\0", oids),  # bytes after the trailer
        (payload[1:], oids),  # no header
        (payload, oids[:1]),  # rows of another width
        (payload, [*oids, type_oid("text")]),
    ]:
        with pytest.raises(ValueError, match="not a binary COPY stream"):
            twophase_native.copy_columns(bad, of)


# -- deletes inside the MERGE: only where no key is deleted and written again ----------------

_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)
_INT8, _BOOL, _TEXT = (type_oid(t) for t in ("int8", "bool", "text"))


def _change_row(place: int | None, deleted: bool, *key: bytes) -> bytes:
    seq = None if place is None else place.to_bytes(8, "big", signed=True)
    return _row([seq, bytes([deleted]), *key, None if deleted else b"v"])


def _rewritten(*rows: bytes, keys: list[int] | None = None) -> bool:
    width = len(keys or [2]) + 3
    payload = _HEADER + b"".join(rows) + b"\xff\xff" if rows else b""
    oids = [_INT8, _BOOL, *[_TEXT] * (width - 2)]
    arrays, rewritten = twophase_native.event_columns(payload, oids, keys or [2])
    assert arrays == twophase_native.copy_columns(payload, oids)
    return rewritten


def test_event_columns_tells_a_key_deleted_and_written_again() -> None:
    a, b = b"a", b"b"
    assert not _rewritten()
    assert not _rewritten(_change_row(0, False, a), _change_row(1, True, a))
    assert not _rewritten(
        _change_row(0, True, a), _change_row(1, True, a), _change_row(2, False, b)
    )
    assert _rewritten(_change_row(0, True, a), _change_row(1, False, b), _change_row(5, False, a))
    # A composite key is every field of it: (a, b) deleted is not (a, a) or (b, a) written.
    two = [2, 3]
    deleted = _change_row(0, True, a, b)
    assert not _rewritten(
        deleted, _change_row(1, False, a, a), _change_row(2, False, b, a), keys=two
    )
    assert _rewritten(deleted, _change_row(1, False, a, b), keys=two)
    # Fields are compared with their lengths: ("ab", "") is not ("a", "b").
    assert not _rewritten(_change_row(0, True, b"ab", b""), _change_row(1, False, a, b), keys=two)
    # Nothing is assumed of rows out of place order or without a place.
    assert _rewritten(_change_row(3, False, a), _change_row(2, False, b))
    assert _rewritten(_change_row(None, False, a))
    with pytest.raises(ValueError, match="keys"):
        twophase_native.event_columns(b"", [_INT8, _BOOL, _TEXT], [1])
    with pytest.raises(ValueError, match="not a binary COPY stream"):
        twophase_native.event_columns(_HEADER + _row([None]), [_INT8, _BOOL, _TEXT], [2])


def statements_run(monkeypatch: pytest.MonkeyPatch, *tables: str) -> list[str]:
    """What each ``MERGE`` into or ``DELETE`` from one of ``tables`` the sinks run is, in
    order: "fold" (a ``MERGE`` that deletes), "merge" or "delete"."""
    run: list[str] = []
    execute = psycopg.Cursor.execute
    targets = tuple(f'"{t}" AS t ' for t in tables)

    def spied(cur: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        text = query.as_string(cur) if isinstance(query, sql.Composable) else str(query)
        if any(t in text for t in targets):
            if text.startswith("MERGE"):
                run.append("fold" if "THEN DELETE" in text else "merge")
            elif text.startswith("DELETE"):
                run.append("delete")
        return execute(cur, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", spied)
    return run


DDL_COLUMNS = ("id", "name", "qty", "amount")

#: Key column types: equal values with equal bytes or not (numeric: ``4`` and ``4.00``; a
#: case-insensitive collation: ``k4`` and ``K4``).
KEY_TYPES = {
    "bigint": "bigint",
    "numeric": "numeric",
    "text": "text",
    "text-nondeterministic": 'text COLLATE "{base}_ci"',
}


@pytest.mark.parametrize("observed", [False, True], ids=["no-trigger", "row-trigger"])
@pytest.mark.parametrize("key_type", sorted(KEY_TYPES))
def test_a_key_deleted_and_written_again_in_one_write_is_a_delete_and_an_insert(
    env: PgEnv, key_type: str, observed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whichever path each change takes (the compiled encoder's, or Python's: a delete keyed
    only by the record key, a row with a null), a key deleted and then written again within
    one write is a DELETE and an INSERT -- what two writes leave: a column the sink does not
    map gets its default back, a row trigger sees both -- and a write whose keys are only
    deleted deletes them in the MERGE itself, unless a trigger is on the table or equal keys
    can differ in bytes (numeric, a nondeterministic collation)."""
    if key_type == "text-nondeterministic":
        env.reader.execute(
            f'CREATE COLLATION IF NOT EXISTS "{env.base}_ci" (provider = icu,'
            " locale = 'und-u-ks-level2', deterministic = false)"
        )
        env.collations.append(f"{env.base}_ci")
    ddl = f"id {KEY_TYPES[key_type].format(base=env.base)} PRIMARY KEY, name text, qty integer,"
    name = env.table("rw", ddl + " amount numeric(12, 2), note text DEFAULT 'default'")
    sink = events_sink(env, f"w{env.base}"[:40], columns={c: c for c in DDL_COLUMNS})
    topic = f"cdc.{name}"
    folds = key_type in ("bigint", "text") and not observed

    def key(k: int, other: bool = False) -> Any:
        if key_type == "numeric":
            return f"{k}.00" if other else k  # the same value, other bytes
        if key_type == "text-nondeterministic":
            return f"K{k}" if other else f"k{k}"  # one value under a case-insensitive collation
        return f"k{k}" if key_type == "text" else k

    for k in range(1, 9):
        env.reader.execute(f"INSERT INTO \"{name}\" (id, note) VALUES (%s, 'set')", [key(k)])
    audit = row_events(env, [name]) if observed else None

    def row(
        op: str, k: int, *, null: bool = False, other: bool = False
    ) -> tuple[str, bytes, bytes]:
        after = {"id": key(k, other), "name": None if null else "n", "qty": 1, "amount": "2.50"}
        ev = {"before": None, "after": after, "op": op, "source": {}}
        return topic, orjson.dumps(ev), orjson.dumps({"id": key(k, other)})

    def delete(k: int, *, before: bool = True) -> tuple[str, bytes, bytes]:
        ev = {"before": {"id": key(k)} if before else None, "after": None, "op": "d", "source": {}}
        return topic, orjson.dumps(ev), orjson.dumps({"id": key(k)})

    writes = [
        [row("u", k) for k in range(1, 9)],
        [delete(1), row("u", 1)],  # both compiled
        [delete(2), row("u", 2, null=True)],  # compiled delete, Python row
        [delete(3, before=False), row("u", 3)],  # Python delete, compiled row
        [delete(4), row("u", 4, other=True)],  # the same key spelled otherwise
        [row("u", 5), delete(5), delete(6)],  # only deletes at the end: in the MERGE
    ]
    run = statements_run(monkeypatch, name)
    each: list[list[str]] = []
    offset = 0
    for txn, events in enumerate(writes, start=1):
        pid = part(env, txn, pipeline=env.pipeline)
        sink.begin(pid)
        before = len(run)
        assert sink.write_raw(pid, batch_of(events, offset)) == []
        each.append(run[before:])
        offset += len(events)
        sink.prepare(pid, {("cdc", 0): offset})
        sink.commit(pid)

    def number(k: Any) -> int:
        return int(str(k).lower().lstrip("k").split(".")[0])

    notes = {number(k): note for k, note in env.rows(f'SELECT id, note FROM "{name}"')}
    assert notes == {1: "default", 2: "default", 3: "default", 4: "default", 7: "set", 8: "set"}
    if audit is not None:
        again = ["UPDATE", "DELETE", "INSERT"]
        want = {k: again for k in (1, 2, 3, 4)} | {5: ["UPDATE", "DELETE"], 6: ["UPDATE", "DELETE"]}
        assert audit(name, number) == want | {7: ["UPDATE"], 8: ["UPDATE"]}
    # Only the last write deletes inside its MERGE, and only where nothing can tell.
    assert each[1:] == [["delete", "merge"]] * 4 + [["fold"] if folds else ["delete", "merge"]]


@pytest.mark.parametrize(
    "guard", ["self-reference", "referenced", "partition-referenced", "row-security", "trigger"]
)
def test_no_delete_inside_the_merge_where_the_order_of_its_rows_shows(
    env: PgEnv, guard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A foreign key that references the target (from itself, another table, or to a
    partition of it) checks and acts on a delete at the end of its statement, a trigger may
    read the table in between, and a row-security policy refuses in a ``MERGE`` what a
    ``DELETE`` skips: such a table keeps the ``DELETE`` first. With a key referencing its own
    table, the write below leaves what the decoded path leaves: the delete of a row a row of
    the same write still references is refused, and dead-lettered."""
    ddl = "id bigint PRIMARY KEY, name text, qty integer, amount numeric(12, 2)"
    tables = {}
    for side in ("raw", "dec"):
        extra = ', parent bigint REFERENCES "{t}" (id)' if guard == "self-reference" else ""
        if guard == "partition-referenced":
            t = f"{env.base}_g{side}"
            env.reader.execute(f'CREATE TABLE "{t}" ({ddl}) PARTITION BY RANGE (id)')
            env.tables.insert(0, t)
            env.reader.execute(
                f'CREATE TABLE "{t}_all" PARTITION OF "{t}" FOR VALUES FROM (MINVALUE) TO (MAXVALUE)'
            )
            env.table(f"c{side}", f'id bigint PRIMARY KEY REFERENCES "{t}_all" (id)')
        else:
            t = env.table(f"g{side}", ddl + extra.format(t=f"{env.base}_g{side}"))
        if guard == "referenced":
            env.table(f"c{side}", f'id bigint PRIMARY KEY REFERENCES "{t}" (id) ON DELETE CASCADE')
        if guard == "row-security":
            env.reader.execute(f'ALTER TABLE "{t}" ENABLE ROW LEVEL SECURITY')
        env.reader.execute(f"INSERT INTO \"{t}\" (id, name) VALUES (3, 'a'), (1, 'b'), (2, 'c')")
        if guard == "self-reference":
            env.reader.execute(f'UPDATE "{t}" SET parent = CASE id WHEN 2 THEN 1 ELSE 3 END')
        tables[side] = t
    if guard == "trigger":
        row_events(env, list(tables.values()))
    options: dict[str, Any] = {"columns": {c: c for c in ("id", "name", "qty", "amount")}}
    if guard == "self-reference":
        options["columns"]["parent"] = "parent"
    raw = make_sink(env, tables["raw"], f"r{env.base}"[:40], mode="upsert", **options)
    dec = make_sink(env, tables["dec"], f"d{env.base}"[:40], mode="upsert",
                    compiled_copy=False, **options)  # fmt: skip
    run = statements_run(monkeypatch, tables["raw"])
    results = []
    for sink, t in ((raw, tables["raw"]), (dec, tables["dec"])):
        after = {"id": 2, "name": "c", "qty": 1, "amount": "1.00", "parent": 3}
        events = [
            (f"cdc.{t}", orjson.dumps({"op": "u", "before": None, "after": after}), b'{"id": 2}'),
            (f"cdc.{t}", orjson.dumps({"op": "d", "before": {"id": 1}, "after": None}),
             b'{"id": 1}'),
        ]  # fmt: skip
        pid = part(env, 1, pipeline=env.pipeline, participant="w1" if sink is raw else "w2")
        sink.begin(pid)
        rejected = sink.write_raw(pid, batch_of(events, 0)) if sink is raw else (
            sink.write(pid, batch_of(events, 0).records())
        )  # fmt: skip
        sink.prepare(pid, {("cdc", 0): 2})
        sink.commit(pid)
        results.append(
            ([r.record.offset for r in rejected], sorted(env.rows(f'SELECT id FROM "{t}"')))
        )
    assert "fold" not in run and "delete" in run
    assert results[0] == results[1]
    if guard == "self-reference":
        assert results[0] == ([1], [(1,), (2,), (3,)])  # row 1 was still referenced


def test_a_write_whose_table_lock_times_out_leaves_its_part_as_it_was(env: PgEnv) -> None:
    """The first write of a part with deletes takes the table's lock to look at what could see
    the order of its rows: when that lock is not had in time (another session holds the table,
    ``statement_timeout_ms``), the write fails retriably and the part is as before it -- the
    same write again goes in once the table is free, and the part commits."""
    name = env.table("lk", "id bigint PRIMARY KEY, name text, qty integer, amount numeric(12, 2)")
    env.reader.execute(f"INSERT INTO \"{name}\" (id, name) VALUES (1, 'a'), (2, 'b')")
    sink = events_sink(env, f"l{env.base}"[:40], statement_timeout_ms=300)
    topic = f"cdc.{name}"
    after = {"id": 3, "name": "c", "qty": 1, "amount": "1.00"}
    events = [
        (topic, orjson.dumps({"op": "c", "before": None, "after": after}), b'{"id": 3}'),
        (topic, orjson.dumps({"op": "d", "before": {"id": 1}, "after": None}), b'{"id": 1}'),
    ]
    pid = part(env, 1, pipeline=env.pipeline)
    sink.begin(pid)
    with psycopg.connect(env.dsn) as holder:
        holder.execute(f'LOCK TABLE "{name}" IN ACCESS EXCLUSIVE MODE')
        with pytest.raises(RetriableSinkError):
            sink.write_raw(pid, batch_of(events, 0))
    assert sink.write_raw(pid, batch_of(events, 0)) == []
    sink.prepare(pid, {("cdc", 0): 2})
    sink.commit(pid)
    assert sorted(table(env, name)) == [2, 3]
