"""The public participant SDK: everything a sink needs, and nothing else.

Built-in sinks (:mod:`participants.sinks`) import only from here. A third-party sink package
registers its class under the ``twophase.sinks`` entry-point group and becomes usable by its name
in a pipeline's ``sinks[].type``.
"""

from participants.sdk.errors import (
    AbortTransactionError,
    BackpressureError,
    FatalSinkError,
    RetriableSinkError,
    SinkError,
    UnknownPartError,
)
from participants.sdk.records import PartId, Positions, Record, Rejected, TopicPartition
from participants.sdk.sink import Sink, SinkConfig, SinkContext

__all__ = [
    "AbortTransactionError",
    "BackpressureError",
    "FatalSinkError",
    "PartId",
    "Positions",
    "Record",
    "Rejected",
    "RetriableSinkError",
    "Sink",
    "SinkConfig",
    "SinkContext",
    "SinkError",
    "TopicPartition",
    "UnknownPartError",
]
