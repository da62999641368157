"""The built-in PostgreSQL sink (``type: postgres``); see :mod:`.sink`."""

from twophase.participants.sinks.postgres.sink import PostgresSink, PostgresSinkConfig

__all__ = ["PostgresSink", "PostgresSinkConfig"]
