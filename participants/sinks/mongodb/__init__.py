"""The MongoDB sink: staged documents, committed with chunked MongoDB transactions (see :mod:`.sink`)."""

from twophase.participants.sinks.mongodb.sink import MongoSink, MongoSinkConfig

__all__ = ["MongoSink", "MongoSinkConfig"]
