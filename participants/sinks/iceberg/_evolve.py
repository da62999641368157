"""``auto_evolve``: the table's schema follows the records' schemas (``docs/iceberg.md``).

A record whose source gives it a schema (a registry format, a Kafka Connect envelope, Debezium)
is compared with the table's by the SDK's one rule (:func:`~twophase.participants.sdk.compare`):
a field added becomes an optional column, a type widened that Iceberg can promote (int to long,
float to double, a decimal's precision) is promoted, a field made optional relaxes its column.
The change is committed at once, on its own, holding the table's catalog row -- before any data
file is written for records of the new schema: files carry Iceberg field ids, and ids a change
not yet committed would assign could go to another writer's column meanwhile. A column added
early is empty (null) until the part that brought it commits; no reader sees a value changed.
A change the rule or Iceberg refuses refuses the record, with the reason.
"""

from __future__ import annotations

from typing import Any

from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.types import DecimalType, IcebergType, PrimitiveType

from twophase.participants.sdk import Change, Field, FieldType, RecordSchema, compare
from twophase.participants.sinks.iceberg._types import BY_KIND, KIND_OF

__all__ = ["plan", "record_schema", "apply"]

#: The promotions Iceberg allows (its spec's "type promotion"): (from, to) kinds.
_PROMOTIONS = frozenset({("int32", "int64"), ("float32", "float64")})


def iceberg_type(t: FieldType) -> PrimitiveType | str:
    """The Iceberg type of a record field's type, or why there is none."""
    if t.kind == "decimal":
        if t.precision is None or t.precision > 38:
            return f"{t.describe()} has no Iceberg decimal (precision 1 to 38)"
        return DecimalType(t.precision, t.scale or 0)
    found = BY_KIND.get(t.kind)
    if found is None:
        return f"{t.describe()}: nested types are not evolved by the iceberg sink yet"
    return found


def _field_type(t: IcebergType, required: bool) -> FieldType:
    if isinstance(t, DecimalType):
        return FieldType("decimal", not required, precision=t.precision, scale=t.scale)
    kind = KIND_OF.get(type(t), "json")
    unit = "us" if kind in ("time", "timestamp", "timestamp_local") else None
    return FieldType(kind, not required, unit=unit)


def record_schema(schema: Schema) -> RecordSchema:
    """The table's schema in the SDK's terms, for :func:`compare`."""
    return RecordSchema(
        tuple(Field(f.name, _field_type(f.field_type, f.required)) for f in schema.fields),
        id=f"iceberg:{schema.schema_id}",
    )


def plan(table_schema: Schema, record: RecordSchema) -> tuple[list[Change], str | None]:
    """The changes the table needs for records of ``record``'s schema, or why it cannot
    follow (the first reason)."""
    changes = compare(record_schema(table_schema), record)
    for c in changes:
        if c.refused is not None:
            return [], c.refused
        if c.kind == "add":
            assert c.new is not None
            got = iceberg_type(c.new)
            if isinstance(got, str):
                return [], f"field {c.name!r}: {got}"
        elif c.kind == "widen":
            assert c.old is not None and c.new is not None
            if not _promotable(c.old, c.new):
                return [], (
                    f"field {c.name!r}: {c.old.describe()} -> {c.new.describe()} is a widening "
                    "Iceberg cannot promote (it promotes int to long, float to double, and a "
                    "decimal's precision at the same scale)"
                )
    return changes, None


def _promotable(old: FieldType, new: FieldType) -> bool:
    if old.kind == new.kind == "decimal":
        return old.scale == new.scale
    if old.kind == new.kind:
        return old.unit == new.unit
    return (old.kind, new.kind) in _PROMOTIONS


def apply(table: Table, changes: list[Change]) -> Any:
    """The schema update of ``changes`` in a new transaction of ``table`` (not committed)."""
    tx = table.transaction()
    with tx.update_schema() as update:
        for c in changes:
            if c.kind == "add":
                assert c.new is not None
                kind = iceberg_type(c.new)
                assert not isinstance(kind, str)
                update.add_column(c.name, kind, required=False)
            elif c.kind == "widen":
                assert c.new is not None
                kind = iceberg_type(c.new)
                assert not isinstance(kind, str)
                update.update_column(c.name, field_type=kind)
                if c.new.nullable:
                    update.make_column_optional(c.name)
            elif c.kind == "relax":
                update.make_column_optional(c.name)
    return tx
