"""Independent checks of a change-data-capture replica: what each sink holds, read from the store
itself and turned back into the source table's rows, compared with the source row for row.

Used by ``make demo-cdc`` and the change-data-capture end-to-end test. Nothing here trusts the
product's bookkeeping: a table's columns and key come from the source database's catalog, the
replica's rows from the store, and the JSON values the pipeline wrote (MongoDB documents,
change-row files) become the source's Python types by the documented rules only
(``docs/cdc.md``: decimals are exact decimal strings, dates ``YYYY-MM-DD``, timestamps ISO-8601
with an offset; ``docs/types.md``: what each sink stores for them, a MongoDB document's values
typed by the record's schema included). A value that does not follow
its rule is kept as it is, so it differs from the source value -- nothing is coerced to match.
Rows compare strictly (:func:`same`): equal values *of the same type*, decimals with the same
digits (``12.30`` is not ``12.3``), timestamps the same instant.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pyarrow.parquet as pq
from bson import Binary, Decimal128
from psycopg import sql
from pymongo import MongoClient

__all__ = [
    "MISSING",
    "Row",
    "Table",
    "differences",
    "mongo_rows",
    "mongo_staged",
    "pg_prepared",
    "pg_rows",
    "replayed_rows",
    "same",
    "source_table",
    "staged_files",
]

Row = tuple[Any, ...]
#: The key of the files sink's JSON-text columns in a Parquet file's metadata (``docs/types.md``).
JSON_COLUMNS_KEY = b"twophase.json_columns"


class _Missing:
    """A field the document or change row lacks (never equal to a source value, null included)."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


@dataclass(frozen=True)
class Table:
    """A source table: its columns (name, ``information_schema`` data type) in table order and
    its primary key's columns in key order."""

    name: str
    columns: tuple[tuple[str, str], ...]
    key: tuple[str, ...]

    @property
    def names(self) -> list[str]:
        return [c for c, _ in self.columns]

    def key_of(self, row: Row) -> Row:
        names = self.names
        return tuple(row[names.index(k)] for k in self.key)

    def from_json(self, fields: dict[str, Any]) -> Row:
        """The row the JSON values ``fields`` (as the pipeline wrote them) stand for, each column
        converted by the documented rule of its type; a missing field is :data:`MISSING`."""
        return tuple(
            _convert(kind, fields[name]) if name in fields else MISSING
            for name, kind in self.columns
        )


def source_table(dsn: str, name: str, schema: str = "public") -> Table:
    """``name``'s columns and primary key, from the catalog of the database at ``dsn``."""
    with psycopg.connect(dsn) as conn:
        columns = conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = %s AND table_name = %s ORDER BY ordinal_position",
            (schema, name),
        ).fetchall()
        key = conn.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a "
            "ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
            "WHERE i.indrelid = %s::regclass AND i.indisprimary "
            "ORDER BY array_position(i.indkey::int2[], a.attnum)",
            (f'"{schema}"."{name}"',),
        ).fetchall()
    if not columns or not key:
        raise ValueError(f"{schema}.{name}: no such table, or it has no primary key")
    return Table(name, tuple((c, t) for c, t in columns), tuple(k for (k,) in key))


def pg_rows(dsn: str, table: Table, relation: str | None = None) -> list[Row]:
    """The rows of ``relation`` (default: the table's own name) in the database at ``dsn``: the
    source's columns, in key order."""
    query = sql.SQL("SELECT {} FROM {}").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in table.names),
        sql.Identifier(relation or table.name),
    )
    with psycopg.connect(dsn) as conn:
        return _sorted(table, conn.execute(query).fetchall())


def mongo_rows(
    uri: str, database: str, collection: str, table: Table, version_field: str | None = "_twophase"
) -> list[Row]:
    """The documents of ``collection`` as rows of ``table``, in key order. A document's ``_id``
    must be its key (the single key field's value, or ``{k1: v1, ...}`` in key order) and it
    may hold no field but the columns, ``_id`` and ``version_field``: otherwise its row gets a
    last element saying what is wrong, so it equals no source row."""
    rows = []
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    with client:
        kinds = dict(table.columns)
        for doc in client[database][collection].find():
            fields = {
                k: _from_bson(kinds.get(k, ""), v)
                for k, v in doc.items()
                if k not in ("_id", version_field)
            }
            row = table.from_json(fields)
            wrong = []
            if extra := sorted(set(fields) - set(table.names)):
                wrong.append(f"extra fields {extra}")
            key = {k: fields.get(k, MISSING) for k in table.key}
            want_id = next(iter(key.values())) if len(key) == 1 else key
            if not _same_value(doc["_id"], want_id):
                wrong.append(f"_id {doc['_id']!r}, key {want_id!r}")
            rows.append(row + ((f"document {'; '.join(wrong)}",) if wrong else ()))
    return _sorted(table, rows)


def replayed_rows(directory: Path, table: Table, op_column: str = "_op") -> list[Row]:
    """What a reader of one topic's change rows gets (``docs/cdc.md``): every Parquet file
    under ``directory`` (names starting with ``_`` or ``.`` skipped, as dataset readers do),
    its JSON-text columns decoded, the rows applied in ``(_partition, _offset)`` order -- a
    ``u`` row's fields over the key's earlier ones, a ``d`` row removing the key -- in key
    order. A row whose op is neither is kept as a row that equals no source row."""
    changes: list[dict[str, Any]] = []
    for path in sorted(directory.rglob("*.parquet")) if directory.exists() else []:
        if any(p.startswith(("_", ".")) for p in path.relative_to(directory).parts):
            continue
        data = pq.read_table(path)
        text = json.loads((data.schema.metadata or {}).get(JSON_COLUMNS_KEY, b"[]"))
        for change in data.to_pylist():
            for name in text:
                if change.get(name) is not None:
                    change[name] = json.loads(change[name])
            changes.append(change)
    state: dict[Row, dict[str, Any]] = {}
    odd: list[Row] = []
    for change in sorted(changes, key=lambda c: (c["_partition"], c["_offset"])):
        key = tuple(_strict(change.get(k, MISSING)) for k in table.key)
        if change.get(op_column) == "d":
            state.pop(key, None)
        elif change.get(op_column) == "u":
            state.setdefault(key, {}).update(change)
        else:
            odd.append((f"change row with {op_column} {change.get(op_column)!r}: {change}",))
    return _sorted(table, [table.from_json(fields) for fields in state.values()]) + odd


def same(a: Sequence[Row], b: Sequence[Row]) -> bool:
    """Row for row equal: the same values of the same types (decimals digit for digit)."""
    return len(a) == len(b) and all(_same_row(x, y) for x, y in zip(a, b, strict=True))


def differences(table: Table, got: Sequence[Row], want: Sequence[Row], n: int = 6) -> list[str]:
    """Up to ``n`` keys whose rows differ, each with both sides (``-`` wanted, ``+`` got)."""
    want_by = {_strict_row(table.key_of(r)): r for r in want}
    got_by = {_strict_row(table.key_of(r)) if len(r) >= len(table.names) else r: r for r in got}
    out = []
    for key in sorted(set(want_by) | set(got_by), key=repr):
        w, g = want_by.get(key), got_by.get(key)
        if w is None or g is None or not _same_row(w, g):
            out.append(f"- {w!r}\n      + {g!r}")
            if len(out) == n:
                break
    return out


def pg_prepared(dsn: str, pipeline: str) -> int:
    """Transactions of ``pipeline`` still prepared in the PostgreSQL at ``dsn`` (its global ids
    name the pipeline)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s", (f"%:{pipeline}~%",)
        ).fetchone()
    return int(row[0]) if row else -1


def pg_rollback_prepared(dsn: str, pipeline: str) -> list[str]:
    """Roll back ``pipeline``'s transactions still prepared in the PostgreSQL at ``dsn``; their
    global ids. For a failed run's clean-up only: a prepared transaction anywhere in the server
    holds back every new logical replication slot (Debezium's among them) until it ends."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        gids = [
            str(row[0])
            for row in conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s", (f"%:{pipeline}~%",)
            )
        ]
        for gid in gids:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
    return gids


def mongo_staged(
    uri: str, database: str, pipeline: str, marker_collection: str = "twophase_parts"
) -> int:
    """Documents left in ``database``'s staging collections plus ``pipeline``'s parts whose
    markers are still open or prepared: 0 when every part was committed or aborted."""
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    with client:
        db = client[database]
        names = db.list_collection_names()
        staged = sum(db[n].count_documents({}) for n in names if "twophase_staging" in n)
        markers = db[marker_collection].count_documents(
            {"kind": "part", "pipeline": pipeline, "state": {"$in": ["open", "prepared"]}}
        )
    return staged + markers


def staged_files(path: Path, pipeline: str) -> int:
    """Parts of ``pipeline`` a files sink at ``path`` still has open or prepared."""
    book = path / "_twophase" / pipeline
    return sum(len(list((book / d).iterdir())) for d in ("open", "prepared") if (book / d).is_dir())


def left_behind(
    pg_dsn: str, mongo_uri: str, database: str, files: Path, pipeline: str
) -> tuple[int, int, int]:
    """``pipeline``'s parts still prepared in PostgreSQL, staged in MongoDB's ``database``, open
    or prepared in the files sink at ``files``: all 0 once every transaction is decided and
    applied (or rolled back)."""
    return (
        pg_prepared(pg_dsn, pipeline),
        mongo_staged(mongo_uri, database, pipeline),
        staged_files(files, pipeline),
    )


def _sorted(table: Table, rows: Sequence[Row]) -> list[Row]:
    """Rows in key order, compared as :func:`_strict` values (so no two types ever meet)."""
    return sorted(rows, key=lambda r: _strict_row(table.key_of(r)))


def _same_row(a: Row, b: Row) -> bool:
    return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same_value(a[k], b[k]) for k in a)
    return bool(_strict(a) == _strict(b))


def _strict_row(row: Row) -> Row:
    return tuple(_strict(v) for v in row)


def _strict(value: Any) -> Any:
    """A value compared by its type too (``1``, ``1.0`` and ``True`` differ) and a decimal by
    its digits; timestamps with a zone compare as instants (the source's session zone and the
    pipeline's UTC spelling name the same instant)."""
    shown = str(value) if isinstance(value, Decimal) else value
    return (type(value).__name__, shown)


def _decimal(value: Any) -> Any:
    """A numeric column: the exact decimal string (``docs/cdc.md``, Connect's ``Decimal``)."""
    if not isinstance(value, str):
        return value
    try:
        return Decimal(value)
    except InvalidOperation:
        return value


def _date(value: Any) -> Any:
    """A date column: ``YYYY-MM-DD`` and nothing else."""
    if not isinstance(value, str):
        return value
    try:
        day = date.fromisoformat(value)
    except ValueError:
        return value
    return day if day.isoformat() == value else value


def _timestamp(zoned: bool) -> Callable[[Any], Any]:
    """A timestamp column: ISO-8601 with an offset (UTC ``Z`` for one without a zone, whose
    source value is then the naive UTC time)."""

    def convert(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            at = datetime.fromisoformat(value)
        except ValueError:
            return value
        if at.utcoffset() is None:
            return value
        if zoned:
            return at
        return at.replace(tzinfo=None) if at.utcoffset() == timedelta(0) else value

    return convert


def _as_is(value: Any) -> Any:
    return value


def _from_bson(kind: str, value: Any) -> Any:
    """A MongoDB value typed by its record's schema (``docs/types.md``, the BSON column) as the
    JSON rules' value of its source column: a ``Decimal128`` in a numeric column its decimal,
    digit for digit; a BSON date at midnight in a date column its day; a BSON date (UTC) in a
    timestamptz column its instant; a BSON UUID in a uuid column its UUID. Anything else --
    a date with a time of day in a date column, say -- stays as it is, and differs."""
    if isinstance(value, Decimal128):
        return value.to_decimal() if kind == "numeric" else value
    if isinstance(value, datetime) and value.tzinfo is None:
        if kind == "date" and value.time() == time(0):
            return value.date()
        if kind == "timestamp with time zone":
            return value.replace(tzinfo=UTC)
        return value
    if isinstance(value, Binary) and value.subtype == 4 and kind == "uuid":
        return UUID(bytes=bytes(value))
    return value


#: ``information_schema`` data type -> how its JSON value becomes the source's Python value.
#: Integers, text and booleans are JSON's own types; a type not listed stays as it is (and so
#: differs from the source unless the JSON value already is the source's value).
_CONVERT: dict[str, Callable[[Any], Any]] = {
    "numeric": _decimal,
    "date": _date,
    "timestamp with time zone": _timestamp(zoned=True),
    "timestamp without time zone": _timestamp(zoned=False),
}


def _convert(kind: str, value: Any) -> Any:
    return None if value is None else _CONVERT.get(kind, _as_is)(value)
