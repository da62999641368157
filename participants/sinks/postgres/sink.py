"""PostgreSQL sink: real two-phase commit (``PREPARE TRANSACTION`` / ``COMMIT PREPARED``).

One part is one PostgreSQL transaction, started with psycopg's ``tpc_begin(gid)`` on a
connection of its own and prepared with ``tpc_prepare()``. The global id is
``twophase:{sink}:{part.token}``, so any process can find a pipeline's prepared parts in
``pg_prepared_xacts`` and finish them. The prepared transaction also inserts a row into the marker
table (positions and counts), so the store itself tells the state of a part:

========================  ===================  ==================
gid in pg_prepared_xacts  marker row visible   state
========================  ===================  ==================
yes                       no                   prepared
no                        yes                  committed
no                        no                   unknown / aborted
========================  ===================  ==================

The marker row also carries the part's source positions (jsonb ``{topic: {partition: offset}}``),
committed atomically with the data: :meth:`PostgresSink.committed_positions` is the highest
offset per partition over the visible rows, :meth:`PostgresSink.last_committed` the visible row
with the highest txn, and :meth:`PostgresSink.forget` deletes old rows but the best one of each
partition and those of the highest txn, which keeps the table bounded. ``COMMIT PREPARED`` cannot
write anything, so the commit time comes from the server's commit timestamps
(``pg_xact_commit_timestamp`` of the row's ``xmin``) when ``track_commit_timestamp = on``, and is
unknown otherwise.

Connections: one for the open part, one per prepared part still waiting for its decision (up to
:data:`_MAX_HELD_PREPARED`; older ones are closed, which leaves their prepared transaction intact),
a couple of idle ones for reuse, and one autocommit *admin* connection for the catalog, recovery
(``COMMIT PREPARED 'gid'`` from a connection that did not prepare) and ``in_doubt``. Each
connection is used by one thread at a time: the open part's by the writer (and ``abort`` of the
open part waits on the part's own lock), a prepared part's by whoever pops it to decide it, the
admin connection under its own lock.

Write path: every :meth:`PostgresSink.write` converts JSON values on the client (bad ones come
back as :class:`Rejected`) and sends the rows with binary ``COPY`` (text ``COPY`` when a column
has a type the server must parse, e.g. an enum) under one ``SAVEPOINT``:

* insert mode: ``COPY`` straight into the target;
* upsert mode: ``COPY`` into an UNLOGGED staging table, then ``INSERT .. SELECT .. ON CONFLICT
  (key) DO UPDATE`` and ``DELETE`` of the staged rows, all in the part's transaction. Records of
  one write are merged per key on the client first, later fields over earlier ones. A ``TEMP``
  table is not an option: PostgreSQL refuses to ``PREPARE`` a transaction that touched one;
  ``unnest(arrays)`` is legal but measured 2-3x slower.

Compiled fast path: with the optional ``twophase-native`` extension installed (``native/``, Rust),
an insert-mode sink whose mapped columns are top-level fields of types it models takes the
source values as JSON bytes (:meth:`PostgresSink.write_raw`) and has them turned straight into
one binary ``COPY`` stream, with no Python object per record. The extension takes a record only
when it is sure the Python converters would store the very same values; everything else (nulls,
missing fields, other spellings, anything that may be refused) comes back and takes the path
above, which keeps every rule and every rejection reason in one place. If the server refuses a
row of the compiled stream, the whole write is redone the careful way. ``compiled_copy: false``
turns it off.

Upserting at write time, not at prepare, means a part T+1 that writes a key the prepared part T
holds waits for T's decision (the row lock), so parts always apply in order; and it means every
refusal by the server surfaces in ``write``, where it can be returned as a rejection. When the
server refuses a row (any SQLSTATE class that is about one row: see ``_ROW_ERROR_CLASSES``), the
sink rolls back to the savepoint and bisects with nested savepoints until it has isolated them,
rejects them with the server's reason and writes the rest. Any other failure rolls the whole
write back, so a :class:`RetriableSinkError` from ``write`` leaves the part as it was and the call
can be repeated; its message names the record the server was at when it can be told (the COPY
line, or the one row left when isolating).
"""

from __future__ import annotations

import time
from typing import Literal

import orjson
import psycopg
from psycopg import sql

from twophase.participants.sdk import (
    AbortTransactionError,
    FatalSinkError,
    PartId,
    Positions,
    RetriableSinkError,
    UnknownPartError,
)
from twophase.participants.sinks.postgres._connections import _MAX_HELD_PREPARED
from twophase.participants.sinks.postgres._errors import _MAX_PREPARED_ZERO, _is_lost
from twophase.participants.sinks.postgres._evolve import _SchemaTargets
from twophase.participants.sinks.postgres.config import PostgresSinkConfig

__all__ = ["PostgresSink"]


def _positions_json(positions: Positions) -> str:
    by_topic: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in sorted(positions.items()):
        by_topic.setdefault(topic, {})[str(partition)] = offset
    return orjson.dumps(by_topic).decode()


class PostgresSink(_SchemaTargets):
    """Exactly-once delivery into one PostgreSQL table with real two-phase commit."""

    config_model = PostgresSinkConfig

    def prepare(self, part: PartId, positions: Positions) -> None:
        with self._lock:
            is_open = self._open is not None and self._open.part == part
        if not is_open and self.state(part) == "prepared":
            return  # a repeated prepare: the part is durable already (SDK: a no-op)
        op = self._open_part(part, "prepare")
        started = time.monotonic()
        with op.lock:
            if op.broken is not None or op.conn is None:
                raise AbortTransactionError(
                    f"part {part.token} cannot be prepared: {op.broken}", sink=self.name
                )
            conn = op.conn
            try:
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (pipeline, sink, txn, participant, positions, records,"
                        " rejected, target) VALUES (%s, %s, %s, %s, %s::jsonb, %s, %s, %s)"
                    ).format(self._marker),
                    (
                        part.pipeline,
                        self.name,
                        part.txn,
                        part.participant,
                        _positions_json(positions),
                        op.records,
                        op.rejected,
                        self.cfg.table,
                    ),
                )
                op.prepare_sent = True
                conn.tpc_prepare()
            except psycopg.NotSupportedError as exc:
                # psycopg's translation of "prepared transactions are disabled".
                self._fail(op, _MAX_PREPARED_ZERO, exc)
                raise FatalSinkError(_MAX_PREPARED_ZERO, sink=self.name) from exc
            except psycopg.errors.UniqueViolation as exc:
                self._fail(op, "its marker row already exists", exc)
                raise FatalSinkError(
                    f"part {part.token} was already committed to {self.cfg.table}; "
                    "a part id must never be reused",
                    sink=self.name,
                ) from exc
            except psycopg.Error as exc:
                # Whether PREPARE reached the server is unknown when the connection dropped:
                # abort() asks the store and rolls back a prepared gid if there is one.
                hint = f" ({exc.diag.message_hint})" if exc.diag.message_hint else ""
                raise self._fail(op, f"prepare failed: {str(exc).strip()}{hint}", exc) from exc
            op.conn = None  # from now on the connection belongs to the prepared part
            with self._lock:
                self._open = None
                self._prepared[part] = conn
                self._undecided.add(part)
                surplus = list(self._prepared)[:-_MAX_HELD_PREPARED]
                released = [self._prepared.pop(p) for p in surplus]
        for old in released:
            old.close()  # its prepared transaction stays; the admin connection decides it
        self.log.info(
            "postgres sink %s: part %s prepared: %d records, %d rejected, %.3fs",
            self.name,
            part.token,
            op.records,
            op.rejected,
            time.monotonic() - started,
        )

    def commit(self, part: PartId) -> None:
        self._require_ready()
        self._targets_decided(part, committed=True)
        with self._lock:
            conn = self._prepared.pop(part, None)
        if conn is not None:
            try:
                conn.tpc_commit()
            except psycopg.Error as exc:
                # Lost connection, or another process finished the gid first: ask the store.
                conn.close()
                self.log.info(
                    "postgres sink %s: part %s: commit on its own connection failed (%s); "
                    "checking the store",
                    self.name,
                    part.token,
                    str(exc).strip(),
                )
            else:
                self._checkin(conn)
                self.log.info("postgres sink %s: part %s committed", self.name, part.token)
                self._now_decided(part)
                return
        self._finish(part, "COMMIT")
        self._now_decided(part)

    def abort(self, part: PartId) -> None:
        self._require_ready()
        self._targets_decided(part, committed=False)  # before the rollback releases the table
        with self._lock:
            op = self._open if self._open is not None and self._open.part == part else None
        if op is not None:
            with op.lock:  # waits for a write/prepare in progress on another thread
                with self._lock:
                    if self._open is op:
                        self._open = None
                conn, op.conn = op.conn, None
                if conn is not None:
                    try:
                        conn.tpc_rollback()
                    except psycopg.Error:
                        conn.close()  # closing rolls back just the same
                    else:
                        self._checkin(conn)
            self.log.info("postgres sink %s: part %s aborted (was open)", self.name, part.token)
            if not op.prepare_sent:
                # Nothing of this attempt can be prepared. A gid of this name in the store is
                # another attempt's (this part id begun again after a rewind, or a dead
                # incarnation's late PREPARE): its transaction's decision settles it, never a
                # rollback by name from here (one landing late would end that attempt).
                self._now_decided(part)
                return
            # Fall through: a prepare that failed in flight may still have reached the server.
        with self._lock:
            prepared = self._prepared.pop(part, None)
        if prepared is not None:
            try:
                prepared.tpc_rollback()
            except psycopg.Error:
                prepared.close()
            else:
                self._checkin(prepared)
                self.log.info("postgres sink %s: part %s rolled back", self.name, part.token)
                self._now_decided(part)
                return
        self._finish(part, "ROLLBACK")
        self._now_decided(part)

    def _now_decided(self, part: PartId) -> None:
        with self._decided:
            self._undecided.discard(part)
            self._decided.notify_all()

    def _finish(self, part: PartId, action: Literal["COMMIT", "ROLLBACK"]) -> None:
        """Decide ``part`` by gid from the admin connection (recovery, other process, retry)."""
        gid = self.gid(part)
        with self._admin_conn() as conn:
            try:
                if action == "COMMIT":
                    conn.tpc_commit(gid)
                else:
                    conn.tpc_rollback(gid)
            except psycopg.errors.UndefinedObject:
                # Not prepared (any more): it is committed, or it never was / was rolled back.
                committed = self._has_marker(conn, part)
            except psycopg.errors.ObjectNotInPrerequisiteState as exc:
                # "prepared transaction with identifier ... is busy": another session is
                # finishing it right now. Ask again shortly.
                raise RetriableSinkError(
                    f"part {part.token}: {str(exc).strip()}", sink=self.name
                ) from exc
            except psycopg.Error as exc:
                if _is_lost(conn, exc):
                    raise
                raise FatalSinkError(
                    f"part {part.token}: {action} PREPARED failed: {str(exc).strip()}",
                    sink=self.name,
                ) from exc
            else:
                self.log.info(
                    "postgres sink %s: part %s %s by gid",
                    self.name,
                    part.token,
                    "committed" if action == "COMMIT" else "rolled back",
                )
                return
        if action == "COMMIT":
            if not committed:
                raise UnknownPartError(
                    f"commit of part {part.token}: neither prepared nor committed in "
                    f"{self.cfg.table} (gid {gid})",
                    sink=self.name,
                )
            self.log.info("postgres sink %s: part %s already committed", self.name, part.token)
        else:
            if committed:
                raise FatalSinkError(
                    f"abort of part {part.token}: it is already committed in {self.cfg.table}",
                    sink=self.name,
                )
            self.log.debug("postgres sink %s: part %s: nothing to abort", self.name, part.token)
