"""The raw path of inferred Parquet: JSON values straight into the :class:`~._arrow.Columns` the
decoded path would make of their records, with Arrow's JSON reader (no Python object per record).

What the decoded path does with a batch -- each record judged by :meth:`Encoder.row`, the rest
typed by one inference over the batch (``pa.array`` of the decoded objects) -- is done here
with the same outcome, or not at all: :meth:`RawReader.read` answers None for any batch it
cannot vouch for (:mod:`twophase.participants.sdk.rawjson` says which), and the sink then
decodes it. The judgement per record needs no decoding in the common case: a value nested
deeper than the limit shows in the inferred type, an empty object by its bytes.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from twophase.participants.sdk.rawjson import (
    exact_doubles,
    join_lines,
    read_flat,
    read_lines,
    strings_for_timestamps,
)
from twophase.participants.sinks.files._arrow import MAX_NESTING
from twophase.participants.sinks.files.config import SOURCE_COLUMNS

__all__ = ["RawRead", "RawReader"]

#: A line that holds an empty object (the values start with ``{``; JSON's whitespace).
_EMPTY_OBJECT = re.compile(rb"\{[ \t\r]*\}[ \t\r]*")


@dataclass(slots=True)
class RawRead:
    """One batch's values read: ``fields`` per top-level field (one Arrow array each, rows in
    the values' order) and ``empty``, the rows that held an empty object."""

    rows: int
    fields: dict[str, Any]
    empty: list[int]


def _depth(kind: Any) -> int:
    """Value nesting levels a column of ``kind`` holds (an object or a list is one level)."""
    if pa.types.is_struct(kind):
        return 1 + max((_depth(f.type) for f in kind), default=0)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return 1 + _depth(kind.value_type)
    return 0


#: The most readings of one stream that a run of refusals of the compiled reading
#: (:func:`read_flat`) sends straight to Arrow's reader before it is tried again.
FLAT_SKIP_MAX = 32
#: Streams whose refusals are remembered (forgotten all at once past this many).
_STREAMS_KEPT = 1024


class RawReader:
    """JSON object values into the fields :meth:`Columns.of` makes of their records.

    A batch's timestamps are read as the strings they are: Arrow infers a timestamp from an ISO
    string, and the decoded path keeps the text. Top-level fields that did so in the last batch
    are named as strings up front, so a steady stream is read once; otherwise a batch whose
    inferred schema has a timestamp or a list is read a second time with its schema given
    (:func:`~twophase.participants.sdk.rawjson.strings_for_timestamps`)."""

    def __init__(self, source_columns: bool) -> None:
        self.source_columns = source_columns
        #: Top-level fields the last batch held ISO strings in: read as strings up front.
        self._strings: pa.Schema | None = None
        #: Per stream: [readings to hand straight to Arrow's reader before the compiled reading
        #: is tried again, how many the next refusal skips]. A refusal after a reading it took
        #: skips none; each refusal in a row after it skips 1, 2, 4 ... up to FLAT_SKIP_MAX. A
        #: stream of nested values is not read twice per batch; a flat stream with a nested
        #: batch now and then loses nothing.
        self._flat: dict[Hashable, list[int]] = {}

    def _read_flat(
        self, values: Sequence[bytes], stream: Hashable
    ) -> tuple[dict[str, pa.Array], list[int]] | None:
        state = self._flat.get(stream)
        if state is None:
            if len(self._flat) >= _STREAMS_KEPT:
                self._flat.clear()
            state = self._flat[stream] = [0, 0]
        if state[0] > 0:
            state[0] -= 1
            return None
        flat = read_flat(values)
        if flat is None:
            state[0] = state[1]
            state[1] = min(max(1, 2 * state[1]), FLAT_SKIP_MAX)
        else:
            state[1] = 0
        return flat

    def read(self, values: Sequence[bytes], stream: Hashable = None) -> RawRead | None:
        """The values read (None: decode them instead). ``stream``: what they belong to (the
        files sink: the output dataset), so that one stream's nested values do not keep
        another's flat ones from the compiled reading."""
        flat = self._read_flat(values, stream)
        if flat is not None:
            # Objects of scalars, read in one compiled pass: the decoded path's types exactly.
            columns, empty_rows = flat
            if self.source_columns and any(c in columns for c in SOURCE_COLUMNS):
                return None  # some value has a field that collides with a source column
            return RawRead(len(values), columns, [] if self.source_columns else empty_rows)
        data = join_lines(values, utf8=True)
        if data is None:
            return None
        n = len(values)
        table = None
        if self._strings is not None:
            table = self._read_hinted(data, values)
            if table is None:
                self._strings = None  # the next reading remembers again
        if table is None:
            table = read_lines(data, n)
            if table is None:
                return None
            again = strings_for_timestamps(table.schema)
            if again is not None:
                self._remember(table.schema)
                table = read_lines(data, n, pa_json.ParseOptions(explicit_schema=again))
                if table is None:
                    return None
        if not exact_doubles(table):
            return None
        # Deeper than the limit: refused by the decoded path (Encoder.row); it names them.
        if any(_depth(f.type) + 1 > MAX_NESTING for f in table.schema):
            return None
        if self.source_columns and any(c in table.column_names for c in SOURCE_COLUMNS):
            return None  # some value has a field that collides with a source column
        table = table.combine_chunks()
        fields = {
            name: (col.chunk(0) if col.num_chunks == 1 else col.combine_chunks())
            for name, col in zip(table.column_names, table.columns, strict=True)
        }
        empty: list[int] = []
        if not self.source_columns:
            # An empty object reads as a row with every column null; of those rows, the ones
            # whose value is ``{}`` (give or take whitespace) are refused by the decoded path.
            nulls = [pc.is_null(f) for f in fields.values()]
            if not nulls:
                maybe = list(range(n))
            elif any(f.null_count for f in fields.values()):
                every = nulls[0]
                for more in nulls[1:]:
                    every = pc.and_(every, more)
                maybe = pc.indices_nonzero(every).to_pylist()
            else:
                maybe = []
            empty = [i for i in maybe if _EMPTY_OBJECT.fullmatch(values[i])]
        return RawRead(n, fields, empty)

    def _remember(self, schema: pa.Schema) -> None:
        strings = [pa.field(f.name, pa.string()) for f in schema if pa.types.is_timestamp(f.type)]
        self._strings = pa.schema(strings) if strings else None

    def _read_hinted(self, data: bytes, values: Sequence[bytes]) -> pa.Table | None:
        """The batch read with the remembered fields given as strings; None when that would not
        be what inference over the batch gives: a given field that is null (or absent)
        everywhere, an inferred one that needs the second reading, or field order that the
        first value does not settle (Arrow puts the given fields first; the decoded path orders
        fields by first appearance)."""
        assert self._strings is not None
        table = read_lines(data, len(values), pa_json.ParseOptions(explicit_schema=self._strings))
        if table is None:
            return None
        given = set(self._strings.names)
        for f, col in zip(table.schema, table.columns, strict=True):
            if f.name in given:
                if col.null_count == len(col):
                    return None
            elif strings_for_timestamps(pa.schema([f])) is not None:
                return None
        try:
            first = orjson.loads(values[0])
        except orjson.JSONDecodeError:
            return None
        order = list(first) if first.__class__ is dict else []
        if len(order) != table.num_columns or set(order) != set(table.column_names):
            return None
        return table.select(order)
