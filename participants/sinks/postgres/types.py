"""JSON value -> PostgreSQL column value conversion for the PostgreSQL sink (internal).

Each target column gets one converter, chosen from the column's base type at set-up. A converter
takes the JSON value of the mapped field (never ``None``: SQL NULL is handled by the caller) and
returns the Python value psycopg writes, or raises :class:`BadValue` with a reason that the sink
turns into a :class:`~twophase.participants.sdk.Rejected`. Converting on the client keeps the common bad
input (a string where a number belongs) off the server, where every error costs a savepoint
rollback; whatever we pass through unchecked the server still validates.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import math
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from psycopg.types.json import Json, Jsonb

from twophase.participants.sdk import values

__all__ = [
    "BYTE_EQUAL_TYPES",
    "KNOWN_TYPES",
    "BadValue",
    "Column",
    "Converter",
    "array_literal",
    "binary_type",
    "byte_equal",
    "converter_for",
    "json_bytes",
]

Converter = Callable[[Any], Any]

_INT_RANGES = {
    "int2": (-(2**15), 2**15 - 1),
    "int4": (-(2**31), 2**31 - 1),
    "int8": (-(2**63), 2**63 - 1),
}
#: Types we convert ourselves. Anything else (enums, inet, arrays, ranges, extensions) goes to the
#: server as text and is validated there.
KNOWN_TYPES = frozenset(
    {
        *_INT_RANGES,
        "float4",
        "float8",
        "numeric",
        "bool",
        "text",
        "varchar",
        "bpchar",
        "name",
        "json",
        "jsonb",
        "timestamptz",
        "timestamp",
        "date",
        "uuid",
        "bytea",
    }
)


#: Base types whose equal values have equal binary forms (text-like ones only under a
#: deterministic collation): keys of these can be compared by their bytes. Not numeric
#: (``1.0`` and ``1.00``), floats (``0`` and ``-0``), bpchar (trailing blanks) or json.
BYTE_EQUAL_TYPES = frozenset(
    {*_INT_RANGES, "bool", "text", "varchar", "name", "uuid", "date", "timestamp",
     "timestamptz", "bytea"}
)  # fmt: skip


def byte_equal(column: Column) -> bool:
    """Whether equal values of ``column`` always have equal binary forms."""
    return column.base_type in BYTE_EQUAL_TYPES and column.deterministic


#: Binary COPY type of each known base type (text-like types share text's wire format).
_BINARY_TYPES = {"varchar": "text", "bpchar": "text", "name": "text"}


def binary_type(base_type: str) -> str | None:
    """The psycopg type name to binary-COPY a column of ``base_type``; None: use text COPY."""
    if base_type not in KNOWN_TYPES:
        return None
    return _BINARY_TYPES.get(base_type, base_type)


#: The JSON value cannot be stored in the column; the message says why (the SDK's shared rule).
BadValue = values.BadValue


@dataclass(frozen=True, slots=True)
class Column:
    """One target column, as introspected from the catalog."""

    name: str
    base_type: str  # pg_type.typname of the column's (domain's base) type, e.g. "int8"
    sql_type: str  # format_type(), e.g. "character varying(20)"; used in casts
    not_null: bool
    has_default: bool  # DEFAULT, identity or serial: an absent field lets the server fill it
    max_length: int | None  # varchar(n)/char(n)
    #: The column's collation is deterministic (or it has none): equal text is equal bytes.
    deterministic: bool


_wrong = values.wrong


def _int_converter(type_name: str) -> Converter:
    low, high = _INT_RANGES[type_name]

    def convert(value: Any) -> Any:
        # Exact class first: the common case, and bool (an int subclass) never matches it.
        if value.__class__ is int and low <= value <= high:
            return value
        return values.to_integer(value, low, high, type_name)

    return convert


_to_float = values.to_float


def _float8(value: Any) -> Any:
    return _to_float(value)


_FLOAT4_MAX = 3.4028234663852886e38


def _float4(value: Any) -> Any:
    number = _to_float(value)
    if math.isfinite(number) and abs(number) > _FLOAT4_MAX:
        raise BadValue(f"{number} is out of range for real")
    return values.to_float32(number)  # one rounding to 0 too: PostgreSQL's float4in refuses it


def _numeric(value: Any) -> Any:
    if value.__class__ is float and value - value == 0.0:  # finite: the common case first
        return Decimal(repr(value))  # repr is the shortest exact round trip of the JSON text
    if isinstance(value, bool):
        raise _wrong(value, "a number")
    if isinstance(value, int):
        return Decimal(value) if -_WIDE < value < _WIDE else _within_numeric(Decimal(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _wrong(value, "a finite number")
        return Decimal(repr(value))  # repr is the shortest exact round trip of the JSON text
    if isinstance(value, str) and value.isascii():
        # ASCII digits only (Decimal alone reads other scripts' digits, "١٢", which PostgreSQL
        # refuses); spaces around the number and "1_000" as PostgreSQL's own input reads them.
        try:
            number = Decimal(value)
        except InvalidOperation:
            pass
        else:
            if not number.is_snan():
                return _within_numeric(number)
    raise _wrong(value, "a number")


#: What PostgreSQL's numeric holds (and psycopg's binary format sends): 131,072 digits before
#: the point, 16,383 after. Past them psycopg fails the whole COPY, not this record.
_NUMERIC_INT_DIGITS = 131_072
_NUMERIC_SCALE = 16_383
_WIDE = 10**18


def _within_numeric(number: Decimal) -> Decimal:
    if not number.is_finite():
        return number
    _sign, digits, exponent = number.as_tuple()
    assert isinstance(exponent, int)
    scale = -exponent if exponent < 0 else 0
    before = len(digits) + exponent if number else 0
    if scale > _NUMERIC_SCALE:
        raise BadValue(f"{scale} digits after the point, more than numeric's {_NUMERIC_SCALE}")
    if before > _NUMERIC_INT_DIGITS:
        raise BadValue(
            f"{before} digits before the point, more than numeric's {_NUMERIC_INT_DIGITS}"
        )
    return number


_bool = values.to_bool


def _text_converter(max_length: int | None) -> Converter:
    def convert(value: Any) -> Any:
        if value.__class__ is str or isinstance(value, str):
            text = value
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        else:
            # Objects and arrays in a text column are stored as their JSON text.
            text = json_bytes(value).decode()
        if "\x00" in text:
            raise BadValue("text contains a NUL character, which PostgreSQL cannot store")
        if max_length is not None and len(text) > max_length:
            raise BadValue(f"{len(text)} characters, longer than the column's {max_length}")
        return text

    return convert


#: Exact JSON text, integers of any width included (the SDK's shared rule).
json_bytes = values.json_text
#: ``\u0000`` escaped by the encoder (not a literal backslash followed by "u0000").
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def _encoded(data: bytes) -> bytes:
    """psycopg ``dumps`` for JSON we encoded already (module level: psycopg caches by code)."""
    return data


def _jsonb(value: Any) -> Any:
    # Encoding here, not in psycopg, keeps an unencodable value a per-record rejection.
    data = json_bytes(value)
    if b"\\u0000" in data and _NUL_ESCAPE.search(data):
        # The server refuses it (22P05); refused here it is a rejection the runtime can ask
        # for before any sink writes (Sink.check), not a write-time refusal to retract.
        raise BadValue("jsonb cannot hold a NUL character (\\u0000) in a string or a key")
    return Jsonb(data, _encoded)


def _json(value: Any) -> Any:
    return Json(json_bytes(value), _encoded)


def _parse_datetime(value: Any) -> dt.datetime:
    if not isinstance(value, str):
        raise _wrong(value, "an ISO-8601 timestamp string")
    # Python 3.11 reads "Z" and fractional seconds of any length -- and drops the digits
    # below the microsecond: those must be zeros, or the value is refused.
    text = values.micros_text(value, "timestamp")
    try:
        return dt.datetime.fromisoformat(text)
    except ValueError:
        raise _wrong(value, "an ISO-8601 timestamp string") from None


def _timestamptz(value: Any) -> Any:
    parsed = _parse_datetime(value)
    if parsed.tzinfo is None:
        # Spark and most producers write UTC without an offset; guessing the server's zone
        # would make the stored instant depend on where the database runs.
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed


def _timestamp(value: Any) -> Any:
    parsed = _parse_datetime(value)
    if parsed.tzinfo is not None:
        try:
            parsed = parsed.astimezone(dt.UTC).replace(tzinfo=None)
        except OverflowError:
            raise _wrong(value, "an instant within the years 1-9999 in UTC") from None
    return parsed


def _date(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return dt.date.fromisoformat(value)
        except ValueError:
            pass
    raise _wrong(value, "an ISO-8601 date string")


def _uuid(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            pass
    raise _wrong(value, "a UUID string")


def _bytea(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            pass
    raise _wrong(value, "a base64 string")


def _passthrough(value: Any) -> Any:
    """Types we do not model: send text and let the server parse and validate it."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, list):
        text = array_literal(value)
    else:
        text = json_bytes(value).decode()
    if "\x00" in text:
        raise BadValue("text contains a NUL character, which PostgreSQL cannot store")
    return text


def _array_element(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, list):
        return array_literal(value)
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, str):
        text = value
    else:
        text = json_bytes(value).decode()
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def array_literal(values: list[Any]) -> str:
    """PostgreSQL array input text for a JSON array (nested arrays become dimensions)."""
    return "{" + ",".join(_array_element(v) for v in values) + "}"


def converter_for(column: Column) -> Converter:
    """The converter of ``column``'s base type (text pass-through for types we do not model)."""
    base = column.base_type
    if base in _INT_RANGES:
        return _int_converter(base)
    if base == "float4":
        return _float4
    if base == "float8":
        return _float8
    if base == "numeric":
        return _numeric
    if base == "bool":
        return _bool
    if base in ("text", "varchar", "bpchar", "name"):
        return _text_converter(column.max_length)
    if base == "jsonb":
        return _jsonb
    if base == "json":
        return _json
    if base == "timestamptz":
        return _timestamptz
    if base == "timestamp":
        return _timestamp
    if base == "date":
        return _date
    if base == "uuid":
        return _uuid
    if base == "bytea":
        return _bytea
    return _passthrough
