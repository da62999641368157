"""Control-topic messages (version 1). The JSON Schemas in ``control-topic/schemas`` are the source
of truth; these dataclasses are the Python binding, checked against the golden examples.

Every message travels in an :class:`Envelope`: id, numbered type, version, timestamp, pipeline,
sender, payload and an optional HMAC. Readers ignore fields they do not know.
Votes carry positions and counts, never data, so a message stays far below ``max.request.size``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias

__all__ = [
    "PROTOCOL_VERSION",
    "Applied",
    "COORDINATOR_MESSAGES",
    "Checkpoint",
    "Complete",
    "Decision",
    "Drained",
    "Envelope",
    "MessageType",
    "Outcome",
    "Part",
    "PartitionRange",
    "Payload",
    "PendingCommit",
    "Position",
    "Prepare",
    "REPLIES",
    "Vote",
    "VoteValue",
]

PROTOCOL_VERSION = 1


#: Largest integer any field may hold on read: Kafka offsets and every counter here are 64-bit.
INT_MAX = 2**63 - 1


def read_int(d: dict[str, Any], key: str, minimum: int, default: int | None = None) -> int:
    """A schema integer: a JSON integer (not a bool, not a float such as 3.7 or 1e300) within
    ``[minimum, INT_MAX]``. Raises ValueError/KeyError, which the reader counts as malformed."""
    value = d[key] if default is None or key in d else default
    if type(value) is not int:
        raise ValueError(f"{key} must be an integer, got {type(value).__name__}")
    if not minimum <= value <= INT_MAX:
        raise ValueError(f"{key} {value} is outside [{minimum}, {INT_MAX}]")
    return value


def read_str(d: dict[str, Any], key: str, default: str | None = None, min_len: int = 0) -> str:
    value = d[key] if default is None or key in d else default
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {type(value).__name__}")
    if len(value) < min_len:
        raise ValueError(f"{key} must not be empty")
    return value


def _objects(d: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """A list of JSON objects (absent: empty)."""
    value = d.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"{key} must be a list of objects")
    return value


def _strings(d: dict[str, Any], key: str) -> tuple[str, ...]:
    """A list of non-empty strings (absent: empty)."""
    value = d.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{key} must be a list of non-empty strings")
    return tuple(value)


class MessageType(enum.IntEnum):
    PREPARE = 1
    VOTE = 2
    DECISION = 3
    APPLIED = 4
    COMPLETE = 5
    CHECKPOINT = 6
    DRAINED = 7


class Outcome(enum.StrEnum):
    COMMIT = "commit"
    ABORT = "abort"


class VoteValue(enum.StrEnum):
    PREPARED = "prepared"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class Position:
    """Next offset to consume in one source partition."""

    topic: str
    partition: int
    offset: int

    def to_json(self) -> dict[str, Any]:
        return {"topic": self.topic, "partition": self.partition, "offset": self.offset}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Position:
        return cls(
            read_str(d, "topic", min_len=1), read_int(d, "partition", 0), read_int(d, "offset", 0)
        )


@dataclass(frozen=True, slots=True)
class PartitionRange:
    """What one vote covers in one partition: offsets ``[start, end)``, their count and DLQ count."""

    topic: str
    partition: int
    start: int
    end: int
    records: int = 0
    dead_lettered: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "start": self.start,
            "end": self.end,
            "records": self.records,
            "dead_lettered": self.dead_lettered,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PartitionRange:
        return cls(
            read_str(d, "topic", min_len=1),
            read_int(d, "partition", 0),
            read_int(d, "start", 0),
            read_int(d, "end", 0),
            read_int(d, "records", 0, default=0),
            read_int(d, "dead_lettered", 0, default=0),
        )


@dataclass(frozen=True, slots=True)
class Part:
    """One participant's share of a committed transaction, and the sinks it prepared in."""

    participant: str
    generation: int
    sinks: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "participant": self.participant,
            "generation": self.generation,
            "sinks": list(self.sinks),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Part:
        return cls(
            read_str(d, "participant", min_len=1),
            read_int(d, "generation", -1),
            _strings(d, "sinks"),
        )


@dataclass(frozen=True, slots=True)
class Prepare:
    """Coordinator -> participants: close the open part as transaction ``txn`` and vote."""

    TYPE: ClassVar[MessageType] = MessageType.PREPARE
    txn: int
    deadline_ms: int

    def to_json(self) -> dict[str, Any]:
        return {"txn": self.txn, "deadline_ms": self.deadline_ms}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Prepare:
        return cls(read_int(d, "txn", 1), read_int(d, "deadline_ms", 0))


@dataclass(frozen=True, slots=True)
class Vote:
    """Participant -> coordinator: the part is durably prepared (or cannot be)."""

    TYPE: ClassVar[MessageType] = MessageType.VOTE
    txn: int
    participant: str
    generation: int
    member_id: str
    vote: VoteValue
    partitions: tuple[PartitionRange, ...] = ()
    sinks: tuple[str, ...] = ()
    reason: str = ""
    #: The source topics the voter's consumer subscribed to for this generation's assignment;
    #: None (absent): every source topic (a voter that reads a fixed set, e.g. the Spark driver).
    topics: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "txn": self.txn,
            "participant": self.participant,
            "generation": self.generation,
            "member_id": self.member_id,
            "vote": self.vote.value,
            "partitions": [p.to_json() for p in self.partitions],
            "sinks": list(self.sinks),
        }
        if self.reason:
            d["reason"] = self.reason
        if self.topics is not None:
            d["topics"] = list(self.topics)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Vote:
        return cls(
            read_int(d, "txn", 1),
            read_str(d, "participant", min_len=1),
            read_int(d, "generation", -1),
            read_str(d, "member_id", ""),
            VoteValue(read_str(d, "vote")),
            tuple(PartitionRange.from_json(p) for p in _objects(d, "partitions")),
            _strings(d, "sinks"),
            read_str(d, "reason", ""),
            _strings(d, "topics") if "topics" in d else None,
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """Coordinator -> all: the commit point. ``positions`` are every source partition's committed
    position after this transaction (commit only); ``parts`` are the parts to commit."""

    TYPE: ClassVar[MessageType] = MessageType.DECISION
    txn: int
    outcome: Outcome
    parts: tuple[Part, ...] = ()
    positions: tuple[Position, ...] = ()
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "txn": self.txn,
            "outcome": self.outcome.value,
            "parts": [p.to_json() for p in self.parts],
            "positions": [p.to_json() for p in self.positions],
        }
        if self.reason:
            d["reason"] = self.reason
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Decision:
        return cls(
            read_int(d, "txn", 1),
            Outcome(read_str(d, "outcome")),
            tuple(Part.from_json(p) for p in _objects(d, "parts")),
            tuple(Position.from_json(p) for p in _objects(d, "positions")),
            read_str(d, "reason", ""),
        )

    def includes(self, participant: str) -> Part | None:
        for part in self.parts:
            if part.participant == participant:
                return part
        return None


@dataclass(frozen=True, slots=True)
class Applied:
    """Participant -> coordinator: ``part`` of committed ``txn`` is applied in every sink it used.
    ``applied_by`` differs from ``part`` when a live participant finished a dead one's work."""

    TYPE: ClassVar[MessageType] = MessageType.APPLIED
    txn: int
    part: str
    applied_by: str

    def to_json(self) -> dict[str, Any]:
        return {"txn": self.txn, "part": self.part, "applied_by": self.applied_by}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Applied:
        part = read_str(d, "part", min_len=1)
        return cls(read_int(d, "txn", 1), part, read_str(d, "applied_by", part, min_len=1))


@dataclass(frozen=True, slots=True)
class Complete:
    """Coordinator -> all: every part of committed ``txn`` is applied; nobody needs it again."""

    TYPE: ClassVar[MessageType] = MessageType.COMPLETE
    txn: int

    def to_json(self) -> dict[str, Any]:
        return {"txn": self.txn}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Complete:
        return cls(read_int(d, "txn", 1))


@dataclass(frozen=True, slots=True)
class PendingCommit:
    """A committed transaction whose parts are not all applied yet."""

    txn: int
    parts: tuple[Part, ...]
    acked: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "txn": self.txn,
            "parts": [p.to_json() for p in self.parts],
            "acked": list(self.acked),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PendingCommit:
        return cls(
            read_int(d, "txn", 1),
            tuple(Part.from_json(p) for p in _objects(d, "parts")),
            _strings(d, "acked"),
        )


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Coordinator -> all: everything recovery needs, so only the tail after it must be read.

    ``last_txn`` is the highest transaction number ever prepared; every transaction up to it is
    decided. Any prepared part up to ``last_txn`` that is not in ``pending`` was aborted or is
    already applied (presumed abort).
    """

    TYPE: ClassVar[MessageType] = MessageType.CHECKPOINT
    last_txn: int
    positions: tuple[Position, ...] = ()
    pending: tuple[PendingCommit, ...] = ()
    #: With a reply topic (the envelope's ``reply_to``): the offset in it from which a new
    #: leader reads the replies this checkpoint does not reflect; -1 (absent): none.
    replies_from: int = -1

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "last_txn": self.last_txn,
            "positions": [p.to_json() for p in self.positions],
            "pending": [p.to_json() for p in self.pending],
        }
        if self.replies_from >= 0:
            d["replies_from"] = self.replies_from
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Checkpoint:
        return cls(
            read_int(d, "last_txn", 0),
            tuple(Position.from_json(p) for p in _objects(d, "positions")),
            tuple(PendingCommit.from_json(p) for p in _objects(d, "pending")),
            read_int(d, "replies_from", 0) if "replies_from" in d else -1,
        )


@dataclass(frozen=True, slots=True)
class Drained:
    """Participant -> coordinator, advisory: this participant has read everything its partitions
    hold and nothing new has come for a while; its open part (after transaction ``after_txn``)
    holds ``records`` records. When such hints cover every source partition the coordinator may
    start the next cycle before its interval. It never moves any state: a lost, late or stale
    hint costs at most a cycle started early or at the interval."""

    TYPE: ClassVar[MessageType] = MessageType.DRAINED
    #: The last transaction this participant knows of, prepared or decided: its open part
    #: follows it.
    after_txn: int
    participant: str
    generation: int
    #: Each assigned partition and the next offset this participant reads in it.
    positions: tuple[Position, ...] = ()
    #: Records (written and dead-lettered) its open part holds.
    records: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "after_txn": self.after_txn,
            "participant": self.participant,
            "generation": self.generation,
            "positions": [p.to_json() for p in self.positions],
            "records": self.records,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Drained:
        return cls(
            read_int(d, "after_txn", 0),
            read_str(d, "participant", min_len=1),
            read_int(d, "generation", -1),
            tuple(Position.from_json(p) for p in _objects(d, "positions")),
            read_int(d, "records", 0),
        )


Payload: TypeAlias = Prepare | Vote | Decision | Applied | Complete | Checkpoint | Drained
#: The messages only a coordinator writes: their envelope's ``reply_to`` says where it reads
#: replies (VOTE and APPLIED).
COORDINATOR_MESSAGES = (Prepare, Decision, Complete, Checkpoint)
#: The participants' replies: all the reply topic carries.
REPLIES = (Vote, Applied)

PAYLOAD_TYPES: dict[MessageType, type[Payload]] = {
    MessageType.PREPARE: Prepare,
    MessageType.VOTE: Vote,
    MessageType.DECISION: Decision,
    MessageType.APPLIED: Applied,
    MessageType.COMPLETE: Complete,
    MessageType.CHECKPOINT: Checkpoint,
    MessageType.DRAINED: Drained,
}


@dataclass(frozen=True, slots=True)
class Envelope:
    """A control message as it travels: metadata plus one typed payload."""

    id: str
    pipeline: str
    sender: str
    ts_ms: int
    payload: Payload
    version: int = PROTOCOL_VERSION
    #: On a coordinator's message: the topic its writer reads votes and APPLIED from (partition
    #: 0), besides the control topic; "" (absent): the control topic only.
    reply_to: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def type(self) -> MessageType:
        return self.payload.TYPE
