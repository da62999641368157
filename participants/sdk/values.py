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

import json
import re
from typing import Any

import orjson

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "BadValue",
    "describe",
    "wrong",
    "json_text",
    "to_bool",
    "to_float",
    "to_integer",
]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: An integer spelled as a string: ASCII digits only (``int()`` would also take "١٢" and "12\n").
_INT_STRING = re.compile(r"\A[+-]?[0-9]+\Z")


class BadValue(ValueError):
    """A JSON value that the target type cannot hold exactly; the message is the reason."""


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
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise wrong(value, "a number")


def to_bool(value: Any) -> bool:
    """A boolean: true/false, or the strings "true"/"false" in any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise wrong(value, "a boolean")
