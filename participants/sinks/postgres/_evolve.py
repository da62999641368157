"""Tables made and changed from the records' schemas: ``auto_create`` and ``auto_evolve``
(``docs/schema-changes.md``; the lock order is also in ``control-topic/PROTOCOL.md``, "The
record path", step 4).

:meth:`_SchemaTargets.open_targets` runs before any sink writes a batch. Per table of the
batch, in sorted order:

1. **Create** a missing table from the first record's schema, in autocommit on the admin
   connection, outside the part: an empty table that appears before its rows commit is
   harmless, and a concurrent creator is no error (``CREATE TABLE IF NOT EXISTS``).
2. **Judge** each schema against the table (:func:`compare`, once per table and schema):
   records whose change is refused -- or any change without ``auto_evolve``, or no schema with
   it -- are :class:`Rejected` with the reason.
3. With ``auto_evolve``, before the part writes a row of the table: skip it -- :class:`Held`
   records -- when another participant has an open *request* to change it (read once per part);
   else take ``ROW EXCLUSIVE`` with a short ``lock_timeout`` (a timeout holds the records), and
   reload what the sink knows of the table when the catalog says it changed.
4. **Evolve**, when a schema needs a change: claim the table's request (autocommit; only the
   owner changes a table), take ``ACCESS EXCLUSIVE`` the same way, ``ALTER TABLE`` and delete
   the request *inside the part*: the column appears when the part commits (and the gate opens
   with it), and vanishes if the part aborts.

A participant never waits for a lock another participant's open part holds: that part is
decided only after this participant votes. The lock timeout bounds the waits it cannot tell
apart from safe ones (a lock a *prepared* part holds, released by its decision).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql

from twophase.participants.sdk import (
    AbortTransactionError,
    FatalSinkError,
    Held,
    PartId,
    RawShape,
    Record,
    RecordSchema,
    Rejected,
    SinkConfig,
    SinkContext,
    SinkError,
)
from twophase.participants.sinks.postgres._connections import _OpenPart, _qualified
from twophase.participants.sinks.postgres._errors import (
    _CREATED_CONCURRENTLY,
    Connection,
    _is_lost,
    _savepoint,
    _sqlstate,
)
from twophase.participants.sinks.postgres._schemas import (
    IDENTIFIER_MAX_BYTES,
    alter_table,
    create_table,
    describe,
    plan,
)
from twophase.participants.sinks.postgres._target import _TABLE_STATE
from twophase.participants.sinks.postgres._write import _WritePath
from twophase.participants.sinks.postgres.types import Column

__all__ = [
    "GATE_LOCK_TIMEOUT_MS",
    "GATE_TABLE",
    "LOCK_TIMEOUT_S",
    "STALE_REQUEST_S",
    "_SchemaTargets",
]

#: How long one ``open_targets`` call may wait for table locks, all tables together. A lock a
#: *prepared* part holds -- the previous cycle's rows (ROW EXCLUSIVE) under an owner's ACCESS
#: EXCLUSIVE, or the owner's change under a writer's ROW EXCLUSIVE -- goes with that part's
#: decision, one round trip after the last vote (tens of milliseconds on a healthy pipeline):
#: worth waiting for, since a hold costs the table's records a cycle. A lock an *open* part
#: holds goes only after this participant has voted, so every wait for one is lost time: while
#: the call waits, the PREPARE it may be delaying waits too. Two seconds is twenty times a
#: decision's latency and a fifth of the default 10 s vote timeout, so a wait that times out
#: still leaves the cycle ample time to vote.
LOCK_TIMEOUT_S = 2.0

#: ``lock_timeout`` of the request statements (autocommit). They wait only when the request's
#: row is being deleted by a part that changed the table and is not decided yet: that part's
#: table is then not free this cycle anyway, so there is nothing worth waiting for.
GATE_LOCK_TIMEOUT_MS = 200

#: A request not renewed for this long is ignored by every participant and may be taken over.
#: Its owner renews it on every try (once per part while its records wait), so only an owner
#: that stopped trying -- it died, or lost the partitions whose records needed the change --
#: leaves one this old; three default vote timeouts ride out cycles that fail meanwhile.
STALE_REQUEST_S = 30.0

#: The table of schema change requests, beside the marker table.
GATE_TABLE = "twophase_schema_changes"

#: Errors that say a lock is not free: the lock timeout, and the deadlock detector (two parts
#: each holding what the other waits for -- only possible when a request was taken over from
#: an owner still trying); either way the records wait for a later part.
_NOT_FREE = frozenset({"55P03", "40P01"})

_TABLE_SAVEPOINT = sql.Identifier("twophase_targets")
_LOCK_SAVEPOINT = sql.Identifier("twophase_lock")
_ALTER_SAVEPOINT = sql.Identifier("twophase_alter")

#: Lock modes, weakest first: a part that holds the second needs nothing more.
_ROW, _EXCLUSIVE = "ROW EXCLUSIVE", "ACCESS EXCLUSIVE"


@dataclass(slots=True)
class _PartTables:
    """What the open part knows and holds of its tables (data thread only)."""

    part: PartId
    #: Open requests of other participants, by table (read on first need, once per part).
    requests: dict[str, tuple[str, str, str]] | None = None
    #: Tables this part has locked, and how.
    locked: dict[str, str] = field(default_factory=dict)
    #: Tables whose records wait for a later part (a request, a lock not free), and why.
    held: dict[str, str] = field(default_factory=dict)
    #: Tables whose change waits for a later part, and why: records that need it are held,
    #: records that fit the table as it is are written.
    blocked: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Verdict:
    """One schema against one table as the sink knows it."""

    refused: str | None
    change: bool


class _SchemaTargets(_WritePath):
    """``open_targets`` for ``auto_create`` and ``auto_evolve``."""

    def __init__(self, config: SinkConfig, context: SinkContext) -> None:
        super().__init__(config, context)
        self._schemas_on = self.cfg.auto_create or self.cfg.auto_evolve
        #: (table, schema id) -> the verdict against the table as loaded (data thread).
        self._verdicts: dict[tuple[str, object], _Verdict] = {}
        self._part_tables: _PartTables | None = None
        #: Parts that changed tables, until decided; tables whose change was undone, to reload
        #: (both under ``self._lock``: abort() runs on the control thread).
        self._evolved: dict[PartId, set[str]] = {}
        self._stale: set[str] = set()
        #: Table oid -> its name in the request table (``schema.table``, quoted as needed).
        self._gate_names: dict[int, str] = {}
        schema = self.cfg.marker_table.split(".")[0] if "." in self.cfg.marker_table else None
        self._gate = sql.Identifier(schema, GATE_TABLE) if schema else sql.Identifier(GATE_TABLE)
        self._owner = (context.pipeline, context.participant, context.sink_name)

    # -- what the runtime asks ---------------------------------------------------------------

    @property
    def makes_targets(self) -> bool:
        return self._schemas_on

    def accepts_raw(self) -> bool:
        # Schemas come with decoded records only.
        return not self._schemas_on and super().accepts_raw()

    def accepts_raw_shape(self, shape: RawShape) -> bool:
        return not self._schemas_on and super().accepts_raw_shape(shape)

    def setup(self) -> None:
        super().setup()
        if self._current and not self.cfg.templated:
            self._remember()
        if not self.cfg.auto_evolve:
            return
        ddl = sql.SQL(
            """CREATE TABLE IF NOT EXISTS {} (
                target text PRIMARY KEY,
                pipeline text NOT NULL,
                participant text NOT NULL,
                sink text NOT NULL,
                since timestamptz NOT NULL DEFAULT now()
            )"""
        ).format(self._gate)
        with self._admin_conn() as conn:
            try:
                with suppress(*_CREATED_CONCURRENTLY):
                    conn.execute(ddl)
                conn.execute(
                    sql.SQL(
                        "SELECT target, pipeline, participant, sink, since FROM {} LIMIT 0"
                    ).format(self._gate)
                )
            except psycopg.Error as exc:
                if _is_lost(conn, exc):
                    raise
                raise FatalSinkError(
                    f"set-up of the schema change table {self._gate.as_string(conn)} failed: "
                    f"{str(exc).strip()}",
                    sink=self.name,
                ) from exc

    def begin(self, part: PartId) -> None:
        with self._lock:
            again = self._open is not None and self._open.part == part
        super().begin(part)
        if not again:
            self._part_tables = None  # a new part (or the same id after a rewind) holds nothing

    def close(self) -> None:
        if self.cfg.auto_evolve and self._ready:
            # Requests of this sink go with it; one a prepared part is deleting is skipped (it
            # goes, or stays for the restarted owner, with that part's decision).
            with suppress(psycopg.Error, SinkError), self._admin_conn() as conn:
                conn.execute(
                    sql.SQL(
                        "DELETE FROM {0} WHERE target IN (SELECT target FROM {0}"
                        " WHERE pipeline = %s AND participant = %s AND sink = %s"
                        " FOR UPDATE SKIP LOCKED)"
                    ).format(self._gate),
                    self._owner,
                )
        super().close()

    def _targets_decided(self, part: PartId, committed: bool) -> None:
        """``part`` is being decided: if it changed tables and is undone, what the sink knows
        of them is stale -- said *before* the rollback, so that whoever gets the table's lock
        once it is released finds it said."""
        with self._lock:
            tables = self._evolved.pop(part, set())
            if not committed:
                self._stale |= tables

    # -- check: only what the table as it is can judge ----------------------------------------

    def check(self, records: Sequence[Record]) -> Sequence[Rejected]:
        if not self._schemas_on:
            return super().check(records)
        with self._lock:
            stale = set(self._stale)
        judged: list[Record] = []
        for r in records:
            table = self._table_name(r)
            if table is None:
                judged.append(r)  # the template's refusal, which check() gives
                continue
            state = self._loaded(table)
            if state is None or table in stale:
                continue  # the table is made or reloaded first (open_targets judges)
            if r.deleted:
                judged.append(r)
            elif r.schema is None:
                if not self.cfg.auto_evolve:
                    judged.append(r)
            else:
                verdict = self._verdict(table, r.schema, state)
                if verdict.refused is None and not verdict.change:
                    judged.append(r)
        return super().check(judged) if judged else []

    def write(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected]:
        if self._schemas_on and not self.cfg.templated and self._current != self.cfg.table:
            # Not made yet (auto_create), or no longer what the configuration needs.
            why = self._use_table(self.cfg.table)
            if why is not None:
                return [Rejected(r, f"table {self.cfg.table}: {why}") for r in records]
        return super().write(part, records)

    # -- open_targets ------------------------------------------------------------------------

    def open_targets(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected | Held]:
        if not self._schemas_on or not records:
            return []
        op = self._open_part(part, "open targets")
        pt = self._part_tables
        if pt is None or pt.part != part:
            pt = self._part_tables = _PartTables(part)
        groups: dict[str, list[Record]] = {}
        for r in records:
            table = self._table_name(r)
            if table is not None:  # else write() rejects it, naming the template
                groups.setdefault(table, []).append(r)
        out: list[Rejected | Held] = []
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        with op.lock:
            if op.broken is not None or op.conn is None:
                raise AbortTransactionError(
                    f"part {part.token} cannot continue: {op.broken}", sink=self.name
                )
            conn = op.conn
            for table in sorted(groups):  # one order for every participant's locks
                try:
                    # On an error the part is as before this table: neither its lock nor its
                    # change.
                    with _savepoint(conn, _TABLE_SAVEPOINT):
                        got = self._open_table(op, pt, table, groups[table], deadline)
                except psycopg.Error as exc:
                    self._undo_table(op.part, pt, table)
                    raise self._classify_write_error(op, exc) from exc
                out += got
        return out

    def _undo_table(self, part: PartId, pt: _PartTables, table: str) -> None:
        """``table``'s work in this call was rolled back: the part holds no lock on it and
        did not change it, and what the sink knows of it may be what the change made."""
        pt.locked.pop(table, None)
        with self._lock:
            if table in self._evolved.get(part, ()):
                self._evolved[part].discard(table)
                self._stale.add(table)
        if table in self._stale:
            self._tables.pop(table, None)
            if self._current == table:
                self._current = ""

    def _open_table(
        self,
        op: _OpenPart,
        pt: _PartTables,
        table: str,
        records: list[Record],
        deadline: float,
    ) -> list[Rejected | Held]:
        if table in pt.held:
            return [Held(r, pt.held[table]) for r in records]
        made = self._have_table(table, records)
        if made is not None:
            return made
        if self._loaded(table) is None:
            return []  # a table the sink cannot use: write() rejects its records, saying why
        if self.cfg.auto_evolve and table not in pt.locked:
            why = self._lock_for_part(op, pt, table, deadline)
            if why is not None:
                pt.held[table] = why
                self.log.info("postgres sink %s: part %s: %s", self.name, op.part.token, why)
                return [Held(r, why) for r in records]
        state = self._loaded(table)
        if state is None:
            return []  # its reload failed: write() rejects them with the reason
        out: list[Rejected | Held] = []
        schemas: dict[object, RecordSchema] = {}
        changing: list[Record] = []
        for r in records:
            if r.deleted:
                continue  # a delete needs the key's columns only
            if r.schema is None:
                if self.cfg.auto_evolve:
                    out.append(
                        Rejected(
                            r,
                            f"table {table}: the record has no schema, and auto_evolve "
                            "compares every record's schema with its table (a source with "
                            "schemas: value_format connect_json, a Debezium envelope)",
                        )
                    )
                continue
            verdict = self._verdict(table, r.schema, state)
            if verdict.refused is not None:
                out.append(Rejected(r, f"table {table}: {verdict.refused}"))
            elif verdict.change:
                if not self.cfg.auto_evolve:
                    out.append(
                        Rejected(
                            r,
                            f"table {table}: the record's schema needs a change "
                            f"({self._describe(state, r.schema)}), and auto_evolve is off",
                        )
                    )
                else:
                    schemas.setdefault(_schema_key(r.schema), r.schema)
                    changing.append(r)
        if changing:
            out += self._evolve(op, pt, table, list(schemas.values()), changing, deadline)
        return out

    # -- 1. the table -------------------------------------------------------------------------

    def _have_table(self, table: str, records: list[Record]) -> list[Rejected | Held] | None:
        """Load ``table`` (created from the first schema when missing and ``auto_create``);
        None when the records may go on, else what becomes of them."""
        why = self._use_table(table)
        if why is None or not self.cfg.auto_create or not self._missing(table):
            return None  # loaded, or write() rejects them with ``why``
        with_schema = [r for r in records if r.schema is not None]
        if not with_schema:
            return [
                Rejected(
                    r,
                    f"table {table} does not exist, and the record has no schema to create it "
                    "from (auto_create)",
                )
                for r in records
            ]
        first = next((r for r in with_schema if not r.deleted), with_schema[0])
        refused = self._create(table, first.schema)  # type: ignore[arg-type]
        if refused is not None:
            return [Rejected(r, f"table {table}: {refused}") for r in records]
        why = self._use_table(table)
        return None if why is None else [Rejected(r, f"table {table}: {why}") for r in records]

    def _missing(self, table: str) -> bool:
        if len(table.encode()) > IDENTIFIER_MAX_BYTES * 2 + 1 or not all(table.split(".")):
            return False
        with self._admin_conn() as conn:
            try:
                return self._regclass(conn, _qualified(table)) is None
            except psycopg.Error as exc:
                if _is_lost(conn, exc):
                    raise
                return False

    def _create(self, table: str, schema: RecordSchema) -> str | None:
        """Create ``table`` from ``schema`` (autocommit); None when done, else why not."""
        key = [] if self.cfg.mode == "insert" else list(schema.key or self.cfg.key)
        if self.cfg.mode != "insert" and not key:
            return (
                f"auto_create in {self.cfg.mode} mode needs a key: the record's schema names "
                "none (its record key has no fields) and the sink's key is empty"
            )
        for k in key:
            if schema.get(k) is None:
                return f"auto_create: key field {k!r} is not in the record's schema"
        for f in schema:
            if not f.name or len(f.name.encode()) > IDENTIFIER_MAX_BYTES:
                return (
                    f"auto_create: field {f.name!r} cannot be a column: a PostgreSQL name is 1 "
                    f"to {IDENTIFIER_MAX_BYTES} bytes"
                )
        if not schema.fields:
            return "auto_create: the record's schema has no fields"
        ddl = create_table(_qualified(table), schema, key)
        with self._admin_conn() as conn:
            try:
                with suppress(*_CREATED_CONCURRENTLY):
                    conn.execute(ddl)
            except psycopg.Error as exc:
                if _is_lost(conn, exc):
                    raise
                message = f"auto_create failed: {str(exc).strip()} [SQLSTATE {_sqlstate(exc)}]"
                if _sqlstate(exc) == "42501":  # insufficient privilege: no record can help
                    raise FatalSinkError(f"table {table}: {message}", sink=self.name) from exc
                return message
        self.log.info(
            "postgres sink %s: created table %s from schema %s (%s)%s",
            self.name,
            table,
            schema.name or schema.id,
            ", ".join(f.name for f in schema),
            f", primary key ({', '.join(key)})" if key else "",
        )
        return None

    # -- 2. the judgement ---------------------------------------------------------------------

    def _verdict(self, table: str, schema: RecordSchema, state: dict[str, Any]) -> _Verdict:
        key = (table, _schema_key(schema))
        known = self._verdicts.get(key)
        if known is None:
            columns = _columns(state)
            planned = plan(columns, [schema], state["_key"])
            known = _Verdict(planned.refused.get(0), planned.columns != columns)
            if len(self._verdicts) >= 4096:
                self._verdicts.clear()  # a handful of schemas per table: this is a safety net
            self._verdicts[key] = known
        return known

    def _describe(self, state: dict[str, Any], schema: RecordSchema) -> str:
        columns = _columns(state)
        return describe(columns, plan(columns, [schema], state["_key"]).columns)

    # -- 3. the part's lock on the table -----------------------------------------------------

    def _lock_for_part(
        self, op: _OpenPart, pt: _PartTables, table: str, deadline: float
    ) -> str | None:
        """Take ROW EXCLUSIVE on ``table`` for the part, and make what the sink knows of it
        current; None when done, else why its records wait."""
        state = self._loaded(table)
        assert state is not None and op.conn is not None
        name = self._gate_name(int(state["_table_oid"]))
        owner = self._requests(pt).get(name)
        if owner is not None and owner != self._owner:
            return (
                f"table {table} is being changed by participant {owner[1]} (pipeline "
                f"{owner[0]}, sink {owner[2]}): its records wait for a later part"
            )
        conn = op.conn
        if not self._lock_table(conn, table, _ROW, deadline):
            return (
                f"table {table}: no {_ROW} lock within {LOCK_TIMEOUT_S:g} s (a part that is "
                "not decided yet holds it): its records wait for a later part"
            )
        pt.locked[table] = _ROW
        with self._lock:
            stale = table in self._stale
        oid = self._regclass(conn, _qualified(table))
        if (
            stale
            or oid != state["_table_oid"]
            or oid is None
            or self._catalog_columns(conn, oid) != state["_table_columns"]
        ):
            try:
                self._reload(conn, table)
            except FatalSinkError as exc:
                # Changed by someone into a table the configuration cannot use: its records
                # are rejected by write(), saying why; no record stops the pipeline.
                self.log.warning("postgres sink %s: table %s: %s", self.name, table, exc)
        return None

    def _lock_table(self, conn: Connection, table: str, mode: str, deadline: float) -> bool:
        """``LOCK TABLE`` in ``mode``, waiting until ``deadline`` at most; False when the lock
        is not free by then (the part is as before)."""
        ms = int((deadline - time.monotonic()) * 1000)
        statement = sql.SQL("LOCK TABLE {} IN {} MODE{}").format(
            _qualified(table), sql.SQL(mode), sql.SQL("" if ms >= 1 else " NOWAIT")
        )
        try:
            # On an error the wait and the SET LOCAL are rolled back.
            with _savepoint(conn, _LOCK_SAVEPOINT):
                if ms >= 1:
                    conn.execute(
                        sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{ms}ms"))
                    )
                conn.execute(statement)
                conn.execute("SET LOCAL lock_timeout TO DEFAULT")
        except psycopg.Error as exc:
            if not _is_lost(conn, exc) and _sqlstate(exc) in _NOT_FREE:
                return False
            raise
        return True

    def _reload(self, conn: Connection, table: str) -> None:
        """What the sink knows of ``table``, read again through the part's connection (which
        sees the part's own changes); the staging table, if any, is made in autocommit."""
        self._current = ""
        self._tables.pop(table, None)
        with self._admin_conn() as admin:
            self._load_target(conn, table, admin)
        self._remember()
        for key in [k for k in self._verdicts if k[0] == table]:
            del self._verdicts[key]
        with self._lock:
            self._stale.discard(table)
        self.log.info(
            "postgres sink %s: table %s reloaded: columns %s",
            self.name,
            table,
            ", ".join(m.column.name for m in self._mapped),
        )

    # -- 4. the change --------------------------------------------------------------------

    def _evolve(
        self,
        op: _OpenPart,
        pt: _PartTables,
        table: str,
        schemas: list[RecordSchema],
        changing: list[Record],
        deadline: float,
    ) -> list[Rejected | Held]:
        """Change ``table`` for ``schemas`` inside the part; what becomes of ``changing``, the
        records that need it (nothing: they are written)."""
        if table in pt.blocked:
            return [Held(r, pt.blocked[table]) for r in changing]
        state = self._loaded(table)
        assert state is not None and op.conn is not None
        columns = _columns(state)
        planned = plan(columns, schemas, state["_key"])
        out: list[Rejected | Held] = []
        refused_keys = {_schema_key(schemas[i]): why for i, why in planned.refused.items()}
        keep: list[Record] = []
        for r in changing:
            why = refused_keys.get(_schema_key(r.schema))  # type: ignore[arg-type]
            if why is not None:
                out.append(Rejected(r, f"table {table}: {why}"))
            else:
                keep.append(r)
        ddl = alter_table(_qualified(table), columns, planned.columns)
        if ddl is None or not keep:
            return out
        if pt.locked.get(table) == _EXCLUSIVE:
            # This part changed the table already: it holds the table, and its request is
            # deleted (uncommitted) by this part -- nobody else can be changing it.
            return out + self._alter(op, table, state, ddl, keep)
        why = self._claim(table, state)
        if why is None:
            if self._lock_table(op.conn, table, _EXCLUSIVE, deadline):
                pt.locked[table] = _EXCLUSIVE
            else:
                why = (
                    f"table {table}: no {_EXCLUSIVE} lock for its schema change within "
                    f"{LOCK_TIMEOUT_S:g} s (a part that is not decided yet writes the table): "
                    "the records that need the change wait for a later part"
                )
        if why is not None:
            pt.blocked[table] = why
            self.log.info("postgres sink %s: part %s: %s", self.name, op.part.token, why)
            return out + [Held(r, why) for r in keep]
        return out + self._alter(op, table, state, ddl, keep)

    def _claim(self, table: str, state: dict[str, Any]) -> str | None:
        """Make this sink the owner of ``table``'s change request (autocommit): a new
        request, this sink's own renewed, or a stale one taken over. None when it is ours,
        else why not."""
        name = self._gate_name(int(state["_table_oid"]))
        pipeline, participant, sink = self._owner
        with self._admin_conn() as conn:
            try:
                with conn.transaction():
                    conn.execute(
                        sql.SQL("SET LOCAL lock_timeout = {}").format(
                            sql.Literal(f"{GATE_LOCK_TIMEOUT_MS}ms")
                        )
                    )
                    row = conn.execute(
                        sql.SQL(
                            "INSERT INTO {0} AS g (target, pipeline, participant, sink)"
                            " VALUES (%(target)s, %(pipeline)s, %(participant)s, %(sink)s)"
                            " ON CONFLICT (target) DO UPDATE SET pipeline = EXCLUDED.pipeline,"
                            " participant = EXCLUDED.participant, sink = EXCLUDED.sink,"
                            " since = now()"
                            " WHERE (g.pipeline, g.participant, g.sink)"
                            "       = (EXCLUDED.pipeline, EXCLUDED.participant, EXCLUDED.sink)"
                            "    OR g.since < now() - make_interval(secs => %(stale)s)"
                            " RETURNING 1"
                        ).format(self._gate),
                        {
                            "target": name,
                            "pipeline": pipeline,
                            "participant": participant,
                            "sink": sink,
                            "stale": STALE_REQUEST_S,
                        },
                    ).fetchone()
                    if row is not None:
                        return None
                    other = conn.execute(
                        sql.SQL(
                            "SELECT pipeline, participant, sink FROM {} WHERE target = %s"
                        ).format(self._gate),
                        (name,),
                    ).fetchone()
            except psycopg.errors.LockNotAvailable:
                other = None
        if other is None:
            return (
                f"table {table}: its change request is being settled by a part not decided "
                "yet: the records that need a change wait for a later part"
            )
        return (
            f"table {table} is being changed by participant {other[1]} (pipeline {other[0]}, "
            f"sink {other[2]}): the records that need a change wait for a later part"
        )

    def _alter(
        self,
        op: _OpenPart,
        table: str,
        state: dict[str, Any],
        ddl: sql.Composed,
        records: list[Record],
    ) -> list[Rejected | Held]:
        """Run ``ddl`` and delete the request inside the part (the part holds ACCESS
        EXCLUSIVE); a change the server refuses rejects ``records`` with its reason."""
        conn = op.conn
        assert conn is not None
        text = ddl.as_string(conn)
        try:
            with _savepoint(conn, _ALTER_SAVEPOINT):
                conn.execute(
                    sql.SQL("SET LOCAL lock_timeout = {}").format(
                        sql.Literal(f"{int(LOCK_TIMEOUT_S * 1000)}ms")
                    )
                )
                conn.execute(ddl)
                conn.execute(
                    sql.SQL(
                        "DELETE FROM {} WHERE target = %s AND pipeline = %s AND participant = %s"
                        " AND sink = %s"
                    ).format(self._gate),
                    (self._gate_name(int(state["_table_oid"])), *self._owner),
                )
                conn.execute("SET LOCAL lock_timeout TO DEFAULT")
        except psycopg.Error as exc:
            if _is_lost(conn, exc):
                raise
            if _sqlstate(exc) in _NOT_FREE:
                why = (
                    f"table {table}: a lock its change needs is not free ({str(exc).strip()}): "
                    "the records that need the change wait for a later part"
                )
                return [Held(r, why) for r in records]
            reason = f"PostgreSQL refused the change ({text}): {str(exc).strip()}"
            self.log.warning("postgres sink %s: table %s: %s", self.name, table, reason)
            return [Rejected(r, f"table {table}: {reason}") for r in records]
        with self._lock:
            self._evolved.setdefault(op.part, set()).add(table)
        self.log.info(
            "postgres sink %s: part %s: %s (visible when the part commits)",
            self.name,
            op.part.token,
            text,
        )
        try:
            self._reload(conn, table)
        except FatalSinkError as exc:
            # The changed table no longer suits the sink's configuration.
            return [Rejected(r, f"table {table}: {exc}") for r in records]
        return []

    # -- helpers ---------------------------------------------------------------------------

    def _table_name(self, record: Record) -> str | None:
        if self._template is None:
            return self.cfg.table
        table = self._template.render(record)
        return None if isinstance(table, Rejected) else table

    def _loaded(self, table: str) -> dict[str, Any] | None:
        """What the sink knows of ``table`` (None: not loaded)."""
        state = self._tables.get(table)
        if state is None and self._current == table:
            state = self._remember()
        return state

    def _remember(self) -> dict[str, Any]:
        """Keep the write path's fields as the current table's (``_Target._use_table``)."""
        state = self._tables[self._current] = {a: getattr(self, a) for a in _TABLE_STATE}
        return state

    def _requests(self, pt: _PartTables) -> dict[str, tuple[str, str, str]]:
        """Open (not stale) change requests by table: read once per part."""
        if pt.requests is None:
            with self._admin_conn() as conn:
                rows = conn.execute(
                    sql.SQL(
                        "SELECT target, pipeline, participant, sink FROM {}"
                        " WHERE since >= now() - make_interval(secs => %s)"
                    ).format(self._gate),
                    (STALE_REQUEST_S,),
                ).fetchall()
            pt.requests = {target: (p, w, s) for target, p, w, s in rows}
        return pt.requests

    def _gate_name(self, oid: int) -> str:
        """A table's one name in the request table, however the configuration spells it."""
        name = self._gate_names.get(oid)
        if name is None:
            with self._admin_conn() as conn:
                row = conn.execute(
                    "SELECT format('%%I.%%I', n.nspname, c.relname) FROM pg_class c"
                    " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s",
                    (oid,),
                ).fetchone()
            name = str(row[0]) if row is not None else f"oid:{oid}"
            self._gate_names[oid] = name
        return name


def _schema_key(schema: RecordSchema) -> object:
    """A schema's identity for the verdict cache: its id, or the schema itself without one."""
    return schema.id or schema


def _columns(state: dict[str, Any]) -> dict[str, Column]:
    """The table's columns to compare with a schema: a generated column is filled by the
    server, so a record may always leave it out."""
    return {
        name: replace(column, has_default=True) if generated else column
        for name, (column, generated) in state["_table_columns"].items()
    }
