"""Set-up: the server's settings, the marker table, the target table (created from
``create_table`` when missing) and its columns -- which become the conversion plan, the
upsert staging table and, when it applies, the compiled COPY encoder."""

from __future__ import annotations

import hashlib
from contextlib import suppress

import psycopg
from psycopg import sql

from twophase.participants.sdk import (
    FatalSinkError,
)
from twophase.participants.sinks.postgres._connections import (
    _Connections,
    _qualified,
    twophase_native,
)
from twophase.participants.sinks.postgres._errors import (
    _CREATED_CONCURRENTLY,
    _MAX_PREPARED_ZERO,
    Connection,
    _is_lost,
)
from twophase.participants.sinks.postgres._rows import (
    _compile_plan,
    _Mapped,
    _nested_getter,
    _PlanStep,
)
from twophase.participants.sinks.postgres.types import (
    Column,
    binary_type,
    converter_for,
)

__all__ = ["_Target"]

#: The Debezium ops whose event carries the row (``after``): create, snapshot read, update.
_EVENT_ROW_OPS = frozenset({"c", "r", "u"})
#: The staging table's own columns, before the mapped ones: the order of a write's rows and
#: whether a row is a delete (the change-event path applies them in order, in SQL).
STAGE_SEQ = "_twophase_seq"
STAGE_DELETED = "_twophase_deleted"

#: What the write path knows of one target table; a template's sink keeps it per table.
_TABLE_STATE = (
    "_target",
    "_mapped",
    "_key_idx",
    "_key_mask",
    "_delete_sql",
    "_plan",
    "_fast",
    "_binary_types",
    "_encoder",
    "_events_encoder",
    "_events_sql",
    "_avro_encoder",
    "_stage",
    "_stage_name",
    "_statements",
    "_current",
    "_key",
    "_table_oid",
    "_table_columns",
)


class _Target(_Connections):
    """Set-up of the marker table and the target table."""

    def setup(self) -> None:
        with self._admin_conn() as conn:
            try:
                self._check_server(conn)
                self._ensure_marker_table(conn)
                if not self.cfg.templated and not (
                    # Made from the first record's schema instead (open_targets).
                    self.cfg.auto_create and self._regclass(conn, self._target) is None
                ):
                    self._load_target(conn, self.cfg.table)
            except psycopg.Error as exc:
                if _is_lost(conn, exc):
                    raise
                raise FatalSinkError(
                    f"set-up of table {self.cfg.table} failed: {str(exc).strip()}", sink=self.name
                ) from exc
        self._ready = True
        self.log.info(
            "postgres sink %s ready: table %s, mode %s, columns %s%s",
            self.name,
            self.cfg.table,
            self.cfg.mode,
            ", ".join(m.column.name for m in self._mapped) or "each table's",
            ", compiled COPY encoder" if self._encoder is not None else "",
        )

    # -- tables of a template (``table: ${topic}``): each one's state, loaded on first use --

    def _use_table(self, table: str) -> str | None:
        """Make ``table`` the one the write path works on (its columns, plan, staging table);
        loaded once, on its first record. None when it can be; else why not (its records are
        rejected with that reason: a missing table is the data's problem, not the sink's)."""
        if self._current == table:
            return None
        state = self._tables.get(table)
        if state is None:
            if len(table.encode()) > 63 * 2 + 1 or not all(table.split(".")):
                return f"{table!r} is not a table name"
            self._current = ""  # whatever fails below, the fields are no table's
            with self._admin_conn() as conn:
                try:
                    self._load_target(conn, table)
                except FatalSinkError as exc:
                    return str(exc)
                except psycopg.Error as exc:
                    if _is_lost(conn, exc):
                        raise
                    return f"set-up of table {table} failed: {str(exc).strip()}"
            self.log.info(
                "postgres sink %s: table %s, columns %s",
                self.name,
                table,
                ", ".join(m.column.name for m in self._mapped),
            )
            state = self._tables[table] = {a: getattr(self, a) for a in _TABLE_STATE}
        else:
            for name, value in state.items():
                setattr(self, name, value)
        self._current = table
        return None

    def _check_server(self, conn: Connection) -> None:
        row = conn.execute("SELECT current_setting('max_prepared_transactions')::int").fetchone()
        assert row is not None
        if row[0] <= 0:
            raise FatalSinkError(_MAX_PREPARED_ZERO, sink=self.name)

    def _ensure_marker_table(self, conn: Connection) -> None:
        ddl = sql.SQL(
            """CREATE TABLE IF NOT EXISTS {} (
                pipeline text NOT NULL,
                sink text NOT NULL,
                txn bigint NOT NULL,
                participant text NOT NULL,
                positions jsonb NOT NULL,
                records integer NOT NULL,
                rejected integer NOT NULL DEFAULT 0,
                target text NOT NULL,
                prepared_at timestamptz NOT NULL DEFAULT now(),
                PRIMARY KEY (pipeline, sink, txn, participant)
            )"""
        ).format(self._marker)
        # UniqueViolation: another participant created it at the same moment.
        with suppress(*_CREATED_CONCURRENTLY):
            conn.execute(ddl)
        # Fails with the missing column's name when an older/foreign table has another shape.
        conn.execute(
            sql.SQL(
                "SELECT pipeline, sink, txn, participant, positions, records, rejected, target"
                " FROM {} LIMIT 0"
            ).format(self._marker)
        )

    def _regclass(self, conn: Connection, target: sql.Composable) -> int | None:
        row = conn.execute("SELECT to_regclass(%s)::oid", (target.as_string(conn),)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def _load_target(self, conn: Connection, table: str, admin: Connection | None = None) -> None:
        """Make ``table`` the write path's, as ``conn`` sees it (the admin connection, or an
        open part's that may have changed it); DDL of the sink's own (the upsert staging
        table) runs on ``admin``, in autocommit, when given."""
        cfg = self.cfg
        target = _qualified(table)
        oid = self._regclass(conn, target)
        if oid is None and cfg.create_table is not None:
            self._create_target(conn, table, target)
            oid = self._regclass(conn, target)
        if oid is None:
            raise FatalSinkError(
                f"target table {table} does not exist (create it, or set create_table or "
                "auto_create)",
                sink=self.name,
            )
        table_columns = self._catalog_columns(conn, oid)
        key = list(cfg.key)
        if not key and cfg.mode != "insert":
            key = self._primary_key(conn, oid, table)
        wanted = (
            cfg.columns
            if cfg.columns is not None
            else {name: name for name, (_, generated) in table_columns.items() if not generated}
        )
        mapped: list[_Mapped] = []
        for column_name, path in wanted.items():
            if column_name not in table_columns:
                raise FatalSinkError(
                    f"columns: table {table} has no column {column_name!r}", sink=self.name
                )
            column, generated = table_columns[column_name]
            if generated:
                raise FatalSinkError(
                    f"columns: {table}.{column_name} is a generated column", sink=self.name
                )
            mapped.append(
                _Mapped(
                    column=column,
                    field=path,
                    # The default mapping reads the column's own name, dots and all.
                    get=_nested_getter(path) if cfg.columns is not None else None,
                    convert=converter_for(column),
                    is_key=column_name in key,
                )
            )
        for k in key:
            if k not in table_columns:
                raise FatalSinkError(f"key: table {table} has no column {k!r}", sink=self.name)
            if k not in wanted:
                raise FatalSinkError(f"columns: must map the key column {k!r}", sink=self.name)
        if cfg.mode == "upsert":
            self._check_unique_key(conn, oid, table, key)
        self._target = target
        self._key = key
        self._mapped = mapped
        self._key_idx = [i for i, m in enumerate(mapped) if m.is_key]
        self._key_mask = sum(1 << i for i in self._key_idx)
        self._plan = [self._plan_step(m) for m in mapped]
        self._fast = _compile_plan(self._plan)
        binary = [binary_type(m.column.base_type) for m in mapped]
        # Binary COPY is ~40% faster to produce and parse, but only for types we convert
        # ourselves; one column the server must parse from text (enum, array, ...) makes it text.
        self._binary_types = None if None in binary else [b for b in binary if b is not None]
        self._encoder = self._compiled_encoder(conn, mapped)
        self._events_encoder = self._compiled_encoder(conn, mapped, events=True)
        self._avro_encoder = (
            twophase_native.AvroCopyEncoder(
                [(m.field, m.column.base_type, m.column.max_length) for m in mapped]
            )
            if self._encoder is not None
            else None
        )
        self._events_sql = None
        self._stage = (
            self._ensure_stage(admin or conn, mapped, table) if cfg.mode != "insert" else None
        )
        self._stage_name = None if self._stage is None else self._stage.as_string(conn)
        self._statements = {}
        self._delete_sql = None
        self._table_oid = oid
        self._table_columns = table_columns
        self._current = table

    def _catalog_columns(self, conn: Connection, oid: int) -> dict[str, tuple[Column, bool]]:
        """The columns of table ``oid`` as ``conn`` sees them: each one, and whether it is
        generated. Equal results mean an unchanged table (what a part checks, once it holds
        the table's lock, before it trusts what it knows of it)."""
        rows = conn.execute(
            """
            SELECT a.attname,
                   CASE WHEN t.typtype = 'd' THEN bt.typname ELSE t.typname END,
                   CASE WHEN t.typtype = 'e' OR bt.typtype = 'e' THEN 'enum'
                        WHEN t.typcategory = 'A' THEN 'array' ELSE '' END,
                   format_type(a.atttypid, a.atttypmod),
                   a.attnotnull OR coalesce(t.typnotnull, false),
                   a.atthasdef OR a.attidentity <> '',
                   a.attgenerated <> '',
                   CASE WHEN coalesce(bt.typname, t.typname) IN ('varchar', 'bpchar')
                             AND a.atttypmod > 4 THEN a.atttypmod - 4 END,
                   coalesce(co.collisdeterministic, true)
              FROM pg_attribute a
              JOIN pg_type t ON t.oid = a.atttypid
              LEFT JOIN pg_type bt ON t.typtype = 'd' AND bt.oid = t.typbasetype
              LEFT JOIN pg_collation co ON co.oid = a.attcollation
             WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
             ORDER BY a.attnum
            """,
            (oid,),
        ).fetchall()
        table_columns: dict[str, tuple[Column, bool]] = {}
        for name, base, special, sql_type, not_null, has_default, generated, max_len, det in rows:
            column = Column(
                name=name,
                base_type=special or base,
                sql_type=sql_type,
                not_null=bool(not_null),
                has_default=bool(has_default),
                max_length=max_len,
                deterministic=bool(det),
            )
            table_columns[name] = (column, bool(generated))
        return table_columns

    def _compiled_encoder(
        self, conn: Connection, mapped: list[_Mapped], events: bool = False
    ) -> twophase_native.CopyEncoder | None:
        """The compiled encoder for this table, or None (and why, at DEBUG) when it does not
        apply: every record then takes the Python path. ``events``: the one for Debezium change
        events in upsert mode, whose rows and deletes are applied in order
        (:meth:`_WritePath.write_raw`)."""
        cfg = self.cfg
        why = ""
        if not cfg.compiled_copy:
            why = "compiled_copy is off"
        elif twophase_native is None:
            why = "twophase-native is not installed"
        elif events and cfg.mode != "upsert":
            why = f"{cfg.mode} mode applies change events in Python"
        elif not events and cfg.mode != "insert":
            why = f"{cfg.mode} mode merges rows per key in Python"
        elif any(m.get is not None for m in mapped):
            why = "nested field paths"
        elif self._binary_types is None:
            why = "a column the server parses from text"
        elif conn.info.encoding != "utf-8":
            why = f"client encoding {conn.info.encoding}"
        else:
            columns = [(m.field, m.column.base_type, m.column.max_length) for m in mapped]
            try:
                if events:
                    return twophase_native.CopyEncoder(
                        columns,
                        row_in="after",
                        ops=sorted(_EVENT_ROW_OPS),
                        seq=True,
                        delete_in="before",
                        key_columns=[m.is_key for m in mapped],
                    )
                return twophase_native.CopyEncoder(columns)
            except ValueError as exc:  # a type it does not model
                why = str(exc)
        if not (events and cfg.mode != "upsert"):
            self.log.debug("postgres sink %s: Python conversion only: %s", self.name, why)
        return None

    @staticmethod
    def _plan_step(m: _Mapped) -> _PlanStep:
        column = m.column
        what = "upsert key" if m.is_key else "the column is NOT NULL"
        absent = None
        if m.is_key or (column.not_null and not column.has_default):
            absent = f"column {column.name!r}: field {m.field!r} is missing ({what})"
        null = None
        if m.is_key or column.not_null:
            null = f"column {column.name!r}: field {m.field!r} is null ({what})"
        return (m.field, m.get, m.convert, absent, null)

    def _ensure_stage(self, conn: Connection, mapped: list[_Mapped], table: str) -> sql.Composable:
        """The UNLOGGED staging table of upsert mode (a TEMP table would forbid PREPARE).

        Named after the target and the mapped columns' types, so a changed target gets a new
        one instead of DDL on a table that prepared transactions may hold locks on. Made from
        the types, not from the target: in autocommit, it must neither wait for a lock an open
        part holds on the target (its own, which is changing it) nor miss a column that part
        added and has not committed yet.
        """
        signature = "|".join(
            ["v2", table, *(f"{m.column.name}:{m.column.sql_type}" for m in mapped)]
        )
        name = f"twophase_stage_{hashlib.sha1(signature.encode()).hexdigest()[:16]}"
        schema = self.cfg.marker_table.split(".")[0] if "." in self.cfg.marker_table else None
        stage = sql.Identifier(schema, name) if schema else sql.Identifier(name)
        # Names and types (format_type's text), no constraints: NOT NULL and CHECK are
        # checked when the rows reach the target. First the order of a write's rows and
        # whether each is a delete (only the change-event path fills them).
        columns = sql.SQL(", ").join(
            [
                sql.SQL("{} bigint").format(sql.Identifier(STAGE_SEQ)),
                sql.SQL("{} boolean").format(sql.Identifier(STAGE_DELETED)),
                *(
                    sql.SQL("{} {}").format(
                        sql.Identifier(m.column.name), sql.SQL(m.column.sql_type)
                    )
                    for m in mapped
                ),
            ]
        )
        with suppress(*_CREATED_CONCURRENTLY):
            conn.execute(
                sql.SQL("CREATE UNLOGGED TABLE IF NOT EXISTS {} ({})").format(stage, columns)
            )
            conn.execute(
                sql.SQL("COMMENT ON TABLE {} IS {}").format(
                    stage,
                    sql.Literal(
                        f"twophase upsert staging for {table}; "
                        "empty outside the transactions that use it"
                    ),
                )
            )
        return stage

    def _create_target(self, conn: Connection, table: str, target: sql.Composable) -> None:
        assert self.cfg.create_table is not None
        items: list[sql.Composable] = [
            sql.SQL("{} {}").format(sql.Identifier(name), sql.SQL(sql_type))
            for name, sql_type in self.cfg.create_table.items()
        ]
        if self.cfg.key:
            items.append(
                sql.SQL("PRIMARY KEY ({})").format(
                    sql.SQL(", ").join(map(sql.Identifier, self.cfg.key))
                )
            )
        with suppress(*_CREATED_CONCURRENTLY):
            conn.execute(
                sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                    target, sql.SQL(", ").join(items)
                )
            )
        self.log.info("postgres sink %s: created table %s", self.name, table)

    def _primary_key(self, conn: Connection, oid: int, table: str) -> list[str]:
        """The primary key's columns of ``table``: the key when the config names none."""
        row = conn.execute(
            """
            SELECT array_agg(a.attname::text ORDER BY array_position(i.indkey, a.attnum))
              FROM pg_index i
              JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
             WHERE i.indrelid = %s AND i.indisprimary
            """,
            (oid,),
        ).fetchone()
        if row is None or not row[0]:
            raise FatalSinkError(
                f"key: table {table} has no primary key; name the key columns", sink=self.name
            )
        return list(row[0])

    def _check_unique_key(self, conn: Connection, oid: int, table: str, key: list[str]) -> None:
        rows = conn.execute(
            """
            SELECT array_agg(a.attname::text ORDER BY a.attname)
              FROM pg_index i
              JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
             WHERE i.indrelid = %s AND i.indisunique AND i.indpred IS NULL
                   AND i.indexprs IS NULL
             GROUP BY i.indexrelid
            """,
            (oid,),
        ).fetchall()
        if sorted(key) not in [sorted(r[0]) for r in rows]:
            raise FatalSinkError(
                f"key: upsert needs a primary key or unique index on exactly "
                f"({', '.join(key)}) of table {table}",
                sink=self.name,
            )
