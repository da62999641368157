"""Record schemas and PostgreSQL columns, both ways (``auto_create``, ``auto_evolve``).

:func:`column_type` is the one table from a schema's field types to column types
(``docs/types.md``, "Tables from record schemas"); :func:`table_schema` reads a table's columns
back as a :class:`RecordSchema`, so that the SDK's :func:`compare` -- the one rule for which
changes a target may follow -- can run table against record; :func:`plan` folds the changes
several schemas need into the columns the table must end with, and :func:`alter_table` is the
one statement that gets it there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from psycopg import sql

from twophase.participants.sdk import Change, Field, FieldType, RecordSchema, compare
from twophase.participants.sinks.postgres.types import Column

__all__ = [
    "IDENTIFIER_MAX_BYTES",
    "Plan",
    "alter_table",
    "column_type",
    "create_table",
    "describe",
    "field_type",
    "plan",
    "table_schema",
]

#: PostgreSQL's NAMEDATALEN - 1: a longer identifier is cut silently by the server.
IDENTIFIER_MAX_BYTES = 63

#: Column type of each kind, spelt as ``format_type`` spells it (a planned column is compared
#: with the catalog's by this text). Nested values -- arrays, maps, records, and ``json``
#: (a value the source cannot type) -- are ``jsonb``: one column holds any nesting exactly (by
#: the sinks' shared JSON rule), a PostgreSQL array could hold neither records, nor nulls
#: inside nested arrays, nor arrays of differing lengths per dimension, and a nested field
#: added or widened later needs no DDL at all. ``enum`` is ``text``: the symbols are the
#: schema's, a PostgreSQL enum type would need DDL of its own (outside any transaction that
#: uses a new label) for every symbol added.
_KIND_TYPES = {
    "boolean": "boolean",
    "int32": "integer",
    "int64": "bigint",
    "float32": "real",
    "float64": "double precision",
    "string": "text",
    "bytes": "bytea",
    "uuid": "uuid",
    "enum": "text",
    "date": "date",
    # PostgreSQL keeps microseconds: ms and us values alike are stored exactly.
    "time": "time without time zone",
    "timestamp": "timestamp with time zone",
    "timestamp_local": "timestamp without time zone",
    "array": "jsonb",
    "map": "jsonb",
    "record": "jsonb",
    "json": "jsonb",
}

#: ``pg_type.typname`` of each type :func:`column_type` gives (a planned column's base type,
#: for its converter).
_BASE_TYPES = {
    "boolean": "bool",
    "integer": "int4",
    "bigint": "int8",
    "real": "float4",
    "double precision": "float8",
    "text": "text",
    "bytea": "bytea",
    "uuid": "uuid",
    "date": "date",
    "time without time zone": "time",
    "timestamp with time zone": "timestamptz",
    "timestamp without time zone": "timestamp",
    "jsonb": "jsonb",
}

#: The largest precision of a ``numeric(p, s)``; a decimal beyond it is an unconstrained numeric.
_NUMERIC_MAX_PRECISION = 1000


def column_type(t: FieldType) -> str:
    """The column type of a field of type ``t`` (nullability aside)."""
    if t.kind == "decimal":
        p, s = t.precision, t.scale or 0
        if p is not None and 1 <= p <= _NUMERIC_MAX_PRECISION and 0 <= s <= p:
            return f"numeric({p},{s})"
        # No precision (any number of digits), or one PostgreSQL's typmod cannot say: the
        # unconstrained numeric keeps every value with the scale it comes with.
        return "numeric"
    return _KIND_TYPES[t.kind]


#: Base type -> kind, for the types that name exactly one kind. Types not here -- json and
#: jsonb (any value), enums, arrays, domains over them, extensions -- take the type of the
#: record's field: the sink stores into them by their converter (the server parses what it
#: does not model), and no schema change ever alters them.
_KINDS = {
    "bool": "boolean",
    # smallint reads as int32 (the schema has no 16-bit kind): an int32 value beyond its range
    # is refused per record by the column's converter, never changed.
    "int2": "int32",
    "int4": "int32",
    "int8": "int64",
    "float4": "float32",
    "float8": "float64",
    "text": "string",
    "varchar": "string",
    "bpchar": "string",
    "name": "string",
    "bytea": "bytes",
    "uuid": "uuid",
    "date": "date",
}

_NUMERIC_TYPMOD = re.compile(r"^numeric\((\d+),(-?\d+)\)$")


def field_type(column: Column) -> FieldType | None:
    """The field type ``column`` holds, or None when it holds whatever the record brings."""
    base = column.base_type
    nullable = not column.not_null
    kind = _KINDS.get(base)
    if kind is not None:
        return FieldType(kind, nullable)
    if base == "numeric":
        found = _NUMERIC_TYPMOD.match(column.sql_type)
        if found is None:
            return FieldType("decimal", nullable)
        return FieldType(
            "decimal", nullable, precision=int(found.group(1)), scale=int(found.group(2))
        )
    if base == "time":
        return FieldType("time", nullable, unit="us")
    if base == "timestamptz":
        return FieldType("timestamp", nullable, unit="us")
    if base == "timestamp":
        return FieldType("timestamp_local", nullable, unit="us")
    return None


def table_schema(columns: Iterable[Column], record: RecordSchema) -> RecordSchema:
    """The table's columns as a schema to :func:`compare` ``record`` with: each column's field
    type (:func:`field_type`), or the record's own type for a column that takes any (so it
    never asks for a change); nullable unless NOT NULL, defaulted when it has a DEFAULT."""
    fields = []
    for column in columns:
        have = field_type(column)
        if have is None:
            theirs = record.get(column.name)
            have = replace(
                theirs.type if theirs is not None else FieldType("json"),
                nullable=not column.not_null,
            )
        fields.append(Field(column.name, have, has_default=column.has_default))
    return RecordSchema(tuple(fields))


@dataclass(frozen=True, slots=True)
class Plan:
    """What a table must become for the schemas of a batch: its columns after the change
    (``columns``, by name, in order) and, per schema in the batch, the reason its records
    can never go in (None: they fit the planned columns)."""

    columns: dict[str, Column]
    refused: dict[int, str]


def _planned_column(name: str, sql_type: str, not_null: bool) -> Column:
    base = "numeric" if sql_type.startswith("numeric") else _BASE_TYPES[sql_type]
    return Column(
        name=name,
        base_type=base,
        sql_type=sql_type,
        not_null=not_null,
        has_default=False,
        max_length=None,
        deterministic=True,  # the tables the sink makes use the database's collation
    )


def _refusal(change: Change, key: tuple[str, ...]) -> str | None:
    """Why the table cannot follow ``change`` although the schema rule allows it."""
    if change.kind == "add":
        size = len(change.name.encode())
        if not change.name or size > IDENTIFIER_MAX_BYTES:
            return (
                f"field {change.name!r} cannot be a column: a PostgreSQL name is 1 to "
                f"{IDENTIFIER_MAX_BYTES} bytes"
            )
    if change.kind == "relax" and change.name in key:
        return f"field {change.name!r} may be null, but its column is in the table's key"
    return None


def plan(
    now: Mapping[str, Column], schemas: Iterable[RecordSchema], key: Iterable[str] = ()
) -> Plan:
    """Fold the changes ``schemas`` need, in order, into the table's columns ``now``.

    Each schema is compared with the table as the schemas before it left it, so a later
    schema that needs what an earlier one added finds it; a schema whose change the rule (or
    the table: a key column made nullable, a name PostgreSQL cannot keep) refuses is named in
    :attr:`Plan.refused` and changes nothing."""
    columns = dict(now)
    key_columns = tuple(key)
    refused: dict[int, str] = {}
    for i, schema in enumerate(schemas):
        changes = compare(table_schema(columns.values(), schema), schema)
        reasons = [c.refused or _refusal(c, key_columns) for c in changes]
        if any(reasons):
            refused[i] = "; ".join(r for r in reasons if r)
            continue
        for c in changes:
            old = columns.get(c.name)
            if c.kind == "add" and c.new is not None:
                # Nullable whatever the field: the rows already there have no value for it.
                columns[c.name] = _planned_column(c.name, column_type(c.new), False)
            elif c.kind == "widen" and old is not None and c.new is not None:
                sql_type = column_type(c.new)
                if sql_type != old.sql_type:
                    columns[c.name] = _planned_column(c.name, sql_type, old.not_null)
            elif c.kind == "relax" and old is not None:
                columns[c.name] = replace(old, not_null=False)
    return Plan(columns, refused)


def alter_table(
    target: sql.Composable, now: Mapping[str, Column], wanted: Mapping[str, Column]
) -> sql.Composed | None:
    """The one ``ALTER TABLE`` (one rewrite at most) from columns ``now`` to ``wanted``;
    None when they are the same."""
    actions: list[sql.Composable] = []
    for name, column in wanted.items():
        ident = sql.Identifier(name)
        have = now.get(name)
        if have is None:
            actions.append(sql.SQL("ADD COLUMN {} {}").format(ident, sql.SQL(column.sql_type)))
            continue
        if column.sql_type != have.sql_type:
            actions.append(
                sql.SQL("ALTER COLUMN {0} TYPE {1} USING {0}::{1}").format(
                    ident, sql.SQL(column.sql_type)
                )
            )
        if have.not_null and not column.not_null:
            actions.append(sql.SQL("ALTER COLUMN {} DROP NOT NULL").format(ident))
    if not actions:
        return None
    return sql.SQL("ALTER TABLE {} {}").format(target, sql.SQL(", ").join(actions))


def create_table(target: sql.Composable, schema: RecordSchema, key: list[str]) -> sql.Composed:
    """``CREATE TABLE IF NOT EXISTS`` with a column per field of ``schema`` (NOT NULL for a
    required field and the key's) and ``key`` as the primary key when there is one."""
    items: list[sql.Composable] = [
        sql.SQL("{} {}{}").format(
            sql.Identifier(f.name),
            sql.SQL(column_type(f.type)),
            sql.SQL(" NOT NULL" if f.name in key or not f.optional else ""),
        )
        for f in schema
    ]
    if key:
        items.append(
            sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, key)))
        )
    return sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(target, sql.SQL(", ").join(items))


def describe(now: Mapping[str, Column], wanted: Mapping[str, Column]) -> str:
    """The change from columns ``now`` to ``wanted`` in words, for reasons and logs."""
    out = []
    for name, column in wanted.items():
        have = now.get(name)
        if have is None:
            out.append(f"column {name!r} added ({column.sql_type})")
            continue
        if column.sql_type != have.sql_type:
            out.append(f"column {name!r} from {have.sql_type} to {column.sql_type}")
        if have.not_null and not column.not_null:
            out.append(f"column {name!r} nullable")
    return ", ".join(out) or "no change"
