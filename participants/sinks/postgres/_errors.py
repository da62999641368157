"""How the PostgreSQL sink reads the server's errors: which SQLSTATEs are one row's fault (isolated
and rejected), which are transient (retried), which are configuration (fatal), when the
connection is lost, and which record a server error met."""

from __future__ import annotations

import contextlib
import re
import struct
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from twophase.participants.sdk import Record

if TYPE_CHECKING:
    from twophase.participants.sinks.postgres._rows import _Row

__all__ = [
    "_savepoint",
    "_CREATED_CONCURRENTLY",
    "Connection",
    "_CONNECT_FATAL_HINTS",
    "_COPY_LINE",
    "_CompiledRefused",
    "_ENCODE_ERRORS",
    "_FATAL_CLASSES",
    "_MAX_PREPARED_ZERO",
    "_MET_RECORD",
    "_RETRIABLE_CLASSES",
    "_RETRIABLE_CODES",
    "_ROW_ERROR_CLASSES",
    "_RowError",
    "_copy_line",
    "_is_lost",
    "_is_row_error",
    "_is_row_refusal",
    "_mark",
    "_note_record",
    "_server_reason",
    "_sqlstate",
]

#: A psycopg connection as the sink uses it (rows as tuples).
Connection = psycopg.Connection[tuple[Any, ...]]

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


#: What a CREATE ... IF NOT EXISTS raises when another participant creates the same table at
#: the same moment (IF NOT EXISTS checks before it inserts into the catalog): the table is there,
#: which is all set-up wanted -- a unique violation in pg_type or pg_class, "relation already
#: exists", or "type already exists".
_CREATED_CONCURRENTLY = (
    psycopg.errors.UniqueViolation,
    psycopg.errors.DuplicateTable,
    psycopg.errors.DuplicateObject,
)
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


class _CompiledRefused(Exception):
    """The server refused a row of a write that had a compiled COPY stream (in the stream or
    not: the stream cannot be split to find out); the write is back at its savepoint."""


class _RowError(Exception):
    """The server refused the batch for its data (SQLSTATE 22/23/P0001)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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


@contextlib.contextmanager
def _savepoint(conn: Connection, name: sql.Identifier) -> Iterator[None]:
    """The block inside savepoint ``name``: when it raises a server error, the transaction is
    rolled back to where the block began (unless the connection is lost: nothing is left to roll
    back) and the error goes on to the caller, who judges it."""
    conn.execute(sql.SQL("SAVEPOINT {}").format(name))
    try:
        yield
    except psycopg.Error as exc:
        if not _is_lost(conn, exc):
            conn.execute(sql.SQL("ROLLBACK TO SAVEPOINT {}").format(name))
            conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(name))
        raise
    conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(name))


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
