"""The files sink: Parquet (default) or JSON Lines, published by atomic rename (see :mod:`.sink`)."""

from twophase.participants.sinks.files.sink import FieldType, FileSink, FileSinkConfig

__all__ = ["FieldType", "FileSink", "FileSinkConfig"]
