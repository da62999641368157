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

import contextlib
import hashlib
import itertools
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pydantic import Field, SecretStr, ValidationInfo, field_validator

from twophase.participants.sdk import (
    AbortTransactionError,
    CommittedInfo,
    FatalSinkError,
    PartId,
    Positions,
    RawBatch,
    Record,
    Rejected,
    RetriableSinkError,
    Sink,
    SinkConfig,
    SinkContext,
    SinkError,
    TopicPartition,
    UnknownPartError,
)
from twophase.participants.sinks.postgres.types import (
    BadValue,
    Column,
    Converter,
    binary_type,
    converter_for,
)

try:
    import twophase_native
except ImportError:  # the optional compiled extension (native/): the Python path does it all
    twophase_native = None  # type: ignore[assignment]

__all__ = ["PostgresSink", "PostgresSinkConfig"]

Connection = psycopg.Connection[tuple[Any, ...]]

#: PostgreSQL's GIDSIZE is 200 bytes including the terminating NUL.
_GID_MAX_BYTES = 199
_GID_PREFIX = "twophase"
#: Longest part token: two 64-character names, a 12-digit txn number and two "~".
_TOKEN_MAX = 64 + 1 + 12 + 1 + 64
#: So that "twophase:{sink}:{token}" always fits in _GID_MAX_BYTES (9 + 40 + 1 + 142 = 192).
SINK_NAME_MAX = 40
#: Prepared parts whose connection we keep so the decision is one round trip on a warm
#: connection. Beyond this (a slow coordinator), the oldest connection is closed -- its prepared
#: transaction lives on in the server and is committed through the admin connection.
_MAX_HELD_PREPARED = 4
#: Idle connections kept for the next part; two cover the usual open + just-committed overlap.
_MAX_IDLE = 2
#: Savepoints: one around each write() so that a failed write leaves the part as it was (the
#: runtime may retry it), and nested ones only while isolating rows the server refused. Kept
#: few on purpose: each one that writes is a subtransaction, and more than 64 of them in one
#: transaction slows every snapshot on the server until the part is decided.
_WRITE_SAVEPOINT = sql.Identifier("twophase_write")
_BATCH_SAVEPOINT = sql.Identifier("twophase_batch")
#: SQLSTATE classes that are about one row, isolated per row and rejected: 22 data exception,
#: 23 integrity violation, 21 cardinality (two rows of one upsert batch that PostgreSQL finds
#: equal and Python did not, e.g. citext keys), 54 program limit exceeded (an index row over the
#: btree limit: a 3,000-character key), 44 WITH CHECK OPTION, 27 triggered data change, and
#: what triggers and functions raise per row: P0 (PL/pgSQL RAISE, ASSERT), 2F (SQL routine),
#: 38/39 (external routines). Not here, as they are about the part or the server: 40
#: (serialization, deadlock: start over), 53 (resources: retried), 57/08 (operator, connection),
#: 28/42 (configuration), XX/58 (server internals).
_ROW_ERROR_CLASSES = ("21", "22", "23", "27", "2F", "38", "39", "44", "54", "P0")
#: Where a COPY failed: ``COPY <table>, line <n>[, column ...]`` in the error's context.
_COPY_LINE = re.compile(r"\bCOPY [^,]+, line (\d+)")
#: Transient conditions after which the part survives (we roll back to the savepoint): lock
#: timeout, statement timeout, out of resources. The runtime retries the same write.
_RETRIABLE_CODES = frozenset({"55P03", "57014"})
_RETRIABLE_CLASSES = ("53",)
#: Configuration/permission problems that no retry fixes.
_FATAL_CLASSES = ("28", "42")
#: libpq reports failed logins without a SQLSTATE; these say a retry cannot help.
_CONNECT_FATAL_HINTS = (
    "password authentication failed",
    "no pg_hba.conf entry",
    "does not exist",  # database or role
    "invalid connection option",
)
_MAX_PREPARED_ZERO = (
    "PostgreSQL max_prepared_transactions is 0; two-phase commit needs it > 0 "
    "(set it in postgresql.conf and restart)"
)

_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
#: Column types in create_table are spliced into DDL: allow type syntax, never a statement.
_SQL_TYPE_PATTERN = r'^[A-Za-z_][A-Za-z0-9_ ,()\[\]".]*$'


class PostgresSinkConfig(SinkConfig):
    """Configuration of a ``postgres`` sink (``sinks[]`` entry of a pipeline)."""

    type: Literal["postgres"]
    #: Part of every prepared transaction's gid, hence short and without ":".
    name: str = Field(min_length=1, max_length=SINK_NAME_MAX, pattern=_NAME_PATTERN)
    #: libpq connection string or URI. Prefer ``password`` (or PGPASSWORD / .pgpass) over a
    #: password inside the DSN; either way neither is ever logged.
    dsn: str = Field(min_length=1, repr=False)
    #: Password of the DSN's user, kept out of the DSN (``${ENV:...}``, ``${FILE:...}``).
    password: SecretStr | None = None
    #: Target table, optionally ``schema.table``. Names are exact (case-sensitive), not folded.
    table: str = Field(min_length=1)
    #: ``insert``: one row per record. ``upsert``: one row per ``key``, the latest record wins.
    mode: Literal["insert", "upsert"] = "insert"
    #: Upsert key: target columns with a unique index or primary key on exactly these columns.
    key: list[str] = Field(default_factory=list, validate_default=True)
    #: Target column -> JSON field (``a.b`` for nested). Default: every table column, fed from
    #: the same-named field. An absent field leaves the column to its DEFAULT on insert and
    #: untouched on update; an explicit JSON null stores NULL.
    columns: dict[str, str] | None = None
    #: Column -> SQL type: create the target table with these columns when it does not exist
    #: (with the upsert key as primary key). Without it the table must exist.
    create_table: dict[str, str] | None = None
    #: Table of per-part markers, optionally ``schema.table``; created when missing.
    marker_table: str = Field(default="twophase_parts", min_length=1)
    #: libpq's connect_timeout (whole seconds).
    connect_timeout_s: int = Field(default=10, ge=1, le=600)
    #: Session statement_timeout; None keeps the server's.
    statement_timeout_ms: int | None = Field(default=None, gt=0)
    #: Use the compiled JSON -> binary COPY encoder (``twophase-native``) when it is installed
    #: and the table allows it (insert mode, top-level fields, types it models). Same results
    #: either way; off only to compare or to rule it out.
    compiled_copy: bool = True

    @field_validator("dsn")
    @classmethod
    def _dsn_parses(cls, value: str) -> str:
        try:
            conninfo_to_dict(value)
        except psycopg.ProgrammingError:
            # Not echoing the value: it may hold a password.
            raise ValueError("not a valid libpq connection string or URI") from None
        return value

    @field_validator("table", "marker_table")
    @classmethod
    def _qualified_name(cls, value: str) -> str:
        parts = value.split(".")
        if len(parts) > 2 or not all(parts):
            raise ValueError(f"{value!r}: expected 'table' or 'schema.table'")
        return value

    @field_validator("key")
    @classmethod
    def _key_for_upsert(cls, value: list[str], info: ValidationInfo) -> list[str]:
        mode = info.data.get("mode")
        if mode == "upsert" and not value:
            raise ValueError("required (one or more target columns) when mode is 'upsert'")
        if mode == "insert" and value:
            raise ValueError("only used when mode is 'upsert'")
        if len(set(value)) != len(value):
            raise ValueError("names a column twice")
        return value

    @field_validator("columns")
    @classmethod
    def _columns_cover_key(
        cls, value: dict[str, str] | None, info: ValidationInfo
    ) -> dict[str, str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("must map at least one column (or be omitted)")
        missing = [k for k in info.data.get("key", []) if k not in value]
        if missing:
            raise ValueError(f"must map the upsert key column(s) {', '.join(missing)}")
        for column, path in value.items():
            if not path or any(not step for step in path.split(".")):
                raise ValueError(f"column {column!r}: {path!r} is not a field path")
        return value

    @field_validator("create_table")
    @classmethod
    def _create_table_types(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("must declare at least one column")
        for column, sql_type in value.items():
            if not re.match(_SQL_TYPE_PATTERN, sql_type):
                raise ValueError(f"column {column!r}: {sql_type!r} is not a column type")
        return value


# -- internals ------------------------------------------------------------------------------


class _Absent:
    """Marks a field missing from the record (as opposed to an explicit JSON null)."""


_ABSENT = _Absent()


def _nested_getter(path: str) -> Callable[[dict[str, Any]], Any] | None:
    """Reads ``path`` ("a.b.c") from a record value; _ABSENT when any step is missing."""
    if "." not in path:
        return None
    steps = path.split(".")

    def get_nested(value: dict[str, Any]) -> Any:
        current: Any = value
        for step in steps:
            if not isinstance(current, dict) or step not in current:
                return _ABSENT
            current = current[step]
        return current

    return get_nested


@dataclass(frozen=True, slots=True)
class _Mapped:
    """One target column fed from one JSON field."""

    column: Column
    field: str
    #: None: ``field`` is a top-level key (the fast path); else reads a dotted path.
    get: Callable[[dict[str, Any]], Any] | None
    convert: Converter
    is_key: bool


#: Per column: field, getter (None = top level), converter, reason when absent (None = allowed),
#: reason when null (None = allowed).
_PlanStep = tuple[str, Callable[[dict[str, Any]], Any] | None, Converter, str | None, str | None]


class _Irregular(Exception):
    """A field is null or missing: the record takes the careful path, which knows the rule."""


#: (records, the careful one-record path) -> a row or a rejection per record, in order.
_BatchConverter = Callable[
    [Sequence[Record], Callable[[Record], "_Row | Rejected"]], "list[_Row | Rejected]"
]


def _compile_plan(plan: list[_PlanStep]) -> _BatchConverter:
    """The conversion loop for one table, as straight-line Python: per column one lookup, two
    identity checks and the converter -- no per-column loop, tuple unpacking or mask updates.
    A record with a null or missing field, or a value its converter refuses, goes to ``slow``
    (the generic path), so every rule and every rejection reason stays in one place."""
    n = len(plan)
    lines = [
        "def convert_batch(records, slow):",
        "    out = []",
        "    append = out.append",
        "    for record in records:",
        "        value = record.value",
        "        try:",
    ]
    env: dict[str, Any] = {
        "_Row": _Row,
        "ABSENT": _ABSENT,
        "Irregular": _Irregular,
        "BadValue": BadValue,
    }
    for i, (field_name, get, convert, _absent, _null) in enumerate(plan):
        env[f"c{i}"] = convert
        if get is None:
            lines.append(f"            r{i} = value.get({field_name!r}, ABSENT)")
        else:
            env[f"g{i}"] = get
            lines.append(f"            r{i} = g{i}(value)")
        lines.append(f"            if r{i} is None or r{i} is ABSENT: raise Irregular")
    values = ", ".join(f"c{i}(r{i})" for i in range(n))
    lines += [
        f"            append(_Row({(1 << n) - 1}, [{values}], [record]))",
        "        except (Irregular, BadValue, AttributeError):",
        "            append(slow(record))",
        "    return out",
    ]
    exec(compile("\n".join(lines), "<postgres sink conversion>", "exec"), env)
    fn: _BatchConverter = env["convert_batch"]
    return fn


@dataclass(slots=True)
class _Row:
    """A converted row: ``values`` spans every mapped column; ``mask`` bit i = column i present.

    In upsert mode one row may merge several records with the same key (later fields overlay
    earlier ones, as running them one after the other would); ``history`` then keeps each
    record's own row so a server-side refusal can be pinned on the right record.
    """

    mask: int
    values: list[Any]
    records: list[Record]
    history: list[_Row] | None = None


class _CompiledRefused(Exception):
    """The server refused a row of a write that had a compiled COPY stream (in the stream or
    not: the stream cannot be split to find out); the write is back at its savepoint."""


class _RowError(Exception):
    """The server refused the batch for its data (SQLSTATE 22/23/P0001)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class _OpenPart:
    part: PartId
    gid: str
    conn: Connection | None
    records: int = 0
    rejected: int = 0
    #: Set when the transaction is gone (connection lost, deadlock): only abort() helps now.
    broken: str | None = None
    #: Held by write/prepare for their whole run, so abort() from another thread waits for them.
    lock: threading.Lock = field(default_factory=threading.Lock)


def _sqlstate(exc: BaseException) -> str:
    return getattr(exc, "sqlstate", None) or ""


def _is_row_error(exc: psycopg.Error) -> bool:
    state = _sqlstate(exc)
    return state[:2] in _ROW_ERROR_CLASSES


#: What a failed COPY/merge can raise: the server's errors, and psycopg's when it cannot encode
#: a value (a converter bug or a type we pass through) -- the latter is that row's fault.
_ENCODE_ERRORS = (psycopg.Error, ValueError, TypeError, OverflowError, struct.error)


def _is_row_refusal(conn: Connection, exc: BaseException) -> bool:
    """True when ``exc`` is about the rows' data and the connection is fine."""
    if conn.closed or conn.broken:
        return False
    if isinstance(exc, psycopg.Error):
        return not _is_lost(conn, exc) and _is_row_error(exc)
    return True


def _is_lost(conn: Connection | None, exc: BaseException) -> bool:
    """True when the connection cannot be used any more (network, server shutdown, ...)."""
    if conn is not None and (conn.closed or conn.broken):
        return True
    state = _sqlstate(exc)
    return state.startswith("08") or state in ("57P01", "57P02", "57P03")


#: Attribute set on a server error: the record (``topic[partition]@offset``) it was raised at.
_MET_RECORD = "twophase_record"


def _copy_line(exc: BaseException) -> int | None:
    """The 1-based COPY line a server error names in its context, if any."""
    diag = getattr(exc, "diag", None)
    found = _COPY_LINE.search(getattr(diag, "context", None) or "") if diag else None
    return int(found.group(1)) if found else None


def _mark(exc: BaseException, record: Record) -> None:
    """Tell ``exc`` the record it met, unless it knows one already."""
    if getattr(exc, _MET_RECORD, None):
        return
    # An exception type without a __dict__: the message just names no record.
    with contextlib.suppress(AttributeError):
        setattr(exc, _MET_RECORD, f"{record.topic}[{record.partition}]@{record.offset}")


def _note_record(exc: BaseException, rows: Sequence[_Row]) -> None:
    """Tell ``exc`` which of ``rows`` it met: the COPY line its context names, or the only
    row; nothing when it cannot be told."""
    line = _copy_line(exc) or (1 if len(rows) == 1 else None)
    if line is not None and 0 < line <= len(rows) and rows[line - 1].records:
        _mark(exc, rows[line - 1].records[-1])


def _server_reason(exc: psycopg.Error) -> str:
    diag = exc.diag
    message = diag.message_primary or str(exc).strip().splitlines()[0]
    where = []
    if diag.column_name:
        where.append(f"column {diag.column_name}")
    if diag.constraint_name:
        where.append(f"constraint {diag.constraint_name}")
    suffix = f" ({', '.join(where)})" if where else ""
    return f"PostgreSQL refused the row: {message}{suffix} [SQLSTATE {_sqlstate(exc)}]"


def _qualified(name: str) -> sql.Composable:
    return sql.Identifier(*name.split("."))


def _positions_json(positions: Positions) -> str:
    by_topic: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in sorted(positions.items()):
        by_topic.setdefault(topic, {})[str(partition)] = offset
    return orjson.dumps(by_topic).decode()


class PostgresSink(Sink):
    """Exactly-once delivery into one PostgreSQL table with real two-phase commit."""

    config_model = PostgresSinkConfig

    def __init__(self, config: SinkConfig, context: SinkContext) -> None:
        super().__init__(config, context)
        if not isinstance(config, PostgresSinkConfig):
            raise FatalSinkError(
                f"expected a PostgresSinkConfig, got {type(config).__name__}",
                sink=context.sink_name,
            )
        self.cfg: PostgresSinkConfig = config
        prefix = f"{_GID_PREFIX}:{context.sink_name}:"
        if ":" in context.sink_name or len(prefix.encode()) + _TOKEN_MAX > _GID_MAX_BYTES:
            raise FatalSinkError(
                f"sink name {context.sink_name!r} must be at most {SINK_NAME_MAX} characters "
                "without ':' so prepared transaction ids fit PostgreSQL's 200-byte limit",
                sink=context.sink_name,
            )
        self._gid_prefix = prefix
        self._conninfo = make_conninfo(
            config.dsn,
            connect_timeout=str(config.connect_timeout_s),
            **({"password": config.password.get_secret_value()} if config.password else {}),
            **(
                {}
                if "application_name" in conninfo_to_dict(config.dsn)
                else {"application_name": f"twophase/{context.pipeline}/{context.sink_name}"}
            ),
        )
        self._target = _qualified(config.table)
        self._marker = _qualified(config.marker_table)
        self._lock = threading.Lock()  # guards the fields below
        self._open: _OpenPart | None = None
        self._prepared: dict[PartId, Connection] = {}
        self._idle: list[Connection] = []
        self._admin_lock = threading.Lock()
        self._admin: Connection | None = None
        self._mapped: list[_Mapped] = []
        self._key_idx: list[int] = []
        self._plan: list[_PlanStep] = []
        self._fast: _BatchConverter = _compile_plan([])
        self._binary_types: list[str] | None = None
        self._encoder: twophase_native.CopyEncoder | None = None  # when the fast path applies
        self._stage: sql.Composable | None = None
        self._stage_name: str | None = None
        self._statements: dict[int, tuple[sql.Composed, sql.Composed | None]] = {}
        self._ready = False

    # -- connections -----------------------------------------------------------------------

    def _connect(self, *, autocommit: bool) -> Connection:
        try:
            conn = psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.OperationalError as exc:
            message = f"cannot connect to PostgreSQL: {str(exc).strip()}"
            if any(hint in message for hint in _CONNECT_FATAL_HINTS):
                raise FatalSinkError(message, sink=self.name) from exc
            raise RetriableSinkError(message, sink=self.name) from exc
        try:
            if self.cfg.statement_timeout_ms is not None:
                conn.execute(
                    "SELECT set_config('statement_timeout', %s, false)",
                    (f"{self.cfg.statement_timeout_ms}ms",),
                )
            conn.autocommit = autocommit
        except psycopg.Error as exc:
            conn.close()
            raise RetriableSinkError(
                f"cannot configure a PostgreSQL session: {exc}", sink=self.name
            ) from exc
        return conn

    @contextmanager
    def _admin_conn(self) -> Iterator[Connection]:
        """The autocommit admin connection, (re)connected as needed, for one thread at a time."""
        with self._admin_lock:
            if self._admin is None or self._admin.closed or self._admin.broken:
                if self._admin is not None:
                    self._admin.close()
                self._admin = self._connect(autocommit=True)
            try:
                yield self._admin
            except psycopg.Error as exc:
                if _is_lost(self._admin, exc):
                    self._admin.close()
                    raise RetriableSinkError(
                        f"lost the PostgreSQL connection: {str(exc).strip()}", sink=self.name
                    ) from exc
                raise

    def _checkout(self) -> Connection:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not (conn.closed or conn.broken):
                    return conn
        return self._connect(autocommit=False)

    def _checkin(self, conn: Connection) -> None:
        if (
            conn.closed
            or conn.broken
            or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
        ):
            conn.close()
            return
        with self._lock:
            if len(self._idle) < _MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    # -- set-up ----------------------------------------------------------------------------

    @property
    def staging_table(self) -> str | None:
        """Upsert mode's UNLOGGED staging table (after setup), for operators; None in insert mode."""
        return self._stage_name

    def gid(self, part: PartId) -> str:
        """The prepared-transaction id of ``part`` in this sink."""
        return f"{self._gid_prefix}{part.token}"

    def setup(self) -> None:
        with self._admin_conn() as conn:
            try:
                self._check_server(conn)
                self._ensure_marker_table(conn)
                self._load_target(conn)
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
            ", ".join(m.column.name for m in self._mapped),
            ", compiled COPY encoder" if self._encoder is not None else "",
        )

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
        with suppress(psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
            conn.execute(ddl)
        # Fails with the missing column's name when an older/foreign table has another shape.
        conn.execute(
            sql.SQL(
                "SELECT pipeline, sink, txn, participant, positions, records, rejected, target"
                " FROM {} LIMIT 0"
            ).format(self._marker)
        )

    def _regclass(self, conn: Connection) -> int | None:
        row = conn.execute(
            "SELECT to_regclass(%s)::oid", (self._target.as_string(conn),)
        ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def _load_target(self, conn: Connection) -> None:
        cfg = self.cfg
        oid = self._regclass(conn)
        if oid is None and cfg.create_table is not None:
            self._create_target(conn)
            oid = self._regclass(conn)
        if oid is None:
            raise FatalSinkError(
                f"target table {cfg.table} does not exist (create it, or set create_table)",
                sink=self.name,
            )
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
                             AND a.atttypmod > 4 THEN a.atttypmod - 4 END
              FROM pg_attribute a
              JOIN pg_type t ON t.oid = a.atttypid
              LEFT JOIN pg_type bt ON t.typtype = 'd' AND bt.oid = t.typbasetype
             WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
             ORDER BY a.attnum
            """,
            (oid,),
        ).fetchall()
        table_columns: dict[str, tuple[Column, bool]] = {}
        for name, base, special, sql_type, not_null, has_default, generated, max_len in rows:
            column = Column(
                name=name,
                base_type=special or base,
                sql_type=sql_type,
                not_null=bool(not_null),
                has_default=bool(has_default),
                max_length=max_len,
            )
            table_columns[name] = (column, bool(generated))
        wanted = (
            cfg.columns
            if cfg.columns is not None
            else {name: name for name, (_, generated) in table_columns.items() if not generated}
        )
        mapped: list[_Mapped] = []
        for column_name, path in wanted.items():
            if column_name not in table_columns:
                raise FatalSinkError(
                    f"columns: table {cfg.table} has no column {column_name!r}", sink=self.name
                )
            column, generated = table_columns[column_name]
            if generated:
                raise FatalSinkError(
                    f"columns: {cfg.table}.{column_name} is a generated column", sink=self.name
                )
            mapped.append(
                _Mapped(
                    column=column,
                    field=path,
                    # The default mapping reads the column's own name, dots and all.
                    get=_nested_getter(path) if cfg.columns is not None else None,
                    convert=converter_for(column),
                    is_key=column_name in cfg.key,
                )
            )
        for key in cfg.key:
            if key not in table_columns:
                raise FatalSinkError(
                    f"key: table {cfg.table} has no column {key!r}", sink=self.name
                )
        if cfg.mode == "upsert":
            self._check_unique_key(conn, oid)
        self._mapped = mapped
        self._key_idx = [i for i, m in enumerate(mapped) if m.is_key]
        self._plan = [self._plan_step(m) for m in mapped]
        self._fast = _compile_plan(self._plan)
        binary = [binary_type(m.column.base_type) for m in mapped]
        # Binary COPY is ~40% faster to produce and parse, but only for types we convert
        # ourselves; one column the server must parse from text (enum, array, ...) makes it text.
        self._binary_types = None if None in binary else [b for b in binary if b is not None]
        self._encoder = self._compiled_encoder(conn, mapped)
        self._stage = self._ensure_stage(conn, mapped) if cfg.mode == "upsert" else None
        self._stage_name = None if self._stage is None else self._stage.as_string(conn)
        self._statements.clear()

    def _compiled_encoder(
        self, conn: Connection, mapped: list[_Mapped]
    ) -> twophase_native.CopyEncoder | None:
        """The compiled encoder for this table, or None (and why, at DEBUG) when it does not
        apply: every record then takes the Python path."""
        cfg = self.cfg
        why = ""
        if not cfg.compiled_copy:
            why = "compiled_copy is off"
        elif twophase_native is None:
            why = "twophase-native is not installed"
        elif cfg.mode != "insert":
            why = "upsert mode merges rows per key in Python"
        elif any(m.get is not None for m in mapped):
            why = "nested field paths"
        elif self._binary_types is None:
            why = "a column the server parses from text"
        elif conn.info.encoding != "utf-8":
            why = f"client encoding {conn.info.encoding}"
        else:
            try:
                return twophase_native.CopyEncoder(
                    [(m.field, m.column.base_type, m.column.max_length) for m in mapped]
                )
            except ValueError as exc:  # a type it does not model
                why = str(exc)
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

    def _ensure_stage(self, conn: Connection, mapped: list[_Mapped]) -> sql.Composable:
        """The UNLOGGED staging table of upsert mode (a TEMP table would forbid PREPARE).

        Named after the target and the mapped columns' types, so a changed target gets a new
        one instead of DDL on a table that prepared transactions may hold locks on.
        """
        signature = "|".join(
            [self.cfg.table, *(f"{m.column.name}:{m.column.sql_type}" for m in mapped)]
        )
        name = f"twophase_stage_{hashlib.sha1(signature.encode()).hexdigest()[:16]}"
        schema = self.cfg.marker_table.split(".")[0] if "." in self.cfg.marker_table else None
        stage = sql.Identifier(schema, name) if schema else sql.Identifier(name)
        columns = sql.SQL(", ").join(sql.Identifier(m.column.name) for m in mapped)
        # CREATE TABLE AS copies names and types, no constraints: NOT NULL and CHECK are
        # checked when the rows reach the target.
        with suppress(psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
            conn.execute(
                sql.SQL(
                    "CREATE UNLOGGED TABLE IF NOT EXISTS {} AS SELECT {} FROM {} WITH NO DATA"
                ).format(stage, columns, self._target)
            )
            conn.execute(
                sql.SQL("COMMENT ON TABLE {} IS {}").format(
                    stage,
                    sql.Literal(
                        f"twophase upsert staging for {self.cfg.table}; "
                        "empty outside the transactions that use it"
                    ),
                )
            )
        return stage

    def _create_target(self, conn: Connection) -> None:
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
        # UniqueViolation: created concurrently by another participant.
        with suppress(psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
            conn.execute(
                sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                    self._target, sql.SQL(", ").join(items)
                )
            )
        self.log.info("postgres sink %s: created table %s", self.name, self.cfg.table)

    def _check_unique_key(self, conn: Connection, oid: int) -> None:
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
        if sorted(self.cfg.key) not in [sorted(r[0]) for r in rows]:
            raise FatalSinkError(
                f"key: upsert needs a primary key or unique index on exactly "
                f"({', '.join(self.cfg.key)}) of table {self.cfg.table}",
                sink=self.name,
            )

    # -- state of a part in the store --------------------------------------------------------

    def state(self, part: PartId) -> Literal["prepared", "committed", "unknown"]:
        """What the store says about ``part``: prepared, committed, or unknown (never/aborted)."""
        with self._admin_conn() as conn:
            return self._state(conn, part)

    def _state(self, conn: Connection, part: PartId) -> Literal["prepared", "committed", "unknown"]:
        # Prepared first, marker second: COMMIT PREPARED makes the commit visible before it
        # removes the gid, so a part cannot slip between the two checks.
        row = conn.execute(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid = %s AND database = current_database()",
            (self.gid(part),),
        ).fetchone()
        if row is not None and row[0]:
            return "prepared"
        return "committed" if self._has_marker(conn, part) else "unknown"

    def _has_marker(self, conn: Connection, part: PartId) -> bool:
        row = conn.execute(
            sql.SQL(
                "SELECT count(*) FROM {} WHERE pipeline = %s AND sink = %s AND txn = %s"
                " AND participant = %s"
            ).format(self._marker),
            (part.pipeline, self.name, part.txn, part.participant),
        ).fetchone()
        return row is not None and bool(row[0])

    # -- the open part ---------------------------------------------------------------------

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
        return self._encoder is not None

    def check(self, records: Sequence[Record]) -> Sequence[Rejected]:
        """What the client-side conversion of :meth:`write` refuses (the same code); what the
        server refuses (constraints, ``numeric(p, s)`` overflow) shows only in ``write``."""
        self._require_ready()
        convert = self._convert_one
        return [row for r in records if (row := convert(r)).__class__ is Rejected]

    def write(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected]:
        return self._write(part, lambda: (b"", 0, records), lambda: records)

    def write_raw(self, part: PartId, batch: RawBatch) -> Sequence[Rejected]:
        encoder = self._encoder
        if encoder is None:
            return super().write_raw(part, batch)

        left_out: list[int] = []

        def encode() -> tuple[bytes, int, Sequence[Record]]:
            # The values the encoder was unsure of, decoded (None: not JSON, the runtime's).
            payload, unsure = encoder.encode(batch.values)
            left_out[:] = unsure
            rest = [r for i in unsure if (r := batch.record(i)) is not None]
            return payload, len(batch) - len(unsure), rest

        def at(line: int) -> Record | None:
            """The record on 1-based ``line`` of the compiled stream (worked out only when an
            error names a line: the stream holds the values the encoder was sure of)."""
            skip = set(left_out)
            compiled = (i for i in range(len(batch)) if i not in skip)
            index = next(itertools.islice(compiled, line - 1, None), None) if line > 0 else None
            return batch.record(index) if index is not None else None

        return self._write(part, encode, batch.records, at)

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
        if rejected:
            self.log.info(
                "postgres sink %s: part %s rejected %d of %d records (first: %s)",
                self.name,
                part.token,
                len(rejected),
                n,
                rejected[0].reason,
            )
        return rejected

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

    # -- conversion ------------------------------------------------------------------------

    def _convert(self, records: Sequence[Record], rejected: list[Rejected]) -> list[_Row]:
        """Client-side conversion: the hot loop of the sink. Records with every mapped field
        present, non-null and convertible go through the loop compiled for this table's plan
        (:func:`_compile_plan`); the rest, through :meth:`_convert_one`, which gives the reason."""
        upsert = self.cfg.mode == "upsert"
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

    def _convert_one(self, record: Record) -> _Row | Rejected:
        """One record, column by column: the row, or why the record cannot be stored."""
        value = record.value
        if not isinstance(value, dict):
            return Rejected(record, "the record value is not a JSON object")
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
        except BadValue as exc:
            column = self._mapped[len(values)]  # the column being converted
            return Rejected(
                record,
                f"column {column.column.name!r} ({column.column.sql_type}) "
                f"from field {column.field!r}: {exc}",
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
        """Merge ``later`` into ``earlier`` (same key) as applying both in order would."""
        if earlier.history is None:
            earlier.history = [_Row(earlier.mask, list(earlier.values), list(earlier.records))]
        earlier.history.append(later)
        if later.mask == earlier.mask:
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

    @staticmethod
    def _groups(rows: list[_Row]) -> list[tuple[int, list[_Row]]]:
        groups: dict[int, list[_Row]] = {}
        for row in rows:
            groups.setdefault(row.mask, []).append(row)
        return list(groups.items())

    # -- sending ---------------------------------------------------------------------------

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
            updates = [c for c in columns if c.name not in self.cfg.key]
            action = (
                sql.SQL("DO UPDATE SET {}").format(
                    sql.SQL(", ").join(
                        sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c.name))
                        for c in updates
                    )
                )
                if updates
                else sql.SQL("DO NOTHING")
            )
            merge = sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} ON CONFLICT ({}) {}").format(
                self._target,
                names,
                names,
                self._stage,
                sql.SQL(", ").join(map(sql.Identifier, self.cfg.key)),
                action,
            )
        self._statements[mask] = (copy, merge)
        return copy, merge

    # -- prepare / commit / abort -------------------------------------------------------------

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
                return
        self._finish(part, "COMMIT")

    def abort(self, part: PartId) -> None:
        self._require_ready()
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
                return
        self._finish(part, "ROLLBACK")

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

    def in_doubt(self) -> list[PartId]:
        self._require_ready()
        prefix = f"{self._gid_prefix}{self.context.pipeline}~"
        with self._admin_conn() as conn:
            rows = conn.execute(
                "SELECT gid FROM pg_prepared_xacts"
                " WHERE database = current_database() AND starts_with(gid, %s) ORDER BY gid",
                (prefix,),
            ).fetchall()
        parts: list[PartId] = []
        for (gid,) in rows:
            try:
                part = PartId.parse(gid[len(self._gid_prefix) :])
            except ValueError:
                self.log.warning("postgres sink %s: ignoring prepared gid %r", self.name, gid)
                continue
            if self.owns(part):
                parts.append(part)
        return sorted(parts)

    # -- housekeeping ------------------------------------------------------------------------

    def committed_positions(self) -> dict[TopicPartition, int]:
        """Next offset per source partition: the highest stored with a committed part of this
        pipeline and sink.

        Read from the marker rows, which become visible with ``COMMIT PREPARED`` (prepared,
        aborted and other pipelines' or sinks' parts never count), as a ``max`` per partition, so
        decisions applied out of order never move a position back. One query over this pipeline's
        markers (the primary key's prefix), whose number :meth:`forget` keeps bounded.
        """
        self._require_ready()
        with self._admin_conn() as conn:
            try:
                with self._no_jit(conn):
                    rows = conn.execute(
                        sql.SQL(
                            "SELECT t.key, p.key::int, max(p.value::bigint)"
                            "  FROM {} m, jsonb_each(m.positions) t, jsonb_each_text(t.value) p"
                            " WHERE m.pipeline = %s AND m.sink = %s"
                            " GROUP BY t.key, p.key"
                        ).format(self._marker),
                        (self.context.pipeline, self.name),
                    ).fetchall()
            except psycopg.Error as exc:
                if _is_lost(conn, exc):
                    raise  # the admin connection's handler makes it retriable
                raise self._housekeeping_error("committed_positions", exc) from exc
        return {(str(topic), int(partition)): int(offset) for topic, partition, offset in rows}

    def last_committed(self) -> CommittedInfo | None:
        """The visible marker row of this pipeline and sink with the highest txn (of its parts,
        the one committed last when the server tells, else the highest participant name).

        ``committed_at`` is the commit timestamp of the row's transaction -- the ``COMMIT
        PREPARED`` -- which the server keeps only with ``track_commit_timestamp = on`` (off by
        default; it costs a few bytes per transaction); otherwise it is None. The row's
        ``prepared_at`` is not offered in its place: a part can wait long for its decision.
        Two index lookups on the primary key's prefix.
        """
        self._require_ready()
        with self._admin_conn() as conn:
            try:
                setting = conn.execute("SELECT current_setting('track_commit_timestamp')")
                row = setting.fetchone()
                tracked = row is not None and row[0] == "on"
                when = sql.SQL(
                    "pg_xact_commit_timestamp(m.xmin)" if tracked else "NULL::timestamptz"
                )
                row = conn.execute(
                    sql.SQL(
                        "SELECT m.txn, m.participant, {when} AS at FROM {marker} m"
                        " WHERE m.pipeline = %(pipeline)s AND m.sink = %(sink)s AND m.txn = ("
                        "   SELECT max(txn) FROM {marker}"
                        "    WHERE pipeline = %(pipeline)s AND sink = %(sink)s)"
                        " ORDER BY at DESC NULLS LAST, m.participant DESC LIMIT 1"
                    ).format(when=when, marker=self._marker),
                    {"pipeline": self.context.pipeline, "sink": self.name},
                ).fetchone()
            except psycopg.Error as exc:
                if _is_lost(conn, exc):
                    raise  # the admin connection's handler makes it retriable
                raise self._housekeeping_error("last_committed", exc) from exc
        if row is None:
            return None
        txn, participant, committed_at = row
        return CommittedInfo(PartId(self.context.pipeline, int(txn), participant), committed_at)

    def forget(self, before_txn: int) -> int:
        """Delete the marker rows of this pipeline and sink with ``txn < before_txn``; returns
        how many went.

        Only committed parts have a visible marker (a prepared part's row is invisible until
        ``COMMIT PREPARED``, an aborted part's was rolled back with it), so prepared parts and the
        data are never touched. What :meth:`committed_positions` needs is kept: per source
        partition, the marker holding its highest offset (ties: the newest part), whatever its
        txn; and so is what :meth:`last_committed` needs: the markers of the highest txn.
        Concurrent calls are safe: a marker is deleted only by a statement whose snapshot
        sees a better one for each of its partitions and a higher txn, so the best one of each
        partition and the newest stay.

        After this, the store no longer knows a forgotten part: ``commit`` of it raises
        :class:`UnknownPartError`, ``abort`` of it is a no-op, and ``begin`` of its id is
        accepted. Callers pass a ``before_txn`` whose decisions nobody repeats any more (the
        decision log is past it), which is what the SDK asks of them.
        """
        self._require_ready()
        with self._admin_conn() as conn:
            try:
                with self._no_jit(conn):
                    cur = conn.execute(
                        sql.SQL(
                            # MATERIALIZED (PostgreSQL 12+): the few keepers are computed
                            # once; inlined, the anti join re-walks the sorted positions of
                            # every marker for each marker (quadratic: 15 s for 5000).
                            """WITH best AS MATERIALIZED (
                                SELECT DISTINCT ON (t.key, p.key) m.txn, m.participant
                                  FROM {marker} m, jsonb_each(m.positions) t,
                                       jsonb_each_text(t.value) p
                                 WHERE m.pipeline = %(pipeline)s AND m.sink = %(sink)s
                                 ORDER BY t.key, p.key, p.value::bigint DESC, m.txn DESC,
                                          m.participant DESC
                            )
                            DELETE FROM {marker} m
                             WHERE m.pipeline = %(pipeline)s AND m.sink = %(sink)s
                               AND m.txn < %(before)s
                               AND m.txn < (
                                   SELECT max(n.txn) FROM {marker} n
                                    WHERE n.pipeline = %(pipeline)s AND n.sink = %(sink)s)
                               AND NOT EXISTS (
                                   SELECT 1 FROM best b
                                    WHERE b.txn = m.txn AND b.participant = m.participant)"""
                        ).format(marker=self._marker),
                        {
                            "pipeline": self.context.pipeline,
                            "sink": self.name,
                            "before": before_txn,
                        },
                    )
            except psycopg.Error as exc:
                if _is_lost(conn, exc):
                    raise  # the admin connection's handler makes it retriable
                raise self._housekeeping_error("forget", exc) from exc
            deleted = max(cur.rowcount, 0)
        if deleted:
            self.log.info(
                "postgres sink %s: forgot %d markers of parts before txn %d",
                self.name,
                deleted,
                before_txn,
            )
        return deleted

    @staticmethod
    @contextmanager
    def _no_jit(conn: Connection) -> Iterator[None]:
        """One transaction with JIT off: ``jsonb_each`` is estimated at 100 rows per call, so a
        few thousand markers make the planner JIT-compile the statement, which costs ~250 ms for
        a query that runs in a few milliseconds (measured on PostgreSQL 15)."""
        with conn.transaction():
            conn.execute("SET LOCAL jit = off")
            yield

    def _housekeeping_error(self, action: str, exc: psycopg.Error) -> SinkError:
        """Permissions and missing objects are fatal; anything else is retried later."""
        message = f"{action} on {self.cfg.marker_table} failed: {str(exc).strip()}"
        if _sqlstate(exc)[:2] in _FATAL_CLASSES:
            return FatalSinkError(message, sink=self.name)
        return RetriableSinkError(message, sink=self.name)

    def close(self) -> None:
        with self._lock:
            conns = [c for c in self._prepared.values()] + self._idle
            if self._open is not None and self._open.conn is not None:
                conns.append(self._open.conn)
                self._open.conn = None
                self._open.broken = "the sink was closed"
            self._prepared.clear()
            self._idle = []
        with self._admin_lock:
            if self._admin is not None:
                conns.append(self._admin)
                self._admin = None
        for conn in conns:
            conn.close()  # prepared transactions stay prepared in the server

    def _require_ready(self) -> None:
        if not self._ready:
            raise FatalSinkError("setup() has not run", sink=self.name)
