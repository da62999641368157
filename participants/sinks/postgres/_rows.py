"""Records into rows: the per-column plan (target column, JSON field, converter), the
straight-line conversion loop compiled from it, and the converted row with the records it holds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from twophase.participants.sdk import (
    Record,
    Rejected,
)
from twophase.participants.sinks.postgres.types import (
    Column,
    Converter,
)

__all__ = [
    "_ABSENT",
    "_Absent",
    "_BatchConverter",
    "_Irregular",
    "_Mapped",
    "_PlanStep",
    "_Row",
    "_compile_plan",
    "_nested_getter",
]


class _Absent:
    """Marks a field missing from the record (as opposed to an explicit JSON null)."""


_ABSENT = _Absent()


def _nested_getter(path: str) -> Callable[[dict[str, Any]], Any] | None:
    """Reads ``path`` ("a.b.c") from a record value; _ABSENT when any step is missing."""
    if "." not in path:
        return None
    steps = path.split(".")

    def get_nested(value: dict[str, Any]) -> Any:
        current: Any = value
        for step in steps:
            if not isinstance(current, dict) or step not in current:
                return _ABSENT
            current = current[step]
        return current

    return get_nested


@dataclass(frozen=True, slots=True)
class _Mapped:
    """One target column fed from one JSON field."""

    column: Column
    field: str
    #: None: ``field`` is a top-level key (the fast path); else reads a dotted path.
    get: Callable[[dict[str, Any]], Any] | None
    convert: Converter
    is_key: bool


#: Per column: field, getter (None = top level), converter, reason when absent (None = allowed),
#: reason when null (None = allowed).
_PlanStep = tuple[str, Callable[[dict[str, Any]], Any] | None, Converter, str | None, str | None]


class _Irregular(Exception):
    """A field is null or missing: the record takes the careful path, which knows the rule."""


#: (records, the careful one-record path) -> a row or a rejection per record, in order.
_BatchConverter = Callable[
    [Sequence[Record], Callable[[Record], "_Row | Rejected"]], "list[_Row | Rejected]"
]


def _compile_plan(plan: list[_PlanStep]) -> _BatchConverter:
    """The conversion loop for one table, as straight-line Python: per column one lookup, two
    identity checks and the converter -- no per-column loop, tuple unpacking or mask updates.
    A record with a null or missing field, or a value its converter refuses, goes to ``slow``
    (the generic path), so every rule and every rejection reason stays in one place."""
    n = len(plan)
    lines = [
        "def convert_batch(records, slow):",
        "    out = []",
        "    append = out.append",
        "    for record in records:",
        "        if record.deleted:",
        "            append(slow(record))",
        "            continue",
        "        value = record.value",
        "        try:",
    ]
    env: dict[str, Any] = {
        "_Row": _Row,
        "ABSENT": _ABSENT,
        "Irregular": _Irregular,
    }
    for i, (field_name, get, convert, _absent, _null) in enumerate(plan):
        env[f"c{i}"] = convert
        if get is None:
            lines.append(f"            r{i} = value.get({field_name!r}, ABSENT)")
        else:
            env[f"g{i}"] = get
            lines.append(f"            r{i} = g{i}(value)")
        lines.append(f"            if r{i} is None or r{i} is ABSENT: raise Irregular")
    values = ", ".join(f"c{i}(r{i})" for i in range(n))
    lines += [
        f"            append(_Row({(1 << n) - 1}, [{values}], [record]))",
        # Anything a converter raises sends the record down the slow path, which says why.
        "        except Exception:",
        "            append(slow(record))",
        "    return out",
    ]
    exec(compile("\n".join(lines), "<postgres sink conversion>", "exec"), env)
    fn: _BatchConverter = env["convert_batch"]
    return fn


@dataclass(slots=True)
class _Row:
    """A converted row: ``values`` spans every mapped column; ``mask`` bit i = column i present.

    In upsert mode one row may merge several records with the same key (later fields overlay
    earlier ones, as running them one after the other would); ``history`` then keeps each
    record's own row so a server-side refusal can be pinned on the right record.

    ``deleted``: the row of this key is deleted (only the key's columns are set).
    ``replaces``: a delete came first, so the existing row is deleted before this one is
    written (its absent columns take their defaults, not the deleted row's values).
    """

    mask: int
    values: list[Any]
    records: list[Record]
    history: list[_Row] | None = None
    deleted: bool = False
    replaces: bool = False
