"""Registry formats: the Confluent wire format (a magic byte, the schema's id) with Avro,
Protobuf or JSON Schema, decoded with the schema the registry holds under that id.

Not built yet (issue #18): a source that names one fails at start-up with this message.
"""

from __future__ import annotations

from typing import ClassVar

from twophase.config import SchemaRegistryConfig
from twophase.errors import ConfigError
from twophase.participants.decoding.formats import FormatResult, ValueFormat

__all__ = ["RegistryFormat"]


class RegistryFormat(ValueFormat):
    name: ClassVar[str] = "registry"

    def __init__(self, kind: str, registry: SchemaRegistryConfig) -> None:
        raise ConfigError(
            f"sources[].value_format/key_format {kind}", "registry formats are not built yet"
        )

    def decode(self, data: bytes, topic: str, is_key: bool = False) -> FormatResult:
        raise NotImplementedError
