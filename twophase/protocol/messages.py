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
    "Checkpoint",
    "Complete",
    "Decision",
    "Envelope",
    "MessageType",
    "Outcome",
    "Part",
    "PartitionRange",
    "Payload",
    "PendingCommit",
    "Position",
    "Prepare",
    "Vote",
    "VoteValue",
]

PROTOCOL_VERSION = 1


class MessageType(enum.IntEnum):
    PREPARE = 1
    VOTE = 2
    DECISION = 3
    APPLIED = 4
    COMPLETE = 5
    CHECKPOINT = 6


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
        return cls(str(d["topic"]), int(d["partition"]), int(d["offset"]))


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
            str(d["topic"]),
            int(d["partition"]),
            int(d["start"]),
            int(d["end"]),
            int(d.get("records", 0)),
            int(d.get("dead_lettered", 0)),
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
        return cls(str(d["participant"]), int(d["generation"]), tuple(d.get("sinks", ())))


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
        return cls(int(d["txn"]), int(d["deadline_ms"]))


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
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Vote:
        return cls(
            int(d["txn"]),
            str(d["participant"]),
            int(d["generation"]),
            str(d.get("member_id", "")),
            VoteValue(d["vote"]),
            tuple(PartitionRange.from_json(p) for p in d.get("partitions", ())),
            tuple(str(s) for s in d.get("sinks", ())),
            str(d.get("reason", "")),
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
            int(d["txn"]),
            Outcome(d["outcome"]),
            tuple(Part.from_json(p) for p in d.get("parts", ())),
            tuple(Position.from_json(p) for p in d.get("positions", ())),
            str(d.get("reason", "")),
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
        return cls(int(d["txn"]), str(d["part"]), str(d.get("applied_by", d["part"])))


@dataclass(frozen=True, slots=True)
class Complete:
    """Coordinator -> all: every part of committed ``txn`` is applied; nobody needs it again."""

    TYPE: ClassVar[MessageType] = MessageType.COMPLETE
    txn: int

    def to_json(self) -> dict[str, Any]:
        return {"txn": self.txn}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Complete:
        return cls(int(d["txn"]))


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
            int(d["txn"]),
            tuple(Part.from_json(p) for p in d.get("parts", ())),
            tuple(str(a) for a in d.get("acked", ())),
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

    def to_json(self) -> dict[str, Any]:
        return {
            "last_txn": self.last_txn,
            "positions": [p.to_json() for p in self.positions],
            "pending": [p.to_json() for p in self.pending],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Checkpoint:
        return cls(
            int(d["last_txn"]),
            tuple(Position.from_json(p) for p in d.get("positions", ())),
            tuple(PendingCommit.from_json(p) for p in d.get("pending", ())),
        )


Payload: TypeAlias = Prepare | Vote | Decision | Applied | Complete | Checkpoint

PAYLOAD_TYPES: dict[MessageType, type[Payload]] = {
    MessageType.PREPARE: Prepare,
    MessageType.VOTE: Vote,
    MessageType.DECISION: Decision,
    MessageType.APPLIED: Applied,
    MessageType.COMPLETE: Complete,
    MessageType.CHECKPOINT: Checkpoint,
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
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def type(self) -> MessageType:
        return self.payload.TYPE
