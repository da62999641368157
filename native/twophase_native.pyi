"""twophase's optional compiled hot path: JSON and Avro source values -> PostgreSQL binary COPY."""

from collections.abc import Sequence
from typing import Any

class CopyEncoder:
    """Encodes JSON objects into binary COPY rows of one table's mapped columns."""

    def __init__(
        self,
        columns: list[tuple[str, str, int | None]],
        row_in: str | None = None,
        ops: list[str] | None = None,
        seq: bool = False,
        delete_in: str | None = None,
        key_columns: list[bool] | None = None,
    ) -> None:
        """Per target column, in COPY order: (JSON field, base type, max length).

        ``row_in`` and ``ops``: the values are change events whose row is the object in member
        ``row_in``, taken when member ``op`` is one of ``ops``. ``seq``: each row starts with
        its value's index (int8) and whether it is a delete (bool). ``delete_in`` (with
        ``seq`` and ``key_columns``, one flag per column): an event whose ``op`` is ``d`` is a
        delete, its row the key columns of the object in member ``delete_in`` and NULL in
        every other column.

        ValueError names a type the encoder does not handle."""

    def encode(
        self, values: list[bytes], keys: list[bytes | None] | None = None
    ) -> tuple[bytes, list[int]]:
        """The complete binary COPY stream of the rows taken (b"" when none), and the
        indices of the values handed back to the Python path. With ``keys`` (the record keys,
        JSON objects), a value is taken only when every key member that feeds a column
        equals the row's."""

class AvroCopyEncoder:
    """Encodes values in the schema registry's Avro framing into binary COPY rows."""

    def __init__(self, columns: list[tuple[str, str, int | None]]) -> None:
        """Per target column, in COPY order: (Avro field, base type, max length).

        ValueError names a type the encoder does not handle."""

    def add_schema(self, id: int, schema: str) -> None:
        """Learn the writer schema (Avro JSON, no references) of schema id ``id``; ValueError
        when it cannot be parsed or is not a record."""

    def knows(self, id: int) -> bool:
        """Whether the writer schema of ``id`` was given."""

    def encode(self, values: list[bytes]) -> tuple[bytes, list[int]]:
        """The complete binary COPY stream of the rows taken (b"" when none), and the
        indices of the values handed back to the Python path (any schema not given)."""

def copy_columns(payload: bytes, oids: list[int]) -> list[bytes]:
    """The columns of a binary COPY stream (``encode``'s; b"" holds no row) of ``len(oids)``
    fields per row, each as one PostgreSQL binary array whose elements have type ``oids[j]``:
    what ``unnest($1::int8[], ...)`` reads back as the same rows. ValueError when ``payload``
    is not such a stream."""

def event_columns(payload: bytes, oids: list[int], keys: list[int]) -> tuple[list[bytes], bool]:
    """``copy_columns`` of the events encoder's stream (place in the batch, delete flag, then
    the columns), and whether a key -- the fields at ``keys``, compared by their binary values
    -- has a delete followed by a row in it (also true for rows out of place order).
    ValueError when ``payload`` is not such a stream or ``keys`` names the place or flag."""

def join_lines(values: Sequence[bytes], utf8: bool = False) -> bytes | None:
    """The values joined by line breaks, or None when one is empty, does not start with
    ``{``, holds a line break, or (``utf8``) is not valid UTF-8."""

def flat_columns(
    values: list[bytes],
) -> (
    tuple[
        list[tuple[str, str, int, bytes | None, bytes, bytes | None]],
        list[int],
    ]
    | None
):
    """``values`` (each one JSON object of scalars) as Arrow buffers: per top-level field, in
    the order fields first appear, (name, kind -- "null", "int64", "double", "string" or
    "bool" --, null count, validity bitmap or None when no null, data buffer -- values, or the
    bits of a bool column --, int32 offsets of a string column or None), and the rows that are
    an empty object: what pyarrow's inference makes of the decoded objects. None when the
    reader cannot vouch for that (a nested value, a repeated key, a field of two kinds Arrow
    does not unify, an integer of more than 18 digits, invalid JSON or UTF-8)."""

def scan_values(
    msgs: list[Any], max_record_bytes: int
) -> tuple[
    list[Any],
    list[bytes],
    list[tuple[int, int]],
    list[tuple[str, int, int, int]],
    int,
]:
    """The runtime's scan of a consumed batch whose values every sink reads itself: the
    messages kept and their values, the set-aside ones by index with their size (-1: a null
    value; else a value over ``max_record_bytes``), the runs of one partition in order (topic,
    partition, highest offset, values kept), and the kept values' total size."""
