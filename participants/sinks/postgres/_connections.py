"""The PostgreSQL sink's connections and state: one connection for the open part, one per
prepared part awaiting its decision (up to :data:`_MAX_HELD_PREPARED`), a few idle ones, and
the autocommit admin connection (catalog, recovery, housekeeping) -- see :mod:`.sink`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psycopg
from psycopg import postgres, sql
from psycopg.abc import Buffer
from psycopg.adapt import Dumper
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import Format

from twophase.participants.sdk import (
    FatalSinkError,
    PartId,
    RetriableSinkError,
    Sink,
    SinkConfig,
    SinkContext,
    TargetTemplate,
)
from twophase.participants.sinks.postgres._errors import _CONNECT_FATAL_HINTS, Connection, _is_lost
from twophase.participants.sinks.postgres._rows import (
    _BatchConverter,
    _compile_plan,
    _Mapped,
    _PlanStep,
)
from twophase.participants.sinks.postgres.config import (
    _GID_MAX_BYTES,
    _GID_PREFIX,
    _TOKEN_MAX,
    SINK_NAME_MAX,
    PostgresSinkConfig,
)
from twophase.participants.sinks.postgres.types import Column

__all__ = [
    "_Connections",
    "_MAX_HELD_PREPARED",
    "_MAX_IDLE",
    "_OpenPart",
    "_qualified",
    "twophase_native",
]

try:
    import twophase_native
except ImportError:  # the optional compiled extension (native/): the Python path does it all
    twophase_native = None  # type: ignore[assignment]


#: Prepared parts whose connection we keep so the decision is one round trip on a warm
#: connection. Beyond this (a slow coordinator), the oldest connection is closed -- its prepared
#: transaction lives on in the server and is committed through the admin connection.
_MAX_HELD_PREPARED = 4


#: Idle connections kept for the next part; two cover the usual open + just-committed overlap.
_MAX_IDLE = 2


class RawArray(bytes):
    """A PostgreSQL array already in its binary wire format (``twophase_native.copy_columns``):
    sent as it is, its type told by the statement's cast (``%b::int8[]``)."""


class _RawArrayDumper(Dumper):
    format = Format.BINARY
    oid = 0  # unknown: the server types the parameter by its cast

    def dump(self, obj: Buffer) -> Buffer:
        return obj


@dataclass(frozen=True, slots=True)
class _EventStatements:
    """What ``_WritePath._apply_events`` runs for one table."""

    upsert: sql.Composed
    merge: sql.Composed
    delete: sql.Composed
    #: The ``MERGE`` that also deletes the keys whose last change is a delete: exact only for
    #: a write with no key deleted and then written again (that must stay a DELETE and an
    #: INSERT, as in two writes, for row triggers and ``ON DELETE`` actions).
    fold: sql.Composed
    #: The element types of the compiled rows' arrays: place, delete flag, every column.
    oids: list[int]
    #: The key's fields among those arrays, for ``twophase_native.event_columns`` to tell a
    #: key deleted and written again; None when a key column's equal values can differ in
    #: bytes (numeric, a nondeterministic collation): such writes never fold.
    keys: list[int] | None


def type_oid(name: str) -> int:
    """The oid of built-in type ``name`` (a ``pg_type.typname``)."""
    info = postgres.types.get(name)
    if info is None:
        raise ValueError(f"not a built-in type: {name}")
    return info.oid


@dataclass(slots=True)
class _OpenPart:
    part: PartId
    gid: str
    conn: Connection | None
    records: int = 0
    rejected: int = 0
    #: Set when the transaction is gone (connection lost, deadlock): only abort() helps now.
    broken: str | None = None
    #: Set once ``PREPARE TRANSACTION`` is on its way: from then on the server may hold the
    #: gid prepared (a prepare that failed in flight), so an abort must look for it by gid.
    #: Before that, the gid is not this part's to touch: the same part id is begun again
    #: after a rewind, and a rollback by name meant for this attempt could end a later one.
    prepare_sent: bool = False
    #: Held by write/prepare for their whole run, so abort() from another thread waits for them.
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Per target table (oid) the part holds ROW EXCLUSIVE on: whether a write of change
    #: events may delete inside its MERGE (``_WritePath._may_fold``).
    foldable: dict[int, bool] = field(default_factory=dict)


def _qualified(name: str) -> sql.Composable:
    return sql.Identifier(*name.split("."))


class _Connections(Sink):
    """Connections, and the state every layer of the sink shares."""

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
                # Which process a session is (pg_stat_activity), for operators; PostgreSQL
                # keeps its first 63 bytes.
                else {
                    "application_name": (
                        f"twophase/{context.pipeline}/{context.sink_name}/{context.participant}"
                    )
                }
            ),
        )
        self._target = _qualified(config.table)
        self._marker = _qualified(config.marker_table)
        self._lock = threading.Lock()  # guards the fields below
        self._open: _OpenPart | None = None
        self._prepared: dict[PartId, Connection] = {}
        #: Parts this instance prepared whose decision it has not applied yet (a delete waits
        #: for them: :meth:`_WritePath._await_decisions`), and the condition that says so.
        self._undecided: set[PartId] = set()
        self._decided = threading.Condition(self._lock)
        self._idle: list[Connection] = []
        self._admin_lock = threading.Lock()
        self._admin: Connection | None = None
        self._mapped: list[_Mapped] = []
        #: The key columns (``key``, else the table's primary key).
        self._key: list[str] = list(config.key)
        self._key_idx: list[int] = []
        #: The mask of the upsert key's columns (a delete's row).
        self._key_mask = 0
        #: The delete of a write's deleted keys (``_WritePath._delete_keys``).
        self._delete_sql: sql.Composed | None = None
        self._events_sql: _EventStatements | None = None
        self._events_encoder: twophase_native.CopyEncoder | None = None
        #: The compiled encoder of Avro values (insert mode, where the JSON one applies).
        self._avro_encoder: twophase_native.AvroCopyEncoder | None = None
        #: Schema ids the Avro encoder cannot read: their values take the Python path.
        self._avro_refused: set[int] = set()
        self._plan: list[_PlanStep] = []
        self._fast: _BatchConverter = _compile_plan([])
        self._binary_types: list[str] | None = None
        self._encoder: twophase_native.CopyEncoder | None = None  # when the fast path applies
        self._stage: sql.Composable | None = None
        self._stage_name: str | None = None
        self._statements: dict[int, tuple[sql.Composed, sql.Composed | None]] = {}
        #: The table's oid and every column of it (generated ones too), as loaded.
        self._table_oid = 0
        self._table_columns: dict[str, tuple[Column, bool]] = {}
        #: The table the fields above describe; with a ``table`` template, every table's
        #: fields by name (``_Target._use_table``).
        self._current = ""
        self._tables: dict[str, dict[str, object]] = {}
        #: With a ``table`` template: each record's table (per-topic names worked out once).
        self._template = (
            TargetTemplate(config.table, config.topic_replace) if config.templated else None
        )
        self._ready = False

    def _connect(self, *, autocommit: bool) -> Connection:
        try:
            conn = psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.OperationalError as exc:
            message = f"cannot connect to PostgreSQL: {str(exc).strip()}"
            if any(hint in message for hint in _CONNECT_FATAL_HINTS):
                raise FatalSinkError(message, sink=self.name) from exc
            raise RetriableSinkError(message, sink=self.name) from exc
        conn.adapters.register_dumper(RawArray, _RawArrayDumper)
        try:
            if self.cfg.statement_timeout_ms is not None:
                conn.execute(
                    "SELECT set_config('statement_timeout', %s, false)",
                    (f"{self.cfg.statement_timeout_ms}ms",),
                )
            # READ COMMITTED whatever the server's or the role's default, for the parts'
            # transactions and the admin connection's statements alike: at REPEATABLE READ or
            # SERIALIZABLE a part that began before the previous one committed could never
            # write a row that one wrote ("could not serialize access", every retry alike), and
            # the catalog would be read as of the part's first statement.
            conn.execute(
                "SELECT set_config('default_transaction_isolation', 'read committed', false),"
                " set_config('idle_in_transaction_session_timeout', '0', false)"
            )
            # No idle timeout of the server's or the role's ends these sessions either: an open
            # part's transaction idles between batches until the cycle's PREPARE (a sparse
            # stream, a long commit interval), a prepared part's connection until its decision,
            # the admin and spare connections until they are next needed. Ended, the open part
            # was aborted and re-read -- every part, where the timeout is shorter than the
            # cycle -- and a begin on a spare connection failed. A participant that ends ends
            # its sessions, and its open transaction with them.
            if conn.info.server_version >= 140000:  # idle_session_timeout is PostgreSQL 14's
                conn.execute("SELECT set_config('idle_session_timeout', '0', false)")
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

    @property
    def staging_table(self) -> str | None:
        """Upsert mode's UNLOGGED staging table (after setup), for operators; None in insert mode."""
        return self._stage_name

    def gid(self, part: PartId) -> str:
        """The prepared-transaction id of ``part`` in this sink."""
        return f"{self._gid_prefix}{part.token}"

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
