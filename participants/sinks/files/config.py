"""The files sink's configuration: the ``sinks[]`` entry of ``type: files``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator

from twophase.participants.sdk import SinkConfig

__all__ = ["SOURCE_COLUMNS", "FieldType", "FileSinkConfig"]

#: The columns ``source_columns`` adds to every row: where the record came from.
SOURCE_COLUMNS = ("_topic", "_partition", "_offset", "_timestamp_ms")
#: The default bound on an open part's buffered records: a participant's memory stays bounded
#: at any rate (a 1M-record PG + files run: peak RSS ~255 MB at 100,000 against ~305 MB at
#: 500,000, the same records/s: README.md, "Memory").
DEFAULT_BUFFERED_RECORDS = 100_000

FieldType = Literal[
    "string", "int32", "int64", "float32", "float64", "bool", "timestamp", "date", "json"
]


class FileSinkConfig(SinkConfig):
    """``sinks[]`` entry of ``type: files``."""

    type: Literal["files"]
    #: Base directory of the dataset; must be one local (POSIX) file system.
    path: Path
    #: ``parquet``, or ``jsonl`` (JSON Lines: one record per line).
    format: Literal["parquet", "jsonl"] = "parquet"
    #: Parquet codec. Default snappy for Parquet; JSON Lines supports only ``none``.
    compression: Literal["snappy", "zstd", "none"] | None = None
    #: ``topic+date``: ``{path}/{topic}/date=YYYY-MM-DD/`` (UTC date of the record timestamp;
    #: ``date=__HIVE_DEFAULT_PARTITION__`` when it has none or is after 9999-12-31).
    partition_by: Literal["topic+date", "topic", "none"] = "topic+date"
    #: A file is closed and a new one started after this many records.
    max_file_records: int = Field(default=250_000, ge=1)
    #: Records held in memory across all files of the open part (beyond it the largest
    #: buffered file is written early); default 100,000, or 2 x max_file_records when lower.
    max_buffered_records: int | None = Field(default=None, ge=1)
    #: ``{field: type}``. Records are checked against it; without it, Parquet types a record
    #: that has a schema by that schema, and infers the others' types per file.
    schema_: dict[str, FieldType] | None = Field(default=None, alias="schema")
    #: With ``schema``: reject records that carry fields it does not name, or drop those fields.
    unknown_fields: Literal["reject", "drop"] = "reject"
    #: Add ``_topic``, ``_partition``, ``_offset``, ``_timestamp_ms`` to every row.
    source_columns: bool = False
    #: A column that tells each row's change: ``u`` (a create or update: the row's fields) or
    #: ``d`` (a delete: the deleted row's key fields). Set, the sink takes deletes as change
    #: rows; applying the rows of a topic in ``(_partition, _offset)`` order gives the current
    #: state (``docs/cdc.md``), so it needs ``source_columns``. Empty: no column, and a
    #: pipeline that can delete refuses the sink at start-up.
    op_column: str = ""
    #: Parquet, records with a schema (``value_format: connect_json``, Debezium's envelope, the
    #: registry formats): a record whose schema is a compatible change of its dataset's (a
    #: field added, a type widened, a field made optional) changes it, in the part that brings
    #: it -- recorded in the part's manifest and merged into ``{dataset}/_common_metadata`` when
    #: the part commits. False: such records are refused (dead-lettered) with the change named.
    #: Incompatible changes are refused either way. A dataset's first schema is made from its
    #: first record (a directory needs no permission: ``auto_create`` is always on for files).
    #: ``docs/types.md``, "From a record's schema".
    auto_evolve: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.format == "jsonl" and self.compression not in (None, "none"):
            raise ValueError("compression: JSON Lines files support only 'none'")
        if self.schema_ is not None:
            if not self.schema_:
                raise ValueError("schema: name at least one field (or leave it out to infer)")
            if self.source_columns and (clash := set(SOURCE_COLUMNS) & set(self.schema_)):
                raise ValueError(f"schema: {sorted(clash)} collide with source_columns")
            if self.op_column and self.schema_.get(self.op_column) != "string":
                raise ValueError(f"schema: must name op_column {self.op_column!r} as string")
        if self.auto_evolve and self.format != "parquet":
            raise ValueError(
                "auto_evolve: JSON Lines files carry no schema (each value is its exact JSON text)"
            )
        if self.auto_evolve and self.schema_ is not None:
            raise ValueError(
                "auto_evolve: a configured schema decides every record's types; leave it out "
                "to type records by their own schemas"
            )
        if self.op_column and not self.source_columns:
            raise ValueError("op_column: needs source_columns: true (the order to replay rows in)")
        if self.source_columns and self.op_column in SOURCE_COLUMNS:
            raise ValueError(f"op_column: {self.op_column!r} is one of the source_columns")
        return self

    @property
    def parquet_compression(self) -> str:
        return self.compression or "snappy"

    @property
    def buffered_limit(self) -> int:
        return self.max_buffered_records or min(DEFAULT_BUFFERED_RECORDS, 2 * self.max_file_records)
