"""Records -> rows of an Iceberg table's schema, by the value rules every sink shares.

Each column is fed from the record value's field of the same name and converted by
:mod:`twophase.participants.sdk.values` (``docs/types.md``, the Iceberg column): a value that
the column's type cannot hold exactly refuses the record, with the column and the reason. A
part's rows are kept as Arrow record batches (:class:`PartRows`); in upsert mode with the last
change of each key, so that the prepare writes each key's final row once and the commit deletes
the rows of every key the part touched.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
from pyiceberg.schema import Schema
from pyiceberg.types import (
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FixedType,
    FloatType,
    IcebergType,
    IntegerType,
    LongType,
    StringType,
    TimestampType,
    TimestamptzType,
    TimeType,
    UUIDType,
)

from twophase.participants.sdk import Record, Rejected, values
from twophase.participants.sdk.rawjson import ARROW_ERRORS, join_lines, read_lines
from twophase.participants.sdk.values import BadValue

__all__ = ["PartRows", "RawReader", "RowMaker", "conform"]

Convert = Callable[[Any], Any]
_EPOCH = datetime(1970, 1, 1)


def _micros(moment: datetime) -> int:
    naive = moment.astimezone(UTC).replace(tzinfo=None) if moment.tzinfo else moment
    return (naive - _EPOCH) // timedelta(microseconds=1)


def _instant(local: bool) -> Convert:
    def convert(value: Any) -> Any:
        if isinstance(value, datetime):
            if local and value.tzinfo is not None:
                raise BadValue(f"local date-time {value.isoformat()!r} has an offset")
            return _micros(value)
        return values.to_instant(value, local=local)

    return convert


def _text(value: Any) -> str:
    if value.__class__ is str:
        return str(value)
    if isinstance(value, (dict, list, bool, int, float, Decimal)):
        return values.json_text(value).decode()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise values.wrong(value, "a string")


def _integer(low: int, high: int, name: str) -> Convert:
    return lambda value: values.to_integer(value, low, high, name)


def _float32(value: Any) -> float:
    return values.to_float32(value)  # refused past its range, or when it would round to 0


def _decimal(t: DecimalType) -> Convert:
    def convert(value: Any) -> Decimal:
        number = value if isinstance(value, Decimal) else values.to_decimal(value)
        return values.fit_decimal(number, t.precision, t.scale)

    return convert


def _date(value: Any) -> date:
    if isinstance(value, date) and not isinstance(value, datetime):
        return value
    return values.to_date(value)


def _uuid(value: Any) -> bytes:
    return (value if isinstance(value, uuid.UUID) else values.to_uuid(value)).bytes


def _binary(width: int | None) -> Convert:
    def convert(value: Any) -> bytes:
        data = bytes(value) if isinstance(value, (bytes, bytearray)) else values.from_base64(value)
        if width is not None and len(data) != width:
            raise BadValue(f"{len(data)} bytes where fixed[{width}] holds exactly {width}")
        return data

    return convert


def converter(t: IcebergType) -> Convert:
    """The conversion of a JSON (or schema-typed) value into a column of type ``t``."""
    if isinstance(t, BooleanType):
        return values.to_bool
    if isinstance(t, IntegerType):
        return _integer(-(2**31), 2**31 - 1, "int")
    if isinstance(t, LongType):
        return _integer(values.INT64_MIN, values.INT64_MAX, "long")
    if isinstance(t, FloatType):
        return _float32
    if isinstance(t, DoubleType):
        return values.to_float
    if isinstance(t, DecimalType):
        return _decimal(t)
    if isinstance(t, DateType):
        return _date
    if isinstance(t, TimeType):
        return values.to_time
    if isinstance(t, TimestamptzType):
        return _instant(local=False)
    if isinstance(t, TimestampType):
        return _instant(local=True)
    if isinstance(t, StringType):
        return _text
    if isinstance(t, UUIDType):
        return _uuid
    if isinstance(t, FixedType):
        return _binary(len(t))
    if isinstance(t, BinaryType):
        return _binary(None)
    return lambda value: value  # nested types: Arrow checks the value's shape


class RowMaker:
    """A record's row of the table's columns, or the reason it cannot be one."""

    def __init__(self, schema: Schema, key: Sequence[str], drop_unknown: bool) -> None:
        self.arrow = schema.as_arrow()
        self._columns = [(f.name, converter(f.field_type), f.required) for f in schema.fields]
        self._names = frozenset(f.name for f in schema.fields)
        self._drop_unknown = drop_unknown
        self.key = list(key)
        positions = {name: i for i, (name, _, _) in enumerate(self._columns)}
        self._key_at = [positions[k] for k in key]

    def row(self, record: Record) -> list[Any] | str:
        value = record.value
        if not self._drop_unknown and not self._names.issuperset(value):
            unknown = sorted(set(value) - self._names)
            return f"fields {unknown} are not columns of the table (unknown_fields: reject)"
        out: list[Any] = []
        for name, convert, required in self._columns:
            v = value.get(name)
            if v is None:
                if required:
                    return f"column {name!r} is required: field {name!r} is missing or null"
                out.append(None)
                continue
            try:
                out.append(convert(v))
            except BadValue as exc:
                return f"column {name!r}: {exc}"
        return out

    def key_of(self, record: Record) -> tuple[Any, ...] | str:
        """The converted key of a delete (which carries only the key's fields, at least)."""
        out = []
        for name, at in zip(self.key, self._key_at, strict=True):
            v = record.value.get(name)
            if v is None:
                return f"a delete needs its key: field {name!r} is missing or null"
            try:
                out.append(self._columns[at][1](v))
            except BadValue as exc:
                return f"key column {name!r}: {exc}"
        return tuple(out)

    def key_of_row(self, row: list[Any]) -> tuple[Any, ...]:
        return tuple(row[i] for i in self._key_at)

    def batch(self, rows: list[list[Any]]) -> pa.RecordBatch:
        """Rows as a record batch of the table's Arrow schema (raises an Arrow error on a value
        the conversions let through and Arrow refuses)."""
        columns = list(zip(*rows, strict=True)) if rows else [()] * len(self.arrow)
        return pa.RecordBatch.from_arrays(
            [pa.array(col, type=f.type) for col, f in zip(columns, self.arrow, strict=True)],
            schema=self.arrow,
        )

    def batches(
        self, records: Sequence[Record], rows: list[list[Any]], at: list[int]
    ) -> tuple[pa.RecordBatch, list[Rejected], list[int]]:
        """:meth:`batch` of ``rows`` (of ``records[at[i]]``); a row Arrow refuses is found one by
        one and refused with Arrow's reason. Returns the batch, the refusals, and the positions
        (in ``records``) of the rows kept."""
        try:
            return self.batch(rows), [], at
        except ARROW_ERRORS:
            pass
        kept: list[list[Any]] = []
        kept_at: list[int] = []
        rejected: list[Rejected] = []
        for row, i in zip(rows, at, strict=True):
            try:
                self.batch([row])
            except ARROW_ERRORS as exc:
                rejected.append(Rejected(records[i], f"Arrow refused the row: {exc}"))
            else:
                kept.append(row)
                kept_at.append(i)
        return self.batch(kept), rejected, kept_at


def conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` in ``schema``: its columns cast (a promotion), the ones it lacks null."""
    if batch.schema.equals(schema, check_metadata=True):
        return batch
    columns = [
        batch.column(f.name).cast(f.type)
        if f.name in batch.schema.names
        else pa.nulls(batch.num_rows, f.type)
        for f in schema
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


class PartRows:
    """The rows of the open part: in append mode all of them, in upsert mode the last change of
    each key (a row, or a delete)."""

    def __init__(self, maker: RowMaker, keyed: bool) -> None:
        self.maker = maker
        self.keyed = keyed
        self.batches: list[pa.RecordBatch] = []
        #: upsert: key -> (batch, row) of its last row, or None when its last change is a delete.
        self.last: dict[tuple[Any, ...], tuple[int, int] | None] = {}
        self.count = 0

    def add(
        self, batch: pa.RecordBatch, changes: Sequence[tuple[tuple[Any, ...], int | None]] = ()
    ) -> None:
        """A batch of rows; in upsert mode with the batch's changes in their order: (key, the
        key's row in ``batch``) for a row, (key, None) for a delete."""
        index = len(self.batches)
        self.batches.append(batch)
        self.count += batch.num_rows
        last = self.last
        for key, row in changes:
            last[key] = None if row is None else (index, row)

    def follow(self, maker: RowMaker) -> None:
        """The table's schema changed (``auto_evolve``): rows from now on are of ``maker``'s,
        and the ones held so far are made so (new columns null, promoted types cast)."""
        self.maker = maker
        self.batches = [conform(b, maker.arrow) for b in self.batches]

    def table(self) -> pa.Table:
        """What the prepare writes: every row, or each key's last row when it is not deleted."""
        if not self.keyed:
            return pa.Table.from_batches(self.batches, schema=self.maker.arrow)
        keep: list[list[int]] = [[] for _ in self.batches]
        for where in self.last.values():
            if where is not None:
                keep[where[0]].append(where[1])
        parts = [
            batch.take(pa.array(sorted(rows), type=pa.int64()))
            for batch, rows in zip(self.batches, keep, strict=True)
            if rows
        ]
        return pa.Table.from_batches(parts, schema=self.maker.arrow)

    def touched_keys(self) -> list[tuple[Any, ...]]:
        """Every key the part touched: the commit deletes their rows before adding the part's."""
        return list(self.last)


#: Column types Arrow's JSON reader converts by the same rules as :func:`converter` (checked
#: value by value in ``tests/integration/test_sink_iceberg.py``), given the checks of
#: :meth:`RawReader.read`. Other types (local timestamps, which Arrow shifts by an offset the
#: rules refuse; float, which Arrow overflows to infinity; dates, times, UUIDs, bytes, nested)
#: keep a table on the decoded path.
_RAW_TYPES = (
    BooleanType,
    IntegerType,
    LongType,
    DoubleType,
    DecimalType,
    StringType,
    TimestamptzType,
)


class RawReader:
    """JSON values straight into Arrow (``pyarrow.json``, no Python object per record), for a
    batch every value of which the decoded path would take exactly so; None for any other
    batch, which then takes the decoded path (every rule, every rejection reason)."""

    def __init__(self, schema: Schema, maker: RowMaker, drop_unknown: bool) -> None:
        self.maker = maker
        self.usable = all(isinstance(f.field_type, _RAW_TYPES) for f in schema.fields)
        self._options = pa_json.ParseOptions(
            explicit_schema=pa.schema([f.remove_metadata() for f in maker.arrow]),
            unexpected_field_behavior="ignore" if drop_unknown else "error",
        )
        self._decimals = [
            (f.name, f.field_type.precision - f.field_type.scale)
            for f in schema.fields
            if isinstance(f.field_type, DecimalType)
        ]
        self._doubles = [f.name for f in schema.fields if isinstance(f.field_type, DoubleType)]

    def read(self, values: Sequence[bytes]) -> pa.Table | None:
        # One value, one line, one object: a value with a line break, or that is not an object,
        # or that holds two objects, would not line up with its record (the count says so).
        data = join_lines(values)
        if data is None:
            return None
        table = read_lines(data, len(values), self._options)
        if table is None:
            return None
        for name, digits in self._decimals:
            # Arrow fits the scale exactly but lets the precision overflow.
            column = table.column(name)
            wide = pa.decimal128(38, column.type.scale)
            bound = pa.scalar(Decimal(10) ** digits, wide)
            if pc.any(pc.greater_equal(pc.abs(column.cast(wide)), bound)).as_py():
                return None
        for name in self._doubles:
            if pc.any(pc.is_nan(table.column(name))).as_py():  # Arrow reads NaN; JSON has none
                return None
        return table.cast(self.maker.arrow)
