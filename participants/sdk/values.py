"""The value rules every built-in sink shares: what a JSON value may become in a typed store.

One place, so that a record meets the same rule in every sink that can apply it
(``docs/types.md`` has the table per sink). Each function returns the converted value or raises
:class:`BadValue` with a reason the sink turns into a :class:`~twophase.participants.sdk.Rejected`. None of
them ever changes a value silently: a conversion either keeps the exact value (``"12"`` -> 12,
``3.0`` -> 3) or refuses (``3.5`` into an integer, ``2**64`` into a 64-bit integer).

Values come from the runtime's JSON decoding, which keeps integers of any size exact (Python
``int``) and never yields NaN or infinities (JSON has neither).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
import uuid
from collections.abc import Callable
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import orjson

__all__ = [
    "FLOAT32_MAX",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_DECIMAL_DIGITS",
    "BadValue",
    "Nested",
    "array_of",
    "describe",
    "fit_decimal",
    "from_base64",
    "json_text",
    "micros_text",
    "nested",
    "to_bool",
    "to_float32",
    "to_date",
    "to_decimal",
    "to_float",
    "to_instant",
    "to_integer",
    "to_time",
    "to_uuid",
    "wrong",
]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: An integer spelled as a string: ASCII digits only (``int()`` would also take "١٢" and "12\n").
_INT_STRING = re.compile(r"\A[+-]?[0-9]+\Z")


class BadValue(ValueError):
    """A JSON value that the target type cannot hold exactly; the message is the reason."""


class Nested(BadValue):
    """A value inside an array, map or record refused: ``where`` below the top-level field
    (``.a[2].b``) and ``reason``; its text names both (``[2].b: expected ...``)."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(where, reason)
        self.where = where
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def nested(piece: str, exc: ValueError) -> Nested:
    """``exc`` (raised converting the value at ``piece``: ``[2]``, ``.b``) as :class:`Nested`,
    its place prefixed with ``piece``."""
    if isinstance(exc, Nested):
        return Nested(piece + exc.where, exc.reason)
    return Nested(piece, str(exc))


def array_of(item: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The converter of a JSON array whose items ``item`` converts (a null item stays None); a
    value that is not an array raises :class:`BadValue`, a refused item :class:`Nested`
    naming its index."""

    def array(value: Any) -> list[Any]:
        if value.__class__ is not list:
            raise wrong(value, "an array")
        out = []
        for i, x in enumerate(value):
            try:
                out.append(None if x is None else item(x))
            except ValueError as exc:
                raise nested(f"[{i}]", exc) from None
        return out

    return array


def describe(value: Any) -> str:
    """The JSON type of ``value``, for reasons."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def wrong(value: Any, expected: str) -> BadValue:
    """The reason a value is not of the ``expected`` kind, for a refusal."""
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return BadValue(f"expected {expected}, got {describe(value)} {shown}")


def json_text(value: Any) -> bytes:
    """The exact JSON text of ``value``: orjson (C) when it can, the standard library for
    integers wider than 64 bits (orjson refuses them; the text keeps every digit).

    :class:`BadValue` for a value nested too deeply to encode (beyond ~250 levels for orjson,
    the interpreter's recursion limit for the fallback)."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: a wide integer, or recursion past its limit
        pass
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    except RecursionError:
        raise BadValue("nested too deeply to encode as JSON text") from None
    except (TypeError, ValueError) as exc:
        raise BadValue(f"cannot be written as JSON: {exc}") from None


def _shown_int(number: int) -> str:
    """An integer for a reason: whole when short (str() refuses past 4,300 digits anyway)."""
    return str(number) if -(10**40) < number < 10**40 else "an integer of over 40 digits"


def to_integer(value: Any, low: int, high: int, type_name: str) -> int:
    """An integer in ``low..high``: an integer, a float with no fraction (3.0 -> 3), or a string
    of ASCII digits with an optional sign ("12" -> 12; ids often travel as strings so that
    JavaScript readers do not round them). Anything else, a fraction (3.5) or a value out of
    range is refused -- never rounded or wrapped."""
    if value.__class__ is int:  # the common case; bool (an int subclass) never matches it
        number = value
    elif isinstance(value, bool):
        raise wrong(value, "an integer")
    elif (
        isinstance(value, int)
        or (isinstance(value, float) and value.is_integer())
        or (isinstance(value, str) and _INT_STRING.match(value))
    ):
        try:
            number = int(value)
        except ValueError:  # digits past the interpreter's int() limit (4,300): far out of range
            raise BadValue(
                f"an integer of over 4,300 digits is out of range for {type_name}"
            ) from None
    else:
        raise wrong(value, "an integer")
    if not low <= number <= high:
        raise BadValue(f"{_shown_int(number)} is out of range for {type_name}")
    return number


def to_float(value: Any) -> float:
    """A double: a number, or a string that spells one ("1.5", "NaN", "Infinity"). An integer
    is converted to the nearest double (documented: a float column holds doubles); an integer
    too large for a double is refused."""
    if isinstance(value, bool):
        raise wrong(value, "a number")
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            raise BadValue(f"{value} is out of range for double precision") from None
    if isinstance(value, str) and value.isascii() and "_" not in value:
        # A number in ASCII digits, no "1_000" (spaces around it are PostgreSQL's own input's
        # too), or NaN/Infinity.
        try:
            number = float(value)
        except ValueError:
            pass
        else:
            if math.isinf(number) and value.lstrip("+-").lower() not in ("inf", "infinity"):
                raise BadValue(f"{value!r} is out of range for double precision")
            if number == 0.0 and _NONZERO_MANTISSA.match(value):
                raise BadValue(f"{value!r} is too close to 0 for double precision (it underflows)")
            return number
    raise wrong(value, "a number")


#: A number spelling with a digit other than 0 before its exponent.
_NONZERO_MANTISSA = re.compile(r"\A[+-]?[0.]*[1-9]")


def to_float32(value: Any) -> float:
    """:func:`to_float` within a float4 (PostgreSQL's ``real``, a Parquet ``float``): refused
    past its range, or when it would round to 0 (PostgreSQL's own ``float4in`` refuses both)."""
    number = to_float(value)
    if math.isfinite(number) and (
        abs(number) > FLOAT32_MAX or (number != 0.0 and _as_f32(number) == 0.0)
    ):
        raise BadValue(f"{number!r} is out of range for a 4-byte float (real)")
    return number


FLOAT32_MAX = 3.4028234663852886e38
_F32 = struct.Struct("f")


def _as_f32(number: float) -> float:
    value: float = _F32.unpack(_F32.pack(number))[0]
    return value


def to_bool(value: Any) -> bool:
    """A boolean: true/false, or the strings "true"/"false" in any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise wrong(value, "a boolean")


# -- values a record's schema types (``docs/types.md``, "From a record's schema") ----------------
#
# A source with a schema sends its logical types as exact JSON values: a decimal as its exact
# decimal string, dates, times and timestamps as ISO-8601, bytes as base64, a UUID as its text.
# These read them back exactly -- a value that does not spell one, or whose digits the reader
# would drop, is refused -- for every sink that stores them typed.

#: What ``Decimal`` reads, less NaN, the infinities, spaces and underscores (no store's decimal
#: type holds the first three, and the others are not JSON's spellings of a number).
_DECIMAL_TEXT = re.compile(r"\A[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z")
#: The fraction of a second in an ISO-8601 time (``HH:MM:SS.f`` or the basic ``HHMMSS.f``).
_FRACTION = re.compile(r"[.,]([0-9]+)")  # only the seconds carry a fraction in ISO-8601
_EPOCH = datetime(1970, 1, 1)
_MICRO = timedelta(microseconds=1)


def to_decimal(value: Any) -> Decimal:
    """An exact decimal: a decimal string (``"12.50"``, ``"-1.2E+3"``), an integer, or a float
    by its shortest spelling (``0.1`` -> 0.1, as PostgreSQL's ``numeric`` takes it). NaN, the
    infinities, booleans and other strings are refused."""
    if value.__class__ is str:
        if _DECIMAL_TEXT.match(value):
            return Decimal(value)
    elif isinstance(value, bool):
        pass
    elif isinstance(value, int):
        return Decimal(value)
    elif isinstance(value, float) and math.isfinite(value):
        return Decimal(repr(value))
    raise wrong(value, "a decimal number")


def fit_decimal(number: Decimal, precision: int | None, scale: int | None) -> Decimal:
    """``number`` with exactly ``scale`` fractional digits (``1.5`` -> ``1.50`` for scale 2;
    a negative scale counts zeros before the point) and at most ``precision`` digits in all.
    A digit that would be dropped, or one too many, refuses it: never rounded. None leaves
    that bound open (up to :data:`MAX_DECIMAL_DIGITS`)."""
    sign, digits, exponent = number.as_tuple()
    if not isinstance(exponent, int):  # NaN or an infinity: to_decimal never makes one
        raise BadValue(f"{number} is not a finite number")
    if not any(digits):  # zero, however spelled (0E+5): every decimal type holds it
        return Decimal((sign, (0,), -scale if scale is not None else min(exponent, 0)))
    limit = MAX_DECIMAL_DIGITS if precision is None else precision
    if scale is not None:
        if exponent > -scale:
            # Zeros appended; counted before they are made (1E+999999999 must not allocate).
            if _significant(digits) + exponent + scale > limit:
                raise _too_many(number, precision, scale)
            digits += (0,) * (exponent + scale)
        elif exponent < -scale:
            cut = -scale - exponent
            if any(digits[-cut:]):
                shown = _shown_decimal(number)
                raise BadValue(
                    f"{shown} has more than {scale} digits after the point"
                    if scale >= 0
                    else f"{shown} is not a multiple of 1E+{-scale}"
                )
            digits = digits[:-cut]
        exponent = -scale
    if _significant(digits) > limit:
        raise _too_many(number, precision, scale)
    return Decimal((sign, digits or (0,), exponent))


#: Digits a decimal may have when no precision bounds it: far beyond any store's decimal type
#: (PostgreSQL's ``numeric`` stops at 131,072 before the point), and small enough to handle.
MAX_DECIMAL_DIGITS = 1_000


def _significant(digits: tuple[int, ...]) -> int:
    """Digits of a coefficient without its leading zeros (at least one)."""
    for i, d in enumerate(digits):
        if d:
            return len(digits) - i
    return 1


def _shown_decimal(number: Decimal) -> str:
    """A decimal for a reason: whole when short."""
    text = str(number)
    return text if len(text) <= 60 else f"a number of {len(number.as_tuple().digits)} digits"


def _too_many(number: Decimal, precision: int | None, scale: int | None) -> BadValue:
    shown = _shown_decimal(number)
    if precision is None:
        return BadValue(f"{shown} has more than {MAX_DECIMAL_DIGITS} digits")
    return BadValue(f"{shown} has more than {precision} digits (decimal({precision},{scale}))")


def micros_text(value: str, what: str) -> str:
    """``value`` with its fraction of a second cut to microseconds, when every digit cut is
    a zero; refused otherwise (``datetime.fromisoformat`` would drop them silently)."""
    m = _FRACTION.search(value)
    if m is None or len(m.group(1)) <= 6:
        return value
    if m.group(1)[6:].strip("0"):
        raise BadValue(f"{what} {value!r} has digits below the microsecond")
    return value[: m.start(1) + 6] + value[m.end(1) :]


def to_instant(value: Any, *, local: bool = False) -> int:
    """Microseconds since 1970-01-01T00:00:00 of an ISO-8601 date-time string. An instant
    (``local`` false) is taken in UTC: its offset is applied, and one without an offset is
    UTC. A local (wall-clock) date-time (``local``) is counted as if it were UTC, and one with
    an offset is refused. Digits below the microsecond are refused unless they are zeros."""
    if value.__class__ is not str:
        raise wrong(value, "an ISO-8601 date-time")
    what = "local date-time" if local else "timestamp"
    text = micros_text(value, what)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise wrong(value, f"an ISO-8601 {what}") from None
    offset = moment.utcoffset()
    if offset is not None and local:
        raise BadValue(f"local date-time {value!r} has an offset (a wall-clock time has none)")
    micros = (moment.replace(tzinfo=None) - _EPOCH) // _MICRO
    return micros - (offset // _MICRO if offset is not None else 0)


def to_date(value: Any) -> date:
    """A calendar date from its ISO-8601 text (``2024-05-01``)."""
    if value.__class__ is str:
        try:
            return date.fromisoformat(value)
        except ValueError:
            pass
    raise wrong(value, "an ISO-8601 date")


def to_time(value: Any) -> int:
    """Microseconds since midnight of an ISO-8601 time of day (``13:45:00.000001``); one with
    an offset, or digits below the microsecond that are not zeros, is refused."""
    if value.__class__ is str:
        text = micros_text(value, "time")
        try:
            moment = time.fromisoformat(text)
        except ValueError:
            pass
        else:
            if moment.tzinfo is not None:
                raise BadValue(f"time {value!r} has an offset (a time of day has none)")
            return ((moment.hour * 60 + moment.minute) * 60 + moment.second) * 1_000_000 + (
                moment.microsecond
            )
    raise wrong(value, "an ISO-8601 time of day")


def from_base64(value: Any) -> bytes:
    """The bytes a standard base64 string (with its padding) spells."""
    if value.__class__ is str:
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            pass
    raise wrong(value, "base64")


def to_uuid(value: Any) -> uuid.UUID:
    """The UUID a string spells (``a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11``, any case, with or
    without hyphens or braces)."""
    if value.__class__ is str:
        try:
            return uuid.UUID(value)
        except ValueError:
            pass
    raise wrong(value, "a UUID")
