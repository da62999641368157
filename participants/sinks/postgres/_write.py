"""The write path: begin a part, convert records to rows, send them with ``COPY`` (and the
upsert merge) under a savepoint, and isolate the rows the server refuses."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import psycopg
from psycopg import sql

from twophase.participants.sdk import (
    AVRO,
    PLAIN_JSON,
    AbortTransactionError,
    FatalSinkError,
    PartId,
    RawBatch,
    RawShape,
    Record,
    Rejected,
    RetriableSinkError,
)
from twophase.participants.sinks.postgres._connections import (
    RawArray,
    _EventStatements,
    _OpenPart,
    twophase_native,
    type_oid,
)
from twophase.participants.sinks.postgres._errors import (
    _ENCODE_ERRORS,
    _FATAL_CLASSES,
    _MET_RECORD,
    _RETRIABLE_CLASSES,
    _RETRIABLE_CODES,
    Connection,
    _CompiledRefused,
    _copy_line,
    _is_lost,
    _is_row_error,
    _is_row_refusal,
    _mark,
    _note_record,
    _RowError,
    _savepoint,
    _server_reason,
    _sqlstate,
)
from twophase.participants.sinks.postgres._markers import _Markers
from twophase.participants.sinks.postgres._rows import _ABSENT, _Row
from twophase.participants.sinks.postgres._target import STAGE_DELETED, STAGE_SEQ
from twophase.participants.sinks.postgres.types import (
    BadValue,
    byte_equal,
)

__all__ = ["_BATCH_SAVEPOINT", "_WRITE_SAVEPOINT", "_WritePath"]


def _any_true(flags: bytes) -> bool:
    """Whether a binary ``bool[]`` (``twophase_native.copy_columns``'s delete flags) holds a
    true: after its 20-byte header, each element is its length (4 bytes, always 1) and one
    byte; an empty array is its 12-byte header alone."""
    return len(flags) > 12 and 1 in flags[24::5]


#: How long a delete waits for an earlier part's decision before the write is retried; a
#: decision takes a cycle, or the vote timeout when a participant is lost.
DELETE_WAIT_S = 30.0


#: Whether anything can see the order of a statement's rows on the table named ``%s`` (as the
#: LOCK before it names it), its partitions or children (:meth:`_WritePath._may_fold`): a
#: foreign key to one of them, a user's trigger on one, row-level security.
_SEEN_ORDER = """
    WITH RECURSIVE tree(oid) AS (
        SELECT %s::regclass::oid
        UNION SELECT i.inhrelid FROM pg_inherits i JOIN tree ON i.inhparent = tree.oid
    )
    SELECT EXISTS (SELECT 1 FROM pg_class c JOIN tree USING (oid) WHERE c.relrowsecurity)
        OR EXISTS (SELECT 1 FROM pg_constraint f JOIN tree ON f.confrelid = tree.oid
                   WHERE f.contype = 'f')
        OR EXISTS (SELECT 1 FROM pg_trigger g JOIN tree ON g.tgrelid = tree.oid
                   WHERE NOT g.tgisinternal)
"""


def _compiled_none(records: Sequence[Record]) -> tuple[bytes, int, Sequence[Record]]:
    """``encode`` of :meth:`_WritePath._write` for records only the Python path converts."""
    return b"", 0, records


def _all(records: Sequence[Record]) -> Sequence[Record]:
    return records


#: Savepoints: one around each write() so that a failed write leaves the part as it was (the
#: runtime may retry it), and nested ones only while isolating rows the server refused. Kept
#: few on purpose: each one that writes is a subtransaction, and more than 64 of them in one
#: transaction slows every snapshot on the server until the part is decided.
_WRITE_SAVEPOINT = sql.Identifier("twophase_write")


_BATCH_SAVEPOINT = sql.Identifier("twophase_batch")


class _WritePath(_Markers):
    """Begin and write a part."""

    def begin(self, part: PartId) -> None:
        self._require_ready()
        with self._lock:
            if self._open is not None:
                if self._open.part == part:
                    return
                raise FatalSinkError(
                    f"begin({part.token}) while part {self._open.part.token} is still open; "
                    "prepare or abort it first",
                    sink=self.name,
                )
        with self._admin_conn() as admin:
            state = self._state(admin, part)
        if state != "unknown":
            raise FatalSinkError(
                f"part {part.token} is already {state} in {self.cfg.table}; "
                "a part id must never be reused",
                sink=self.name,
            )
        gid = self.gid(part)
        conn = self._checkout()
        try:
            conn.tpc_begin(gid)
        except psycopg.Error as exc:
            conn.close()
            if not _is_lost(conn, exc):
                raise
            conn = self._connect(autocommit=False)  # a stale idle connection: one fresh try
            try:
                conn.tpc_begin(gid)
            except psycopg.Error as exc2:
                conn.close()
                raise RetriableSinkError(
                    f"part {part.token}: cannot start a transaction: {exc2}", sink=self.name
                ) from exc2
        with self._lock:
            self._open = _OpenPart(part=part, gid=gid, conn=conn)
        self.log.debug("postgres sink %s: part %s open (gid %s)", self.name, part.token, gid)

    def _open_part(self, part: PartId, action: str) -> _OpenPart:
        with self._lock:
            op = self._open
        if op is None or op.part != part:
            raise AbortTransactionError(
                f"{action}: part {part.token} is not the open part", sink=self.name
            )
        return op

    def _fail(self, op: _OpenPart, reason: str, exc: BaseException | None) -> AbortTransactionError:
        """Give up the open part's transaction: only abort() can follow."""
        op.broken = reason
        if op.conn is not None:
            op.conn.close()  # rolls the transaction back server-side
            op.conn = None
        self.log.warning(
            "postgres sink %s: part %s must abort: %s", self.name, op.part.token, reason
        )
        error = AbortTransactionError(f"part {op.part.token}: {reason}", sink=self.name)
        if exc is not None:
            error.__cause__ = exc
        return error

    def accepts_raw(self) -> bool:
        return self._encoder is not None and not self.cfg.templated

    def accepts_raw_shape(self, shape: RawShape) -> bool:
        """Plain JSON as :meth:`accepts_raw`; Debezium change events in upsert mode, into one
        table or a table per topic (:meth:`_write_events`)."""
        if shape == PLAIN_JSON:
            return self.accepts_raw()
        if shape == AVRO:
            return self._avro_encoder is not None and not self.cfg.templated
        return (
            shape.envelope == "debezium"
            and self.cfg.mode == "upsert"
            and self.cfg.compiled_copy
            and twophase_native is not None
            and (self._template is None or self._template.topic_only)
        )

    @property
    def supports_deletes(self) -> bool:
        """In upsert and update mode: a delete removes the row of its key (``docs/cdc.md``)."""
        return self.cfg.mode != "insert"

    def check(self, records: Sequence[Record]) -> Sequence[Rejected]:
        """What the client-side conversion of :meth:`write` refuses (the same code); what the
        server refuses (constraints, ``numeric(p, s)`` overflow) shows only in ``write``."""
        self._require_ready()
        if not self.cfg.templated:
            return self._check(records)
        out: list[Rejected] = []
        for group, refused in self._by_table(records):
            out += refused
            out += self._check(group)
        return out

    def _check(self, records: Sequence[Record]) -> list[Rejected]:
        convert = self._convert_one
        return [row for r in records if (row := convert(r)).__class__ is Rejected]

    def write(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected]:
        if not self.cfg.templated:
            return self._write(part, lambda: (b"", 0, records), lambda: records)
        rejected: list[Rejected] = []
        for group, refused in self._by_table(records):
            rejected += refused
            if group:
                rejected += self._write(part, partial(_compiled_none, group), partial(_all, group))
        return rejected

    # -- a table template: each record's table -------------------------------------------------

    def _by_table(
        self, records: Sequence[Record]
    ) -> Iterator[tuple[Sequence[Record], list[Rejected]]]:
        """The records of each table the template names, in their order, with that table made
        the write path's (:meth:`_use_table`); records whose table cannot be had come back as
        rejections with the reason, and an empty group."""
        groups: dict[str, list[Record]] = {}
        refused: list[Rejected] = []
        for r in records:
            table = self._table_of(r)
            if isinstance(table, Rejected):
                refused.append(table)
            else:
                groups.setdefault(table, []).append(r)
        if refused:
            yield [], refused
        for table, group in groups.items():
            why = self._use_table(table)
            if why is None:
                yield group, []
            else:
                yield [], [Rejected(r, f"table {table}: {why}") for r in group]

    def _table_of(self, record: Record) -> str | Rejected:
        assert self._template is not None  # only with a table template
        return self._template.render(record)

    def write_raw(self, part: PartId, batch: RawBatch) -> Sequence[Rejected]:
        if batch.shape.envelope is not None:
            return self._write_events(part, batch)
        avro = batch.shape.format == "avro"
        encoder = self._avro_encoder if avro else self._encoder
        if encoder is None:
            return super().write_raw(part, batch)

        left_out: list[int] = []

        def encode() -> tuple[bytes, int, Sequence[Record]]:
            # The values the encoder was unsure of, decoded (None: not a record, the runtime's).
            payload, unsure = encoder.encode(batch.values)
            left_out[:] = unsure
            rest = [r for i in unsure if (r := batch.record(i)) is not None]
            if avro:
                self._learn_schemas(batch, unsure)
            return payload, len(batch) - len(unsure), rest

        def at(line: int) -> Record | None:
            """The record on 1-based ``line`` of the compiled stream (worked out only when an
            error names a line: the stream holds the values the encoder was sure of)."""
            skip = set(left_out)
            compiled = (i for i in range(len(batch)) if i not in skip)
            index = next(itertools.islice(compiled, line - 1, None), None) if line > 0 else None
            return batch.record(index) if index is not None else None

        return self._write(part, encode, batch.records, at)

    def _learn_schemas(self, batch: RawBatch, unsure: Sequence[int]) -> None:
        """Give the Avro encoder the writer schemas of values it handed back for not knowing
        them, now that decoding them fetched them: the next values of those schemas are its."""
        encoder = self._avro_encoder
        assert encoder is not None
        for i in unsure:
            value = batch.values[i]
            if len(value) < 5 or value[0] != 0:
                continue
            sid = int.from_bytes(value[1:5], "big")
            if sid in self._avro_refused or encoder.knows(sid):
                continue
            text = batch.writer_schema(sid)
            if text is None:
                continue
            try:
                encoder.add_schema(sid, text)
            except ValueError as exc:  # a schema Apache's Rust codec does not read
                self._avro_refused.add(sid)
                self.log.info("postgres sink %s: schema %d in Python: %s", self.name, sid, exc)

    # -- change events (RawShape "debezium"): each key's last change, applied from arrays --

    def _write_events(self, part: PartId, batch: RawBatch) -> Sequence[Rejected]:
        """Debezium change events, each topic's into its table: the events the compiled
        encoder takes (creates, snapshot reads and updates with every mapped field, deletes
        whose ``before`` holds the key) become binary rows with their place in the batch; the
        rest (rows with nulls or unusual values, deletes keyed only by the record key) are
        decoded and converted here; then each key's last change is applied
        (:meth:`_apply_events`). The same result as :meth:`write` of the decoded records."""
        if self._template is None:
            return self._write_events_of(part, batch)
        by_topic: dict[str, list[int]] = {}
        for i, topic in enumerate(batch.topics()):
            by_topic.setdefault(topic, []).append(i)
        rejected: list[Rejected] = []
        for topic, positions in by_topic.items():
            table = self._template.for_topic(topic)
            view = batch.subset(positions)
            why = self._use_table(table)
            if why is None:
                rejected += self._write_events_of(part, view)
            else:
                rejected += [Rejected(r, f"table {table}: {why}") for r in view.records()]
        return rejected

    def _write_events_of(self, part: PartId, batch: RawBatch) -> Sequence[Rejected]:
        """:meth:`_write_events` of events into the current table."""
        encoder = self._events_encoder
        if encoder is None:
            return self._write_decoded(part, batch)
        keys = batch.keys() if batch.shape.key_fields else None
        payload, unsure = encoder.encode(batch.values, keys)
        assert twophase_native is not None  # the events encoder exists
        statements = self._events_statements()
        if statements.keys is None:
            columns, rewritten = twophase_native.copy_columns(payload, statements.oids), True
        else:
            columns, rewritten = twophase_native.event_columns(
                payload, statements.oids, statements.keys
            )
        compiled = [RawArray(c) for c in columns]
        rejected: list[Rejected] = []
        staged: list[tuple[int, _Row]] = []
        full = (1 << len(self._mapped)) - 1
        for i in unsure:
            record = batch.record(i)
            if record is None:
                continue  # not a change event: the runtime dead-letters it
            row = self._convert_one(record)
            if row.__class__ is Rejected:
                rejected.append(row)
                continue
            assert isinstance(row, _Row)
            if not row.deleted and row.mask != full:
                # A row with fields missing merges into the key's earlier rows: in Python.
                return self._write_decoded(part, batch)
            staged.append((i, row))
        n = len(batch) - len(unsure) + len(staged)
        op = self._open_part(part, "write")
        with op.lock:
            if op.broken is not None or op.conn is None:
                raise AbortTransactionError(
                    f"part {part.token} cannot continue: {op.broken}", sink=self.name
                )
            settled = _any_true(compiled[1]) or any(row.deleted for _, row in staged)
            if settled:
                self._await_decisions(part)
            try:
                fold = (
                    settled
                    and not (rewritten or staged)
                    and op.conn.info.server_version >= 150000
                    and self._may_fold(op, op.conn)
                )
                self._apply_events(op.conn, compiled, staged, settled=settled, fold=fold)
            except _CompiledRefused as exc:
                # The server refused a row (a CHECK, numeric(p, s) overflow, a key another
                # process inserted): the whole batch the careful way, which isolates culprits.
                cause = exc.__cause__
                self.log.info(
                    "postgres sink %s: part %s: %d change events redone the careful way: %s",
                    self.name, part.token, len(batch),
                    _server_reason(cause) if isinstance(cause, psycopg.Error) else repr(cause),
                )  # fmt: skip
                refused = True
            except _ENCODE_ERRORS as exc:
                raise self._classify_write_error(op, exc) from exc
            else:
                refused = False
                op.records += n
                op.rejected += len(rejected)
        if refused:
            return self._write_decoded(part, batch)
        self._log_rejected(part, rejected, n + len(rejected))
        return rejected

    def _write_decoded(self, part: PartId, batch: RawBatch) -> Sequence[Rejected]:
        records = batch.records()
        return self._write(part, partial(_compiled_none, records), partial(_all, records))

    def _apply_events(
        self,
        conn: Connection,
        compiled: list[RawArray],
        staged: list[tuple[int, _Row]],
        *,
        settled: bool,
        fold: bool = False,
    ) -> None:
        """Apply the compiled rows (``compiled``, one array per column: place in the batch,
        delete flag, every mapped column) and ``staged`` (place in the batch, row): delete the
        keys with a delete among their changes, then write each key's last change when it is
        a row. The rows reach the server as arrays (``unnest``), not through a staging table:
        no heap to fill, scan and empty again per write. ``settled``: the write has deletes
        (a statement deletes their keys first, unless ``fold``) and so waited until no earlier
        part of this instance is undecided (:meth:`_await_decisions`): a key absent from the
        target is absent for good and PostgreSQL's ``MERGE`` (15 and later) applies the rows
        without ``ON CONFLICT``'s speculative insertion; otherwise the upsert waits on the
        unique index by itself. ``fold``: no key of the write is deleted and then written
        again and nothing can see the order of a statement's rows (:meth:`_may_fold`), so
        instead of a DELETE first the ``MERGE`` itself deletes the keys whose last change is
        a delete: the same rows and the same row events per key, one statement fewer
        (measured: 15-17% more change events per second at 1M events, 5% at 3M). Raises
        :class:`_CompiledRefused` (the part as before) when the server refuses a row -- or
        when ``MERGE`` meets a key another process inserted meanwhile (a unique violation):
        the careful path then redoes the batch."""
        statements = self._events_statements()
        columns: list[list[Any]] = [[] for _ in self._mapped]
        places: list[int] = []
        flags: list[bool] = []
        for seq, row in staged:
            places.append(seq)
            flags.append(row.deleted)
            for i, value in enumerate(row.values):
                columns[i].append(value)
        merge = settled and conn.info.server_version >= 150000
        fold = fold and merge
        conn.execute(sql.SQL("SAVEPOINT {}").format(_WRITE_SAVEPOINT))
        try:
            with conn.cursor() as cur:
                if settled and not fold:
                    keys = self._key_idx
                    cur.execute(
                        statements.delete,
                        [compiled[1], *(compiled[2 + i] for i in keys), flags,
                         *(columns[i] for i in keys)],
                    )  # fmt: skip
                cur.execute(
                    statements.fold if fold else statements.merge if merge else statements.upsert,
                    [*compiled, places, flags, *columns],
                )
        except _ENCODE_ERRORS as exc:
            if conn.closed or conn.broken or _is_lost(conn, exc):
                raise
            refused = _is_row_refusal(conn, exc)
            conn.execute(sql.SQL("ROLLBACK TO SAVEPOINT {}").format(_WRITE_SAVEPOINT))
            conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(_WRITE_SAVEPOINT))
            if refused:
                raise _CompiledRefused from exc
            raise
        conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(_WRITE_SAVEPOINT))

    def _may_fold(self, op: _OpenPart, conn: Connection) -> bool:
        """Whether a write of change events into the current table may delete inside its
        ``MERGE``: only where nothing can see the order of the statement's rows -- no foreign
        key references the table or a partition or child of it (``ON DELETE`` checks and
        actions would run at the end of the ``MERGE``, after the write's other rows, instead
        of before them), no trigger of the user's is on any of them (it could read the table
        in between), no row-level security (a ``MERGE`` fails on a row its DELETE policy
        hides, where a ``DELETE`` skips it). Asked once per part and table, under ROW
        EXCLUSIVE (which the write takes anyway) and at READ COMMITTED (every part's, see
        ``_connect``), so the catalog is read as of the lock: a key, trigger or policy added
        meanwhile waits for the part. In a savepoint of its own, so that a lock timeout leaves
        the part as it was (a retriable write error)."""
        oid = self._table_oid
        known = op.foldable.get(oid)
        if known is None:
            with _savepoint(conn, _WRITE_SAVEPOINT):
                conn.execute(sql.SQL("LOCK TABLE {} IN ROW EXCLUSIVE MODE").format(self._target))
                row = conn.execute(_SEEN_ORDER, (self._target.as_string(conn),)).fetchone()
            known = op.foldable[oid] = row is not None and not row[0]
        return known

    def _events_statements(self) -> _EventStatements:
        """The statements of :meth:`_apply_events` for the current table. The rows come as two
        sets of arrays -- place in the batch, delete flag, every mapped column -- the compiled
        ones (binary, made by :func:`twophase_native.copy_columns`) and the ones converted
        here (psycopg's lists), each typed by the column's base type: the target's own types
        (``numeric(p, s)``, ``varchar(n)``, domains) apply as the rows reach it."""
        if self._events_sql is None:
            types = [m.column.base_type for m in self._mapped]
            seq, deleted = sql.Identifier(STAGE_SEQ), sql.Identifier(STAGE_DELETED)
            names = [sql.Identifier(m.column.name) for m in self._mapped]
            listed = sql.SQL(", ").join(names)
            # Built-in type names (types.KNOWN_TYPES: the encoder exists only for those).
            casts = [sql.SQL(f"{t}[]") for t in ("int8", "bool", *types)]

            def unnest(placeholder: str, alias: str, of: list[int]) -> sql.Composed:
                return sql.SQL("unnest({}) AS {}({})").format(
                    sql.SQL(", ").join(sql.SQL(placeholder + "::{}").format(casts[i]) for i in of),
                    sql.Identifier(alias),
                    sql.SQL(", ").join([seq, deleted, *names][i] for i in of),
                )

            every = list(range(len(casts)))
            keys = [sql.Identifier(k) for k in self._key]
            key_list = sql.SQL(", ").join(keys)
            matches = sql.SQL(" AND ").join(sql.SQL("t.{0} = s.{0}").format(k) for k in keys)
            source = sql.SQL(
                "SELECT DISTINCT ON ({}) * FROM (SELECT * FROM {} UNION ALL SELECT * FROM {})"
                " AS u ORDER BY {}, {} DESC"
            ).format(key_list, unnest("%b", "c", every), unnest("%s", "p", every), key_list, seq)
            action = self._on_conflict([m.column.name for m in self._mapped])
            upsert = sql.SQL(
                "INSERT INTO {} ({}) SELECT {} FROM ({}) AS s WHERE NOT s.{} ON CONFLICT ({}) {}"
            ).format(self._target, listed, listed, source, deleted, key_list, action)
            updates = [n for m, n in zip(self._mapped, names, strict=True) if not m.is_key]
            matched = (
                sql.SQL("UPDATE SET {}").format(
                    sql.SQL(", ").join(sql.SQL("{0} = s.{0}").format(n) for n in updates)
                )
                if updates
                else sql.SQL("DO NOTHING")
            )

            def merge_of(deletes: str) -> sql.Composed:
                return sql.SQL(
                    "MERGE INTO {target} AS t USING ({source}) AS s ON {matches}" + deletes
                    + " WHEN MATCHED AND NOT s.{deleted} THEN {matched}"
                    " WHEN NOT MATCHED AND NOT s.{deleted} THEN INSERT ({listed}) VALUES ({values})"
                ).format(
                    target=self._target, source=source, matches=matches, deleted=deleted,
                    matched=matched, listed=listed,
                    values=sql.SQL(", ").join(sql.SQL("s.{}").format(n) for n in names),
                )  # fmt: skip

            # The deletes of a write in which no key is deleted and then written again go in
            # the MERGE (``fold``): a key's last change decides alone.
            merge = merge_of("")
            fold = merge_of(" WHEN MATCHED AND s.{deleted} THEN DELETE")
            # The keys with a delete among their changes, from both sets of arrays: the delete
            # flags and the key columns'.
            flagged = [1, *(2 + i for i in self._key_idx)]
            delete = sql.SQL(
                "DELETE FROM {} AS t USING (SELECT * FROM {} UNION ALL SELECT * FROM {}) AS s"
                " WHERE s.{} AND {}"
            ).format(
                self._target, unnest("%b", "c", flagged), unnest("%s", "p", flagged), deleted,
                matches,
            )  # fmt: skip
            oids = [type_oid(t) for t in ("int8", "bool", *types)]
            exact = all(byte_equal(self._mapped[i].column) for i in self._key_idx)
            fields = [2 + i for i in self._key_idx] if exact else None
            self._events_sql = _EventStatements(upsert, merge, delete, fold, oids, fields)
        return self._events_sql

    def _log_rejected(self, part: PartId, rejected: list[Rejected], n: int) -> None:
        if rejected:
            self.log.info(
                "postgres sink %s: part %s rejected %d of %d records (first: %s)",
                self.name,
                part.token,
                len(rejected),
                n,
                rejected[0].reason,
            )

    def _write(
        self,
        part: PartId,
        encode: Callable[[], tuple[bytes, int, Sequence[Record]]],
        every: Callable[[], Sequence[Record]],
        at: Callable[[int], Record | None] = lambda line: None,
    ) -> Sequence[Rejected]:
        """Write one batch: ``encode()`` gives the compiled COPY stream, how many records it
        holds, and the records left to convert here; ``every()`` all of them, for the careful
        redo; ``at(line)`` the record on a line of the compiled stream, for error messages."""
        op = self._open_part(part, "write")
        with op.lock:
            if op.broken is not None or op.conn is None:
                raise AbortTransactionError(
                    f"part {part.token} cannot continue: {op.broken}", sink=self.name
                )
            rejected: list[Rejected] = []
            payload, compiled, records = encode()
            n = compiled + len(records)
            rows = self._convert(records, rejected)
            if self.cfg.mode == "upsert" and any(row.deleted for row in rows):
                self._await_decisions(part)
            try:
                try:
                    if rows or payload:
                        rejected.extend(self._write_rows(op.conn, self._groups(rows), payload))
                except _CompiledRefused:
                    # The server refused a row of this write (a CHECK, a numeric(p, s) overflow)
                    # and the compiled stream cannot be split: the whole batch the careful way,
                    # which isolates the culprits.
                    rejected = []
                    records = every()
                    n = len(records)
                    rows = self._convert(records, rejected)
                    if rows:
                        rejected.extend(self._write_rows(op.conn, self._groups(rows)))
            except _ENCODE_ERRORS as exc:
                line = _copy_line(exc) if payload else None
                met = at(line) if line is not None else None
                if met is not None:
                    # Rows sent the Python way name their record already (_send): a line left
                    # unnamed is the compiled stream's.
                    _mark(exc, met)
                raise self._classify_write_error(op, exc) from exc
            op.records += n - len(rejected)
            op.rejected += len(rejected)
        self._log_rejected(part, rejected, n)
        return rejected

    def _await_decisions(self, part: PartId) -> None:
        """Before a delete: wait until every earlier part this instance prepared is decided.

        A row an undecided part inserted is invisible to this part's transaction, so a DELETE
        of its key would find nothing and the row would appear when that part commits -- a lost
        delete (an upsert, by contrast, waits on the unique index by itself). Records keep
        flowing while a part is decided, so the next part's first delete usually waits for one
        decision. Another process's undecided part needs no wait here: this part then starts
        before that part's end, and the chain rule aborts it (``control-topic/PROTOCOL.md``).
        """
        with self._decided:
            if self._decided.wait_for(
                lambda: not (self._undecided - {part}), timeout=DELETE_WAIT_S
            ):
                return
            pending = sorted(p.token for p in self._undecided - {part})
        raise RetriableSinkError(
            f"part {part.token}: deletes wait for the decision of {', '.join(pending)}",
            sink=self.name,
        )

    def _classify_write_error(self, op: _OpenPart, exc: BaseException) -> Exception:
        state = _sqlstate(exc)
        met = getattr(exc, _MET_RECORD, None)
        # The record the server was at, when it can be told: the operator's first lead.
        detail = f"{str(exc).strip()} [SQLSTATE {state}]" + (f" [at record {met}]" if met else "")
        if _is_lost(op.conn, exc):
            return self._fail(op, f"lost the PostgreSQL connection: {detail}", exc)
        if state in _RETRIABLE_CODES or state[:2] in _RETRIABLE_CLASSES:
            # _savepoint rolled the batch back: the part is as before this write.
            return RetriableSinkError(f"part {op.part.token}: {detail}", sink=self.name)
        if state[:2] in _FATAL_CLASSES:
            self._fail(op, detail, exc)
            return FatalSinkError(
                f"part {op.part.token}: table {self.cfg.table}: {detail}", sink=self.name
            )
        # Class 40 (serialization failure, deadlock) and anything unexpected: start over.
        return self._fail(op, detail, exc)

    def _convert(self, records: Sequence[Record], rejected: list[Rejected]) -> list[_Row]:
        """Client-side conversion: the hot loop of the sink. Records with every mapped field
        present, non-null and convertible go through the loop compiled for this table's plan
        (:func:`_compile_plan`); the rest, through :meth:`_convert_one`, which gives the reason."""
        upsert = self.cfg.mode != "insert"  # rows merge per key
        key_idx = self._key_idx
        rows: list[_Row] = []
        by_key: dict[tuple[Any, ...], _Row] = {}
        for row in self._fast(records, self._convert_one):
            if row.__class__ is Rejected:
                rejected.append(row)
                continue
            assert isinstance(row, _Row)
            if not upsert:
                rows.append(row)
                continue
            key = tuple([row.values[i] for i in key_idx])
            earlier = by_key.get(key)
            if earlier is None:
                by_key[key] = row
                rows.append(row)
            else:
                self._overlay(earlier, row)
        return rows

    def _convert_delete(self, record: Record) -> _Row | Rejected:
        """A delete: the row of its key's columns, or why the key cannot be told."""
        value = record.value
        values: list[Any] = [None] * len(self._plan)
        try:
            for i in self._key_idx:
                field_name, get, convert, _absent, _null = self._plan[i]
                raw = value.get(field_name, _ABSENT) if get is None else get(value)
                if raw is None or raw is _ABSENT:
                    column = self._mapped[i].column.name
                    return Rejected(
                        record,
                        f"a delete needs its key: field {field_name!r} (column {column!r}) is "
                        + ("null" if raw is None else "missing"),
                    )
                values[i] = convert(raw)
        except BadValue as exc:
            return Rejected(record, f"the delete's key: {exc}")
        return _Row(self._key_mask, values, [record], deleted=True)

    def _convert_one(self, record: Record) -> _Row | Rejected:
        """One record, column by column: the row, or why the record cannot be stored."""
        value = record.value
        if not isinstance(value, dict):
            return Rejected(record, "the record value is not a JSON object")
        if record.deleted:
            return self._convert_delete(record)
        values: list[Any] = []
        append = values.append
        mask = 0
        bit = 1
        try:
            for field_name, get, convert, absent_reason, null_reason in self._plan:
                raw = value.get(field_name, _ABSENT) if get is None else get(value)
                if raw is None:
                    if null_reason is not None:
                        return Rejected(record, null_reason)
                    append(None)
                    mask |= bit
                elif raw is _ABSENT:
                    if absent_reason is not None:
                        return Rejected(record, absent_reason)
                    append(None)
                else:
                    append(convert(raw))
                    mask |= bit
                bit <<= 1
        except (BadValue, ArithmeticError, TypeError, ValueError) as exc:
            # A converter's own refusal, or what a value outside its checks made it raise (an
            # instant past year 9999 once in UTC): the record's, never the part's.
            said = str(exc) if isinstance(exc, BadValue) else f"not storable ({exc!r})"
            column = self._mapped[len(values)]  # the column being converted
            return Rejected(
                record,
                f"column {column.column.name!r} ({column.column.sql_type}) "
                f"from field {column.field!r}: {said}",
            )
        if mask == 0:
            return Rejected(
                record,
                "none of the mapped fields is present: "
                + ", ".join(sorted({m.field for m in self._mapped})),
            )
        return _Row(mask, values, [record])

    @staticmethod
    def _overlay(earlier: _Row, later: _Row) -> None:
        """Merge ``later`` into ``earlier`` (same key) as applying both in order would: the
        last change of a key wins -- a delete ends what came before it, a write after a delete
        replaces the deleted row, writes after writes overlay their fields."""
        if earlier.history is None:
            earlier.history = [
                _Row(
                    earlier.mask,
                    list(earlier.values),
                    list(earlier.records),
                    deleted=earlier.deleted,
                    replaces=earlier.replaces,
                )
            ]
        earlier.history.append(later)
        if later.deleted or earlier.deleted:
            earlier.replaces = earlier.deleted and not later.deleted
            earlier.deleted = later.deleted
            earlier.mask = later.mask
            earlier.values = later.values
        elif later.mask == earlier.mask:
            earlier.values = later.values
        else:
            earlier.values = list(earlier.values)  # never alias a history entry's list
            bit = 1
            for i in range(len(earlier.values)):
                if later.mask & bit:
                    earlier.values[i] = later.values[i]
                bit <<= 1
            earlier.mask |= later.mask
        earlier.records.extend(later.records)

    def _groups(self, rows: list[_Row]) -> list[tuple[int, list[_Row]]]:
        """Rows of one mask together, the deletes first (and, for a row that replaces a deleted
        one, the delete of its key): a key's last change is applied last."""
        deletes: list[_Row] = []
        groups: dict[int, list[_Row]] = {}
        for row in rows:
            if row.deleted:
                deletes.append(row)
                continue
            if row.replaces:
                deletes.append(_Row(self._key_mask, row.values, row.records, deleted=True))
            groups.setdefault(row.mask, []).append(row)
        return ([(self._key_mask, deletes)] if deletes else []) + list(groups.items())

    def _write_rows(
        self, conn: Connection, groups: list[tuple[int, list[_Row]]], payload: bytes = b""
    ) -> list[Rejected]:
        """Write all of ``groups`` (and ``payload``, a compiled binary COPY stream of every
        mapped column) but the rows the server refuses (returned), or raise and leave the part
        exactly as it was before. With a ``payload``, a refused row raises
        :class:`_CompiledRefused` (the part as before, too): only the caller can redo the
        stream's records."""
        rejected: list[Rejected] = []
        write_sp = sql.SQL("SAVEPOINT {}").format(_WRITE_SAVEPOINT)
        rollback = sql.SQL("ROLLBACK TO SAVEPOINT {}").format(_WRITE_SAVEPOINT)
        conn.execute(write_sp)
        try:
            try:
                # The common case: one COPY per group and no savepoint but this one.
                if payload:
                    self._send_compiled(conn, payload)
                for mask, rows in groups:
                    self._send(conn, mask, rows)
            except _ENCODE_ERRORS as exc:
                if not _is_row_refusal(conn, exc):
                    raise
                conn.execute(rollback)  # keeps the savepoint for the careful pass
                if payload:
                    conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(_WRITE_SAVEPOINT))
                    raise _CompiledRefused from exc
                self.log.debug("postgres sink %s: isolating refused rows: %s", self.name, exc)
                for mask, rows in groups:
                    self._write_isolating(conn, mask, rows, rejected)
        except _ENCODE_ERRORS as exc:
            if not (conn.closed or conn.broken or _is_lost(conn, exc)):
                conn.execute(rollback)
                conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(_WRITE_SAVEPOINT))
            raise
        conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(_WRITE_SAVEPOINT))
        return rejected

    def _write_isolating(
        self, conn: Connection, mask: int, rows: list[_Row], rejected: list[Rejected]
    ) -> None:
        """Write ``rows``; when the server refuses them for their data, bisect to the culprits."""
        try:
            with self._savepoint(conn, _BATCH_SAVEPOINT):
                self._send(conn, mask, rows)
            return
        except _RowError as exc:
            if len(rows) > 1:
                middle = len(rows) // 2
                self._write_isolating(conn, mask, rows[:middle], rejected)
                self._write_isolating(conn, mask, rows[middle:], rejected)
                return
            row = rows[0]
            if row.history is not None:
                # A merged upsert row: replay its records one by one so only the bad one goes.
                for single in row.history:
                    self._write_isolating(conn, single.mask, [single], rejected)
                return
            rejected.extend(Rejected(r, exc.reason) for r in row.records)

    @contextmanager
    def _savepoint(self, conn: Connection, name: sql.Identifier) -> Iterator[None]:
        """Run the block under savepoint ``name``; on failure roll back to it and re-raise,
        a refusal of the rows' data as :class:`_RowError`."""
        conn.execute(sql.SQL("SAVEPOINT {}").format(name))
        try:
            yield
        except _ENCODE_ERRORS as exc:
            if isinstance(exc, psycopg.Error) and _is_lost(conn, exc):
                raise
            # An exception inside a COPY block cancels the COPY (CopyFail); the rollback undoes
            # whatever had reached the server.
            conn.execute(sql.SQL("ROLLBACK TO SAVEPOINT {}").format(name))
            conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(name))
            if not isinstance(exc, psycopg.Error):
                raise _RowError(f"cannot encode the row: {type(exc).__name__}: {exc}") from exc
            if _is_row_error(exc):
                raise _RowError(_server_reason(exc)) from exc
            raise
        conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(name))

    def _columns_of(self, mask: int) -> list[int]:
        return [i for i in range(len(self._mapped)) if mask & (1 << i)]

    def _send(self, conn: Connection, mask: int, rows: list[_Row]) -> None:
        """COPY ``rows`` (all with ``mask``) into the target, or via the staging table."""
        try:
            self._send_rows(conn, mask, rows)
        except _ENCODE_ERRORS as exc:
            _note_record(exc, rows)
            raise

    def _send_rows(self, conn: Connection, mask: int, rows: list[_Row]) -> None:
        if rows[0].deleted:
            with conn.cursor() as cur:
                self._delete_keys(cur, rows)
            return
        idx = self._columns_of(mask)
        copy_sql, merge_sql = self._statements_for(mask, idx)
        with conn.cursor() as cur:
            with cur.copy(copy_sql) as copy:
                if self._binary_types is not None:
                    copy.set_types([self._binary_types[i] for i in idx])
                write_row = copy.write_row
                if len(idx) == len(self._mapped):
                    for row in rows:
                        write_row(row.values)
                else:
                    for row in rows:
                        values = row.values
                        write_row([values[i] for i in idx])
            if merge_sql is not None:
                assert self._stage is not None
                cur.execute(merge_sql)
                # Only this transaction's rows are visible to it: every transaction deletes
                # what it staged before it prepares, so the table is empty to everyone else.
                cur.execute(sql.SQL("DELETE FROM {}").format(self._stage))

    def _send_compiled(self, conn: Connection, payload: bytes) -> None:
        """COPY a compiled binary stream of full rows straight into the target (insert mode)."""
        full = (1 << len(self._mapped)) - 1
        copy_sql, _ = self._statements_for(full, self._columns_of(full))
        with conn.cursor() as cur, cur.copy(copy_sql) as copy:
            copy.write(payload)

    def _delete_keys(self, cur: psycopg.Cursor[Any], rows: Sequence[_Row]) -> None:
        """Delete the target's rows of these (delete) rows' keys, in one statement whose keys
        come as arrays (``unnest``): the target is read by its key's index whatever the planner
        believes of the staging table, which a join with it would depend on."""
        if self._delete_sql is None:
            assert self._stage is not None  # deletes exist only in upsert and update mode
            cols = [self._mapped[i].column for i in self._key_idx]
            self._delete_sql = sql.SQL(
                "DELETE FROM {} AS t USING unnest({}) AS d({}) WHERE {}"
            ).format(
                self._target,
                sql.SQL(", ").join(sql.SQL("%s::{}[]").format(sql.SQL(c.sql_type)) for c in cols),
                sql.SQL(", ").join(sql.Identifier(c.name) for c in cols),
                sql.SQL(" AND ").join(
                    sql.SQL("t.{0} = d.{0}").format(sql.Identifier(c.name)) for c in cols
                ),
            )
        cur.execute(self._delete_sql, [[row.values[i] for row in rows] for i in self._key_idx])

    def _on_conflict(self, names: list[str]) -> sql.Composed:
        """The upsert's ON CONFLICT action for a row of columns ``names``: the non-key ones
        take the new values (nothing to do when the key is all there is)."""
        updates = [n for n in names if n not in self._key]
        if not updates:
            return sql.SQL("DO NOTHING").format()
        return sql.SQL("DO UPDATE SET {}").format(
            sql.SQL(", ").join(
                sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in updates
            )
        )

    def _statements_for(
        self, mask: int, idx: list[int]
    ) -> tuple[sql.Composed, sql.Composed | None]:
        cached = self._statements.get(mask)
        if cached is not None:
            return cached
        columns = [self._mapped[i].column for i in idx]
        names = sql.SQL(", ").join(sql.Identifier(c.name) for c in columns)
        binary = sql.SQL(" (FORMAT BINARY)" if self._binary_types is not None else "")
        merge: sql.Composed | None = None
        if self._stage is None:
            copy = sql.SQL("COPY {} ({}) FROM STDIN{}").format(self._target, names, binary)
        else:
            copy = sql.SQL("COPY {} ({}) FROM STDIN{}").format(self._stage, names, binary)
            updates = [c for c in columns if c.name not in self._key]
            action = self._on_conflict([c.name for c in columns])
            if self.cfg.mode == "update":
                # Update-only: a staged row whose key has no row in the target changes nothing.
                merge = (
                    sql.SQL("UPDATE {} AS t SET {} FROM {} AS s WHERE {}").format(
                        self._target,
                        sql.SQL(", ").join(
                            sql.SQL("{0} = s.{0}").format(sql.Identifier(c.name)) for c in updates
                        ),
                        self._stage,
                        sql.SQL(" AND ").join(
                            sql.SQL("t.{0} = s.{0}").format(sql.Identifier(k)) for k in self._key
                        ),
                    )
                    if updates
                    else sql.SQL("SELECT 1").format()  # only the key: nothing to update
                )
            else:
                merge = sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} ON CONFLICT ({}) {}").format(
                    self._target,
                    names,
                    names,
                    self._stage,
                    sql.SQL(", ").join(map(sql.Identifier, self._key)),
                    action,
                )
        self._statements[mask] = (copy, merge)
        return copy, merge
