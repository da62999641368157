"""The public participant SDK: everything a sink needs, and nothing else.

Built-in sinks (:mod:`twophase.participants.sinks`) import only from here. A third-party sink package
registers its class under the ``twophase.sinks`` entry-point group and becomes usable by its name
in a pipeline's ``sinks[].type``.

* :class:`Sink` -- the contract (:mod:`twophase.participants.sdk.sink` documents every rule).
* :class:`BatchingSink` -- the contract built on six store operations, for stores with local
  transactions but no two-phase commit (:mod:`twophase.participants.sdk.batching`), with
  :class:`OpenSlot` for what its store operations hold in memory about the open part, and the
  marker's positions as JSON (:func:`positions_to_json`, :func:`positions_from_json`).
* the durable file-system steps of :mod:`twophase.participants.sdk.staging`, for sinks that stage files.
* :class:`RecordSchema` -- the types a source says its values have (:attr:`Record.schema`),
  and :func:`compare`, the one rule for which schema changes a target may follow
  (:mod:`twophase.participants.sdk.schema`).
* :class:`TargetTemplate` -- a target name per record (``table: ${topic}``), for sinks that
  route records to many tables or collections (:mod:`twophase.participants.sdk.routing`).
* :mod:`twophase.participants.sdk.rawjson` -- raw JSON values into Arrow (``pyarrow.json``) by
  the runtime's decoding rules, for sinks with a raw path (imported on its own).
* :mod:`twophase.participants.sdk.values` -- the value conversions the built-in sinks share
  (``docs/types.md``), so a record meets the same rule in every sink.
* :mod:`twophase.participants.sdk.testkit` -- the conformance kit, a pytest plugin (imported on its own:
  it needs pytest, a sink at run time does not).

Guide: ``docs/write-a-sink.md``.
"""

from twophase.participants.sdk.batching import (
    BatchingSink,
    OpenSlot,
    PartMarker,
    PartState,
    positions_from_json,
    positions_to_json,
)
from twophase.participants.sdk.errors import (
    AbortTransactionError,
    BackpressureError,
    FatalSinkError,
    RetriableSinkError,
    SinkError,
    UnknownPartError,
)
from twophase.participants.sdk.records import (
    AVRO,
    PLAIN_JSON,
    CommittedInfo,
    Held,
    PartId,
    Positions,
    RawBatch,
    RawShape,
    Record,
    Rejected,
    TopicPartition,
)
from twophase.participants.sdk.routing import (
    TargetTemplate,
    check_template,
    check_topic_replace,
    is_template,
)
from twophase.participants.sdk.schema import Change, Field, FieldType, RecordSchema, compare
from twophase.participants.sdk.sink import Sink, SinkConfig, SinkContext
from twophase.participants.sdk.staging import (
    discard_tree,
    fsync_dir,
    makedirs_durable,
    read_json,
    remove_tree,
    rename_durable,
    write_atomic,
    write_durable,
    write_json_atomic,
)

__all__ = [
    "AVRO",
    "PLAIN_JSON",
    "AbortTransactionError",
    "BackpressureError",
    "BatchingSink",
    "Change",
    "CommittedInfo",
    "FatalSinkError",
    "Field",
    "FieldType",
    "Held",
    "OpenSlot",
    "PartId",
    "PartMarker",
    "PartState",
    "Positions",
    "RawBatch",
    "RawShape",
    "Record",
    "RecordSchema",
    "Rejected",
    "RetriableSinkError",
    "Sink",
    "SinkConfig",
    "SinkContext",
    "SinkError",
    "TargetTemplate",
    "TopicPartition",
    "UnknownPartError",
    "check_template",
    "compare",
    "check_topic_replace",
    "discard_tree",
    "fsync_dir",
    "is_template",
    "makedirs_durable",
    "positions_from_json",
    "positions_to_json",
    "read_json",
    "remove_tree",
    "rename_durable",
    "write_atomic",
    "write_durable",
    "write_json_atomic",
]
