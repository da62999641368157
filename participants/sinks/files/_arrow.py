"""Inferred Parquet: each column's type decided from all of one file's values (``docs/types.md``).

Without a configured ``schema``, a file's column types come from *all* of that file's values of
the field, so no record is refused because of the records around it or their order: Arrow's own
inference when it is exact (ints with floats become doubles only when every int is exactly a
double; objects merge their keys), integers outside int64 as ``decimal(38, 0)``, and anything
else -- mixed types, nesting Parquet readers cannot read -- as the values' exact JSON text, the
column named in the file's ``twophase.json_columns`` metadata. Parquet cannot store an empty
group, so ``{}`` nested in a record is stored as null.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pyarrow as pa

from twophase.participants.sdk import Record, values
from twophase.participants.sinks.files.config import SOURCE_COLUMNS

__all__ = [
    "JSON_COLUMNS_KEY",
    "MAX_NESTING",
    "Columns",
    "deeper_than",
    "parquet_levels",
    "source_arrays",
    "without_empty_structs",
]

_ARROW_VALUE_ERRORS: tuple[type[BaseException], ...] = (
    pa.ArrowInvalid,
    pa.ArrowTypeError,
    pa.ArrowNotImplementedError,
    OverflowError,
)
#: Deepest value a file may hold, in nesting levels: beyond it the JSON text of a value (the
#: fallback below) is no longer safe to produce. Also refused by the MongoDB sink (100 levels).
MAX_NESTING = 255
#: Parquet readers refuse a schema nested 100 levels deep (pyarrow/parquet-cpp: "Parquet schema
#: too deeply nested"; a struct is one level, a list two): such columns are stored as JSON text.
_PARQUET_MAX_LEVELS = 100
#: Digits of Parquet's widest decimal (decimal128 with precision 38).
_DECIMAL_DIGITS = 38
#: File metadata key naming the columns stored as JSON text (a JSON list of names).
JSON_COLUMNS_KEY = "twophase.json_columns"


def deeper_than(value: Any, limit: int) -> bool:
    """True when ``value`` nests more than ``limit`` levels (without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return False


@dataclass(slots=True)
class Columns:
    """A chunk of inferred Parquet: one write's records of one file, per field an Arrow array
    (Arrow's exact inference over the chunk) or, where the chunk's values have no exact Arrow
    type, the values themselves. Arrays keep the buffer small (~150 bytes a record, against
    ~800 as Python objects); the file's column types are decided from all chunks when the file
    is written (:meth:`table`), so a record is never judged by the chunk it came in."""

    rows: int
    fields: dict[str, Any]
    #: The source columns (arrays), when configured.
    source: list[Any] | None

    def __len__(self) -> int:
        return self.rows

    @classmethod
    def of(cls, records: list[Record], source_columns: bool) -> Columns:
        objs = [r.value for r in records]
        try:
            batch = pa.RecordBatch.from_struct_array(pa.array(objs))
            fields: dict[str, Any] = dict(zip(batch.schema.names, batch.columns, strict=True))
        except _ARROW_VALUE_ERRORS:
            fields = {}
            for name in dict.fromkeys(k for v in objs for k in v):
                values = [v.get(name) for v in objs]
                try:
                    fields[name] = pa.array(values)
                except _ARROW_VALUE_ERRORS:
                    fields[name] = values
        return cls(len(objs), fields, source_arrays(records) if source_columns else None)

    def slice(self, start: int, length: int) -> Columns:
        fields = {
            name: (f[start : start + length] if isinstance(f, list) else f.slice(start, length))
            for name, f in self.fields.items()
        }
        source = None if self.source is None else [a.slice(start, length) for a in self.source]
        return Columns(length, fields, source)

    def values(self, name: str) -> list[Any]:
        """This chunk's values of ``name`` as Python objects (None where absent)."""
        f = self.fields.get(name)
        if f is None:
            return [None] * self.rows
        return f if isinstance(f, list) else f.to_pylist()

    @staticmethod
    def table(chunks: list[Columns]) -> tuple[Any, list[str]]:
        """One file's table and its JSON-text columns. A field whose chunks agree on one Arrow
        type is concatenated as is; otherwise its type is decided from all of its values
        (:func:`_column`), which gives what one inference over the whole file would."""
        names = list(dict.fromkeys(n for c in chunks for n in c.fields))
        arrays: list[Any] = []
        json_columns: list[str] = []
        for name in names:
            pieces = [c.fields.get(name) for c in chunks]
            kinds = {p.type for p in pieces if p is not None and not isinstance(p, list)}
            column: Any = None
            if len(kinds) == 1 and not any(isinstance(p, list) for p in pieces):
                kind = kinds.pop()
                column = pa.chunked_array(
                    [
                        p if p is not None else pa.nulls(c.rows, kind)
                        for p, c in zip(pieces, chunks, strict=True)
                    ],
                    type=kind,
                )
            else:
                column = _column([v for c in chunks for v in c.values(name)])
            if column is None or not _parquet_ok(column.type):
                column = _json_column([v for c in chunks for v in c.values(name)])
                json_columns.append(name)
            arrays.append(column)
        if chunks[0].source is not None:
            for i in range(len(SOURCE_COLUMNS)):
                arrays.append(pa.chunked_array([c.source[i] for c in chunks if c.source]))
            names.extend(SOURCE_COLUMNS)
        return pa.Table.from_arrays(arrays, names=names), json_columns


def source_arrays(records: Sequence[Record]) -> list[Any]:
    return [
        pa.array([r.topic for r in records], type=pa.string()),
        pa.array([r.partition for r in records], type=pa.int32()),
        pa.array([r.offset for r in records], type=pa.int64()),
        pa.array([r.timestamp_ms for r in records], type=pa.int64()),
    ]


#: Type of a column stored as JSON text.
_JSON_TEXT = pa.string()


def _column(column: list[Any]) -> Any | None:
    """The Arrow array of one field's values (None where absent or null), by the rule of
    ``docs/types.md``: Arrow's own inference over all of them when it is exact (it refuses
    rather than round: an integer past 2**53 next to a float fails); integers that do not all
    fit int64 as decimal(38, 0) when they fit 38 digits; None: anything else, stored as JSON
    text by the caller."""
    try:
        return pa.array(column)
    except _ARROW_VALUE_ERRORS:
        pass
    present = [v for v in column if v is not None]
    if all(v.__class__ is int for v in present) and all(
        len(str(abs(v))) <= _DECIMAL_DIGITS for v in present
    ):
        return pa.array(
            [None if v is None else Decimal(v) for v in column],
            type=pa.decimal128(_DECIMAL_DIGITS, 0),
        )
    return None


def _json_column(column: list[Any]) -> Any:
    """Each value as its exact JSON text (``"12"`` and ``12`` stay apart: ``"\"12\""``, ``"12"``)."""
    return pa.array(
        [None if v is None else values.json_text(v).decode() for v in column], type=_JSON_TEXT
    )


def _levels(kind: Any) -> int:
    """Parquet schema levels of an Arrow type (a struct adds one, a list two)."""
    if pa.types.is_struct(kind):
        return 1 + max((_levels(kind.field(i).type) for i in range(kind.num_fields)), default=0)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return 2 + _levels(kind.value_type)
    return 1


def _parquet_ok(kind: Any) -> bool:
    return bool(_levels(kind) < _PARQUET_MAX_LEVELS)


def parquet_levels(kind: Any) -> int:
    """Parquet schema levels of an Arrow type (a struct adds one, a list or a map two)."""
    if pa.types.is_map(kind):
        return 2 + max(_levels(kind.key_type), parquet_levels(kind.item_type))
    if pa.types.is_struct(kind):
        return 1 + max(
            (parquet_levels(kind.field(i).type) for i in range(kind.num_fields)), default=0
        )
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return 2 + parquet_levels(kind.value_type)
    return 1


def _has_empty_struct(kind: Any) -> bool:
    if pa.types.is_struct(kind):
        return kind.num_fields == 0 or any(
            _has_empty_struct(kind.field(i).type) for i in range(kind.num_fields)
        )
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _has_empty_struct(kind.value_type)
    return False


def _without_empty_struct_type(kind: Any) -> Any:
    if pa.types.is_struct(kind):
        if kind.num_fields == 0:
            return pa.null()
        return pa.struct(
            [
                pa.field(kind.field(i).name, _without_empty_struct_type(kind.field(i).type))
                for i in range(kind.num_fields)
            ]
        )
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return pa.list_(_without_empty_struct_type(kind.value_type))
    return kind


def _without_empty_struct_value(value: Any, kind: Any) -> Any:
    if value is None:
        return None
    if pa.types.is_struct(kind):
        if kind.num_fields == 0:
            return None
        return {
            kind.field(i).name: _without_empty_struct_value(
                value.get(kind.field(i).name), kind.field(i).type
            )
            for i in range(kind.num_fields)
        }
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return [_without_empty_struct_value(v, kind.value_type) for v in value]
    return value


def without_empty_structs(table: Any) -> Any:
    """Parquet has no empty group: store ``{}`` (type ``struct<>``) as null instead."""
    for i, f in enumerate(table.schema):
        if _has_empty_struct(f.type):
            kind = _without_empty_struct_type(f.type)
            values = [_without_empty_struct_value(v, f.type) for v in table.column(i).to_pylist()]
            table = table.set_column(i, pa.field(f.name, kind), pa.array(values, type=kind))
    return table
