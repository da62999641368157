"""The built-in PostgreSQL sink (``type: postgres``); see :mod:`.sink`."""

from twophase.participants.sinks.postgres.config import PostgresSinkConfig
from twophase.participants.sinks.postgres.sink import PostgresSink

__all__ = ["PostgresSink", "PostgresSinkConfig"]
