"""Iceberg's primitive types by the names users and record schemas give them."""

from __future__ import annotations

from pyiceberg.types import (
    BinaryType,
    BooleanType,
    DateType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    PrimitiveType,
    StringType,
    TimestampType,
    TimestamptzType,
    TimeType,
    UUIDType,
)

__all__ = ["BY_KIND", "BY_NAME", "KIND_OF"]

#: ``create_table``'s type names (Iceberg's own; ``decimal(p, s)`` apart).
BY_NAME: dict[str, PrimitiveType] = {
    "boolean": BooleanType(),
    "int": IntegerType(),
    "long": LongType(),
    "float": FloatType(),
    "double": DoubleType(),
    "date": DateType(),
    "time": TimeType(),
    "timestamp": TimestampType(),
    "timestamptz": TimestamptzType(),
    "string": StringType(),
    "uuid": UUIDType(),
    "binary": BinaryType(),
}
#: A record schema's kinds (:mod:`twophase.participants.sdk.schema`; ``decimal`` apart).
BY_KIND: dict[str, PrimitiveType] = {
    "boolean": BooleanType(),
    "int32": IntegerType(),
    "int64": LongType(),
    "float32": FloatType(),
    "float64": DoubleType(),
    "string": StringType(),
    "enum": StringType(),
    "json": StringType(),
    "bytes": BinaryType(),
    "uuid": UUIDType(),
    "date": DateType(),
    "time": TimeType(),
    "timestamp": TimestamptzType(),
    "timestamp_local": TimestampType(),
}
#: The kind of a column's type, to compare a table with a record schema.
KIND_OF: dict[type, str] = {
    BooleanType: "boolean",
    IntegerType: "int32",
    LongType: "int64",
    FloatType: "float32",
    DoubleType: "float64",
    StringType: "string",
    BinaryType: "bytes",
    UUIDType: "uuid",
    DateType: "date",
    TimeType: "time",
    TimestamptzType: "timestamp",
    TimestampType: "timestamp_local",
}
