"""Encoders: records into buffered chunks, chunks into the bytes of one JSON Lines or Parquet file.

An encoder is also where a record is judged (:meth:`Encoder.row`), for ``write`` and ``check``
alike. The type rules are in :mod:`._schema` (a configured schema) and :mod:`._arrow` (inferred).
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from twophase.participants.sdk import PartId, Record, Rejected, values
from twophase.participants.sinks.files._arrow import (
    JSON_COLUMNS_KEY,
    MAX_NESTING,
    Columns,
    deeper_than,
    source_arrays,
    without_empty_structs,
)
from twophase.participants.sinks.files._schema import ARROW_TYPES, Mismatch, SchemaCheck
from twophase.participants.sinks.files.config import SOURCE_COLUMNS, FileSinkConfig

if TYPE_CHECKING:
    from twophase.participants.sinks.files._typed import Typing

__all__ = ["EMPTY_ROW", "Encoder", "Refused", "encoder_for", "refusal"]

#: Why an empty object is refused by Parquet without ``source_columns``.
EMPTY_ROW = "empty object: a Parquet row needs a column (or set source_columns)"


def refusal(record: Record, reason: str, field_name: str | None) -> Rejected:
    """``record`` refused for ``reason``, naming the value's field at fault when one is."""
    return Rejected(record, reason, {"field": field_name} if field_name else {})


def encoder_for(config: FileSinkConfig, typing: Typing | None = None) -> Encoder:
    """The encoder of the configured ``format``; ``typing``: records with a schema are judged
    by it (Parquet without a configured ``schema``; their files are :mod:`._typed`'s)."""
    if config.format == "parquet":
        return ParquetEncoder(config, typing)
    return JsonLinesEncoder(config)


class Refused(ValueError):
    """One record this sink cannot store; ``field_name`` when one field is at fault."""

    def __init__(self, reason: str, field_name: str | None = None) -> None:
        super().__init__(reason)
        self.field_name = field_name


class Encoder(abc.ABC):
    """Turns records into buffered chunks and chunks into the bytes of one file.

    :meth:`row` is the one place a record is judged: ``write`` (through :meth:`encode`) and
    ``check`` both call it, so they refuse exactly the same records for the same reasons.
    Nothing in it looks at other records: whether a record is refused never depends on the
    batch it came with or on its place in it."""

    extension: ClassVar[str]

    def __init__(self, config: FileSinkConfig) -> None:
        self.config = config
        self.check = SchemaCheck(config.schema_, config.unknown_fields) if config.schema_ else None

    @abc.abstractmethod
    def row(self, record: Record) -> Any:
        """What a chunk holds for ``record``; raises :class:`Mismatch` / :class:`Refused`."""

    def encode(self, records: Sequence[Record]) -> tuple[Any, list[Rejected]]:
        """A chunk of the accepted records (None when none is), and the rejected ones."""
        rows: list[Any] = []
        rejected: list[Rejected] = []
        for record in records:
            try:
                rows.append(self.row(record))
            except (Mismatch, Refused) as exc:
                rejected.append(refusal(record, str(exc), exc.field_name))
        return (self.chunk(rows) if rows else None), rejected

    def chunk(self, rows: list[Any]) -> Any:
        return rows

    @abc.abstractmethod
    def serialize(self, chunks: list[Any], part: PartId) -> memoryview:
        """The complete file content for ``chunks``."""

    @staticmethod
    def rows(chunk: Any) -> int:
        return len(chunk)

    def cut(self, chunk: Any, start: int, length: int) -> Any:
        """Rows ``start .. start+length`` of ``chunk``."""
        return chunk[start : start + length]


def _source_clash(value: Mapping[str, Any]) -> None:
    if clash := next((c for c in SOURCE_COLUMNS if c in value), None):
        raise Mismatch(clash, "collides with a source column")


class JsonLinesEncoder(Encoder):
    extension = "jsonl"

    def row(self, record: Record) -> Any:
        value: dict[str, Any] = record.value
        check = self.check
        if check is not None:
            check.convert(value)
            if not check.reject_unknown and not value.keys() <= check.names:
                value = {k: v for k, v in value.items() if k in check.names}
        if self.config.source_columns:
            _source_clash(value)
            value = {
                **value,
                "_topic": record.topic,
                "_partition": record.partition,
                "_offset": record.offset,
                "_timestamp_ms": record.timestamp_ms,
            }
        try:
            return orjson.dumps(value, option=orjson.OPT_APPEND_NEWLINE)
        except orjson.JSONEncodeError:
            pass
        try:  # integers wider than 64 bits: the exact text (docs/types.md)
            return values.json_text(value) + b"\n"
        except values.BadValue as exc:
            raise Refused(f"value cannot be written as JSON: {exc}") from None

    def serialize(self, chunks: list[Any], part: PartId) -> memoryview:
        return memoryview(b"".join(itertools.chain.from_iterable(chunks)))


class ParquetEncoder(Encoder):
    extension = "parquet"

    def __init__(self, config: FileSinkConfig, typing: Typing | None = None) -> None:
        super().__init__(config)
        schema = config.schema_ or {}
        self.arrow_schema = pa.schema([(name, ARROW_TYPES[kind]) for name, kind in schema.items()])
        #: Records with a schema are stored typed by it (never inferred) unless ``schema`` is
        #: configured, which then decides every record's types.
        self.typing = typing if self.check is None else None

    def row(self, record: Record) -> Any:
        value = record.value
        source = self.config.source_columns
        if self.typing is not None and record.schema is not None:
            # Judged by its own schema: its part writes it by the dataset's (:mod:`._typed`).
            return self.typing.check(record)
        if self.check is not None:
            row = self.check.convert(value)
            if source:
                _source_clash(value)
            return (row, record)
        if source:
            _source_clash(value)
        elif not value:
            raise Refused(EMPTY_ROW)
        # A value of n levels is at least 2n bytes of JSON: most records skip the walk.
        if (record.size == 0 or record.size > 2 * MAX_NESTING) and deeper_than(value, MAX_NESTING):
            raise Refused(f"nested deeper than {MAX_NESTING} levels")
        return record

    def chunk(self, rows: list[Any]) -> Any:
        if self.check is not None:
            return self._configured_table(rows)
        return Columns.of(rows, self.config.source_columns)

    def cut(self, chunk: Any, start: int, length: int) -> Any:
        return chunk.slice(start, length)

    def serialize(self, chunks: list[Any], part: PartId) -> memoryview:
        json_columns: list[str] = []
        if self.check is not None:
            table = chunks[0] if len(chunks) == 1 else pa.concat_tables(chunks)
        else:
            table, json_columns = Columns.table(chunks)
        table = without_empty_structs(table)
        metadata = {"twophase.part": part.token}
        if json_columns:
            metadata[JSON_COLUMNS_KEY] = orjson.dumps(json_columns).decode()
        table = table.replace_schema_metadata(metadata)
        out = pa.BufferOutputStream()
        pq.write_table(table, out, compression=self.config.parquet_compression)
        return memoryview(out.getvalue())

    def _configured_table(self, rows: list[tuple[list[Any], Record]]) -> Any:
        columns: list[list[Any]] = [[] for _ in self.arrow_schema]
        for row, _record in rows:
            for column, value in zip(columns, row, strict=True):
                column.append(value)
        arrays = [
            pa.array(column, type=f.type)
            for column, f in zip(columns, self.arrow_schema, strict=True)
        ]
        names = list(self.arrow_schema.names)
        if self.config.source_columns:
            arrays.extend(source_arrays([record for _row, record in rows]))
            names.extend(SOURCE_COLUMNS)
        return pa.Table.from_arrays(arrays, names=names)
