"""Python binding of the control-topic wire contract (``control-topic/`` is the source of truth)."""

from twophase.protocol.codec import AUTH_HEADER, DecodeError, decode, encode, new_envelope
from twophase.protocol.messages import (
    PROTOCOL_VERSION,
    Applied,
    Checkpoint,
    Complete,
    Decision,
    Envelope,
    MessageType,
    Outcome,
    Part,
    PartitionRange,
    PendingCommit,
    Position,
    Prepare,
    Vote,
    VoteValue,
)

__all__ = [
    "AUTH_HEADER",
    "PROTOCOL_VERSION",
    "Applied",
    "Checkpoint",
    "Complete",
    "Decision",
    "DecodeError",
    "Envelope",
    "MessageType",
    "Outcome",
    "Part",
    "PartitionRange",
    "PendingCommit",
    "Position",
    "Prepare",
    "Vote",
    "VoteValue",
    "decode",
    "encode",
    "new_envelope",
]
